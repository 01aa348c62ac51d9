"""What a fake server shows and how it words its answers: a `Surface`, as plain data.

A surface lists its tools (names, schemas, annotations, as `tools/list` answers), and says for each tool
that sends (`Send`: its key argument, if it takes one, its recipients, the record it keeps and its answer),
reads back (`Get`) or lists (`Lister`) what it answers, and how the server words a failure (`error`). A
fake knows nothing of hail-guard's profiles: `profiled` makes the surface a profile describes, and
hand-written surfaces of real servers' public schemas live in `servers`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mcp import types

from hail_guard.sandbox.answers import Answer, Refusal, Reply

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


def found(record: Record | None, wanted: str) -> Answer:
    return structured(record) if record is not None else isError(f"no message {json.dumps(wanted)}")


def listed(where: str) -> Callable[[list[Record], Mapping[str, Any]], Answer]:
    def answer(records: list[Record], arguments: Mapping[str, Any]) -> Answer:
        limit = arguments.get("limit")
        kept = records[: int(limit)] if isinstance(limit, int) and limit > 0 else records
        return structured({where: kept})

    return answer


def error_answer(status: int, message: str = "the request failed") -> Answer:
    return isError(f"HTTP {status}: {message}")
