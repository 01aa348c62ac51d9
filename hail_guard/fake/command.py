"""`hail-guard fake`: run a generic fake MCP server over stdio or Streamable HTTP, from the command line.

    hail-guard fake --profile FILE_OR_NAME [--port P | --stdio] [--fault SPEC]... [--outbox PATH]

`--profile` names a profile file (the fake is the one it describes, `surfaces.from_profile`) or one of the
built-in profiles whose server has a hand-written fake (`resend`, `agentmail`: `servers`). Over stdio the
fake is an upstream command hail-guard can start itself (`[upstream] command`); over HTTP it listens at `/`.
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

import anyio

from hail_guard.errors import ConfigError
from hail_guard.fake.engine import FakeUpstream
from hail_guard.fake.servers import HAND_WRITTEN
from hail_guard.fake.surfaces import Surface, from_profile
from hail_guard.profiles import load_profile
from hail_guard.sandbox.faults import SPEC_FORMAT, Fault, parse_fault

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `fake` subcommand's options to `parser`."""
    parser.add_argument(
        "--profile", required=True, metavar="FILE", help=f"a profile file, or {' or '.join(HAND_WRITTEN)}"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--stdio", action="store_true", help="serve MCP on stdin/stdout (an upstream command)")
    where.add_argument("--port", type=int, default=8082, help="serve Streamable HTTP at / on this port; 0 picks one")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC", help=f"repeatable: {SPEC_FORMAT}")
    parser.add_argument(
        "--outbox", metavar="PATH", help="append one JSON line per accepted message (and remember them)"
    )


def surface_for(reference: str) -> Surface:
    """The fake a profile reference names: a hand-written server's, else the one the profile describes."""
    if reference in HAND_WRITTEN:
        return HAND_WRITTEN[reference]()
    if reference == "hail":
        raise ConfigError("Hail's fake is the sandbox: run `hail-guard sandbox`")
    return from_profile(load_profile(reference))


def faults_for(surface: Surface, specs: list[str]) -> list[Fault]:
    names = [tool.name for tool in surface.tools]
    try:
        return [parse_fault(spec, tools=names, sends=list(surface.sends)) for spec in specs]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run_from_args(ns: argparse.Namespace) -> int:
    """Run the fake until interrupted (or, over stdio, until its client leaves); returns the exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        surface = surface_for(ns.profile)
        fake = FakeUpstream(surface, faults=faults_for(surface, ns.fault), outbox_path=ns.outbox)
    except ConfigError as exc:
        print(f"hail-guard: {exc}", file=sys.stderr)
        return 1
    log.info("fake_starting server=%s faults=%s outbox=%s", surface.name, ns.fault or "none", ns.outbox)
    anyio.run(_serve_stdio if ns.stdio else partial(_serve_http, host=ns.host, port=ns.port), fake)
    return 0


async def _serve_stdio(fake: FakeUpstream) -> None:
    from mcp.server.stdio import stdio_server

    server = fake.server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def _serve_http(fake: FakeUpstream, *, host: str, port: int) -> None:
    from hail_guard.sandbox.http import serve_http

    async with anyio.create_task_group() as tg:
        await tg.start(partial(serve_http, fake, host, port, None))
