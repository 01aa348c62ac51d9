"""The sandbox served over stdio, so a benchmark can keep the fake Hail out of hail-guard's process.

    python -m bench.stdio_sandbox [--latency-ms MS]

Used as hail-guard's upstream command by the memory case, and as the start-up baseline (a bare
MCP server on the same Python and SDK).
"""

from __future__ import annotations

import argparse

import anyio
from mcp.server.stdio import stdio_server

from hail_guard.sandbox import Sandbox


async def serve(latency_ms: float) -> None:
    server = Sandbox(latency_seconds=latency_ms / 1000).server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stdio_sandbox")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    anyio.run(serve, parser.parse_args().latency_ms)


if __name__ == "__main__":
    main()
