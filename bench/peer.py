"""Case `peer`: hail-guard beside a plain MCP proxy, FastMCP's, on the same calls to the same sandbox.

What users would otherwise put in front of Hail is a proxy that forwards and records nothing. Each runs in a
process of its own, spawned over stdio by the same MCP client, and both reach the one sandbox, which runs in a
third process over Streamable HTTP (as Hail is reached). The client also calls the sandbox straight (over HTTP):
the baseline of every row. Calls rotate between the three paths (and which goes first), so noise lands on all.

    direct:    client -> sandbox (HTTP)
    FastMCP:   client -> fastmcp proxy (stdio) -> sandbox (HTTP)            forwards only
    hail-guard: client -> hail-guard serve (stdio) -> sandbox (HTTP)         records, forwards, records

FastMCP is installed by the bench, from the package index, into a virtual environment of its own under the cache
folder (`~/.cache/hail-guard-bench/fastmcp`, or `$XDG_CACHE_HOME`): it pins its own `mcp`, which need not agree
with hail-guard's, and runs on its own interpreter. Where it cannot be installed or started, the rows say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from bench.figures import Figure, median, ms, percentile, skipped
from bench.workload import direct_email, lead_email, sandbox_process

FASTMCP = "fastmcp>=2.12"
"""What the peer's environment installs (the proxy's API, `create_proxy`, as of these versions). Its proxy is
made as FastMCP documents it, `create_proxy(url)`: it opens a fresh session to the upstream for every request."""
PEER_SCRIPT = (
    "import sys\n"
    "from fastmcp.server import create_proxy\n"
    "create_proxy(sys.argv[1], name='fastmcp-proxy').run(transport='stdio', show_banner=False)\n"
)
INSTALL_SECONDS = 600
REPO = Path(__file__).resolve().parent.parent


class PeerMissing(RuntimeError):
    """FastMCP could not be installed or started here; the message says why."""


def peer_python() -> Path:
    """The interpreter of FastMCP's own environment, made (and FastMCP installed) on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "hail-guard-bench" / "fastmcp"
    python = venv / "bin" / "python"
    if python.exists() and _runs(python, "import fastmcp.server"):
        return python
    for step in ([sys.executable, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", "-q", FASTMCP]):
        done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_SECONDS, check=False)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PeerMissing(f"`{' '.join(step[-3:])}` failed: {' / '.join(said)}")
    if not _runs(python, "import fastmcp.server"):
        raise PeerMissing(f"fastmcp was installed into {venv} but does not import")
    return python


def _runs(python: Path, code: str) -> bool:
    done = subprocess.run([str(python), "-c", code], capture_output=True, timeout=120, check=False)
    return done.returncode == 0


async def measure(folder: Path, latency_ms: int, iterations: int, warmup: int) -> list[Figure]:
    try:
        python = peer_python()
    except (PeerMissing, OSError, subprocess.SubprocessError) as exc:
        return _skipped(latency_ms, f"FastMCP's proxy cannot be had here: {exc}")
    try:
        return await _side_by_side(python, folder, latency_ms, iterations, warmup)
    except Exception as exc:  # a peer that fails must not stop the other cases: its rows say why
        return _skipped(latency_ms, f"the side-by-side run failed: {type(exc).__name__}: {exc}")


def _skipped(latency_ms: int, why: str) -> list[Figure]:
    return [skipped("peer", f"{path}, upstream {latency_ms} ms", "-", why) for path in ("send_email", "get_email")]


async def _side_by_side(python: Path, folder: Path, latency_ms: int, iterations: int, warmup: int) -> list[Figure]:
    sends: dict[str, list[float]] = {path: [] for path in PATHS}
    reads: dict[str, list[float]] = {path: [] for path in PATHS}
    async with sandbox_process(latency_ms) as url, AsyncExitStack() as stack:
        errlog = stack.enter_context(open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115  (closed by the stack)

        async def spawned(params: StdioServerParameters) -> Client:
            return await stack.enter_async_context(Client(stdio_client(params, errlog=errlog), mode="legacy"))

        clients = {
            "direct": await stack.enter_async_context(Client(url, mode="legacy")),
            "fastmcp": await spawned(_stdio([str(python), "-c", PEER_SCRIPT, url])),
            "hail-guard": await spawned(_serve(folder, url)),
        }
        for n in range(warmup + iterations):
            order = PATHS[n % 3 :] + PATHS[: n % 3]
            for path in order:
                arguments = lead_email(n, "p") if path == "hail-guard" else direct_email(n, path[0])
                sent = await _timed(clients[path], "send_email", arguments)
                read = await _timed(clients[path], "get_email", {"email_id": _id_of(sent[0])})
                if n >= warmup:
                    sends[path].append(sent[1])
                    reads[path].append(read[1])
    return [
        _figure("send_email", "FastMCP's proxy (forwards, records nothing)", "-", latency_ms, sends, "fastmcp"),
        _figure("send_email", "hail-guard (guarded: recorded, forwarded, recorded)", "sqlite", latency_ms, sends),
        _figure("get_email", "FastMCP's proxy", "-", latency_ms, reads, "fastmcp"),
        _figure("get_email", "hail-guard (pass-through)", "sqlite", latency_ms, reads),
    ]


PATHS = ["direct", "fastmcp", "hail-guard"]


def _stdio(command: list[str], **env: str) -> StdioServerParameters:
    everything = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return StdioServerParameters(command=command[0], args=command[1:], env=everything, cwd=str(REPO))


def _serve(folder: Path, url: str) -> StdioServerParameters:
    """`hail-guard serve` on a SQLite ledger of its own (durable, as shipped), the sandbox at `url` upstream."""
    ledger = f"sqlite:///{folder / 'peer.db'}"
    command = [sys.executable, "-m", "hail_guard", "serve"]
    return _stdio(command, HAIL_GUARD_LEDGER_URL=ledger, HAIL_GUARD_UPSTREAM_URL=url)


async def _timed(client: Client, tool: str, arguments: dict[str, Any]) -> tuple[types.CallToolResult, float]:
    started = time.perf_counter()
    result = await client.call_tool(tool, arguments)
    seconds = time.perf_counter() - started
    if result.is_error:
        raise RuntimeError(f"the benchmark call {tool} failed: {result.content}")
    return result, seconds


def _id_of(result: types.CallToolResult) -> str:
    data = result.structured_content
    if not isinstance(data, dict):  # FastMCP may answer with text only
        text = "".join(block.text for block in result.content if isinstance(block, types.TextContent))
        data = json.loads(text)
    message_id = data.get("id") if isinstance(data, dict) else None
    if not isinstance(message_id, str):
        raise RuntimeError(f"send_email answered without an id: {data}")  # noqa: TRY004  (a failed run, not a type)
    return message_id


def _figure(
    tool: str, who: str, ledger: str, latency_ms: int, samples: dict[str, list[float]], path: str = "hail-guard"
) -> Figure:
    mine, direct = ms(samples[path]), ms(samples["direct"])
    p50, base = median(mine), median(direct)
    return Figure(
        case="peer",
        name=f"{tool} through {who}, upstream {latency_ms} ms",
        ledger=ledger,
        unit="ms",
        median=p50,
        p99=percentile(mine, 0.99),
        baseline=base,
        ratio=p50 / base,
        note=f"added p50 {p50 - base:.2f} ms; each proxy in its own process over stdio, the sandbox over HTTP"
        + ("; FastMCP's create_proxy(url) opens a new upstream session per request" if path == "fastmcp" else "")
        + f"; baseline: the sandbox called straight; n={len(mine)}",
    )
