"""Batches and workers: plan many sends at once, approve, dispatch, resume, share one ledger.

A batch is planned whole or not at all: every send is validated and keyed like a single guarded
call, then all are recorded in one transaction (`ready`, or `planned` until an operator approves).
Sends stream from the file through the checks into the ledger, so a batch of any size is never held
in memory: only each send's key and, per recipient, its message are kept, to refuse repeats. One text
to many leads (a campaign) is never a repeat: two sends repeat each other only when they carry the same
message to a shared recipient (`same_send`).
Dispatch reconciles the batch's `unknown` operations first, then claims `ready` ones with bounded
concurrency; it can be run again at any time and never resends an accepted operation. A send whose
recipient (or lead) has an unresolved send is held when it would be claimed: it stays `ready` while the
rest goes on, and goes once what holds it is settled. A worker is the same loop, run until stopped, over
every batch or one. While either sends, it keeps a heartbeat in the ledger (`heartbeat`), so the console
and `status` say who is sending, and when nobody is.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import structlog

from hail_guard import same_send
from hail_guard.crashpoints import crash_point
from hail_guard.errors import BadInput, HailGuardError, RefusedByPolicy, UpstreamUnavailable
from hail_guard.guard import PROCESS_ID, Guard, claim_token
from hail_guard.ledger import Batching, Heartbeat, Heartbeats
from hail_guard.models import BatchStatus, Intent, State

log = structlog.get_logger(__name__)

Progress = Callable[[int, int | None], Awaitable[None]]
"""Called with (sends done, total) as a batch is dispatched."""
SchemaOf = Callable[[str], Mapping[str, Any] | None]
IDLE_POLL_SECONDS = 1.0
"""How long an idle worker waits before looking for new work."""
HEARTBEAT_SECONDS = 10.0
"""How often a sender tells the ledger it is at work; one silent for `STALE_SECONDS` may have died."""
STALE_SECONDS = 3 * HEARTBEAT_SECONDS
_OWNER = re.compile(r"^(?P<host>.+):(?P<pid>\d+)(?::[0-9a-f]{12})?$")


@dataclass(frozen=True)
class PlannedSend:
    tool: str
    arguments: dict[str, Any]
    where: str
    """How errors name this send: `send 3`, `line 4`."""


class BatchLedger(Batching, Heartbeats, Protocol):
    """What batches use of the ledger: plans, and a run's heartbeat."""


class Batches:
    """Planning and dispatch over one guard; `schema_of` gives a guarded tool's input schema (or None); a send
    whose lead has an unresolved send on another channel is held with `hold_lead` (`same_send.Rules`)."""

    def __init__(
        self,
        ledger: BatchLedger,
        guard: Guard,
        schema_of: SchemaOf,
        *,
        require_approval: bool = False,
        hold_lead: bool = True,
    ) -> None:
        self._ledger = ledger
        self.guard = guard
        self.schema_of = schema_of
        self.require_approval = require_approval
        self.hold_lead = hold_lead

    async def plan(self, sends: Iterable[PlannedSend], *, name: str | None = None, actor: str = "agent") -> str:
        """Record every send as its own operation; nothing is sent. Returns the batch id."""
        batch_id = f"batch-{uuid.uuid4().hex[:12]}"
        state = State.PLANNED if self.require_approval else State.READY
        repeats = _Repeats()
        count = await self._ledger.plan_batch(
            batch_id=batch_id,
            name=name,
            intents=self._intents(sends, repeats),
            state=state,
            actor=actor,
            rules=self.guard.rules,
            where=repeats.where,
        )
        log.info("batch_planned", batch_id=batch_id, sends=count, state=state)
        return batch_id

    def _intents(self, sends: Iterable[PlannedSend], repeats: _Repeats) -> Iterator[Intent]:
        """Each send's intent, in order; refused (`BadInput`, `RefusedByPolicy`) at the first bad send or repeat."""
        for send in sends:
            intent = self._intent(send)
            repeats.check(send, intent)
            yield intent
        if repeats.empty:
            raise BadInput("the batch has no sends; give at least one {tool, arguments}")

    def _intent(self, send: PlannedSend) -> Intent:
        schema = self.schema_of(send.tool)
        if schema is None:
            raise BadInput(f"{send.where}: {send.tool!r} is not a guarded send tool of this upstream")
        try:
            intent, _ = self.guard.prepare(send.tool, send.arguments, schema)
        except BadInput as exc:
            raise BadInput(f"{send.where}: {exc}; nothing was planned") from None
        except RefusedByPolicy as exc:  # a consent rule
            raise RefusedByPolicy(f"{send.where}: {exc}; nothing was planned") from None
        return intent

    async def run(self, batch_id: str, *, concurrency: int = 4, progress: Progress | None = None) -> BatchStatus:
        """Settle the batch's unknowns, then send what is ready; safe to run again at any time."""
        before = await self.status(batch_id)  # NotFound for a batch that does not exist
        async with heartbeat(self._ledger, "batch run", batch_id):
            reconciled = await self.guard.reconcile(batch_id=batch_id)
            if reconciled:
                log.info("batch_reconciled", batch_id=batch_id, operations=len(reconciled))
            total = before.counts.get(State.READY, 0)
            done = 0

            async def on_sent() -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    await progress(done, total)

            await drain(self.guard, concurrency=concurrency, batch_id=batch_id, on_sent=on_sent)
        return await self.status(batch_id)

    async def status(self, batch_id: str) -> BatchStatus:
        """The batch's counts, unresolved sends and held sends (held as `hold_lead` says)."""
        return await self._ledger.batch_status(batch_id, hold_lead=self.hold_lead)


async def drain(
    guard: Guard,
    *,
    concurrency: int,
    batch_id: str | None = None,
    on_sent: Callable[[], Awaitable[None]] | None = None,
    stop: anyio.Event | None = None,
) -> int:
    """Claim and send `ready` operations with `concurrency` loops until none is left (or `stop` is set)."""
    sent = 0

    async def loop() -> None:
        nonlocal sent

        while stop is None or not stop.is_set():
            owner = claim_token()
            claimed = await guard.claim_ready(owner, batch_id=batch_id)
            if not claimed:
                return
            crash_point("after_claim")
            for operation in claimed:
                await guard.dispatch(operation, owner)
                sent += 1
                if on_sent is not None:
                    await on_sent()

    async with anyio.create_task_group() as tg:
        for _ in range(max(1, concurrency)):
            tg.start_soon(loop)
    return sent


async def run_worker(
    guard: Guard,
    heartbeats: Heartbeats,
    *,
    concurrency: int,
    stop: anyio.Event,
    batch_id: str | None = None,
    poll_seconds: float = IDLE_POLL_SECONDS,
) -> int:
    """Until `stop` is set: reconcile what is due, send what is ready, then wait for more."""
    total = 0
    async with heartbeat(heartbeats, "worker", batch_id):
        while not stop.is_set():
            try:
                await guard.reconcile(batch_id=batch_id)
            except UpstreamUnavailable as exc:  # nothing to replay into: the unknowns wait, their attempts unspent
                log.warning("reconcile_skipped", error=str(exc))
            sent = await drain(guard, concurrency=concurrency, batch_id=batch_id, stop=stop)
            total += sent
            if sent == 0:
                with anyio.move_on_after(poll_seconds):
                    await stop.wait()
    log.info("worker_stopped", sent=total)
    return total


@asynccontextmanager
async def heartbeat(
    ledger: Heartbeats, role: str, batch_id: str | None = None, *, every_seconds: float = HEARTBEAT_SECONDS
) -> AsyncIterator[Heartbeat]:
    """While the block runs, the ledger knows this process sends (`Ledger.heartbeats`): a beat first, then every
    `every_seconds`; taken away when the block ends (bounded in time). A beat the ledger refuses is logged, never
    raised: the sends go on, and a missed beat only makes this sender look stale."""
    beat = Heartbeat(id=uuid.uuid4().hex, who=PROCESS_ID, role=role, batch_id=batch_id)
    await _beat(ledger.record_heartbeat, beat)
    raised: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_beating, ledger, beat, every_seconds)
            try:
                yield beat
            except BaseException as exc:  # the block's own error: let out as raised, not in the group's
                raised = exc
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(HEARTBEAT_SECONDS):
            await _beat(lambda done: ledger.end_heartbeat(done.id), beat)
    if raised is not None:
        raise raised


async def _beating(ledger: Heartbeats, beat: Heartbeat, every_seconds: float) -> None:
    while True:
        await anyio.sleep(every_seconds)
        await _beat(ledger.record_heartbeat, beat)


async def _beat(write: Callable[[Heartbeat], Awaitable[None]], beat: Heartbeat) -> None:
    try:
        await write(beat)
    except HailGuardError as exc:
        log.warning("heartbeat_not_recorded", role=beat.role, error=str(exc))


def sender_name(who: str) -> str:
    """A process as `Heartbeat.who` and claims (`guard.claim_token`) name it, `host:pid[:fence]`, as a person reads
    it: `host, process pid` (a claim's fence left out); anything else (an operator's name) as it is."""
    found = _OWNER.match(who)
    return f"{found['host']}, process {found['pid']}" if found else who


class _Repeats:
    """Two sends in one batch may not share a key, nor (unless allowed) carry the same message to a shared
    recipient: the same tool, message and sender (`same_send`) for one recipient key.

    A large file's sends are kept as little as they can be (a 16-byte digest of each key, and of each recipient's
    message; a campaign's one sender text, once): `python -m bench --only memory` measures a batch of 100,000."""

    def __init__(self) -> None:
        self._keys: dict[bytes, str] = {}
        self._messages: dict[bytes, tuple[tuple[str, str], ...]] = {}
        self._wheres: list[str] = []
        """Each send's name (`send 3`, `line 4`), by position: the ledger's refusals name sends by it."""

    @property
    def empty(self) -> bool:
        return not self._wheres

    def where(self, position: int) -> str:
        """The send at `position` (from 1) as its batch names it (`ledger.Where`)."""
        return self._wheres[position - 1]

    def check(self, send: PlannedSend, intent: Intent) -> None:
        self._wheres.append(send.where)
        key = _digest(intent.idempotency_key)
        if key in self._keys:
            said = f"the same key ({intent.idempotency_key!r}); give each send its own metadata ids or key"
            raise _refused(self._keys[key], send, said)
        self._keys[key] = send.where
        if intent.allow_duplicate:
            return
        sender = sys.intern(intent.sender)  # a campaign's sends share their sender: kept once
        for recipient in same_send.keys_of_intent(intent):
            message = _digest(intent.tool, intent.content_fingerprint, recipient)
            earlier = self._messages.get(message, ())
            for where, their_sender in earlier:
                if same_send.senders_agree(json.loads(their_sender), json.loads(sender)):
                    raise _refused(where, send, f"the same message for {recipient}; leave one of them out")
            self._messages[message] = (*earlier, (send.where, sender))


def _digest(*parts: str) -> bytes:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).digest()


def _refused(earlier: str, send: PlannedSend, what: str) -> RefusedByPolicy:
    return RefusedByPolicy(f"{earlier} and {send.where} have {what}; nothing was planned")


def sends_from_tool(arguments: Sequence[object]) -> list[PlannedSend]:
    """The `sends` argument of the `plan_batch` tool: a list of {tool, arguments}."""
    return [_planned(item, f"send {position}") for position, item in enumerate(arguments, start=1)]


def _planned(item: object, where: str) -> PlannedSend:
    if not isinstance(item, dict) or not isinstance(item.get("tool"), str):
        raise BadInput(f"{where}: give an object with `tool` and `arguments`; nothing was planned")
    arguments = item.get("arguments", {})
    if not isinstance(arguments, dict):
        raise BadInput(f"{where}: `arguments` must be an object; nothing was planned")
    return PlannedSend(item["tool"], dict(arguments), where)


def read_batch_file(path: str, schema_of: SchemaOf) -> Iterator[PlannedSend]:
    """JSON Lines (`{"tool": ..., "arguments": {...}}` per line) or CSV (docs/how-to/campaigns.md), read a line
    at a time."""
    if not Path(path).is_file():
        raise BadInput(f"cannot read the batch file {path}: no such file")
    return _read_sends(path, schema_of)


def _read_sends(path: str, schema_of: SchemaOf) -> Iterator[PlannedSend]:
    try:
        with open(path, encoding="utf-8", newline="") as file:
            if path.lower().endswith(".csv"):
                yield from _csv_sends(file, schema_of)
            else:
                yield from _jsonl_sends(file)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read the batch file {path}: {exc}; nothing was planned") from exc


def _jsonl_sends(lines: Iterable[str]) -> Iterator[PlannedSend]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise BadInput(f"line {number}: not valid JSON ({exc}); nothing was planned") from None
        yield _planned(item, f"line {number}")


def _csv_sends(lines: Iterable[str], schema_of: SchemaOf) -> Iterator[PlannedSend]:
    reader = csv.DictReader(lines)
    if reader.fieldnames is None or "tool" not in reader.fieldnames:
        raise BadInput("line 1: a CSV batch needs a header row with a `tool` column")
    for row in reader:
        number = reader.line_num
        tool = (row.pop("tool") or "").strip()
        properties = (schema_of(tool) or {}).get("properties", {})
        arguments: dict[str, Any] = {}
        for column, cell in row.items():
            if column is None or cell is None or cell == "":
                continue
            path = column.split(".")
            try:
                _put(arguments, path, _typed(cell, _cell_schema(properties, path)))
            except (ValueError, TypeError) as exc:
                raise BadInput(f"line {number}, column {column}: {exc}; nothing was planned") from None
        yield PlannedSend(tool, arguments, f"line {number}")


def _cell_schema(properties: Mapping[str, Any], path: Sequence[str]) -> Mapping[str, Any]:
    """The schema of the property a (dotted) column names: `metadata.lead_id` is `lead_id` inside
    `metadata`. A member the schema does not describe (of a free-form object) has none: a string."""
    schema: Any = {"properties": properties}
    for part in path:
        nested = schema.get("properties") if isinstance(schema, Mapping) else None
        extra = schema.get("additionalProperties") if isinstance(schema, Mapping) else None
        if isinstance(nested, Mapping) and part in nested:
            schema = nested[part]
        elif isinstance(extra, Mapping):
            schema = extra
        else:
            return {}
    return schema if isinstance(schema, Mapping) else {}


def _typed(cell: str, schema: Mapping[str, Any]) -> Any:
    """A cell as its schema types it; where the schema also allows a string, a cell that does not parse is one."""
    kinds = schema.get("type", "string")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    for kind, parse in _PARSERS.items():
        if kind in kinds:
            try:
                return parse(cell)
            except ValueError:
                if "string" not in kinds:
                    raise
    return cell


def _boolean(cell: str) -> bool:
    if cell not in ("true", "false"):
        raise ValueError(f"{cell!r} is not true or false")
    return cell == "true"


def _json_object(cell: str) -> dict[str, Any]:
    value = json.loads(cell)
    if not isinstance(value, dict):
        raise ValueError(f"{cell!r} is not a JSON object")  # noqa: TRY004  (a cell that does not parse)
    return value


_PARSERS: dict[str, Callable[[str], Any]] = {
    "boolean": _boolean,
    "array": lambda cell: [part.strip() for part in cell.split(";") if part.strip()],
    "integer": int,
    "number": float,
    "object": _json_object,
}
"""How a cell becomes each JSON type but a string, in the order tried (list cells are split on `;`)."""


def _put(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise TypeError(f"{part} is both a value and an object")
    target[path[-1]] = value
