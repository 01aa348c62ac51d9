"""Case 4, start-up: from spawning `hail-guard serve` to the first `tools/list` answer over stdio.

The MCP client spawns the process, does the handshake and lists the tools; the clock runs from
before the spawn to the answer. hail-guard opens an existing SQLite ledger (the first start, which
creates it, is a warm-up) and its built-in sandbox as upstream. The baseline is the sandbox alone
served over stdio (`bench.stdio_sandbox`): the floor for any MCP server on this Python and SDK.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench.figures import Figure, median, percentile

TARGET_SECONDS = 1.0
REPO = Path(__file__).resolve().parent.parent


async def time_to_tools(command: list[str], env: dict[str, str]) -> float:
    params = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=str(REPO))
    with open(os.devnull, "w", encoding="utf-8") as errlog:
        started = time.perf_counter()
        async with Client(stdio_client(params, errlog=errlog), mode="legacy") as client:
            tools = await client.list_tools()
            seconds = time.perf_counter() - started
    if not tools.tools:
        raise RuntimeError(f"{' '.join(command)} listed no tools")
    return seconds


async def measure(folder: Path, runs: int) -> Figure:
    env = {"HAIL_GUARD_LEDGER_URL": f"sqlite:///{folder / 'startup.db'}", "PYTHONPATH": str(REPO)}
    serve = [sys.executable, "-m", "hail_guard", "serve"]
    bare = [sys.executable, "-m", "bench.stdio_sandbox"]
    await time_to_tools(serve, env)  # creates and migrates the ledger; warms the OS's file cache
    await time_to_tools(bare, env)
    guarded, baseline = [], []
    for _ in range(runs):
        guarded.append(await time_to_tools(serve, env))
        baseline.append(await time_to_tools(bare, env))
    p50 = median(guarded)
    return Figure(
        case="startup",
        name="hail-guard serve: spawn to first tools/list (stdio)",
        unit="s",
        median=p50,
        p99=percentile(guarded, 0.99),
        baseline=median(baseline),
        ratio=p50 / median(baseline),
        target=f"<= {TARGET_SECONDS:g} s",
        met=p50 <= TARGET_SECONDS,
        note=f"baseline: the bare sandbox over stdio; n={runs}",
    )
