"""`hail-guard fake`: run a generic fake MCP server over stdio or Streamable HTTP, from the command line.

    hail-guard fake --profile FILE_OR_NAME [--port P | --stdio] [--fault SPEC]... [--outbox PATH]

`--profile` names a profile file or one of the built-in profiles whose server has a hand-written fake
(`resend`, `agentmail`: `hail_guard.fake.servers`). Over stdio the fake is an upstream command hail-guard
can start itself (`[upstream] command`); over HTTP it listens at `/`. Logs go to stderr.

The fakes read no profile: `from_profile`, here at the edge, turns a profile into a `Surface` (plain data).
Each guarded tool takes the arguments its pointers name and answers with the record (the id where
`provider_id` says), its lookup reads a record back by the argument its profile maps to `$provider_id`, and
its search lists records alike in the arguments it maps from the send (`examples/chat.toml`, say).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import anyio
from mcp import types

from hail_guard import pointers
from hail_guard.errors import ConfigError
from hail_guard.fake.engine import FakeUpstream
from hail_guard.fake.servers import HAND_WRITTEN
from hail_guard.fake.surfaces import (
    READS,
    SENDS,
    Get,
    Lister,
    Record,
    Send,
    Surface,
    equal,
    error_answer,
    found,
    listed,
    not_before,
    structured,
)
from hail_guard.profiles import PROVIDER_ID, SINCE, Profile, ToolSpec, load_profile
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


def from_profile(profile: Profile) -> Surface:
    """The fake a profile describes (see the module docstring)."""
    tools: list[types.Tool] = []
    sends: dict[str, Send] = {}
    gets: dict[str, Get] = {}
    lists: dict[str, Lister] = {}
    for spec in profile.tools.values():
        tools.append(_send_tool(spec))
        sends[spec.name] = Send(structured, key=spec.key, recipients=_names(spec.recipients), id_field=_id(spec))
        if spec.lookup is not None and spec.lookup.tool not in gets:
            argument = next((name for name, v in spec.lookup.arguments.items() if v == PROVIDER_ID), None)
            if argument is None:
                raise ConfigError(f"{spec.name}'s lookup maps no argument to {PROVIDER_ID}: the fake cannot read back")
            tools.append(_read_tool(spec.lookup.tool, list(spec.lookup.arguments), [argument], "Read one message."))
            gets[spec.lookup.tool] = Get(argument, found, id_field=_id(spec))
        if spec.search is not None and spec.search.tool not in lists:
            search = spec.search
            arguments = list(search.arguments)
            tools.append(_read_tool(search.tool, arguments, [], "List messages, newest first."))
            where = pointers.top_level(search.items) if search.items is not None else None
            lists[search.tool] = Lister(listed(where or "messages"), _filters(search.arguments))
    return Surface(profile.name, tuple(tools), error_answer, sends, gets, lists)


def _send_tool(spec: ToolSpec) -> types.Tool:
    names = dict.fromkeys([*_names(spec.recipients[:1]), *_names(spec.content or ()), *_names(spec.recipients[1:])])
    names.update(dict.fromkeys(_names((*spec.sender, *spec.sender_names))))
    properties: dict[str, Any] = {name: {"type": "string"} for name in names}
    required = [*_names(spec.recipients[:1]), *_names(spec.content or ())]
    if spec.key is not None:
        properties[spec.key] = {"type": "string", "minLength": 1, "description": "Idempotency key."}
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    output = {"type": "object", "properties": {_id(spec): {"type": "string"}}}
    return types.Tool(
        name=spec.name, description="Send a message.", input_schema=schema, output_schema=output, annotations=SENDS
    )


def _read_tool(name: str, arguments: list[str], required: list[str], description: str) -> types.Tool:
    properties: dict[str, Any] = {argument: {} for argument in arguments}
    schema = {"type": "object", "properties": properties, "required": required}
    return types.Tool(name=name, description=description, input_schema=schema, annotations=READS)


def _names(found: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = []
    for pointer in found:
        name = pointers.top_level(pointer)
        if name is None:
            raise ConfigError(f"the fake takes top-level arguments only, not {pointer!r}")
        names.append(name)
    return tuple(names)


def _id(spec: ToolSpec) -> str:
    name = pointers.top_level(spec.provider_id)
    if name is None:
        raise ConfigError(f"the fake answers with a top-level id only, not {spec.provider_id!r}")
    return name


def _filters(mapping: Mapping[str, Any]) -> dict[str, Callable[[Record, Any], bool]]:
    """A search argument filled from the send finds the records alike in it; `$since` the later ones."""
    filters: dict[str, Callable[[Record, Any], bool]] = {}
    for argument, source in mapping.items():
        if source == SINCE:
            filters[argument] = not_before("created_at")
        elif isinstance(source, str) and source.startswith("/") and (name := pointers.top_level(source)):
            filters[argument] = equal(name)
    return filters
