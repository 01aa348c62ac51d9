"""The SQLite ledger: one file, WAL, writes in `BEGIN IMMEDIATE`, the database's clock.

One connection per process. Each ledger operation is one plain function over that connection,
run whole on a worker thread (`_write` in a transaction, `_read` without): one thread round trip
per operation, however many statements it runs, and never two at once. Several processes share
the file: SQLite's own locking plus a busy timeout. Every sqlite3 error is mapped to our tree in
`_mapped`, and only there.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, closing, contextmanager, suppress
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
import anyio.to_thread

from hail_guard import delivery, policy, recipients
from hail_guard.errors import (
    HailGuardError,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    NotFound,
    RefusedByPolicy,
    SchemaTooNew,
)
from hail_guard.ledger import Begin, backfill, batch_summaries
from hail_guard.models import (
    TERMINAL_STATES,
    BatchStatus,
    BatchSummary,
    DeliveryEvent,
    DeliveryObservation,
    DeliveryState,
    Event,
    Intent,
    Operation,
    Outcome,
    PruneReport,
    State,
    Suppression,
    ToolPin,
    Webhook,
    WebhookOutcome,
)

NOW = "((julianday('now') - 2440587.5) * 86400.0)"
"""The database clock, in Unix epoch seconds."""

_COLUMNS = (
    "id, idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, "
    "campaign_id, lead_id, message_id, batch_id, state, provider_id, result, last_error, review_reason, cancel_reason, "
    "attempts, lease_owner, lease_expires_at, not_before, next_check_at, created_at, updated_at, "
    "first_sent_at, delivery_state, delivery_at, delivery_checks, delivery_next_check_at, resend_of, resent_as, "
    "sender, may_have_left"
)
_SELECT = f"SELECT {_COLUMNS} FROM operations"
_O_COLUMNS = ", ".join(f"o.{column}" for column in _COLUMNS.split(", "))
_TIME_COLUMNS = frozenset(
    {
        "lease_expires_at",
        "not_before",
        "next_check_at",
        "created_at",
        "updated_at",
        "first_sent_at",
        "delivery_at",
        "delivery_next_check_at",
    }
)

_EXPIRE_LEASES = f"""
    UPDATE operations SET state = 'unknown', updated_at = {NOW}, next_check_at = {NOW}
    WHERE state = 'sending' AND lease_expires_at <= {NOW}
    RETURNING id
"""
_SUPPRESSED = """EXISTS (
    SELECT 1 FROM suppressions s, json_each(operations.recipient_keys) r
    WHERE s.recipient = r.value AND s.channel IN (operations.channel, 'all'))"""
"""True for an operation any of whose recipients opted out of its channel."""
_INTENT_COLUMNS = (
    "idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint, content_fingerprint, "
    "sender, campaign_id, lead_id, message_id, batch_id"
)
"""What an `Intent` fills in (`_intent_values`, in this order)."""
_INSERT = f"""
    INSERT INTO operations (id, {_INTENT_COLUMNS}, state, attempts, lease_owner, lease_expires_at, created_at,
        updated_at, first_sent_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'sending', 1, ?, {NOW} + ?, {NOW}, {NOW}, {NOW})
    RETURNING {_COLUMNS}
"""
_INSERT_PLANNED = f"""
    INSERT INTO operations (id, {_INTENT_COLUMNS}, state, created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {NOW}, {NOW})
"""
_INSERT_RECIPIENTS = """
    INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
    SELECT o.id, r.value, o.content_fingerprint FROM operations o, json_each(o.recipients) r WHERE o.id = ?
"""
_CLAIM_READY_BY_ID = f"""
    UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?,
        lease_expires_at = {NOW} + ?, updated_at = {NOW}, first_sent_at = COALESCE(first_sent_at, {NOW})
    WHERE id = ? AND state = 'ready' AND COALESCE(not_before, 0) <= {NOW} AND NOT {_SUPPRESSED}
"""
_SENDERS_AGREE = """NOT EXISTS (
    SELECT 1 FROM json_each(o.sender) a, json_each({sender}) b WHERE a.key = b.key AND a.value IS NOT b.value)"""
"""`policy.senders_agree` in SQL: sender fields differ only where both give them."""
_MATCHES = f"""
    SELECT {_O_COLUMNS} FROM operation_recipients r JOIN operations o ON o.id = r.operation_id
    WHERE r.content_fingerprint = ? AND r.recipient IN (SELECT value FROM json_each(?))
      AND o.idempotency_key != ? AND o.tool = ?
      AND (o.state IN (SELECT value FROM json_each(?)) OR (? AND o.may_have_left))
      AND o.created_at >= {NOW} - ? AND {_SENDERS_AGREE.format(sender="?")}
    GROUP BY o.id ORDER BY o.created_at DESC, o.rowid DESC LIMIT 20
"""
"""Operations that block a new send (`policy.blocks`): the same message to one of its recipients, live,
within the window, under another key."""
_CLAIM_READY = f"""
    UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = ?,
        lease_expires_at = {NOW} + ?, updated_at = {NOW}, first_sent_at = COALESCE(first_sent_at, {NOW})
    WHERE id IN (
        SELECT id FROM operations INDEXED BY {{index}}
        WHERE state = 'ready' AND {{batch}} AND COALESCE(not_before, 0) <= {NOW} AND NOT {_SUPPRESSED}
        ORDER BY {{order}} LIMIT ?)
    RETURNING {_COLUMNS}
"""
_CLAIM_READY_ANY = _CLAIM_READY.format(index="operations_ready", batch="? IS NULL", order="created_at, rowid")
_CLAIM_READY_IN_BATCH = _CLAIM_READY.format(
    index="operations_ready_by_batch", batch="batch_id = ?", order="batch_id, created_at, rowid"
)
"""Walk the ready rows (of one batch, or all) oldest first and stop at the first that may go. Without
INDEXED BY, SQLite (no ANALYZE statistics) picks `operations_by_state`, checks every ready row for
opt-outs and sorts them all, so a drain of N sends cost O(N^2) (seen by `python -m bench --only drain`)."""
_CLAIM_UNKNOWN = f"""
    UPDATE operations SET attempts = attempts + 1, lease_owner = ?, lease_expires_at = {NOW} + ?,
        updated_at = {NOW}
    WHERE id IN (
        SELECT id FROM operations
        WHERE state = 'unknown' AND (? IS NULL OR batch_id = ?)
          AND (? IS NOT NULL AND id = ? OR ? IS NULL AND COALESCE(next_check_at, 0) <= {NOW})
          AND COALESCE(lease_expires_at, 0) <= {NOW}
        ORDER BY next_check_at LIMIT ?)
    RETURNING {_COLUMNS}
"""
_CANCEL_SUPPRESSED = f"""
    UPDATE operations SET state = 'cancelled', cancel_reason = ?, updated_at = {NOW}
    WHERE state IN ('planned', 'ready') AND {_SUPPRESSED}
    RETURNING id, state
"""
_LEASE_EXPIRED = "lease expired while sending: the request may have left"
_CHUNK = 500
"""Sends staged per round trip while planning a batch."""
_RECORD = f"""
    UPDATE operations SET state = ?, provider_id = COALESCE(?, provider_id), result = COALESCE(?, result),
        last_error = COALESCE(?, last_error), review_reason = ?, attempts = attempts - ?,
        not_before = CASE WHEN ? IS NULL THEN NULL ELSE {NOW} + ? END,
        next_check_at = CASE WHEN ? IS NULL THEN NULL ELSE {NOW} + ? END,
        lease_expires_at = NULL, updated_at = {NOW}
    WHERE id = ? AND lease_owner = ? AND state IN ('sending', 'unknown')
    RETURNING {_COLUMNS}
"""
_EVENT = f"""
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason) VALUES (?, {NOW}, ?, ?, ?, ?)
"""
_LIST_OPERATIONS = f"""
    {_SELECT} WHERE (? IS NULL OR state = ?) AND (? IS NULL OR campaign_id = ?) AND (? IS NULL OR batch_id = ?)
      AND (? IS NULL OR EXISTS (SELECT 1 FROM json_each(operations.recipient_keys) r WHERE r.value = ?))
      AND (? IS NULL OR created_at >= ?)
      AND (? IS NULL OR (created_at, rowid) < (SELECT created_at, rowid FROM operations o WHERE o.id = ?))
    ORDER BY created_at DESC, rowid DESC LIMIT ?
"""
_DELIVERY_EVENT = f"""
    INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
    VALUES (?, ?, ?, {NOW}, ?, ?) ON CONFLICT (operation_id, state) DO NOTHING
"""
_SET_DELIVERY = f"""
    UPDATE operations SET delivery_state = ?, delivery_at = COALESCE(?, {NOW}), updated_at = {NOW} WHERE id = ?
"""
_COUNT_DELIVERY_CHECK = f"""
    UPDATE operations SET delivery_checks = delivery_checks + 1, delivery_next_check_at = {NOW} + ? WHERE id = ?
"""
_CLAIM_DELIVERY_CHECKS = f"""
    UPDATE operations SET delivery_next_check_at = {NOW} + ?
    WHERE id IN (
        SELECT id FROM operations
        WHERE state = 'accepted' AND provider_id IS NOT NULL
          AND channel IN (SELECT value FROM json_each(?))
          AND (delivery_state IS NULL OR delivery_state NOT IN (SELECT value FROM json_each(?)))
          AND COALESCE(delivery_next_check_at, 0) <= {NOW}
          AND COALESCE(first_sent_at, created_at) >= {NOW} - ?
        ORDER BY COALESCE(delivery_next_check_at, 0), created_at LIMIT ?)
    RETURNING {_COLUMNS}
"""
_RECORD_WEBHOOK = f"""
    INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, operation_id, outcome,
        received_at, payload)
    VALUES (?, ?, ?, ?, ?, ?, {NOW}, ?)
"""
_RESOLVE_REVIEW = f"""
    UPDATE operations SET state = ?, provider_id = COALESCE(?, provider_id), cancel_reason = COALESCE(?, cancel_reason),
        last_error = COALESCE(?, last_error), may_have_left = ?, lease_owner = NULL, lease_expires_at = NULL,
        next_check_at = NULL, updated_at = {NOW}
    WHERE id = ? AND state = 'needs_review'
"""
_SUPERSEDE = f"""
    UPDATE operations SET state = 'cancelled', cancel_reason = ?, resent_as = ?, may_have_left = 1, lease_owner = NULL,
        lease_expires_at = NULL, next_check_at = NULL, updated_at = {NOW}
    WHERE id = ? AND state = 'needs_review'
"""
_PRUNABLE = """
    SELECT id FROM operations
    WHERE state IN (SELECT value FROM json_each(?)) AND updated_at < ? AND created_at < ?
"""


_P = ParamSpec("_P")
_T = TypeVar("_T")


class SqliteLedger:
    def __init__(self, connection: sqlite3.Connection, path: str, busy_timeout_seconds: float) -> None:
        self._db = connection
        self._path = path
        self._busy_timeout_ms = int(busy_timeout_seconds * 1000)
        self._turn = anyio.Lock()
        """One call on the connection at a time; a call's statements never interleave with another's."""

    async def now(self) -> datetime:
        return _time(await self._quick_run(_scalar, f"SELECT {NOW}"))

    async def begin_send(
        self, intent: Intent, *, owner: str, lease_seconds: float, duplicate_window_seconds: float | None = None
    ) -> Begin:
        return await self._quick_write(_begin_send, intent, owner, lease_seconds, duplicate_window_seconds)

    async def plan_batch(
        self,
        *,
        batch_id: str,
        name: str | None,
        intents: Iterable[Intent],
        state: State,
        actor: str,
        duplicate_window_seconds: float | None = None,
    ) -> int:
        """Staged first, a chunk per round trip, in a temporary table of this connection (writing it takes
        no lock on the ledger, so other processes keep sending while a large file is read and checked);
        then checked against the ledger and copied into it in one short transaction."""
        stage = _Stage(f"plan_{uuid.uuid4().hex}")
        await self._run(stage.create)
        try:
            staged = 0
            for chunk in _chunks(intents, _CHUNK):
                await self._run(stage.add, staged, chunk)
                staged += len(chunk)
            await self._write(stage.plan, batch_id, name, state, actor, duplicate_window_seconds)
        finally:
            with anyio.CancelScope(shield=True):
                await self._run(stage.drop)
        return staged

    async def approve_batch(self, batch_id: str, *, actor: str) -> int:
        return await self._write(_approve_batch, batch_id, actor)

    async def claim_ready(
        self, *, owner: str, lease_seconds: float, batch_id: str | None = None, limit: int = 1
    ) -> list[Operation]:
        return await self._quick_write(_claim_ready, owner, lease_seconds, batch_id, limit)

    async def batch_status(self, batch_id: str) -> BatchStatus:
        return await self._run(_batch_status, batch_id)

    async def list_batches(self, *, limit: int = 50) -> list[BatchSummary]:
        rows = await self._run(_rows, _LIST_BATCHES, (limit,))
        return batch_summaries((row[0], row[1], _time(row[2]), row[3], int(row[4])) for row in rows)

    async def count_by_state(self) -> dict[State, int]:
        rows = await self._run(_rows, "SELECT state, COUNT(*) FROM operations GROUP BY state")
        return {State(row[0]): int(row[1]) for row in rows}

    async def add_suppression(self, suppression: Suppression, *, actor: str) -> list[str]:
        return await self._write(_suppress, suppression, actor)

    async def remove_suppression(self, recipient: str, channel: str) -> bool:
        return await self._write(_remove_suppression, _opt_out_key(recipient, channel), channel)

    async def list_suppressions(self) -> list[Suppression]:
        rows = await self._run(
            _rows, "SELECT recipient, channel, reason, source, created_at FROM suppressions ORDER BY created_at"
        )
        return [
            Suppression(recipient=r[0], channel=r[1], reason=r[2], source=r[3], created_at=_time(r[4])) for r in rows
        ]

    async def is_suppressed(self, recipients: Sequence[str], channel: str) -> bool:
        return await self._quick_run(_suppressed, recipients, channel)

    async def observe_tools(self, fingerprints: Mapping[str, str]) -> list[ToolPin]:
        return await self._write(_observe_tools, dict(fingerprints))

    async def accept_tools(self, names: Sequence[str] | None = None) -> list[str]:
        query = (
            "UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL "
            "WHERE fingerprint != accepted_fingerprint"
        )
        params = list(names or ())
        if names is not None:
            query += f" AND name IN ({', '.join('?' for _ in params)})"
        rows = await self._write(_rows, f"{query} RETURNING name", params)
        return sorted(row[0] for row in rows)

    async def tool_pins(self) -> list[ToolPin]:
        return await self._run(_tool_pins)

    async def oldest(self, state: State) -> Operation | None:
        query = f"{_SELECT} WHERE state = ? ORDER BY created_at, rowid LIMIT 1"
        return await self._run(_one, query, (state.value,))

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        return await self._quick_write(_record_outcome, operation_id, owner, outcome, actor)

    async def claim_unknown(
        self,
        *,
        owner: str,
        lease_seconds: float,
        operation_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        params = (owner, lease_seconds, batch_id, batch_id, operation_id, operation_id, operation_id, limit)
        return await self._quick_write(_claim_unknown, params)

    async def get(self, operation_id: str) -> Operation:
        return await self._quick_run(_must, operation_id)

    async def find_by_key(self, idempotency_key: str) -> Operation | None:
        return await self._quick_run(_one, f"{_SELECT} WHERE idempotency_key = ?", (idempotency_key,))

    async def list_operations(
        self,
        *,
        state: State | None = None,
        campaign_id: str | None = None,
        batch_id: str | None = None,
        recipient: str | None = None,
        since: datetime | None = None,
        before: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        state_value = state.value if state is not None else None
        wanted = recipients.comparable(recipient, None) if recipient is not None else None
        after = since.timestamp() if since is not None else None
        filters = (state_value, campaign_id, batch_id, wanted, after, before)
        params = [value for value in filters for _ in range(2)]
        rows = await self._run(_rows, _LIST_OPERATIONS, (*params, limit))
        return [_operation(row) for row in rows]

    async def events(self, operation_id: str) -> list[Event]:
        rows = await self._run(
            _rows,
            "SELECT operation_id, at, from_state, to_state, actor, reason FROM events WHERE operation_id = ? "
            "ORDER BY id",
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
            for r in rows
        ]

    async def expire_leases(self) -> int:
        return await self._write(_expire)

    async def record_delivery(
        self,
        operation_id: str,
        observations: Sequence[DeliveryObservation],
        *,
        next_check_seconds: float | None = None,
    ) -> Operation:
        return await self._write(_record_delivery, operation_id, list(observations), next_check_seconds)

    async def claim_delivery_checks(
        self, *, channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int = 50
    ) -> list[Operation]:
        settled = json.dumps(sorted(state.value for state in delivery.SETTLED))
        params = (hold_seconds, json.dumps(list(channels)), settled, max_age_seconds, limit)
        rows = await self._write(_rows, _CLAIM_DELIVERY_CHECKS, params)
        return [_operation(row) for row in rows]

    async def delivery_events(self, operation_id: str) -> list[DeliveryEvent]:
        rows = await self._run(
            _rows,
            "SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events "
            "WHERE operation_id = ? ORDER BY id",
            (operation_id,),
        )
        return [
            DeliveryEvent(
                operation_id=r[0],
                state=DeliveryState(r[1]),
                occurred_at=_time(r[2]) if r[2] is not None else None,
                recorded_at=_time(r[3]),
                source=r[4],
                detail=r[5],
            )
            for r in rows
        ]

    async def record_webhook(self, webhook: Webhook) -> WebhookOutcome:
        return await self._write(_record_webhook, webhook)

    async def resolve_review(
        self, operation_id: str, *, state: State, reason: str, actor: str, provider_id: str | None = None
    ) -> Operation:
        policy.check_review_decision(state, reason, provider_id)
        return await self._write(_resolve_review, operation_id, state, reason, actor, provider_id)

    async def resend(self, operation_id: str, intent: Intent, *, reason: str, actor: str) -> Operation:
        policy.check_review_decision(State.CANCELLED, reason)
        return await self._write(_resend, operation_id, intent, reason, actor)

    async def prune(self, *, older_than_seconds: float) -> PruneReport:
        if not older_than_seconds > 0:
            raise RefusedByPolicy("prune needs a positive age; nothing was removed")
        return await self._write(_prune, older_than_seconds)

    async def backup(self, path: str) -> int:
        with _mapped(path):
            return await anyio.to_thread.run_sync(_backup_file, self._path, path)

    async def aclose(self) -> None:
        async with self._turn:
            with _mapped(self._path):
                await anyio.to_thread.run_sync(self._db.close)

    async def _write(
        self, work: Callable[Concatenate[sqlite3.Connection, _P], _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """`work` as one `BEGIN IMMEDIATE` transaction: committed if it returns, rolled back if it raises."""
        return await self._call(lambda db: _transaction(db, lambda db: work(db, *args, **kwargs)), quick=False)

    async def _quick_write(
        self, work: Callable[Concatenate[sqlite3.Connection, _P], _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """`_write` for a short transaction of the send path: see `_call`."""
        return await self._call(lambda db: _transaction(db, lambda db: work(db, *args, **kwargs)), quick=True)

    async def _run(
        self, work: Callable[Concatenate[sqlite3.Connection, _P], _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """`work(connection, ...)` with no transaction of ours (reads, the staging table)."""
        return await self._call(lambda db: work(db, *args, **kwargs), quick=False)

    async def _quick_run(
        self, work: Callable[Concatenate[sqlite3.Connection, _P], _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        return await self._call(lambda db: work(db, *args, **kwargs), quick=True)

    async def _call(self, call: Callable[[sqlite3.Connection], _T], *, quick: bool) -> _T:
        """Run `call` whole, one at a time on the connection.

        A quick call (the few short statements of the send path) first runs right here, without
        waiting for any lock: the connection's busy timeout is 0, so a ledger another process is
        writing answers "busy" at once instead of blocking the event loop. Only then, and for every
        other call, it runs on a worker thread with the configured busy timeout: one round trip,
        about 0.4 ms here, which is what a quick call saves. A call that has started is never
        abandoned (to_thread does not abandon it on cancellation): one left half-way would leave the
        connection inside a transaction. A busy quick call is simply run again: its transaction
        never began, or was rolled back.
        """
        async with self._turn:
            with _mapped(self._path):
                if quick:
                    try:
                        return call(self._db)
                    except sqlite3.OperationalError as exc:
                        if exc.sqlite_errorcode not in _BUSY:
                            raise
                return await anyio.to_thread.run_sync(_waiting, self._db, call, self._busy_timeout_ms)


_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def _waiting(db: sqlite3.Connection, call: Callable[[sqlite3.Connection], _T], busy_timeout_ms: int) -> _T:
    """`call` allowed to wait up to the busy timeout for another process's lock."""
    db.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
    try:
        return call(db)
    finally:
        db.execute("PRAGMA busy_timeout = 0")


def _transaction(db: sqlite3.Connection, work: Callable[[sqlite3.Connection], _T]) -> _T:
    db.execute("BEGIN IMMEDIATE")
    try:
        result = work(db)
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return result


@asynccontextmanager
async def open_sqlite_ledger(path: str, *, busy_timeout_seconds: float = 5.0) -> AsyncIterator[SqliteLedger]:
    """Open the file (created 0600 with its folder), switch on WAL and migrate it."""
    with _mapped(path):
        connection = await anyio.to_thread.run_sync(_connect, path)
    ledger = SqliteLedger(connection, path, busy_timeout_seconds)
    try:
        await ledger._run(_prepare, path)
        yield ledger
    finally:
        with anyio.CancelScope(shield=True):
            await ledger.aclose()


def _connect(path: str) -> sqlite3.Connection:
    _create_private(path)
    refuse_network_filesystem(path)
    # Autocommit: transactions are ours (`_transaction`). Used by one caller at a time (`SqliteLedger._call`),
    # which sets the busy timeout for each call.
    return sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)


def _prepare(db: sqlite3.Connection, path: str) -> None:
    """Run through `_waiting`, so under the busy timeout."""
    busy_timeout_seconds = db.execute("PRAGMA busy_timeout").fetchone()[0] / 1000
    _switch_to_wal(db, busy_timeout_seconds)
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute("PRAGMA foreign_keys = ON")
    _migrate(db, path)


def _begin_send(
    db: sqlite3.Connection, intent: Intent, owner: str, lease_seconds: float, duplicate_window_seconds: float | None
) -> Begin:
    _expire(db)
    existing = _one(db, f"{_SELECT} WHERE idempotency_key = ?", (intent.idempotency_key,))
    if existing is not None:
        same = existing.request_fingerprint == intent.request_fingerprint or policy.same_meaning(existing, intent)
        return _claim_if_ready(db, existing, owner, lease_seconds) if same else Begin(existing, claimed=False)
    if _suppressed(db, intent.recipients, intent.channel):
        raise policy.suppressed_refusal(intent.recipients, intent.channel)
    if duplicate_window_seconds is not None:
        matches = _matches(db, intent, duplicate_window_seconds)
        if matches:
            return _claim_if_ready(db, policy.repeat_of(intent, matches), owner, lease_seconds)
    operation_id = str(uuid.uuid4())
    inserted = db.execute(_INSERT, (operation_id, *_intent_values(intent), owner, lease_seconds)).fetchone()
    db.execute(_INSERT_RECIPIENTS, (operation_id,))
    _event(db, operation_id, None, State.SENDING, owner, "intent recorded; forwarding")
    return Begin(_operation(inserted), claimed=True)


def _claim_if_ready(db: sqlite3.Connection, operation: Operation, owner: str, lease_seconds: float) -> Begin:
    """A `ready` operation is claimed to be sent now (under its own key and request); any other is answered from."""
    if db.execute(_CLAIM_READY_BY_ID, (owner, lease_seconds, operation.id)).rowcount == 1:
        _event(db, operation.id, State.READY, State.SENDING, owner, "claimed; forwarding")
        return Begin(_must(db, operation.id), claimed=True)
    return Begin(operation, claimed=False)


def _matches(db: sqlite3.Connection, intent: Intent, window_seconds: float) -> list[Operation]:
    """The operations that block `intent` being recorded (see `_MATCHES`), newest first."""
    states, closed_block = policy.blocking_states(allow_duplicate=intent.allow_duplicate)
    params = (
        intent.content_fingerprint,
        json.dumps(list(intent.recipients)),
        intent.idempotency_key,
        intent.tool,
        json.dumps(states),
        closed_block,
        window_seconds,
        intent.sender,
    )
    return [_operation(row) for row in db.execute(_MATCHES, params)]


def _record_outcome(db: sqlite3.Connection, operation_id: str, owner: str, outcome: Outcome, actor: str) -> Operation:
    before = _must(db, operation_id)
    result = json.dumps(outcome.result) if outcome.result is not None else None
    recorded = db.execute(
        _RECORD,
        (
            outcome.state.value,
            outcome.provider_id,
            result,
            outcome.error,
            outcome.review_reason,
            0 if outcome.attempted else 1,
            outcome.not_before_seconds,
            outcome.not_before_seconds,
            outcome.check_after_seconds,
            outcome.check_after_seconds,
            operation_id,
            owner,
        ),
    ).fetchall()
    if len(recorded) != 1:
        raise LeaseLost(
            f"operation {operation_id} is no longer ours to record (state {before.state.value}, "
            f"claimed by another worker); its outcome was not overwritten"
        )
    _event(db, operation_id, before.state, outcome.state, actor, outcome.reason)
    return _operation(recorded[0])


def _claim_ready(
    db: sqlite3.Connection, owner: str, lease_seconds: float, batch_id: str | None, limit: int
) -> list[Operation]:
    _expire(db)
    query = _CLAIM_READY_ANY if batch_id is None else _CLAIM_READY_IN_BATCH
    claimed = [_operation(row) for row in db.execute(query, (owner, lease_seconds, batch_id, limit))]
    for operation in claimed:
        _event(db, operation.id, State.READY, State.SENDING, owner, "claimed; forwarding")
    return claimed


def _claim_unknown(db: sqlite3.Connection, params: Sequence[Any]) -> list[Operation]:
    _expire(db)
    return [_operation(row) for row in db.execute(_CLAIM_UNKNOWN, params)]


def _expire(db: sqlite3.Connection) -> int:
    expired = [row[0] for row in db.execute(_EXPIRE_LEASES).fetchall()]
    for operation_id in expired:
        _event(db, operation_id, State.SENDING, State.UNKNOWN, "ledger", _LEASE_EXPIRED)
    return len(expired)


class _Stage:
    """A batch being planned: its sends in a temporary table, then into the ledger in one transaction."""

    def __init__(self, table: str) -> None:
        self.table = f'temp."{table}"'

    def create(self, db: sqlite3.Connection) -> None:
        db.execute(
            f"""CREATE TABLE {self.table} (
                position INTEGER PRIMARY KEY, id TEXT NOT NULL, idempotency_key TEXT NOT NULL, tool TEXT NOT NULL,
                channel TEXT NOT NULL, recipients TEXT NOT NULL, recipient_keys TEXT NOT NULL, request TEXT NOT NULL,
                request_fingerprint TEXT NOT NULL, content_fingerprint TEXT NOT NULL, sender TEXT NOT NULL,
                campaign_id TEXT, lead_id TEXT, message_id TEXT, allow_duplicate INTEGER NOT NULL)"""
        )

    def add(self, db: sqlite3.Connection, staged: int, intents: Sequence[Intent]) -> None:
        db.executemany(
            f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (position, str(uuid.uuid4()), *_intent_values(intent)[:-1], intent.allow_duplicate)
                for position, intent in enumerate(intents, start=staged + 1)
            ],
        )

    def plan(
        self,
        db: sqlite3.Connection,
        batch_id: str,
        name: str | None,
        state: State,
        actor: str,
        duplicate_window_seconds: float | None,
    ) -> None:
        db.execute(
            f"INSERT INTO batches (id, name, created_by, created_at) VALUES (?, ?, ?, {NOW})", (batch_id, name, actor)
        )
        self._refuse_known_keys(db)
        if duplicate_window_seconds is not None:
            self._refuse_duplicates(db, duplicate_window_seconds)
        db.execute(
            f"""INSERT INTO operations (id, {_INTENT_COLUMNS}, state, created_at, updated_at)
                SELECT id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
                    content_fingerprint, sender, campaign_id, lead_id, message_id, ?, ?, {NOW}, {NOW}
                FROM {self.table} ORDER BY position""",
            (batch_id, state.value),
        )
        db.execute(
            f"""INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
                SELECT p.id, r.value, p.content_fingerprint FROM {self.table} p, json_each(p.recipients) r"""
        )
        db.execute(
            f"""INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
                SELECT id, {NOW}, NULL, ?, ?, ? FROM {self.table} ORDER BY position""",
            (state.value, actor, f"planned in batch {batch_id}"),
        )
        _cancel_suppressed(db, actor, "the recipient opted out before the send")

    def drop(self, db: sqlite3.Connection) -> None:
        db.execute(f"DROP TABLE IF EXISTS {self.table}")

    def _refuse_known_keys(self, db: sqlite3.Connection) -> None:
        taken = [
            f"send {position} (key {key!r} is operation {operation_id})"
            for position, key, operation_id in db.execute(
                f"SELECT p.position, p.idempotency_key, o.id FROM {self.table} p "
                "JOIN operations o ON o.idempotency_key = p.idempotency_key ORDER BY p.position"
            )
        ]
        if taken:
            raise RefusedByPolicy(
                f"{len(taken)} send(s) already exist in the ledger: {'; '.join(taken[:10])}; nothing was planned"
            )

    def _refuse_duplicates(self, db: sqlite3.Connection, window_seconds: float) -> None:
        """The first staged send that the ledger already has (by meaning, for one of its recipients)."""
        for allow_duplicate in (False, True):
            states, closed_block = policy.blocking_states(allow_duplicate=allow_duplicate)
            row = db.execute(
                f"""SELECT p.position FROM {self.table} p, json_each(p.recipients) pr
                    JOIN operation_recipients r
                        ON r.content_fingerprint = p.content_fingerprint AND r.recipient = pr.value
                    JOIN operations o ON o.id = r.operation_id
                    WHERE p.allow_duplicate = ? AND o.idempotency_key != p.idempotency_key AND o.tool = p.tool
                      AND (o.state IN (SELECT value FROM json_each(?)) OR (? AND o.may_have_left))
                      AND o.created_at >= {NOW} - ? AND {_SENDERS_AGREE.format(sender="p.sender")}
                    ORDER BY p.position LIMIT 1""",
                (allow_duplicate, json.dumps(states), closed_block, window_seconds),
            ).fetchone()
            if row is not None:
                intent = self._intent(db, row[0])
                raise policy.already_planned(intent, _matches(db, intent, window_seconds), row[0])

    def _intent(self, db: sqlite3.Connection, position: int) -> Intent:
        names = _INTENT_COLUMNS.replace("batch_id", "allow_duplicate")
        row = db.execute(f"SELECT {names} FROM {self.table} WHERE position = ?", (position,)).fetchone()
        values = dict(zip(names.split(", "), row, strict=True))
        values["recipients"] = tuple(json.loads(values["recipients"]))
        del values["recipient_keys"]
        return Intent.model_validate(values)


def _chunks(items: Iterable[Intent], size: int) -> Iterator[list[Intent]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _approve_batch(db: sqlite3.Connection, batch_id: str, actor: str) -> int:
    _must_batch(db, batch_id)
    approved = db.execute(
        f"UPDATE operations SET state = 'ready', updated_at = {NOW} WHERE batch_id = ? AND state = 'planned' "
        "RETURNING id",
        (batch_id,),
    ).fetchall()
    for (operation_id,) in approved:
        _event(db, operation_id, State.PLANNED, State.READY, actor, "batch approved")
    return len(approved)


_LIST_BATCHES = (
    "SELECT b.id, b.name, b.created_at, o.state, COUNT(o.id) "
    "FROM (SELECT id, name, created_at FROM batches ORDER BY created_at DESC, id DESC LIMIT ?) AS b "
    "LEFT JOIN operations AS o ON o.batch_id = b.id GROUP BY b.id, o.state ORDER BY b.created_at DESC, b.id DESC"
)


def _batch_status(db: sqlite3.Connection, batch_id: str) -> BatchStatus:
    name = _must_batch(db, batch_id)
    counts = {
        State(state): int(count)
        for state, count in db.execute(
            "SELECT state, COUNT(*) FROM operations WHERE batch_id = ? GROUP BY state", (batch_id,)
        )
    }
    unresolved = db.execute(
        f"{_SELECT} WHERE batch_id = ? AND state IN ('sending', 'unknown', 'needs_review') "
        "ORDER BY created_at LIMIT 100",
        (batch_id,),
    )
    return BatchStatus(batch_id=batch_id, name=name, counts=counts, unresolved=[_operation(r) for r in unresolved])


def _suppress(db: sqlite3.Connection, suppression: Suppression, actor: str) -> list[str]:
    db.execute(
        f"INSERT INTO suppressions (recipient, channel, reason, source, created_at) "
        f"VALUES (?, ?, ?, ?, {NOW}) ON CONFLICT (recipient, channel) "
        "DO UPDATE SET reason = excluded.reason, source = excluded.source",
        (
            _opt_out_key(suppression.recipient, suppression.channel),
            suppression.channel,
            suppression.reason,
            suppression.source,
        ),
    )
    return _cancel_suppressed(db, actor, policy.suppression_reason(suppression))


def _remove_suppression(db: sqlite3.Connection, recipient: str, channel: str) -> bool:
    removed = db.execute("DELETE FROM suppressions WHERE recipient = ? AND channel = ?", (recipient, channel))
    return bool(removed.rowcount)


def _cancel_suppressed(db: sqlite3.Connection, actor: str, reason: str) -> list[str]:
    pending = db.execute(
        f"SELECT id, state FROM operations WHERE state IN ('planned', 'ready') AND {_SUPPRESSED}"
    ).fetchall()
    if not pending:
        return []
    db.execute(_CANCEL_SUPPRESSED, (reason,))
    for operation_id, state in pending:
        _event(db, operation_id, State(state), State.CANCELLED, actor, reason)
    return [row[0] for row in pending]


def _observe_tools(db: sqlite3.Connection, fingerprints: dict[str, str]) -> list[ToolPin]:
    db.executemany(
        f"""INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at)
            VALUES (?, ?, ?, {NOW})
            ON CONFLICT (name) DO UPDATE SET
                changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint
                                  THEN upstream_tools.changed_at ELSE {NOW} END,
                fingerprint = excluded.fingerprint""",
        [(name, fp, fp) for name, fp in fingerprints.items()],
    )
    return _tool_pins(db)


def _record_delivery(
    db: sqlite3.Connection,
    operation_id: str,
    observations: Sequence[DeliveryObservation],
    next_check_seconds: float | None,
) -> Operation:
    _apply_delivery(db, _must(db, operation_id), observations, next_check_seconds)
    return _must(db, operation_id)


def _record_webhook(db: sqlite3.Connection, webhook: Webhook) -> WebhookOutcome:
    if _exists(db, "SELECT 1 FROM webhook_deliveries WHERE signature = ?", webhook.signature):
        return WebhookOutcome.REPLAYED
    if _exists(db, "SELECT 1 FROM webhook_deliveries WHERE delivery_id = ?", webhook.delivery_id):
        return WebhookOutcome.DUPLICATE
    outcome, operation_id = _apply_webhook(db, webhook)
    db.execute(
        _RECORD_WEBHOOK,
        (
            webhook.delivery_id,
            webhook.signature,
            webhook.event_type,
            webhook.provider_id,
            operation_id,
            outcome.value,
            webhook.payload,
        ),
    )
    return outcome


def _apply_webhook(db: sqlite3.Connection, webhook: Webhook) -> tuple[WebhookOutcome, str | None]:
    if webhook.opt_out is not None:
        _suppress(db, webhook.opt_out, "webhook")
        return WebhookOutcome.OPTED_OUT, None
    if webhook.observation is None or webhook.provider_id is None:
        return WebhookOutcome.IGNORED, None
    operation = _one(db, f"{_SELECT} WHERE provider_id = ? ORDER BY created_at DESC LIMIT 1", (webhook.provider_id,))
    if operation is None:
        return WebhookOutcome.UNKNOWN_OPERATION, None
    _apply_delivery(db, operation, [webhook.observation], None)
    return WebhookOutcome.APPLIED, operation.id


def _resolve_review(
    db: sqlite3.Connection, operation_id: str, state: State, reason: str, actor: str, provider_id: str | None
) -> Operation:
    why = policy.review_decision_text(state, reason, provider_id)
    before = _must(db, operation_id)
    if before.state is not State.NEEDS_REVIEW:
        raise policy.not_in_review(before, "resolved")
    cancel_reason = why if state is State.CANCELLED else None
    last_error = why if state is State.FAILED else None
    may_have_left = state is not State.ACCEPTED  # closed by an operator: it may have been sent
    db.execute(_RESOLVE_REVIEW, (state.value, provider_id, cancel_reason, last_error, may_have_left, operation_id))
    _event(db, operation_id, State.NEEDS_REVIEW, state, actor, why)
    return _must(db, operation_id)


def _resend(db: sqlite3.Connection, operation_id: str, intent: Intent, reason: str, actor: str) -> Operation:
    old = _must(db, operation_id)
    if old.state is not State.NEEDS_REVIEW:
        raise policy.not_in_review(old, "resent")
    if _suppressed(db, intent.recipients, intent.channel):
        raise policy.suppressed_refusal(intent.recipients, intent.channel)
    taken = _one(db, f"{_SELECT} WHERE idempotency_key = ?", (intent.idempotency_key,))
    if taken is not None:
        raise policy.resend_key_taken(intent.idempotency_key, taken)
    new_id = str(uuid.uuid4())
    texts = policy.resend_texts(old.id, new_id, reason)
    db.execute(_INSERT_PLANNED, (new_id, *_intent_values(intent), State.READY.value))
    db.execute(_INSERT_RECIPIENTS, (new_id,))
    db.execute("UPDATE operations SET resend_of = ? WHERE id = ?", (old.id, new_id))
    _event(db, new_id, None, State.READY, actor, texts.new_event)
    db.execute(_SUPERSEDE, (texts.cancel_reason, new_id, old.id))
    _event(db, old.id, State.NEEDS_REVIEW, State.CANCELLED, actor, texts.old_event)
    return _must(db, new_id)


def _prune(db: sqlite3.Connection, older_than_seconds: float) -> PruneReport:
    resolved = json.dumps(sorted(state.value for state in TERMINAL_STATES))
    webhook_age = max(older_than_seconds, policy.WEBHOOK_DEDUPE_SECONDS)
    cutoff = _scalar(db, f"SELECT {NOW} - ?", (older_than_seconds,))
    which = (resolved, cutoff, cutoff)
    events = db.execute(f"DELETE FROM events WHERE operation_id IN ({_PRUNABLE})", which).rowcount
    db.execute(f"DELETE FROM delivery_events WHERE operation_id IN ({_PRUNABLE})", which)
    db.execute(f"DELETE FROM operation_recipients WHERE operation_id IN ({_PRUNABLE})", which)
    operations = db.execute(f"DELETE FROM operations WHERE id IN ({_PRUNABLE})", which).rowcount
    hooks = db.execute(f"DELETE FROM webhook_deliveries WHERE received_at < {NOW} - ?", (webhook_age,)).rowcount
    return PruneReport(operations=operations, events=events, webhook_deliveries=hooks)


NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smbfs", "smb3", "afs", "ceph", "glusterfs", "lustre", "9p", "fuse.sshfs", "davfs"}
)
"""SQLite's locking is not reliable on these: several processes could each think they hold a claim."""


def filesystem_type(path: str, mounts: str) -> str | None:
    """The type of the filesystem holding `path`, from a `/proc/mounts`-style table."""
    target = os.path.realpath(path)
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > len(best):
            best, kind = mount_point, fields[2]
    return kind


def refuse_network_filesystem(path: str, mounts_file: str = "/proc/mounts") -> None:
    try:
        with open(mounts_file, encoding="utf-8") as file:
            mounts = file.read()
    except OSError:
        return  # not Linux: nothing to read the filesystem type from
    kind = filesystem_type(os.path.dirname(os.path.abspath(path)), mounts)
    if kind in NETWORK_FILESYSTEMS:
        raise LedgerUnavailable(
            f"the ledger {path} is on a network filesystem ({kind}), where SQLite's locks do not hold across "
            'hosts; keep it on a local disk, or share one PostgreSQL ledger ([ledger] url = "postgresql://...")'
        )


def _create_private(path: str) -> None:
    if path == ":memory:" or os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


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
    folder = resources.files("hail_guard.ledger") / "migrations" / "sqlite"
    found = [
        (int(item.name.split("_")[0]), item.read_text()) for item in folder.iterdir() if item.name.endswith(".sql")
    ]
    return sorted(found)


def _migrate(db: sqlite3.Connection, path: str) -> None:
    """Apply what is missing, all in one write transaction, so processes starting together take turns."""
    known = migrations()
    latest = known[-1][0]
    if _schema_version(db, path, latest) == latest:
        return  # the usual start: no write lock taken, so processes starting together do not queue

    def apply(db: sqlite3.Connection) -> None:
        current = _schema_version(db, path, latest)
        for version, sql in known:
            if version > current:
                _run_script(db, sql)
                if version in _BACKFILLS:
                    _BACKFILLS[version](db)
                db.execute(f"PRAGMA user_version = {version}")

    _transaction(db, apply)


def _backfill_recipients(db: sqlite3.Connection) -> None:
    """Version 6: recipients, opt-out keys, message fingerprints and senders recomputed (`backfill`)."""
    rows = db.execute("SELECT id, tool, channel, request FROM operations ORDER BY rowid")
    for page in backfill.pages(iter(rows.fetchall())):
        found = [
            (operation_id, backfill.facts(tool, channel, request)) for operation_id, tool, channel, request in page
        ]
        db.executemany(
            "UPDATE operations SET recipients = ?, recipient_keys = ?, content_fingerprint = ?, sender = ? "
            "WHERE id = ?",
            [
                (json.dumps(f.recipients), json.dumps(f.recipient_keys), f.content_fingerprint, f.sender, operation_id)
                for operation_id, f in found
            ],
        )
        db.executemany(
            "INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint) VALUES (?, ?, ?)",
            [(operation_id, r, f.content_fingerprint) for operation_id, f in found for r in f.recipients],
        )
    opt_outs = db.execute("SELECT rowid, recipient, channel FROM suppressions ORDER BY created_at").fetchall()
    for rowid, recipient, channel in opt_outs:  # of two that now read the same, the earliest is kept
        key = recipients.comparable(recipient, channel)
        if key != recipient:
            moved = db.execute("UPDATE OR IGNORE suppressions SET recipient = ? WHERE rowid = ?", (key, rowid))
            if moved.rowcount == 0:
                db.execute("DELETE FROM suppressions WHERE rowid = ?", (rowid,))


_BACKFILLS: dict[int, Callable[[sqlite3.Connection], None]] = {6: _backfill_recipients}
"""Migrations whose stored values are recomputed in Python right after their SQL, in their transaction."""


def _schema_version(db: sqlite3.Connection, path: str, latest: int) -> int:
    row = db.execute("PRAGMA user_version").fetchone()
    current = int(row[0]) if row else 0
    if current > latest:
        raise SchemaTooNew(
            f"the ledger {path} has schema version {current}, newer than this hail-guard knows ({latest}); "
            "upgrade hail-guard"
        )
    return current


def _run_script(db: sqlite3.Connection, sql: str) -> None:
    """Run a migration's statements one by one inside the open transaction."""
    for statement in _statements(sql):
        db.execute(statement)


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
    if "disk i/o" in lowered:
        return (
            f"cannot write the ledger {path} ({message}): its storage is read-only or failing; "
            "check the disk and the file's permissions, then retry"
        )
    if "full" in lowered:
        return f"the disk holding the ledger {path} is full: free space, then retry"
    if "unable to open" in lowered:
        return f"cannot open the ledger {path}: check that the folder exists and is writable"
    return f"the ledger {path} failed: {message}"


def _backup_file(source: str, path: str) -> int:
    """Copy into a new, uniquely named file beside `path`, then link it there: a backup is whole or
    absent, and never replaces a file (not one that was there, nor one that appears meanwhile)."""
    target = os.path.abspath(path)
    if os.path.lexists(target):
        raise LedgerError(f"{path} already exists; a backup never overwrites a file: give a new path")
    folder = os.path.dirname(target)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".partial", dir=folder)
    os.close(descriptor)  # created 0600, and only ever ours: mkstemp refuses a name that exists
    try:
        count = _copy_online(source, temporary)
        _link_new(temporary, target, path)
    finally:
        for leftover in (temporary, f"{temporary}-journal"):
            with suppress(FileNotFoundError):
                os.remove(leftover)
    _sync_folder(folder)
    return count


def _link_new(temporary: str, target: str, path: str) -> None:
    """Give the finished copy its name; a hard link fails, rather than replace, when the name is taken."""
    try:
        os.link(temporary, target)
    except FileExistsError:
        raise LedgerError(f"{path} appeared while the backup was being written; it was left as it is") from None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise LedgerError(
                f"cannot back up to {path}: its filesystem has no hard links, which a backup needs to be sure never "
                "to replace a file; back up to a folder on a local filesystem"
            ) from exc
        raise


def _sync_folder(folder: str) -> None:
    """The backup's name is durable too (the copy itself was synced by SQLite's commit)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _copy_online(source: str, target: str) -> int:
    """SQLite's online backup of `source` into `target` (one self-contained file), checked; returns its operations.

    A reader of its own, so writers (in WAL mode, in any process) go on while it copies.
    """
    with closing(sqlite3.connect(source)) as origin, closing(sqlite3.connect(target)) as copy:
        origin.backup(copy)
        copy.execute("PRAGMA journal_mode = DELETE")
        check = copy.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise sqlite3.DatabaseError(f"the copy failed its integrity check: {check}")
        row = copy.execute("SELECT COUNT(*) FROM operations").fetchone()
    return int(row[0])


def _apply_delivery(
    db: sqlite3.Connection,
    operation: Operation,
    observations: Sequence[DeliveryObservation],
    next_check_seconds: float | None,
) -> None:
    """Each state once as an event; the current state only forward (`delivery.settle`); `state` untouched."""
    db.executemany(
        _DELIVERY_EVENT,
        [(operation.id, o.state.value, _epoch(o.occurred_at), o.source, o.detail) for o in observations],
    )
    moved = delivery.settle(operation.delivery_state, observations)
    if moved is not None:
        db.execute(_SET_DELIVERY, (moved.state.value, _epoch(moved.occurred_at), operation.id))
    if next_check_seconds is not None:
        db.execute(_COUNT_DELIVERY_CHECK, (next_check_seconds, operation.id))


def _exists(db: sqlite3.Connection, query: str, value: str) -> bool:
    return db.execute(query, (value,)).fetchone() is not None


def _epoch(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment is not None else None


def _intent_values(intent: Intent) -> tuple[Any, ...]:
    """Values for `_INTENT_COLUMNS`."""
    return (
        intent.idempotency_key,
        intent.tool,
        intent.channel,
        json.dumps(list(intent.recipients)),
        json.dumps(recipients.keys_of(intent.recipients)),
        intent.request,
        intent.request_fingerprint,
        intent.content_fingerprint,
        intent.sender,
        intent.campaign_id,
        intent.lead_id,
        intent.message_id,
        intent.batch_id,
    )


def _suppressed(db: sqlite3.Connection, reached: Sequence[str], channel: str) -> bool:
    """Whether any of these (normalised) recipients opted out of `channel`, or of everything."""
    if not reached:
        return False
    names = recipients.keys_of(reached, channel)
    marks = ", ".join("?" for _ in names)
    found = db.execute(
        f"SELECT 1 FROM suppressions WHERE recipient IN ({marks}) AND channel IN (?, 'all') LIMIT 1",
        (*names, channel),
    ).fetchone()
    return found is not None


def _opt_out_key(recipient: str, channel: str) -> str:
    """An opt-out's recipient in the one normal form (the edges refuse one that has none: a webhook's is kept)."""
    return recipients.comparable(recipient, channel)


def _tool_pins(db: sqlite3.Connection) -> list[ToolPin]:
    cursor = db.execute(
        "SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools ORDER BY name"
    )
    return [
        ToolPin(
            name=r[0],
            fingerprint=r[1],
            accepted_fingerprint=r[2],
            first_seen_at=_time(r[3]),
            changed_at=_time(r[4]) if r[4] is not None else None,
        )
        for r in cursor.fetchall()
    ]


def _must_batch(db: sqlite3.Connection, batch_id: str) -> str | None:
    row = db.execute("SELECT name FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None:
        raise NotFound(f"no batch {batch_id}; plan one with `hail-guard batch plan FILE`")
    name: str | None = row[0]
    return name


def _one(db: sqlite3.Connection, query: str, params: Sequence[Any]) -> Operation | None:
    row = db.execute(query, params).fetchone()
    return _operation(row) if row is not None else None


def _must(db: sqlite3.Connection, operation_id: str) -> Operation:
    found = _one(db, f"{_SELECT} WHERE id = ?", (operation_id,))
    if found is None:
        raise NotFound(f"no operation {operation_id}; list them with `hail-guard ops list`")
    return found


def _event(
    db: sqlite3.Connection, operation_id: str, before: State | None, after: State, actor: str, reason: str
) -> None:
    db.execute(_EVENT, (operation_id, before.value if before else None, after.value, actor, reason))


def _operation(row: Sequence[Any]) -> Operation:
    values = dict(zip(_COLUMNS.split(", "), row, strict=True))
    values["recipients"] = json.loads(values["recipients"])
    values["result"] = json.loads(values["result"]) if values["result"] is not None else None
    values["sender"] = json.loads(values["sender"])
    for name in _TIME_COLUMNS:
        values[name] = _time(values[name]) if values[name] is not None else None
    return Operation.model_validate(values)


def _rows(db: sqlite3.Connection, query: str, params: Sequence[Any] = ()) -> list[Any]:
    return db.execute(query, params).fetchall()


def _scalar(db: sqlite3.Connection, query: str, params: Sequence[Any] = ()) -> Any:
    row = db.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _time(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)
