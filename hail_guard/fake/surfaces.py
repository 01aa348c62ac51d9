"""What a fake server shows and how it words its answers: a `Surface`, and the one a profile drives.

A surface lists its tools (names, schemas, annotations, as `tools/list` answers), and says for each tool
that sends (`Send`: its key argument, if it takes one, its recipients, the record it keeps and its answer),
reads back (`Get`) or lists (`Lister`) what it answers, and how the server words a failure (`error`).

`from_profile` builds one from a profile: each guarded tool takes the arguments its pointers name and
answers with the record (the id where `provider_id` says), its lookup reads a record back by the argument
its profile maps to `$provider_id`, and its search lists records alike in the arguments it maps from the
send. That is the fake `hail-guard fake --profile FILE` serves (`examples/chat.toml`, say). Hand-written
surfaces of real servers' public schemas live in `servers`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mcp import types

from hail_guard import pointers
from hail_guard.errors import ConfigError
from hail_guard.profiles import PROVIDER_ID, SINCE, Profile, ToolSpec
from hail_guard.sandbox.service import Answer, Refusal, Reply

Record = dict[str, Any]
SENDS = types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=True)
READS = types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=True)


@dataclass(frozen=True)
class Send:
    answer: Callable[[Record], Answer]
    key: str | None = None
    """The argument the server dedupes on (same key, same body: the first answer again)."""
    recipients: tuple[str, ...] = ()
    """Argument names the outbox's `to` is made of."""
    id_field: str = "id"
    adds: Callable[[Record], Record] = lambda record: {}
    """Fields the server adds to what it keeps (a thread id, labels, ...)."""

    def record(self, tool: str, arguments: Mapping[str, Any], new_id: str, now: datetime) -> Record:
        record: Record = {self.id_field: new_id, "created_at": now.isoformat(), "tool": tool, **arguments}
        return {**record, **self.adds(record)}


@dataclass(frozen=True)
class Get:
    id_argument: str
    answer: Callable[[Record | None, str], Answer]
    """The record found (None: none has that id) and the id asked for."""
    id_field: str = "id"


@dataclass(frozen=True)
class Lister:
    answer: Callable[[list[Record], Mapping[str, Any]], Answer]
    """The records kept, newest first, and the arguments."""
    filters: Mapping[str, Callable[[Record, Any], bool]] = field(default_factory=dict)
    """Per argument: whether a record passes for the value given (arguments not given filter nothing)."""

    def keeps(self, record: Record, arguments: Mapping[str, Any]) -> bool:
        return all(keep(record, arguments[name]) for name, keep in self.filters.items() if name in arguments)


@dataclass(frozen=True)
class Surface:
    name: str
    tools: tuple[types.Tool, ...]
    error: Callable[..., Answer]
    """`error(status, message=...)`: how the server words a failure (a refusal, a gateway error)."""
    sends: Mapping[str, Send] = field(default_factory=dict)
    gets: Mapping[str, Get] = field(default_factory=dict)
    lists: Mapping[str, Lister] = field(default_factory=dict)
    instructions: str = "A fake MCP server (hail-guard): nothing is really sent; see the outbox."


def structured(record: Mapping[str, Any]) -> Reply:
    """The record as structured content and JSON text."""
    return Reply(dict(record))


def isError(text: str) -> Refusal:
    return Refusal(text)


def equal(field_name: str) -> Callable[[Record, Any], bool]:
    return lambda record, value: record.get(field_name) == value


def not_before(field_name: str) -> Callable[[Record, Any], bool]:
    return lambda record, value: str(record.get(field_name, "")) >= str(value)


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
            gets[spec.lookup.tool] = Get(argument, _found, id_field=_id(spec))
        if spec.search is not None and spec.search.tool not in lists:
            search = spec.search
            arguments = list(search.arguments)
            tools.append(_read_tool(search.tool, arguments, [], "List messages, newest first."))
            where = pointers.top_level(search.items) if search.items is not None else None
            lists[search.tool] = Lister(_listed(where or "messages"), _filters(search.arguments))
    return Surface(profile.name, tuple(tools), _error, sends, gets, lists)


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


def _found(record: Record | None, wanted: str) -> Answer:
    return structured(record) if record is not None else isError(f"no message {json.dumps(wanted)}")


def _listed(where: str) -> Callable[[list[Record], Mapping[str, Any]], Answer]:
    def answer(records: list[Record], arguments: Mapping[str, Any]) -> Answer:
        limit = arguments.get("limit")
        kept = records[: int(limit)] if isinstance(limit, int) and limit > 0 else records
        return structured({where: kept})

    return answer


def _error(status: int, message: str = "the request failed") -> Answer:
    return isError(f"HTTP {status}: {message}")
