"""The SQLite ledger: one file, WAL with `synchronous = FULL`, aiosqlite threads, group commits.

Every commit reaches stable storage before it is acknowledged (WAL with FULL syncs the log at each
commit; EXTRA adds nothing in WAL mode), so a power cut or an OS crash forgets nothing that was
answered. The event loop never waits on the disk or a lock: each connection runs on its own
aiosqlite thread, which also waits out another process's lock (the busy timeout).

Writes go through one connection, one transaction at a time (`_Writer`). The send path's writes
(`begin_send`, `record_outcome`, the claims, lease expiry) are plain functions of a `sqlite3`
connection: those that arrive while a commit is in flight join the next one, and the whole group
runs in one trip to the thread, each in a savepoint of its own, sharing one commit and one fsync. A
refusal in one (an opt-out, a key conflict, a lost lease) rolls back only its savepoint; a lone write
never waits for company. The other writes (`LedgerCore`'s: review, opt-outs, webhooks...) take a
transaction of their own. Reads use a second connection; planning a batch uses a third, its own.

Every sqlite3 error is mapped to our tree in `sqlite_file.errors_mapped`, and only there.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import aiosqlite
import anyio
import anyio.to_thread
import structlog

from hail_guard import policy, same_send
from hail_guard.errors import HailGuardError, LeaseLost, LedgerUnavailable
from hail_guard.ledger import backfill, core, params, planning, reads, sql
from hail_guard.ledger.core import DEFAULT_RULES, LEASE_EXPIRED, Row, Tx, Work, must_row
from hail_guard.ledger.params import Params
from hail_guard.ledger.roles import Begin, Plan
from hail_guard.ledger.sqlite_file import (
    backup_file,
    create_private,
    damaged,
    errors_mapped,
    refuse_empty,
    refuse_network_filesystem,
)
from hail_guard.ledger.turns import Turn, Turns
from hail_guard.models import Intent, Operation, Outcome, State
from hail_guard.same_send import Candidates, Rules

log = structlog.get_logger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")
Grouped = Callable[Concatenate[sqlite3.Connection, _P], _T]
"""A send-path write: a function of the writing connection, run on its thread."""

_SQL: Final = sql.statements("sqlite")
CLOSE_SECONDS = 10.0
"""How long closing waits for the writes in flight."""
MAX_GROUP = 64
"""Send-path writes committed together at most."""


def _dict_row(cursor: sqlite3.Cursor, values: tuple[Any, ...]) -> dict[str, Any]:
    return {column[0]: value for column, value in zip(cursor.description, values, strict=True)}


async def _on_thread(db: aiosqlite.Connection, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in one trip to the connection's own thread, between its other calls (aiosqlite runs every
    call there in turn, but has no public way to run a function of ours: this is its one private use)."""
    return await db._execute(function, *args)  # type: ignore[no-untyped-call]


class _Tx:
    """`core.Tx` over an aiosqlite connection: a trip to its thread per statement."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def rows(self, name: str, /, **params: Any) -> list[Row]:
        statement = _SQL[name]
        found = await self._db.execute_fetchall(statement.text, statement.values(params))
        return list(found)  # type: ignore[arg-type]  # dicts: the connection's row factory is `_dict_row`

    async def row(self, name: str, /, **params: Any) -> Row | None:
        found = await self.rows(name, **params)
        return found[0] if found else None

    async def run(self, name: str, /, **params: Any) -> int:
        statement = _SQL[name]
        cursor = await self._db.execute(statement.text, statement.values(params))
        return cursor.rowcount

    async def run_many(self, name: str, params: Sequence[Params], /) -> None:
        if params:
            statement = _SQL[name]
            await self._db.executemany(statement.text, [statement.values(each) for each in params])


@dataclass(eq=False)
class _Job(Turn):
    """One write waiting for its turn: a send-path function (grouped) or a core work (a transaction alone)."""

    grouped: Callable[[sqlite3.Connection], Any] | None = None
    alone: Callable[[_Tx], Any] | None = None


class _Writer(Turns[_Job]):
    """The one writing connection: jobs in arrival order, one transaction at a time (`turns`, the module
    docstring)."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        super().__init__()
        self._db = db
        self._raw: sqlite3.Connection = db._conn  # used only on the connection's own thread (`_on_thread`)

    async def _commit_next(self) -> None:
        if self._queue[0].alone is not None:
            group = [self._queue.popleft()]
            await self._alone(group[0])
        else:
            group = []
            while self._queue and self._queue[0].alone is None and len(group) < MAX_GROUP:
                group.append(self._queue.popleft())
            await self._run_on_thread(_commit_group, self._raw, group)
        for job in group:
            job.done = True
            job.wake.set()

    async def _alone(self, job: _Job) -> None:
        assert job.alone is not None
        try:
            await self._db.execute("BEGIN IMMEDIATE")
            try:
                job.result = await job.alone(_Tx(self._db))
            except BaseException:
                if self._db.in_transaction:
                    await self._db.execute("ROLLBACK")
                raise
            await self._db.execute("COMMIT")
        except BaseException as exc:  # the caller gets it, mapped, as any error of its write
            job.error = exc

    async def _run_on_thread(self, function: Callable[..., Any], *args: Any) -> Any:
        """A whole function in one trip to the connection's thread (aiosqlite runs each call there in turn)."""
        return await _on_thread(self._db, function, *args)


def _commit_group(db: sqlite3.Connection, group: list[_Job]) -> None:
    """On the connection's thread: one transaction, a savepoint per job, one commit (one fsync)."""
    try:
        db.execute("BEGIN IMMEDIATE")
        for job in group:
            assert job.grouped is not None
            db.execute("SAVEPOINT job")
            try:
                job.result = job.grouped(db)
            except HailGuardError as exc:  # a refusal (opt-out, lost lease...): only its own writes are undone
                db.execute("ROLLBACK TO job")
                job.error = exc
            db.execute("RELEASE job")
        db.execute("COMMIT")
    except BaseException as exc:  # the disk, a lock, a bug: nothing of the group is committed
        if db.in_transaction:
            db.execute("ROLLBACK")
        for job in group:
            job.result, job.error = None, exc


class SqliteLedger(reads.OperatorReads):
    def __init__(self, writer: aiosqlite.Connection, reader: aiosqlite.Connection, path: str, busy: float) -> None:
        self._writer = _Writer(writer)
        self._writer_db = writer
        self._reader = reader
        self._reading = anyio.Lock()
        """One read's statements at a time on the reading connection."""
        self._path = path
        self._busy_timeout_seconds = busy

    async def _read(self, work: Work[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with errors_mapped(self._path):
            async with self._reading:
                return await work(_Tx(self._reader), *args, **kwargs)

    async def _write(self, work: Work[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        async def alone(tx: _Tx) -> Any:
            return await work(tx, *args, **kwargs)

        with errors_mapped(self._path):
            return await self._writer.run(_Job(alone=alone))

    async def _grouped(self, function: Grouped[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """A send-path write, committed with whatever else arrives meanwhile."""
        with errors_mapped(self._path):
            result: _T = await self._writer.run(_Job(grouped=lambda db: function(db, *args, **kwargs)))
            return result

    # --- the send path ------------------------------------------------------------------------------

    async def begin_send(
        self, intent: Intent, *, owner: str, lease_seconds: float, rules: Rules = DEFAULT_RULES
    ) -> Begin:
        return await self._grouped(_begin_send, intent, owner, lease_seconds, rules)

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        return await self._grouped(_record_outcome, operation_id, owner, outcome, actor)

    async def claim_ready(
        self, *, owner: str, lease_seconds: float, batch_id: str | None = None, limit: int = 1, hold_lead: bool = True
    ) -> list[Operation]:
        return await self._grouped(_claim_ready, owner, lease_seconds, batch_id, limit, hold_lead)

    async def _claim_unknown(
        self, owner: str, lease_seconds: float, operation_id: str | None, batch_id: str | None, limit: int
    ) -> list[Operation]:
        return await self._grouped(_claim_unknown, owner, lease_seconds, operation_id, batch_id, limit)

    async def expire_leases(self) -> int:
        return await self._grouped(_expire)

    async def claim_delivery_checks(
        self, *, channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int = 50
    ) -> list[Operation]:
        wanted = params.delivery_check_args(channels, max_age_seconds, hold_seconds, limit)
        return await self._grouped(_operations, "claim_delivery_checks", wanted)

    async def _plan_batch(self, intents: Iterable[Intent], plan: Plan) -> int:
        """On a connection of its own: staged a chunk per trip in a temporary table (no lock on the ledger, so
        other processes keep sending while a large file is read and checked), then checked against the ledger
        and copied into it in one short transaction."""
        with errors_mapped(self._path):
            async with _connected(self._path, self._busy_timeout_seconds) as db:
                tx = _Tx(db)
                await tx.run("create_stage")
                staged = 0
                for chunk in _chunks(intents, planning.PLAN_CHUNK):
                    await tx.run_many("stage_send", planning.stage_rows(chunk, first=staged + 1))
                    staged += len(chunk)
                await db.execute("BEGIN IMMEDIATE")
                try:
                    await planning.plan_staged(tx, plan, staged)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await db.execute("ROLLBACK")
                    raise
                with anyio.CancelScope(shield=True):
                    await db.execute("COMMIT")
        return staged

    async def backup(self, path: str) -> int:
        with errors_mapped(path):
            return await anyio.to_thread.run_sync(backup_file, self._path, path)

    async def verify(self) -> None:
        """`PRAGMA quick_check`: every page read (as long as reading the file takes), nothing locked."""
        found = await self._read(_quick_check)
        if found != ["ok"]:
            said = " ".join("; ".join(found).split())  # one line: quick_check reports a problem a line
            raise LedgerUnavailable(damaged(said if len(said) <= 300 else said[:300] + "…", self._path))

    async def aclose(self) -> None:
        """Close, once the writes in flight (a shutdown's last ones among them) are committed: bounded."""
        with errors_mapped(self._path), anyio.CancelScope(shield=True):
            with anyio.move_on_after(CLOSE_SECONDS):
                await self._writer.drained()
            await self._reader.close()
            await self._writer_db.close()


async def _quick_check(tx: Tx, /) -> list[str]:
    return [str(next(iter(row.values()))) for row in await tx.rows("quick_check")]


# --- the send path, on the writing connection's thread (a statement's parameters in one dict, passed on as it is)


def _fetch(db: sqlite3.Connection, name: str, given: Params) -> list[Row]:
    statement = _SQL[name]
    return db.execute(statement.text, statement.values(given)).fetchall()


def _run(db: sqlite3.Connection, name: str, given: Params) -> int:
    statement = _SQL[name]
    return db.execute(statement.text, statement.values(given)).rowcount


def _run_many(db: sqlite3.Connection, name: str, rows: Sequence[Params]) -> None:
    statement = _SQL[name]
    db.executemany(statement.text, [statement.values(each) for each in rows])


def _operations(db: sqlite3.Connection, name: str, given: Params) -> list[Operation]:
    return [core.operation_of(row) for row in _fetch(db, name, given)]


def _must(db: sqlite3.Connection, operation_id: str) -> Operation:
    return core.operation_of(must_row(_fetch(db, "operation_by_id", {"id": operation_id}), operation_id))


def _event(db: sqlite3.Connection, operation_id: str, before: State | None, after: State, actor: str, why: str) -> None:
    _run(db, "record_event", core.event_values(operation_id, before, after, actor, why))


def _expire(db: sqlite3.Connection) -> int:
    expired = [row["id"] for row in _fetch(db, "expire_leases", {})]
    for operation_id in expired:
        _event(db, operation_id, State.SENDING, State.UNKNOWN, "ledger", LEASE_EXPIRED)
    return len(expired)


def _begin_send(db: sqlite3.Connection, intent: Intent, owner: str, lease_seconds: float, rules: Rules) -> Begin:
    _expire(db)
    keys = {"idempotency_key": intent.idempotency_key, "legacy_key": intent.legacy_key}
    existing = next(iter(_operations(db, "operation_by_keys", keys)), None)
    if existing is not None:
        if not same_send.repeats(existing, intent):
            return Begin(existing, claimed=False)  # the key holds another message: the caller refuses it
        return _claim_if_ready(db, existing, owner, lease_seconds, rules)
    if _opted_out(db, intent.recipients, intent.channel):
        raise policy.suppressed_refusal(intent.recipients, intent.channel)
    answer = policy.decide(intent, _candidates(db, intent, rules), rules)
    if answer is not None:
        return _claim_if_ready(db, answer, owner, lease_seconds, rules)
    operation_id = str(uuid.uuid4())
    sending = {"id": operation_id, **params.intent_values(intent), "owner": owner, "lease_seconds": lease_seconds}
    [row] = _fetch(db, "insert_sending", sending)
    _run(db, "insert_operation_recipients", {"id": operation_id})
    _event(db, operation_id, None, State.SENDING, owner, "intent recorded; forwarding")
    return Begin(core.operation_of(row), claimed=True)


def _claim_if_ready(
    db: sqlite3.Connection, operation: Operation, owner: str, lease_seconds: float, rules: Rules
) -> Begin:
    """A `ready` operation is claimed to be sent now (under its own key and request), unless its recipient is held;
    any other is answered from."""
    claim = {"owner": owner, "lease_seconds": lease_seconds, "id": operation.id, "hold_lead": rules.hold_lead}
    claimed = _fetch(db, "claim_ready_by_id", claim)
    if not claimed:
        return Begin(operation, claimed=False)
    _event(db, operation.id, State.READY, State.SENDING, owner, "claimed; forwarding")
    return Begin(core.operation_of(claimed[0]), claimed=True)


def _opted_out(db: sqlite3.Connection, reached: Sequence[str], channel: str) -> bool:
    probes = core.opt_out_probes(reached, channel)
    return bool(probes) and bool(_fetch(db, "opted_out", {"keys": json.dumps(probes), "channel": channel}))


def _candidates(db: sqlite3.Connection, intent: Intent, rules: Rules) -> Candidates:
    """What the ledger holds that the rules about the same send compare `intent` with (see `same_send`)."""
    matches = _operations(db, "matches", params.match_args(intent, rules))
    if matches:
        return Candidates(matches=matches)
    holds = _operations(db, "holds", params.hold_args(intent, rules))
    if holds or not rules.compares_near or intent.allow_duplicate:
        return Candidates(holds=holds)
    return Candidates(near=_operations(db, "near", params.near_args(intent, rules)))


def _record_outcome(db: sqlite3.Connection, operation_id: str, owner: str, outcome: Outcome, actor: str) -> Operation:
    before = State(must_row(_fetch(db, "state_of", {"id": operation_id}), operation_id)["state"])
    if outcome.state is State.ACCEPTED and outcome.provider_id is not None:
        holder = _fetch(db, "provider_id_holder", {"provider_id": outcome.provider_id, "id": operation_id})
        if holder:
            outcome = policy.provider_id_taken(outcome, holder[0]["id"])
    recorded = _fetch(db, "record_outcome", {**params.outcome_values(outcome), "id": operation_id, "owner": owner})
    if not recorded:
        raise LeaseLost(
            f"operation {operation_id} is no longer ours to record (state {before.value}, "
            f"claimed by another worker); its outcome was not overwritten"
        )
    _event(db, operation_id, before, outcome.state, actor, outcome.reason)
    operation = core.operation_of(recorded[0])
    if outcome.provider_id is not None:
        kept = {"provider_id": outcome.provider_id, "within_seconds": core.PARKED_WEBHOOK_SECONDS}
        parked = _fetch(db, "parked_webhooks", kept)
        if parked:  # webhooks that came before the id: applied in this same commit
            for name, rows in core.parked_writes(operation, parked):
                _run_many(db, name, rows)
            return _must(db, operation_id)
    return operation


def _claim_ready(
    db: sqlite3.Connection, owner: str, lease_seconds: float, batch_id: str | None, limit: int, hold_lead: bool
) -> list[Operation]:
    _expire(db)
    name, batch = ("claim_ready_any", {}) if batch_id is None else ("claim_ready_in_batch", {"batch_id": batch_id})
    claim = {"owner": owner, "lease_seconds": lease_seconds, "limit": 1, "hold_lead": hold_lead, **batch}
    claimed: list[Operation] = []
    while len(claimed) < limit:  # one at a time: each claimed send holds the next to its recipient and lead
        found = _operations(db, name, claim)
        if not found:
            break
        _event(db, found[0].id, State.READY, State.SENDING, owner, "claimed; forwarding")
        claimed.extend(found)
    return claimed


def _claim_unknown(
    db: sqlite3.Connection, owner: str, lease_seconds: float, operation_id: str | None, batch_id: str | None, limit: int
) -> list[Operation]:
    _expire(db)
    lease = {"owner": owner, "lease_seconds": lease_seconds, "batch_id": batch_id}
    if operation_id is not None:
        return _operations(db, "claim_unknown_by_id", {**lease, "id": operation_id})
    return _operations(db, "claim_unknown_due", {**lease, "limit": limit})


# --- planning a batch ----------------------------------------------------------------------------------


def _chunks(items: Iterable[Intent], size: int) -> Iterator[list[Intent]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


# --- connections, migrations, errors --------------------------------------------------------------------


@asynccontextmanager
async def open_sqlite_ledger(path: str, *, busy_timeout_seconds: float = 5.0) -> AsyncIterator[SqliteLedger]:
    """Open the file (created 0600 with its folder, with a notice, where no file is; an empty file is refused),
    switch on WAL and migrate it; a writer and a reader."""
    with errors_mapped(path):
        if created := await anyio.to_thread.run_sync(_create_checked, path):
            log.warning(
                "ledger_created",
                ledger=created,
                message="no ledger was there: a new, empty one was made; if you expected your ledger, check "
                "[ledger] url (a relative path is taken from the config file's folder)",
            )
    async with (
        _connected(path, busy_timeout_seconds, prepare=True) as writer,
        _connected(path, busy_timeout_seconds, reader=True) as reader,
    ):
        yield SqliteLedger(writer, reader, path, busy_timeout_seconds)


def _create_checked(path: str) -> str | None:
    """The file's absolute path when this made it (no file was there), else None; an empty file is refused."""
    refuse_network_filesystem(path)
    created = create_private(path)
    refuse_empty(path)
    return os.path.abspath(path) if created else None


@asynccontextmanager
async def _connected(
    path: str, busy_timeout_seconds: float, *, prepare: bool = False, reader: bool = False
) -> AsyncIterator[aiosqlite.Connection]:
    """An aiosqlite connection with the ledger's settings; the first one (`prepare`) migrates."""
    with errors_mapped(path):
        db = await aiosqlite.connect(path, timeout=busy_timeout_seconds, isolation_level=None)
    try:
        with errors_mapped(path):
            await _on_thread(db, _settings, db._conn, path, busy_timeout_seconds, prepare, reader)
        yield db
    finally:
        with anyio.CancelScope(shield=True), errors_mapped(path):
            await db.close()


def _settings(db: sqlite3.Connection, path: str, busy: float, prepare: bool, reader: bool) -> None:
    db.row_factory = _dict_row
    if prepare:
        _switch_to_wal(db, busy)
    db.execute("PRAGMA synchronous = FULL")  # durable at each commit: see the module docstring
    db.execute("PRAGMA foreign_keys = ON")
    if prepare:
        _migrate(db, path)
    if reader:
        db.execute("PRAGMA query_only = ON")


def _switch_to_wal(db: sqlite3.Connection, busy_timeout_seconds: float) -> None:
    """WAL mode; on a brand-new file opened by several processes at once the switch can find the
    file locked without waiting the busy timeout, so it is retried within that timeout."""
    deadline = time.monotonic() + max(busy_timeout_seconds, 1.0)
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        else:
            return


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) for every migration shipped, in order."""
    return sql.migrations("sqlite")


def _migrate(db: sqlite3.Connection, path: str) -> None:
    """Apply what is missing, all in one write transaction, so processes starting together take turns."""
    known = migrations()
    latest = known[-1][0]
    if _schema_version(db, path, latest) == latest:
        return  # the usual start: no write lock taken, so processes starting together do not queue
    db.execute("BEGIN IMMEDIATE")
    try:
        current = _schema_version(db, path, latest)
        for version, script in known:
            if version > current:
                for statement in _statements(script):
                    db.execute(statement)
                if version in _BACKFILLS:
                    _backfill(db, _BACKFILLS[version])
                db.execute(f"PRAGMA user_version = {version}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _schema_version(db: sqlite3.Connection, path: str, latest: int) -> int:
    row = db.execute("PRAGMA user_version").fetchone()
    return sql.check_version(int(next(iter(row.values()))) if row else 0, latest, path)


def _statements(script: str) -> Iterator[str]:
    """Each statement of a migration, whole: as SQLite reads them, so a trigger's body (with its own `;`) is one."""
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    if pending.strip():
        yield pending  # what is left is comments (it runs as nothing), or an unfinished statement (it fails)


def _backfill(db: sqlite3.Connection, step: backfill.Step) -> None:
    """A migration's stored values recomputed (`backfill`), then each opt-out stored by its recipient's key now."""
    for page in backfill.pages(iter(_fetch(db, f"backfill_{step.name}_rows", {}))):
        updates, reached = step.recompute(page)
        _run_many(db, f"backfill_{step.name}", updates)
        _run_many(db, "backfill_recipient", reached)
    for row in _fetch(db, "backfill_opt_outs", {}):
        key = step.opt_out_key(row["recipient"], row["channel"])
        if key != row["recipient"]:
            kept = {"recipient": row["recipient"], "channel": row["channel"]}
            _run(db, "backfill_opt_out_key", {"key": key, **kept})
            _run(db, "backfill_drop_opt_out", kept)


_BACKFILLS = {6: backfill.FACTS, 9: backfill.KEYS}
"""Migrations whose stored values are recomputed in Python right after their SQL, in their transaction."""
