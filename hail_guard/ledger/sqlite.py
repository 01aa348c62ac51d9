"""The SQLite ledger: one file, WAL, writes in `BEGIN IMMEDIATE`, the database's clock.

One connection per process, serialised by a lock so a transaction's statements never interleave
with another task's. Several processes share the file: SQLite's own locking plus a busy timeout.
Every sqlite3 error is mapped to our tree in `_mapped`, and only there.
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import aiosqlite
import anyio

from hail_guard.errors import HailGuardError, LeaseLost, LedgerUnavailable, NotFound, SchemaTooNew
from hail_guard.ledger import Begin
from hail_guard.models import Event, Intent, Operation, Outcome, State

NOW = "((julianday('now') - 2440587.5) * 86400.0)"
"""The database clock, in Unix epoch seconds."""

_COLUMNS = (
    "id, idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, "
    "campaign_id, lead_id, message_id, batch_id, state, provider_id, result, last_error, review_reason, "
    "attempts, lease_owner, lease_expires_at, not_before, next_check_at, created_at, updated_at, "
    "first_sent_at"
)
_SELECT = f"SELECT {_COLUMNS} FROM operations"  # noqa: S608  (constant column list)
_TIME_COLUMNS = frozenset(
    {"lease_expires_at", "not_before", "next_check_at", "created_at", "updated_at", "first_sent_at"}
)

_EXPIRE_LEASES = f"""
    UPDATE operations SET state = 'unknown', updated_at = {NOW}, next_check_at = {NOW}
    WHERE state = 'sending' AND lease_expires_at <= {NOW}
    RETURNING id
"""  # noqa: S608
_INSERT = f"""
    INSERT INTO operations (id, idempotency_key, tool, channel, recipients, request, request_fingerprint,
        content_fingerprint, campaign_id, lead_id, message_id, batch_id, state, attempts, lease_owner,
        lease_expires_at, created_at, updated_at, first_sent_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'sending', 1, ?, {NOW} + ?, {NOW}, {NOW}, {NOW})
"""  # noqa: S608
_CLAIM_READY = f"""
    UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?,
        lease_expires_at = {NOW} + ?, updated_at = {NOW}, first_sent_at = COALESCE(first_sent_at, {NOW})
    WHERE id = ? AND state = 'ready' AND request_fingerprint = ? AND COALESCE(not_before, 0) <= {NOW}
"""  # noqa: S608
_CLAIM_UNKNOWN = f"""
    UPDATE operations SET attempts = attempts + 1, lease_owner = ?, lease_expires_at = {NOW} + ?,
        updated_at = {NOW}
    WHERE id IN (
        SELECT id FROM operations
        WHERE state = 'unknown'
          AND (? IS NOT NULL AND id = ? OR ? IS NULL AND COALESCE(next_check_at, 0) <= {NOW})
          AND COALESCE(lease_expires_at, 0) <= {NOW}
        ORDER BY next_check_at LIMIT ?)
    RETURNING {_COLUMNS}
"""  # noqa: S608
_RECORD = f"""
    UPDATE operations SET state = ?, provider_id = COALESCE(?, provider_id), result = COALESCE(?, result),
        last_error = COALESCE(?, last_error), review_reason = ?,
        not_before = CASE WHEN ? IS NULL THEN NULL ELSE {NOW} + ? END,
        next_check_at = CASE WHEN ? IS NULL THEN NULL ELSE {NOW} + ? END,
        lease_expires_at = NULL, updated_at = {NOW}
    WHERE id = ? AND lease_owner = ? AND state IN ('sending', 'unknown')
"""  # noqa: S608
_EVENT = f"""
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason) VALUES (?, {NOW}, ?, ?, ?, ?)
"""  # noqa: S608


class SqliteLedger:
    def __init__(self, connection: aiosqlite.Connection, path: str) -> None:
        self._db = connection
        self._path = path
        self._lock = anyio.Lock()

    async def now(self) -> datetime:
        async with self._read() as db:
            row = await (await db.execute(f"SELECT {NOW}")).fetchone()
        assert row is not None
        return _time(row[0])

    async def begin_send(self, intent: Intent, *, owner: str, lease_seconds: float) -> Begin:
        async with self._write() as db:
            await self._expire(db, "lease expired while sending: the request may have left")
            existing = await _one(db, f"{_SELECT} WHERE idempotency_key = ?", (intent.idempotency_key,))
            if existing is None:
                operation_id = str(uuid.uuid4())
                await db.execute(
                    _INSERT,
                    (
                        operation_id,
                        intent.idempotency_key,
                        intent.tool,
                        intent.channel,
                        json.dumps(list(intent.recipients)),
                        intent.request,
                        intent.request_fingerprint,
                        intent.content_fingerprint,
                        intent.campaign_id,
                        intent.lead_id,
                        intent.message_id,
                        intent.batch_id,
                        owner,
                        lease_seconds,
                    ),
                )
                await _event(db, operation_id, None, State.SENDING, owner, "intent recorded; forwarding")
                return Begin(await _must(db, operation_id), claimed=True)
            claimed = await db.execute(_CLAIM_READY, (owner, lease_seconds, existing.id, intent.request_fingerprint))
            if claimed.rowcount == 1:
                await _event(db, existing.id, State.READY, State.SENDING, owner, "claimed; forwarding")
                return Begin(await _must(db, existing.id), claimed=True)
            return Begin(existing, claimed=False)

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        result = json.dumps(outcome.result) if outcome.result is not None else None
        async with self._write() as db:
            before = await _must(db, operation_id)
            updated = await db.execute(
                _RECORD,
                (
                    outcome.state.value,
                    outcome.provider_id,
                    result,
                    outcome.error,
                    outcome.review_reason,
                    outcome.not_before_seconds,
                    outcome.not_before_seconds,
                    outcome.check_after_seconds,
                    outcome.check_after_seconds,
                    operation_id,
                    owner,
                ),
            )
            if updated.rowcount != 1:
                raise LeaseLost(
                    f"operation {operation_id} is no longer ours to record (state {before.state.value}, "
                    f"claimed by another worker); its outcome was not overwritten"
                )
            await _event(db, operation_id, before.state, outcome.state, actor, outcome.reason)
            return await _must(db, operation_id)

    async def claim_unknown(
        self, *, owner: str, lease_seconds: float, operation_id: str | None = None, limit: int = 100
    ) -> list[Operation]:
        async with self._write() as db:
            await self._expire(db, "lease expired while sending: the request may have left")
            cursor = await db.execute(
                _CLAIM_UNKNOWN, (owner, lease_seconds, operation_id, operation_id, operation_id, limit)
            )
            return [_operation(row) for row in await cursor.fetchall()]

    async def get(self, operation_id: str) -> Operation:
        async with self._read() as db:
            return await _must(db, operation_id)

    async def find_by_key(self, idempotency_key: str) -> Operation | None:
        async with self._read() as db:
            return await _one(db, f"{_SELECT} WHERE idempotency_key = ?", (idempotency_key,))

    async def list_operations(
        self, *, state: State | None = None, campaign_id: str | None = None, limit: int = 100
    ) -> list[Operation]:
        query = (
            f"{_SELECT} WHERE (? IS NULL OR state = ?) AND (? IS NULL OR campaign_id = ?) "
            "ORDER BY created_at DESC, id LIMIT ?"
        )
        state_value = state.value if state is not None else None
        async with self._read() as db:
            cursor = await db.execute(query, (state_value, state_value, campaign_id, campaign_id, limit))
            return [_operation(row) for row in await cursor.fetchall()]

    async def events(self, operation_id: str) -> list[Event]:
        async with self._read() as db:
            cursor = await db.execute(
                "SELECT operation_id, at, from_state, to_state, actor, reason FROM events "
                "WHERE operation_id = ? ORDER BY id",
                (operation_id,),
            )
            return [
                Event(
                    operation_id=r[0],
                    at=_time(r[1]),
                    from_state=State(r[2]) if r[2] else None,
                    to_state=State(r[3]),
                    actor=r[4],
                    reason=r[5],
                )
                for r in await cursor.fetchall()
            ]

    async def expire_leases(self) -> int:
        async with self._write() as db:
            return await self._expire(db, "lease expired while sending: the request may have left")

    async def aclose(self) -> None:
        with _mapped(self._path):
            await self._db.close()

    async def _expire(self, db: aiosqlite.Connection, reason: str) -> int:
        expired = [row[0] for row in await (await db.execute(_EXPIRE_LEASES)).fetchall()]
        for operation_id in expired:
            await _event(db, operation_id, State.SENDING, State.UNKNOWN, "ledger", reason)
        return len(expired)

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[aiosqlite.Connection]:
        """One `BEGIN IMMEDIATE` transaction: committed on success, rolled back on any error."""
        async with self._lock:
            with _mapped(self._path):
                await self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._db.rollback()
                    raise
                with anyio.CancelScope(shield=True):
                    await self._db.commit()

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock:
            with _mapped(self._path):
                yield self._db


@asynccontextmanager
async def open_sqlite_ledger(path: str, *, busy_timeout_seconds: float = 5.0) -> AsyncIterator[SqliteLedger]:
    """Open the file (created 0600 with its folder), switch on WAL and migrate it."""
    with _mapped(path):
        _create_private(path)
        connection = await aiosqlite.connect(path, isolation_level=None)
    ledger = SqliteLedger(connection, path)
    try:
        with _mapped(path):
            await connection.execute(f"PRAGMA busy_timeout = {int(busy_timeout_seconds * 1000)}")
            await connection.execute("PRAGMA journal_mode = WAL")
            await connection.execute("PRAGMA synchronous = NORMAL")
            await connection.execute("PRAGMA foreign_keys = ON")
            await _migrate(connection, path)
        yield ledger
    finally:
        with anyio.CancelScope(shield=True):
            await ledger.aclose()


def _create_private(path: str) -> None:
    if path == ":memory:" or os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) for every migration shipped, in order."""
    folder = resources.files("hail_guard.ledger") / "migrations" / "sqlite"
    found = [
        (int(item.name.split("_")[0]), item.read_text()) for item in folder.iterdir() if item.name.endswith(".sql")
    ]
    return sorted(found)


async def _migrate(db: aiosqlite.Connection, path: str) -> None:
    known = migrations()
    latest = known[-1][0]
    row = await (await db.execute("PRAGMA user_version")).fetchone()
    current = int(row[0]) if row else 0
    if current > latest:
        raise SchemaTooNew(
            f"the ledger {path} has schema version {current}, newer than this hail-guard knows ({latest}); "
            "upgrade hail-guard"
        )
    for version, sql in known:
        if version <= current:
            continue
        await db.execute("BEGIN IMMEDIATE")
        try:
            await _run_script(db, sql)
            await db.execute(f"PRAGMA user_version = {version}")
        except BaseException:
            await db.rollback()
            raise
        await db.commit()


async def _run_script(db: aiosqlite.Connection, sql: str) -> None:
    """Run a migration's statements one by one inside the open transaction."""
    for statement in _statements(sql):
        await db.execute(statement)


def _statements(sql: str) -> Iterator[str]:
    lines = [line.split("--")[0] for line in sql.splitlines()]
    for statement in "\n".join(lines).split(";"):
        if statement.strip():
            yield statement


@contextmanager
def _mapped(path: str) -> Iterator[None]:
    """The one place sqlite3 errors become ours."""
    try:
        yield
    except HailGuardError:
        raise
    except sqlite3.OperationalError as exc:
        raise LedgerUnavailable(_explain(str(exc), path)) from exc
    except (sqlite3.DatabaseError, OSError, ValueError) as exc:
        raise LedgerUnavailable(f"the ledger {path} cannot be used: {exc}") from exc


def _explain(message: str, path: str) -> str:
    lowered = message.lower()
    if "locked" in lowered or "busy" in lowered:
        return (
            f"the ledger {path} stayed locked past the busy timeout; another process holds it: "
            "retry, or raise [ledger] busy_timeout_seconds"
        )
    if "readonly" in lowered or "read-only" in lowered:
        return f"the ledger {path} is read-only: make the file and its folder writable by this user"
    if "full" in lowered:
        return f"the disk holding the ledger {path} is full: free space, then retry"
    if "unable to open" in lowered:
        return f"cannot open the ledger {path}: check that the folder exists and is writable"
    return f"the ledger {path} failed: {message}"


async def _one(db: aiosqlite.Connection, query: str, params: Sequence[Any]) -> Operation | None:
    row = await (await db.execute(query, params)).fetchone()
    return _operation(row) if row is not None else None


async def _must(db: aiosqlite.Connection, operation_id: str) -> Operation:
    found = await _one(db, f"{_SELECT} WHERE id = ?", (operation_id,))
    if found is None:
        raise NotFound(f"no operation {operation_id}; list them with `hail-guard ops list`")
    return found


async def _event(
    db: aiosqlite.Connection, operation_id: str, before: State | None, after: State, actor: str, reason: str
) -> None:
    await db.execute(_EVENT, (operation_id, before.value if before else None, after.value, actor, reason))


def _operation(row: Sequence[Any]) -> Operation:
    values = dict(zip(_COLUMNS.split(", "), row, strict=True))
    values["recipients"] = json.loads(values["recipients"])
    values["result"] = json.loads(values["result"]) if values["result"] is not None else None
    for name in _TIME_COLUMNS:
        values[name] = _time(values[name]) if values[name] is not None else None
    return Operation.model_validate(values)


def _time(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)
