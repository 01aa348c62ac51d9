"""The PostgreSQL ledger: several processes and hosts share one database through a connection pool.

It behaves exactly like the SQLite ledger (the contract tests run on both); what differs is how:

- The clock is the database's `statement_timestamp()`: fixed within one statement (as SQLite's
  'now'), fresh for each statement, so a transaction that waited for a lock measures a lease from
  when it writes it, not from when it began (`now()` is frozen at the start of the transaction).
  Inside `hg_begin_send` (below) the lease runs from `clock_timestamp()`, read after its locks.
- Each hot operation is one statement, so one round trip to the server: a claim, an outcome, and
  `begin_send`, which calls the function `hg_begin_send` (migration 0006) that runs its steps
  (lease expiry, the key's row, the opt-out and duplicate checks, the insert or the claim, the event)
  statement by statement on the server. Claims and lease expiry commit on their own; writes of
  several statements run in a transaction (`_write`). Pooled connections skip the session reset.
- Claims are single statements over rows taken with `FOR UPDATE SKIP LOCKED`: two workers never
  take the same row and never wait for each other. Completion is fenced on the lease owner.
- `begin_send` locks the key's row (`FOR UPDATE`) or inserts it with `ON CONFLICT DO NOTHING`;
  the duplicate guard holds a transaction advisory lock on the content, so two new keys for the
  same content cannot both pass it at once.
- A batch streams in: its sends are staged a chunk at a time (COPY) into a temporary table inside
  the planning transaction, then checked and copied into the ledger with a few set statements.
- Migrations are versioned (`hail_guard_schema_version`) and applied under an advisory lock.

Every asyncpg and socket error is mapped to our tree in `_mapped`, and only there; messages name
the server by its scheme, host, port and database only (`urls.parse_url`), never by the raw URL."""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import datetime
from importlib import resources
from typing import Any

import anyio
import asyncpg
import structlog

from hail_guard import delivery, policy, recipients
from hail_guard.errors import (
    ConfigError,
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
from hail_guard.urls import parse_url

log = structlog.get_logger(__name__)

NOW = "statement_timestamp()"
"""The database clock: one value per statement."""
MIGRATION_LOCK = 0x4861696C47756172
"""Advisory lock key ("HailGuar") held while migrating, so processes starting at once take turns."""
CONTENT_LOCK_SPACE = 0x48474346
"""Advisory lock space ("HGCF") of the duplicate guard; the second key is a bucket of the content."""
CONTENT_LOCK_BUCKETS = 256
MIGRATION_LOCK_TIMEOUT = "60s"
CLOSE_SECONDS = 5.0
PLAN_CHUNK = 500
"""Sends read and staged per round trip while planning a batch."""
_LEASE_EXPIRED = "lease expired while sending: the request may have left"


def _later(seconds: str) -> str:
    """`NOW` plus a bound parameter of seconds (NULL stays NULL)."""
    return f"{NOW} + {seconds}::float8 * interval '1 second'"


_COLUMNS = (
    "id, idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, "
    "campaign_id, lead_id, message_id, batch_id, state, provider_id, result, last_error, review_reason, cancel_reason, "
    "attempts, lease_owner, lease_expires_at, not_before, next_check_at, created_at, updated_at, "
    "first_sent_at, delivery_state, delivery_at, delivery_checks, delivery_next_check_at, resend_of, resent_as, "
    "sender, may_have_left"
)
_NAMES = tuple(_COLUMNS.split(", "))
_SELECT = f"SELECT {_COLUMNS} FROM operations"


def _opted_out(recipient_keys: str, channel: str) -> str:
    """True when any of the recipients (normalised) opted out of the channel.

    One probe of the opt-out list's key per recipient: the `LIMIT` keeps PostgreSQL from planning it as a
    join, which it did as a scan of the whole list (guessing ten recipients a send); a claim evaluates this
    for every candidate row it passes, so that cost 0.3 ms a row with a thousand opt-outs.
    """
    return f"""EXISTS (
        SELECT 1 FROM unnest({recipient_keys}) AS r (recipient), LATERAL (
            SELECT 1 FROM suppressions s WHERE s.recipient = r.recipient AND s.channel IN ({channel}, 'all')
            LIMIT 1) AS opted_out)"""


_SUPPRESSED = _opted_out("operations.recipient_keys", "operations.channel")
"""True for an operation any of whose recipients opted out of its channel."""


def _literal(text: str) -> str:
    """One of our own constant texts as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _expiring(reason: str) -> str:
    """CTEs that turn `sending` operations whose lease ran out into `unknown`, with their events (`expired`).

    The rows are picked once, locked, and updated by id. (Written as `id IN (subquery)`, PostgreSQL could
    run the subquery again for every `sending` row: quadratic in the sends in flight, 45 ms for 300 on a
    1M-row ledger. With `state = 'sending'` repeated in the UPDATE, it read every `sending` row to join
    them to none: 600 pages a call.) The partial index on `sending` leases makes this one short index probe
    when nothing is due. The function `hg_begin_send` (migration 0006) runs the same statement.
    """
    return f"""
    expiring AS MATERIALIZED (
        SELECT id FROM operations WHERE state = 'sending' AND lease_expires_at <= {NOW}
        FOR UPDATE SKIP LOCKED),
    expired AS (
        UPDATE operations SET state = 'unknown', updated_at = {NOW}, next_check_at = {NOW}
        FROM expiring WHERE operations.id = expiring.id
        RETURNING operations.id),
    expired_logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT id, {NOW}, 'sending', 'unknown', 'ledger', {reason} FROM expired)"""


_EXPIRE_LEASES = f"WITH {_expiring('$1')} SELECT count(*) FROM expired"
_BEGIN_SEND = f"""
    SELECT b.verdict, {", ".join(f"(b.operation).{name}" for name in _NAMES)}
    FROM hg_begin_send($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10::jsonb, $11, $12, $13, $14, $15, $16, $17, $18,
        $19, $20, $21, $22) b
"""
"""Everything `begin_send` does, in one round trip: see sql/postgres/begin_send.sql for the statements it runs."""
_CLAIM_READY_BY_ID = f"""
    WITH claimed AS (
        UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = $1,
            lease_expires_at = {_later("$2")}, updated_at = {NOW}, first_sent_at = COALESCE(first_sent_at, {NOW})
        WHERE id = $3 AND state = 'ready' AND (not_before IS NULL OR not_before <= {NOW}) AND NOT {_SUPPRESSED}
        RETURNING operations.*),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT id, {NOW}, 'ready', 'sending', $1, 'claimed; forwarding' FROM claimed)
    SELECT {_COLUMNS} FROM claimed
"""
"""A `ready` operation that a send repeats (by meaning) is claimed to be sent now, under its own key."""
_FUNCTIONS = ("begin_send",)
"""Server-side functions, each in sql/postgres/<name>.sql, (re)created by `migrate` when their text changes."""
_PLAN_STAGE = "hg_plan_stage"
"""The batch being planned, in a temporary table of the planning transaction (dropped at its end)."""
_STAGE_COLUMNS = (
    "position",
    "id",
    "idempotency_key",
    "tool",
    "channel",
    "recipients",
    "recipient_keys",
    "request",
    "request_fingerprint",
    "content_fingerprint",
    "sender",
    "campaign_id",
    "lead_id",
    "message_id",
    "allow_duplicate",
)
_CREATE_STAGE = f"""
    CREATE TEMPORARY TABLE {_PLAN_STAGE} (
        position INTEGER NOT NULL, id TEXT NOT NULL, idempotency_key TEXT NOT NULL, tool TEXT NOT NULL,
        channel TEXT NOT NULL, recipients JSONB NOT NULL, recipient_keys TEXT[] NOT NULL, request TEXT NOT NULL,
        request_fingerprint TEXT NOT NULL, content_fingerprint TEXT NOT NULL, sender JSONB NOT NULL, campaign_id TEXT,
        lead_id TEXT, message_id TEXT, allow_duplicate BOOLEAN NOT NULL
    ) ON COMMIT DROP
"""
_STAGED_KNOWN_KEYS = f"""
    SELECT p.position, p.idempotency_key, o.id, count(*) OVER () AS taken
    FROM {_PLAN_STAGE} p JOIN operations o ON o.idempotency_key = p.idempotency_key
    ORDER BY p.position LIMIT 10
"""
_STAGED_DUPLICATE = f"""
    SELECT p.position FROM {_PLAN_STAGE} p
    CROSS JOIN LATERAL jsonb_array_elements_text(p.recipients) AS pr (recipient)
    JOIN operation_recipients r ON r.content_fingerprint = p.content_fingerprint AND r.recipient = pr.recipient
    JOIN operations o ON o.id = r.operation_id
    WHERE p.allow_duplicate = $2 AND o.idempotency_key <> p.idempotency_key AND o.tool = p.tool
      AND (o.state = ANY ($3::text[]) OR ($4 AND o.may_have_left))
      AND o.created_at >= {NOW} - $1::float8 * interval '1 second'
      AND NOT EXISTS (
        SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each(p.sender) b ON a.key = b.key WHERE a.value <> b.value)
    ORDER BY p.position
    LIMIT 1
"""
"""The first staged send whose message a live operation under another key already has for one of its recipients."""
_STAGED_INTENT = f"""
    SELECT idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, sender,
        campaign_id, lead_id, message_id, allow_duplicate
    FROM {_PLAN_STAGE} WHERE position = $1
"""
_MATCHES = f"""
    SELECT {", ".join(f"o.{name}" for name in _NAMES)} FROM operations o
    WHERE o.id IN (
        SELECT r.operation_id FROM operation_recipients r
        WHERE r.content_fingerprint = $1 AND r.recipient = ANY ($2::text[]))
      AND o.idempotency_key <> $3 AND o.tool = $4
      AND (o.state = ANY ($5::text[]) OR ($6 AND o.may_have_left))
      AND o.created_at >= {NOW} - $7::float8 * interval '1 second'
      AND NOT EXISTS (
        SELECT 1 FROM jsonb_each(o.sender) a JOIN jsonb_each($8::jsonb) b ON a.key = b.key WHERE a.value <> b.value)
    ORDER BY o.created_at DESC, o.seq DESC
    LIMIT 20
"""
"""As hg_begin_send's check, for a staged send named in a refusal."""
_PLAN_STAGED = f"""
    WITH planned AS (
        INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
            request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, state,
            created_at, updated_at)
        SELECT id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
            content_fingerprint, sender, campaign_id, lead_id, message_id, $1, $2, {NOW}, {NOW}
        FROM {_PLAN_STAGE} ORDER BY position
        RETURNING id, seq),
    reached AS (
        INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
        SELECT p.id, r, p.content_fingerprint FROM {_PLAN_STAGE} p, jsonb_array_elements_text(p.recipients) AS r)
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    SELECT id, {NOW}, NULL, $2, $3, $4 FROM planned ORDER BY seq
"""
_INSERT_PLANNED = f"""
    WITH planned AS (
        INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
            request_fingerprint, content_fingerprint, sender, campaign_id, lead_id, message_id, batch_id, state,
            created_at, updated_at)
        VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10::jsonb, $11, $12, $13, $14, $15, {NOW}, {NOW})
        RETURNING id, recipients, content_fingerprint)
    INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
    SELECT id, r, content_fingerprint FROM planned, jsonb_array_elements_text(planned.recipients) AS r
"""


def _claiming(batch: str, limit: str) -> str:
    """Expire the leases that ran out, and claim the oldest `ready` operations of `batch` (a condition) whose
    recipients did not opt out, with their events: one statement (the two touch different rows).

    $1 is the owner, $2 the lease in seconds. A claim for any batch and a claim for one are separate
    statements, so each keeps one plan (with `$3 IS NULL OR batch_id = $3`, PostgreSQL planned every claim
    again: 0.5 ms each).
    """
    return f"""
    WITH {_expiring(_literal(_LEASE_EXPIRED))},
    picked AS MATERIALIZED (
        SELECT id FROM operations
        WHERE state = 'ready' AND {batch}
          AND (not_before IS NULL OR not_before <= {NOW}) AND NOT {_SUPPRESSED}
        ORDER BY created_at, seq LIMIT {limit}
        FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE operations SET state = 'sending', attempts = attempts + 1, lease_owner = $1,
            lease_expires_at = {_later("$2")}, updated_at = {NOW},
            first_sent_at = COALESCE(first_sent_at, {NOW})
        FROM picked WHERE operations.id = picked.id
        RETURNING operations.*),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT id, {NOW}, 'ready', 'sending', $1, 'claimed; forwarding' FROM claimed)
    SELECT {_COLUMNS} FROM claimed ORDER BY created_at, seq
"""


_CLAIM_READY = _claiming(batch="batch_id = $3", limit="$4")
"""Claim from one batch ($3), up to $4."""
_CLAIM_READY_ANY = _claiming(batch="true", limit="$3")
"""Claim from every batch and none, up to $3."""
_CLAIM_UNKNOWN_SET = f"""
    attempts = attempts + 1, lease_owner = $1, lease_expires_at = {_later("$2")}, updated_at = {NOW}
"""
_CLAIM_UNKNOWN_DUE = f"""
    WITH picked AS MATERIALIZED (
        SELECT id FROM operations
        WHERE state = 'unknown' AND ($3::text IS NULL OR batch_id = $3)
          AND (next_check_at IS NULL OR next_check_at <= {NOW})
          AND (lease_expires_at IS NULL OR lease_expires_at <= {NOW})
        ORDER BY next_check_at NULLS FIRST, seq LIMIT $4
        FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE operations SET {_CLAIM_UNKNOWN_SET}
        FROM picked WHERE operations.id = picked.id
        RETURNING operations.*)
    SELECT {_COLUMNS} FROM claimed ORDER BY next_check_at NULLS FIRST, seq
"""
_CLAIM_UNKNOWN_BY_ID = f"""
    UPDATE operations SET {_CLAIM_UNKNOWN_SET}
    WHERE id = $4 AND state = 'unknown' AND ($3::text IS NULL OR batch_id = $3)
      AND (lease_expires_at IS NULL OR lease_expires_at <= {NOW})
    RETURNING {_COLUMNS}
"""
_LOCK_BY_ID = f"{_SELECT} WHERE id = $1 FOR UPDATE"
_RECORD = f"""
    WITH before AS MATERIALIZED (
        SELECT id, state FROM operations WHERE id = $8 FOR UPDATE),
    recorded AS (
        UPDATE operations SET state = $1, provider_id = COALESCE($2, provider_id),
            result = COALESCE($3::json, result), last_error = COALESCE($4, last_error), review_reason = $5,
            attempts = operations.attempts - $12,
            not_before = {_later("$6")}, next_check_at = {_later("$7")},
            lease_expires_at = NULL, updated_at = {NOW}
        FROM before
        WHERE operations.id = $8 AND before.id = $8 AND operations.lease_owner = $9
          AND operations.state IN ('sending', 'unknown')
        RETURNING operations.*, before.state AS from_state),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT id, {NOW}, from_state, $1, $10, $11 FROM recorded)
    SELECT before.state AS before_state, {", ".join(f"recorded.{name}" for name in _NAMES)}
    FROM before LEFT JOIN recorded ON true
"""
"""Fenced on the lease owner; the event names the state the row was in. One row: `before_state` NULL when there
is no such operation, the other columns NULL when it is not ours to record."""
_EVENT = f"""
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason) VALUES ($1, {NOW}, $2, $3, $4, $5)
"""
_IS_SUPPRESSED = f"SELECT {_opted_out('$1::text[]', '$2')}"
_LOCK_CONTENT = "SELECT pg_advisory_xact_lock($1, bucket) FROM unnest($2::int[]) AS bucket"


def _cancelling(where: str) -> str:
    """Cancel the unforwarded operations (`planned`, `ready`) matching `where` whose recipients opted out;
    their ids. $1 is the reason, $2 the actor."""
    return f"""
    WITH pending AS MATERIALIZED (
        SELECT id, state FROM operations
        WHERE state IN ('planned', 'ready') AND {where} AND {_SUPPRESSED}
        ORDER BY id
        FOR UPDATE),
    cancelled AS (
        UPDATE operations SET state = 'cancelled', cancel_reason = $1, updated_at = {NOW}
        FROM pending WHERE operations.id = pending.id
        RETURNING operations.id, operations.seq, pending.state AS from_state),
    logged AS (
        INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
        SELECT id, {NOW}, from_state, 'cancelled', $2, $1 FROM cancelled)
    SELECT id FROM cancelled ORDER BY seq
"""


_CANCEL_SUPPRESSED = _cancelling("true")
_CANCEL_SUPPRESSED_IN_BATCH = _cancelling("batch_id = $3")
"""After planning: the batch's sends to recipients who opted out start `cancelled`."""
_APPROVE_BATCH = f"""
    WITH approved AS (
        UPDATE operations SET state = 'ready', updated_at = {NOW}
        WHERE batch_id = $1 AND state = 'planned'
        RETURNING id)
    INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
    SELECT id, {NOW}, 'planned', 'ready', $2, 'batch approved' FROM approved
"""
_ADD_SUPPRESSION = f"""
    INSERT INTO suppressions (recipient, channel, reason, source, created_at) VALUES ($1, $2, $3, $4, {NOW})
    ON CONFLICT (recipient, channel) DO UPDATE SET reason = excluded.reason, source = excluded.source
"""
_LIST_OPERATIONS = f"""
    {_SELECT} WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR campaign_id = $2)
      AND ($3::text IS NULL OR batch_id = $3) AND ($4::text IS NULL OR $4 = ANY (recipient_keys))
      AND ($5::timestamptz IS NULL OR created_at >= $5)
      AND ($6::text IS NULL OR (created_at, seq) < (SELECT o.created_at, o.seq FROM operations o WHERE o.id = $6))
    ORDER BY created_at DESC, seq DESC LIMIT $7
"""
_DELIVERY_EVENT = f"""
    INSERT INTO delivery_events (operation_id, state, occurred_at, recorded_at, source, detail)
    VALUES ($1, $2, $3, {NOW}, $4, $5) ON CONFLICT (operation_id, state) DO NOTHING
"""
_SET_DELIVERY = f"""
    UPDATE operations SET delivery_state = $1, delivery_at = COALESCE($2::timestamptz, {NOW}), updated_at = {NOW}
    WHERE id = $3
"""
_COUNT_DELIVERY_CHECK = f"""
    UPDATE operations SET delivery_checks = delivery_checks + 1, delivery_next_check_at = {_later("$1")} WHERE id = $2
"""
_CLAIM_DELIVERY_CHECKS = f"""
    WITH picked AS MATERIALIZED (
        SELECT id FROM operations
        WHERE state = 'accepted' AND provider_id IS NOT NULL AND channel = ANY ($2::text[])
          AND (delivery_state IS NULL OR delivery_state <> ALL ($3::text[]))
          AND (delivery_next_check_at IS NULL OR delivery_next_check_at <= {NOW})
          AND COALESCE(first_sent_at, created_at) >= {NOW} - $4::float8 * interval '1 second'
        ORDER BY delivery_next_check_at NULLS FIRST, created_at, seq LIMIT $5
        FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE operations SET delivery_next_check_at = {_later("$1")}
        FROM picked WHERE operations.id = picked.id
        RETURNING operations.*)
    SELECT {_COLUMNS} FROM claimed ORDER BY created_at, seq
"""
_DELIVERY_EVENTS = """
    SELECT operation_id, state, occurred_at, recorded_at, source, detail FROM delivery_events
    WHERE operation_id = $1 ORDER BY id
"""
_SIGNATURE_SEEN = "SELECT EXISTS (SELECT 1 FROM webhook_deliveries WHERE signature = $1)"
_CLAIM_WEBHOOK = f"""
    INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at, payload)
    VALUES ($1, $2, $3, $4, 'pending', {NOW}, $5)
    ON CONFLICT DO NOTHING
    RETURNING delivery_id
"""
"""Counts a delivery id (and a signature) once: a concurrent twin waits for this one, then does nothing."""
_SETTLE_WEBHOOK = "UPDATE webhook_deliveries SET outcome = $1, operation_id = $2 WHERE delivery_id = $3"
_LOCK_BY_PROVIDER = f"{_SELECT} WHERE provider_id = $1 ORDER BY created_at DESC, seq DESC LIMIT 1 FOR UPDATE"
_RESOLVE_REVIEW = f"""
    UPDATE operations SET state = $1, provider_id = COALESCE($2, provider_id),
        cancel_reason = COALESCE($3, cancel_reason), last_error = COALESCE($4, last_error), may_have_left = $6,
        lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL, updated_at = {NOW}
    WHERE id = $5 AND state = 'needs_review'
    RETURNING {_COLUMNS}
"""
_SUPERSEDE = f"""
    UPDATE operations SET state = 'cancelled', cancel_reason = $1, resent_as = $2, may_have_left = true,
        lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL, updated_at = {NOW}
    WHERE id = $3 AND state = 'needs_review'
"""
_PRUNABLE = "SELECT id FROM operations WHERE state = ANY ($1::text[]) AND updated_at < $2 AND created_at < $2"
_OBSERVE_TOOL = f"""
    INSERT INTO upstream_tools (name, fingerprint, accepted_fingerprint, first_seen_at) VALUES ($1, $2, $2, {NOW})
    ON CONFLICT (name) DO UPDATE SET
        changed_at = CASE WHEN excluded.fingerprint = upstream_tools.fingerprint
                          THEN upstream_tools.changed_at ELSE {NOW} END,
        fingerprint = excluded.fingerprint
"""
_ACCEPT_TOOLS = """
    UPDATE upstream_tools SET accepted_fingerprint = fingerprint, changed_at = NULL
    WHERE fingerprint <> accepted_fingerprint AND ($1::text[] IS NULL OR name = ANY ($1))
    RETURNING name
"""
_TOOL_PINS = """
    SELECT name, fingerprint, accepted_fingerprint, first_seen_at, changed_at FROM upstream_tools
    ORDER BY name COLLATE "C"
"""
_SCHEMA_TABLE = "hail_guard_schema_version"
_HAS_SCHEMA_TABLE = f"SELECT to_regclass('{_SCHEMA_TABLE}') IS NOT NULL"
_SCHEMA_VERSION = f"SELECT COALESCE(max(version), 0) FROM {_SCHEMA_TABLE}"
_CREATE_SCHEMA_TABLE = f"""
    CREATE TABLE IF NOT EXISTS {_SCHEMA_TABLE} (
        version    INTEGER PRIMARY KEY,
        applied_at TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp())
"""


class PostgresLedger:
    def __init__(self, pool: asyncpg.Pool, where: str, secrets: frozenset[str]) -> None:
        self._pool = pool
        self._where = where
        self._secrets = secrets

    async def now(self) -> datetime:
        async with self._read() as db:
            value: datetime = await db.fetchval(f"SELECT {NOW}")
        return value

    async def begin_send(
        self, intent: Intent, *, owner: str, lease_seconds: float, duplicate_window_seconds: float | None = None
    ) -> Begin:
        states, closed_block = policy.blocking_states(allow_duplicate=intent.allow_duplicate)
        # One statement: it would commit as well on its own (`_alone`, one round trip instead of three).
        # The intent and the outcome keep BEGIN ... COMMIT for now because tests/test_postgres_outage.py
        # finds the moment "recorded, answer lost" by the COMMIT on the wire.
        async with self._write() as db:
            rows = await db.fetch(
                _BEGIN_SEND,
                str(uuid.uuid4()),
                *_intent_values(intent),
                owner,
                lease_seconds,
                duplicate_window_seconds,
                states,
                closed_block,
                CONTENT_LOCK_SPACE,
                _message_locks(intent),
                _LEASE_EXPIRED,
            )
            verdict = rows[0]["verdict"]
            if verdict == "suppressed":
                raise policy.suppressed_refusal(intent.recipients, intent.channel)
            if verdict == "vanished":
                key = intent.idempotency_key
                raise LedgerUnavailable(f"the operation under key {key!r} changed while it was being recorded; retry")
            found = _operation(rows[0])
            if verdict == "claimed":
                return Begin(found, claimed=True)
            if verdict == "matches":
                found = policy.repeat_of(intent, [_operation(row) for row in rows])  # an overlap is refused
            elif found.state is not State.READY or not policy.same_meaning(found, intent):
                return Begin(found, claimed=False)  # answered from; another message under the key is refused
            claimed = await db.fetchrow(_CLAIM_READY_BY_ID, owner, lease_seconds, found.id)
            return Begin(_operation(claimed), claimed=True) if claimed is not None else Begin(found, claimed=False)

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        result = json.dumps(outcome.result) if outcome.result is not None else None
        async with self._write() as db:  # one statement in BEGIN ... COMMIT: see begin_send
            row = await db.fetchrow(
                _RECORD,
                outcome.state.value,
                outcome.provider_id,
                result,
                outcome.error,
                outcome.review_reason,
                outcome.not_before_seconds,
                outcome.check_after_seconds,
                operation_id,
                owner,
                actor,
                outcome.reason,
                0 if outcome.attempted else 1,
            )
        if row is None:
            raise _not_found(operation_id)
        if row["id"] is None:
            raise LeaseLost(
                f"operation {operation_id} is no longer ours to record (state {row['before_state']}, "
                f"claimed by another worker); its outcome was not overwritten"
            )
        return _operation(row)

    async def claim_unknown(
        self,
        *,
        owner: str,
        lease_seconds: float,
        operation_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        async with self._alone() as db:
            await _expire(db)  # first, and committed: what it turns `unknown` can be claimed next
            if operation_id is not None:  # an operator asked for this one: wait for a lock rather than skip it
                rows = await db.fetch(_CLAIM_UNKNOWN_BY_ID, owner, lease_seconds, batch_id, operation_id)
            else:
                rows = await db.fetch(_CLAIM_UNKNOWN_DUE, owner, lease_seconds, batch_id, limit)
            return [_operation(row) for row in rows]

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
        """One transaction: the sends are staged a chunk at a time in a temporary table (nothing of the ledger
        is locked while `intents` is read, which may take long and may raise), then checked against the ledger
        and copied into it with a few statements. Any error anywhere rolls it all back."""
        try:
            return await self._plan(batch_id, name, intents, state, actor, duplicate_window_seconds)
        except _IntentsRaised as raised:
            raise raised.error from raised.error.__cause__  # the caller's own error, not the ledger's

    async def _plan(
        self,
        batch_id: str,
        name: str | None,
        intents: Iterable[Intent],
        state: State,
        actor: str,
        duplicate_window_seconds: float | None,
    ) -> int:
        async with self._write(shielded=False) as db:
            await db.execute(_CREATE_STAGE)
            staged, buckets = 0, set[int]()
            for chunk in _chunks(intents, PLAN_CHUNK):
                await db.copy_records_to_table(
                    _PLAN_STAGE, records=_staged(chunk, first=staged + 1), columns=_STAGE_COLUMNS
                )
                buckets.update(bucket for intent in chunk for bucket in _message_locks(intent))
                staged += len(chunk)
            await db.execute(
                f"INSERT INTO batches (id, name, created_by, created_at) VALUES ($1, $2, $3, {NOW})",
                batch_id,
                name,
                actor,
            )
            await _refuse_known_keys(db)
            if duplicate_window_seconds is not None and buckets:
                await db.execute(_LOCK_CONTENT, CONTENT_LOCK_SPACE, sorted(buckets))
                await _refuse_duplicates(db, duplicate_window_seconds)
            await db.execute(_PLAN_STAGED, batch_id, state.value, actor, f"planned in batch {batch_id}")
            await db.execute(_CANCEL_SUPPRESSED_IN_BATCH, "the recipient opted out before the send", actor, batch_id)
        return staged

    async def approve_batch(self, batch_id: str, *, actor: str) -> int:
        async with self._write() as db:
            await _must_batch(db, batch_id)
            return _count(await db.execute(_APPROVE_BATCH, batch_id, actor))

    async def claim_ready(
        self, *, owner: str, lease_seconds: float, batch_id: str | None = None, limit: int = 1
    ) -> list[Operation]:
        async with self._alone() as db:
            if batch_id is None:
                rows = await db.fetch(_CLAIM_READY_ANY, owner, lease_seconds, limit)
            else:
                rows = await db.fetch(_CLAIM_READY, owner, lease_seconds, batch_id, limit)
        return [_operation(row) for row in rows]

    async def batch_status(self, batch_id: str) -> BatchStatus:
        async with self._read() as db:
            name = await _must_batch(db, batch_id)
            rows = await db.fetch("SELECT state, count(*) FROM operations WHERE batch_id = $1 GROUP BY state", batch_id)
            unresolved = await db.fetch(
                f"{_SELECT} WHERE batch_id = $1 AND state IN ('sending', 'unknown', 'needs_review') "
                "ORDER BY created_at, seq LIMIT 100",
                batch_id,
            )
        counts = {State(row[0]): int(row[1]) for row in rows}
        return BatchStatus(batch_id=batch_id, name=name, counts=counts, unresolved=[_operation(r) for r in unresolved])

    async def list_batches(self, *, limit: int = 50) -> list[BatchSummary]:
        async with self._read() as db:
            rows = await db.fetch(
                "SELECT b.id, b.name, b.created_at, o.state, count(o.id) "
                "FROM (SELECT id, name, created_at FROM batches ORDER BY created_at DESC, id DESC LIMIT $1) AS b "
                "LEFT JOIN operations AS o ON o.batch_id = b.id "
                "GROUP BY b.id, b.name, b.created_at, o.state ORDER BY b.created_at DESC, b.id DESC",
                limit,
            )
        return batch_summaries((row[0], row[1], row[2], row[3], int(row[4])) for row in rows)

    async def count_by_state(self) -> dict[State, int]:
        async with self._read() as db:
            rows = await db.fetch("SELECT state, count(*) FROM operations GROUP BY state")
        return {State(row[0]): int(row[1]) for row in rows}

    async def add_suppression(self, suppression: Suppression, *, actor: str) -> list[str]:
        async with self._write() as db:
            return await _suppress(db, suppression, actor)

    async def remove_suppression(self, recipient: str, channel: str) -> bool:
        async with self._write() as db:
            status = await db.execute(
                "DELETE FROM suppressions WHERE recipient = $1 AND channel = $2",
                recipients.comparable(recipient, channel),
                channel,
            )
        return _count(status) > 0

    async def list_suppressions(self) -> list[Suppression]:
        async with self._read() as db:
            rows = await db.fetch(
                "SELECT recipient, channel, reason, source, created_at FROM suppressions "
                "ORDER BY created_at, recipient, channel"
            )
        return [Suppression.model_validate(dict(row.items())) for row in rows]

    async def is_suppressed(self, recipients: Sequence[str], channel: str) -> bool:
        async with self._read() as db:
            return await _suppressed(db, recipients, channel)

    async def observe_tools(self, fingerprints: Mapping[str, str]) -> list[ToolPin]:
        async with self._write() as db:
            await db.executemany(_OBSERVE_TOOL, sorted(fingerprints.items()))  # one order: no deadlock
            return [ToolPin.model_validate(dict(row.items())) for row in await db.fetch(_TOOL_PINS)]

    async def accept_tools(self, names: Sequence[str] | None = None) -> list[str]:
        async with self._write() as db:
            rows = await db.fetch(_ACCEPT_TOOLS, list(names) if names is not None else None)
        return sorted(row[0] for row in rows)

    async def tool_pins(self) -> list[ToolPin]:
        async with self._read() as db:
            rows = await db.fetch(_TOOL_PINS)
        return [ToolPin.model_validate(dict(row.items())) for row in rows]

    async def oldest(self, state: State) -> Operation | None:
        async with self._read() as db:
            return await _one(db, f"{_SELECT} WHERE state = $1 ORDER BY created_at, seq LIMIT 1", state.value)

    async def get(self, operation_id: str) -> Operation:
        async with self._read() as db:
            found = await _one(db, f"{_SELECT} WHERE id = $1", operation_id)
        if found is None:
            raise _not_found(operation_id)
        return found

    async def find_by_key(self, idempotency_key: str) -> Operation | None:
        async with self._read() as db:
            return await _one(db, f"{_SELECT} WHERE idempotency_key = $1", idempotency_key)

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
        async with self._read() as db:
            rows = await db.fetch(_LIST_OPERATIONS, state_value, campaign_id, batch_id, wanted, since, before, limit)
        return [_operation(row) for row in rows]

    async def events(self, operation_id: str) -> list[Event]:
        async with self._read() as db:
            rows = await db.fetch(
                "SELECT operation_id, at, from_state, to_state, actor, reason FROM events "
                "WHERE operation_id = $1 ORDER BY id",
                operation_id,
            )
        return [Event.model_validate(dict(row.items())) for row in rows]

    async def expire_leases(self) -> int:
        async with self._alone() as db:
            return await _expire(db)

    async def record_delivery(
        self,
        operation_id: str,
        observations: Sequence[DeliveryObservation],
        *,
        next_check_seconds: float | None = None,
    ) -> Operation:
        async with self._write() as db:
            operation = await _one(db, _LOCK_BY_ID, operation_id)
            if operation is None:
                raise _not_found(operation_id)
            await _apply_delivery(db, operation, observations, next_check_seconds)
            return await _must(db, operation_id)

    async def claim_delivery_checks(
        self, *, channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int = 50
    ) -> list[Operation]:
        settled = sorted(state.value for state in delivery.SETTLED)
        async with self._write() as db:
            rows = await db.fetch(_CLAIM_DELIVERY_CHECKS, hold_seconds, list(channels), settled, max_age_seconds, limit)
        return [_operation(row) for row in rows]

    async def delivery_events(self, operation_id: str) -> list[DeliveryEvent]:
        async with self._read() as db:
            rows = await db.fetch(_DELIVERY_EVENTS, operation_id)
        return [DeliveryEvent.model_validate(dict(row.items())) for row in rows]

    async def record_webhook(self, webhook: Webhook) -> WebhookOutcome:
        async with self._write() as db:
            if await db.fetchval(_SIGNATURE_SEEN, webhook.signature):
                return WebhookOutcome.REPLAYED
            claimed = await db.fetchval(
                _CLAIM_WEBHOOK,
                webhook.delivery_id,
                webhook.signature,
                webhook.event_type,
                webhook.provider_id,
                webhook.payload,
            )
            if claimed is None:
                replayed = await db.fetchval(_SIGNATURE_SEEN, webhook.signature)
                return WebhookOutcome.REPLAYED if replayed else WebhookOutcome.DUPLICATE
            outcome, operation_id = await _apply_webhook(db, webhook)
            await db.execute(_SETTLE_WEBHOOK, outcome.value, operation_id, webhook.delivery_id)
            return outcome

    async def resolve_review(
        self, operation_id: str, *, state: State, reason: str, actor: str, provider_id: str | None = None
    ) -> Operation:
        policy.check_review_decision(state, reason, provider_id)
        why = policy.review_decision_text(state, reason, provider_id)
        cancel_reason = why if state is State.CANCELLED else None
        last_error = why if state is State.FAILED else None
        async with self._write() as db:
            before = await _one(db, _LOCK_BY_ID, operation_id)
            if before is None:
                raise _not_found(operation_id)
            if before.state is not State.NEEDS_REVIEW:
                raise policy.not_in_review(before, "resolved")
            may_have_left = state is not State.ACCEPTED  # closed by an operator: it may have been sent
            row = await db.fetchrow(
                _RESOLVE_REVIEW, state.value, provider_id, cancel_reason, last_error, operation_id, may_have_left
            )
            await _event(db, operation_id, State.NEEDS_REVIEW, state, actor, why)
        return _operation(row)

    async def resend(self, operation_id: str, intent: Intent, *, reason: str, actor: str) -> Operation:
        policy.check_review_decision(State.CANCELLED, reason)
        async with self._write() as db:
            old = await _one(db, _LOCK_BY_ID, operation_id)
            if old is None:
                raise _not_found(operation_id)
            if old.state is not State.NEEDS_REVIEW:
                raise policy.not_in_review(old, "resent")
            if await _suppressed(db, intent.recipients, intent.channel):
                raise policy.suppressed_refusal(intent.recipients, intent.channel)
            taken = await _one(db, f"{_SELECT} WHERE idempotency_key = $1", intent.idempotency_key)
            if taken is not None:
                raise policy.resend_key_taken(intent.idempotency_key, taken)
            new_id = str(uuid.uuid4())
            texts = policy.resend_texts(old.id, new_id, reason)
            await db.execute(_INSERT_PLANNED, new_id, *_intent_values(intent), State.READY.value)
            await db.execute("UPDATE operations SET resend_of = $1 WHERE id = $2", old.id, new_id)
            await _event(db, new_id, None, State.READY, actor, texts.new_event)
            await db.execute(_SUPERSEDE, texts.cancel_reason, new_id, old.id)
            await _event(db, old.id, State.NEEDS_REVIEW, State.CANCELLED, actor, texts.old_event)
            return await _must(db, new_id)

    async def prune(self, *, older_than_seconds: float) -> PruneReport:
        if not older_than_seconds > 0:
            raise RefusedByPolicy("prune needs a positive age; nothing was removed")
        resolved = sorted(state.value for state in TERMINAL_STATES)
        webhook_age = max(older_than_seconds, policy.WEBHOOK_DEDUPE_SECONDS)
        async with self._write() as db:
            cutoff = await db.fetchval(f"SELECT {_later('$1')}", -older_than_seconds)
            events = _count(
                await db.execute(f"DELETE FROM events WHERE operation_id IN ({_PRUNABLE})", resolved, cutoff)
            )
            await db.execute(f"DELETE FROM delivery_events WHERE operation_id IN ({_PRUNABLE})", resolved, cutoff)
            await db.execute(f"DELETE FROM operation_recipients WHERE operation_id IN ({_PRUNABLE})", resolved, cutoff)
            operations = _count(await db.execute(f"DELETE FROM operations WHERE id IN ({_PRUNABLE})", resolved, cutoff))
            hooks = _count(
                await db.execute(f"DELETE FROM webhook_deliveries WHERE received_at < {_later('$1')}", -webhook_age)
            )
        return PruneReport(operations=operations, events=events, webhook_deliveries=hooks)

    async def backup(self, path: str) -> int:
        raise LedgerError(
            f"hail-guard copies SQLite ledgers only; back up the PostgreSQL ledger at {self._where} with pg_dump "
            "(e.g. `pg_dump --format=custom --file ledger.dump DATABASE_URL`), then restore with pg_restore"
        )

    async def aclose(self) -> None:
        """Close the pool: wait a moment for connections in use, then cut them."""
        with _mapped(self._where, self._secrets):
            with anyio.move_on_after(CLOSE_SECONDS):
                await self._pool.close()  # cancelled, it terminates the connections itself

    @asynccontextmanager
    async def _write(self, *, shielded: bool = True) -> AsyncIterator[asyncpg.Connection]:
        """One transaction on one pooled connection: committed on success, rolled back on any error.

        Shielded from cancellation once the connection is ours, up to and including its release: a
        claim committed and then cancelled on its way out would leave operations `sending` that
        nobody forwards. Unshielded (planning a batch, which reads its sends while the transaction is
        open), a cancellation rolls everything back; the commit and the release are still shielded.
        """
        with _mapped(self._where, self._secrets):
            db = await self._pool.acquire()  # cancellable: nothing has started yet
            try:
                with anyio.CancelScope(shield=shielded):
                    transaction = db.transaction()
                    await transaction.start()
                    try:
                        yield db
                    except BaseException:
                        with (
                            anyio.CancelScope(shield=True),
                            suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError),
                        ):
                            await transaction.rollback()  # a dead connection is discarded by the pool anyway
                        raise
                    with anyio.CancelScope(shield=True):
                        await transaction.commit()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._pool.release(db, timeout=RELEASE_SECONDS)  # a dead link is dropped, not awaited

    @asynccontextmanager
    async def _alone(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for writes that are one statement each: a statement commits on its own, as
        one round trip (in `_write`, BEGIN and COMMIT are two more). Shielded as `_write` is."""
        with _mapped(self._where, self._secrets):
            db = await self._pool.acquire()  # cancellable: nothing has started yet
            with anyio.CancelScope(shield=True):
                try:
                    yield db
                finally:
                    await self._pool.release(db, timeout=RELEASE_SECONDS)

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[asyncpg.Connection]:
        with _mapped(self._where, self._secrets):
            async with self._pool.acquire() as db:
                yield db


COMMAND_TIMEOUT_SECONDS = 60.0
"""Longest a single statement may take before the call fails as `LedgerUnavailable`."""
RELEASE_SECONDS = 10.0
"""Longest a connection's reset may take when it goes back to the pool; past it the pool drops it."""


@asynccontextmanager
async def open_postgres_ledger(
    url: str,
    *,
    busy_timeout_seconds: float = 5.0,
    connect_timeout_seconds: float = 10.0,
    min_connections: int = 1,
    max_connections: int = 10,
    command_timeout_seconds: float = COMMAND_TIMEOUT_SECONDS,
) -> AsyncIterator[PostgresLedger]:
    """Migrate the database, then connect a pool to `url`.

    `busy_timeout_seconds` bounds every wait for a lock held by another process (`lock_timeout`),
    like the SQLite ledger's busy timeout. `command_timeout_seconds` bounds every statement, so a
    network that goes silent fails the call (nothing forwarded) instead of hanging it.
    """
    where, secrets = describe(url)
    await migrate(url, connect_timeout_seconds=connect_timeout_seconds)  # no statement bound: it may wait its turn
    with _mapped(where, secrets):
        pool = await asyncpg.create_pool(
            url,
            min_size=min_connections,
            max_size=max_connections,
            timeout=connect_timeout_seconds,
            command_timeout=command_timeout_seconds,
            connection_class=_Connection,
            server_settings={
                "application_name": "hail-guard",
                "lock_timeout": f"{max(1, int(busy_timeout_seconds * 1000))}ms",
            },
        )
    ledger = PostgresLedger(pool, where, secrets)
    try:
        yield ledger
    finally:
        with anyio.CancelScope(shield=True):
            await ledger.aclose()


class _Connection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg is untyped: its classes are Any
    """A pooled connection that keeps its session when it goes back to the pool.

    hail-guard sets no session state (no `SET`, `LISTEN`, cursors or session advisory locks), and the pool
    still rolls back any open transaction. The default reset (`RESET ALL`, `UNLISTEN *`, ...) would cost a
    round trip on every release.
    """

    def get_reset_query(self) -> str:
        return ""


async def migrate(url: str, *, connect_timeout_seconds: float = 10.0) -> int:
    """Bring the database at `url` to the newest schema this hail-guard knows; returns that version.

    Safe to run from several processes at once: they take turns under an advisory lock.
    """
    where, secrets = describe(url)
    with _mapped(where, secrets):
        db = await asyncpg.connect(url, timeout=connect_timeout_seconds)
        try:
            return await _migrate(db, where)
        finally:
            with anyio.CancelScope(shield=True):
                await db.close()


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) for every migration shipped, in order."""
    folder = resources.files("hail_guard.ledger") / "migrations" / "postgres"
    found = [
        (int(item.name.split("_")[0]), item.read_text()) for item in folder.iterdir() if item.name.endswith(".sql")
    ]
    return sorted(found)


async def _migrate(db: asyncpg.Connection, where: str) -> int:
    """Check the encoding and the version; apply what is missing, all or nothing, one process at a time."""
    encoding = await db.fetchval("SHOW server_encoding")
    if encoding != "UTF8":
        raise LedgerUnavailable(
            f"the PostgreSQL ledger at {where} uses encoding {encoding}; hail-guard stores requests exactly as "
            "sent and needs a UTF8 database (CREATE DATABASE ... ENCODING 'UTF8')"
        )
    known = migrations()
    latest = known[-1][0]
    functions = _function_texts()
    if _check_version(await _version(db), latest, where) == latest and await _applied_functions(db) == functions:
        return latest  # nothing to do: no lock, no DDL (a role without CREATE can use a migrated database)
    async with db.transaction():
        await db.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'")
        await db.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await db.execute(_CREATE_SCHEMA_TABLE)
        current = _check_version(await _version(db), latest, where)
        pending = [(version, sql) for version, sql in known if version > current]
        for version, sql in pending:
            await db.execute(sql)
            if version in _BACKFILLS:
                await _BACKFILLS[version](db)
            await db.execute(f"INSERT INTO {_SCHEMA_TABLE} (version) VALUES ($1)", version)
        applied = await _applied_functions(db)
        for name, (checksum, sql) in functions.items():
            if applied.get(name) != (checksum, sql):
                await db.execute(sql)
                await db.execute(_RECORD_FUNCTION, name, checksum)
    for version, _ in pending:  # committed
        log.info("ledger_migrated", backend="postgres", ledger=where, version=version)
    return latest


_RECORD_FUNCTION = """
    INSERT INTO hail_guard_functions (name, checksum) VALUES ($1, $2)
    ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum
"""


def _function_texts() -> dict[str, tuple[str, str]]:
    """Each server-side function's (checksum, SQL), from sql/postgres/<name>.sql."""
    folder = resources.files("hail_guard.ledger") / "sql" / "postgres"
    texts = {name: (folder / f"{name}.sql").read_text() for name in _FUNCTIONS}
    return {name: (hashlib.sha256(sql.encode()).hexdigest(), sql) for name, sql in texts.items()}


async def _applied_functions(db: asyncpg.Connection) -> dict[str, tuple[str, str]]:
    """The functions the database has, as `_function_texts` gives them when their checksums match."""
    if not await db.fetchval("SELECT to_regclass('hail_guard_functions') IS NOT NULL"):
        return {}
    known = _function_texts()
    rows = await db.fetch("SELECT name, checksum FROM hail_guard_functions")
    return {
        row["name"]: known[row["name"]]
        for row in rows
        if row["name"] in known and known[row["name"]][0] == row["checksum"]
    }


async def _backfill_recipients(db: asyncpg.Connection) -> None:
    """Version 8: recipients, opt-out keys, message fingerprints and senders recomputed (`backfill`)."""
    rows = await db.fetch("SELECT id, tool, channel, request FROM operations ORDER BY seq")
    for page in backfill.pages(iter(rows)):
        found = [(row["id"], backfill.facts(row["tool"], row["channel"], row["request"])) for row in page]
        await db.executemany(
            "UPDATE operations SET recipients = $1::jsonb, recipient_keys = $2, content_fingerprint = $3, "
            "sender = $4::jsonb WHERE id = $5",
            [
                (json.dumps(f.recipients), f.recipient_keys, f.content_fingerprint, f.sender, operation_id)
                for operation_id, f in found
            ],
        )
        await db.executemany(
            "INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint) VALUES ($1, $2, $3)",
            [(operation_id, r, f.content_fingerprint) for operation_id, f in found for r in f.recipients],
        )
    opt_outs = await db.fetch("SELECT recipient, channel FROM suppressions ORDER BY created_at")
    for row in opt_outs:  # of two that now read the same, the earliest is kept
        key = recipients.comparable(row["recipient"], row["channel"])
        if key != row["recipient"]:
            await db.execute(
                "WITH taken AS (SELECT 1 FROM suppressions WHERE recipient = $1 AND channel = $3) "
                "UPDATE suppressions SET recipient = $1 WHERE recipient = $2 AND channel = $3 "
                "AND NOT EXISTS (SELECT 1 FROM taken)",
                key,
                row["recipient"],
                row["channel"],
            )
            await db.execute(
                "DELETE FROM suppressions WHERE recipient = $1 AND channel = $2", row["recipient"], row["channel"]
            )


_BACKFILLS = {8: _backfill_recipients}
"""Migrations whose stored values are recomputed in Python right after their SQL, in their transaction."""


async def _version(db: asyncpg.Connection) -> int:
    if not await db.fetchval(_HAS_SCHEMA_TABLE):
        return 0
    version: int = await db.fetchval(_SCHEMA_VERSION)
    return version


def _check_version(current: int, latest: int, where: str) -> int:
    if current > latest:
        raise SchemaTooNew(
            f"the PostgreSQL ledger at {where} has schema version {current}, newer than this hail-guard knows "
            f"({latest}); upgrade hail-guard"
        )
    return current


def describe(url: str) -> tuple[str, frozenset[str]]:
    """Where the ledger is, as messages may show it (`urls.parse_url`: scheme, host, port, database), and
    the password's spellings to scrub from any message; a URL drivers would misread is refused first."""
    parts = parse_url(url)
    if parts.ambiguous:
        raise ConfigError(
            f"the ledger URL for {parts.display} has a /, ?, # or @ in its user name or password: write them "
            "percent-encoded (%2F, %3F, %23, %40), or pass the password with ?password= (encoded the same way)"
        )
    if any(not 0 < port <= _MAX_PORT for port in parts.ports):
        raise ConfigError(f"the ledger URL {parts.display} names a port outside 1-{_MAX_PORT}: fix the port")
    return parts.display, parts.secrets


_MAX_PORT = 65535
_EXPLANATIONS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], str], ...] = (
    (
        OSError,
        "cannot reach the PostgreSQL ledger at {where}: {detail}; check that the server is running and the host "
        "and port in the ledger URL",
    ),
    (
        asyncpg.InvalidPasswordError,
        "the PostgreSQL ledger at {where} refused the password: check the user and password in the ledger URL",
    ),
    (asyncpg.InvalidAuthorizationSpecificationError, "the PostgreSQL ledger at {where} refused the login: {detail}"),
    (
        asyncpg.InvalidCatalogNameError,
        "the PostgreSQL ledger at {where} does not exist: {detail}; create the database or fix the ledger URL",
    ),
    (
        (asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError),
        "the PostgreSQL ledger at {where} is not accepting connections now: {detail}; retry",
    ),
    (
        (asyncpg.ClientConfigurationError, ValueError, OverflowError),  # a malformed URL; a value asyncpg cannot send
        "the PostgreSQL ledger at {where} cannot be used: {detail}",
    ),
    (
        (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            asyncpg.OperatorInterventionError,
        ),
        "the connection to the PostgreSQL ledger at {where} failed: {detail}; retry (a write cut off while "
        "committing may have been recorded after all: the retry finds it)",
    ),
    (
        asyncpg.LockNotAvailableError,
        "the PostgreSQL ledger at {where} stayed locked past the lock timeout; another process holds it: retry, "
        "or raise [ledger] busy_timeout_seconds",
    ),
    (
        (asyncpg.TransactionRollbackError, asyncpg.UniqueViolationError),
        "another process wrote the PostgreSQL ledger at {where} at the same moment ({detail}); nothing was "
        "recorded: retry",
    ),
    (
        asyncpg.ReadOnlySQLTransactionError,
        "the PostgreSQL ledger at {where} is read-only (a standby?): point the ledger URL at the primary",
    ),
    (
        asyncpg.InsufficientResourcesError,
        "the PostgreSQL ledger at {where} is out of resources (disk full?): {detail}",
    ),
    (asyncpg.InsufficientPrivilegeError, "the user of the PostgreSQL ledger at {where} lacks a privilege: {detail}"),
    (
        asyncpg.UndefinedTableError,
        "the PostgreSQL ledger at {where} has no hail-guard tables ({detail}): run `hail-guard migrate`",
    ),
)
"""What each kind of failure means for the operator, first match wins; anything else says what failed."""


@contextmanager
def _mapped(where: str, secrets: frozenset[str] = frozenset()) -> Iterator[None]:
    """The one place asyncpg and socket errors become ours; the password never reaches a message."""
    try:
        yield
    except HailGuardError:
        raise
    except (
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.InternalClientError,
        OSError,
        ValueError,
        OverflowError,
    ) as exc:
        message = _explain(exc, where)
        for secret in secrets:
            message = message.replace(secret, "***")
        leaks = any(secret in str(exc) for secret in secrets)
        raise LedgerUnavailable(message) from (None if leaks else exc)


def _explain(exc: Exception, where: str) -> str:
    detail = str(exc) or type(exc).__name__
    for kinds, template in _EXPLANATIONS:
        if isinstance(exc, kinds):
            return template.format(where=where, detail=detail)
    return f"the PostgreSQL ledger at {where} failed: {detail}"


async def _expire(db: asyncpg.Connection) -> int:
    expired: int = await db.fetchval(_EXPIRE_LEASES, _LEASE_EXPIRED)
    return expired


def _intent_values(intent: Intent) -> tuple[Any, ...]:
    return (
        intent.idempotency_key,
        intent.tool,
        intent.channel,
        json.dumps(list(intent.recipients)),
        recipients.keys_of(intent.recipients),
        intent.request,
        intent.request_fingerprint,
        intent.content_fingerprint,
        intent.sender,
        intent.campaign_id,
        intent.lead_id,
        intent.message_id,
        intent.batch_id,
    )


async def _suppress(db: asyncpg.Connection, suppression: Suppression, actor: str) -> list[str]:
    """Record the opt-out; cancel every unforwarded operation to that recipient; their ids."""
    recipient = recipients.comparable(suppression.recipient, suppression.channel)  # the edges refuse unreadable ones
    await db.execute(_ADD_SUPPRESSION, recipient, suppression.channel, suppression.reason, suppression.source)
    return [row[0] for row in await db.fetch(_CANCEL_SUPPRESSED, policy.suppression_reason(suppression), actor)]


async def _apply_delivery(
    db: asyncpg.Connection,
    operation: Operation,
    observations: Sequence[DeliveryObservation],
    next_check_seconds: float | None,
) -> None:
    """Each state once as an event; the current state only forward (`delivery.settle`); `state` untouched.

    The caller holds the operation's row lock, so a poll and a webhook settle one after the other.
    """
    await db.executemany(
        _DELIVERY_EVENT, [(operation.id, o.state.value, o.occurred_at, o.source, o.detail) for o in observations]
    )
    moved = delivery.settle(operation.delivery_state, observations)
    if moved is not None:
        await db.execute(_SET_DELIVERY, moved.state.value, moved.occurred_at, operation.id)
    if next_check_seconds is not None:
        await db.execute(_COUNT_DELIVERY_CHECK, next_check_seconds, operation.id)


async def _apply_webhook(db: asyncpg.Connection, webhook: Webhook) -> tuple[WebhookOutcome, str | None]:
    if webhook.opt_out is not None:
        await _suppress(db, webhook.opt_out, "webhook")
        return WebhookOutcome.OPTED_OUT, None
    if webhook.observation is None or webhook.provider_id is None:
        return WebhookOutcome.IGNORED, None
    operation = await _one(db, _LOCK_BY_PROVIDER, webhook.provider_id)
    if operation is None:
        return WebhookOutcome.UNKNOWN_OPERATION, None
    await _apply_delivery(db, operation, [webhook.observation], None)
    return WebhookOutcome.APPLIED, operation.id


async def _must(db: asyncpg.Connection, operation_id: str) -> Operation:
    found = await _one(db, f"{_SELECT} WHERE id = $1", operation_id)
    if found is None:
        raise _not_found(operation_id)
    return found


async def _suppressed(db: asyncpg.Connection, reached: Sequence[str], channel: str) -> bool:
    names = recipients.keys_of(reached, channel)
    return bool(names) and bool(await db.fetchval(_IS_SUPPRESSED, names, channel))


def _message_locks(intent: Intent) -> list[int]:
    """The duplicate guard's advisory locks for this message to each recipient (of `CONTENT_LOCK_BUCKETS`),
    sorted, so that two sends of one message to a shared recipient take turns and never deadlock."""
    pairs = (f"{intent.content_fingerprint}:{recipient}" for recipient in intent.recipients or ("",))
    return sorted({zlib.crc32(pair.encode()) % CONTENT_LOCK_BUCKETS for pair in pairs})


class _IntentsRaised(HailGuardError):
    """What reading the caller's intents raised, carried through the ledger's error mapping unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _chunks(intents: Iterable[Intent], size: int) -> Iterator[list[Intent]]:
    iterator = iter(intents)
    while True:
        try:
            chunk = list(itertools.islice(iterator, size))
        except HailGuardError:
            raise
        except Exception as exc:  # not the ledger's: `_mapped` must not call it a ledger failure
            raise _IntentsRaised(exc) from exc
        if not chunk:
            return
        yield chunk


def _staged(chunk: Sequence[Intent], *, first: int) -> list[tuple[Any, ...]]:
    """Rows of the planning stage (`_STAGE_COLUMNS`), numbered from `first`."""
    return [
        (position, str(uuid.uuid4()), *_intent_values(intent)[:-1], intent.allow_duplicate)
        for position, intent in enumerate(chunk, start=first)
    ]


async def _refuse_known_keys(db: asyncpg.Connection) -> None:
    rows = await db.fetch(_STAGED_KNOWN_KEYS)
    if rows:
        named = "; ".join(f"send {n} (key {key!r} is operation {op_id})" for n, key, op_id, _ in rows)
        raise RefusedByPolicy(f"{rows[0]['taken']} send(s) already exist in the ledger: {named}; nothing was planned")


async def _refuse_duplicates(db: asyncpg.Connection, window_seconds: float) -> None:
    """The duplicate guard over the staged batch; the caller holds the advisory locks on its messages."""
    for allow_duplicate in (False, True):
        states, closed_block = policy.blocking_states(allow_duplicate=allow_duplicate)
        position = await db.fetchval(_STAGED_DUPLICATE, window_seconds, allow_duplicate, states, closed_block)
        if position is None:
            continue
        staged = dict((await db.fetchrow(_STAGED_INTENT, position)).items())
        staged["recipients"] = tuple(json.loads(staged["recipients"]))
        intent = Intent.model_validate(staged)
        matches = await db.fetch(
            _MATCHES,
            intent.content_fingerprint,
            list(intent.recipients),
            intent.idempotency_key,
            intent.tool,
            states,
            closed_block,
            window_seconds,
            intent.sender,
        )
        raise policy.already_planned(intent, [_operation(row) for row in matches], position)


async def _must_batch(db: asyncpg.Connection, batch_id: str) -> str | None:
    row = await db.fetchrow("SELECT name FROM batches WHERE id = $1", batch_id)
    if row is None:
        raise NotFound(f"no batch {batch_id}; plan one with `hail-guard batch plan FILE`")
    name: str | None = row["name"]
    return name


async def _one(db: asyncpg.Connection, query: str, *args: Any) -> Operation | None:
    row = await db.fetchrow(query, *args)
    return _operation(row) if row is not None else None


def _not_found(operation_id: str) -> NotFound:
    return NotFound(f"no operation {operation_id}; list them with `hail-guard ops list`")


async def _event(
    db: asyncpg.Connection, operation_id: str, before: State | None, after: State, actor: str, reason: str
) -> None:
    await db.execute(_EVENT, operation_id, before.value if before else None, after.value, actor, reason)


def _count(status: str) -> int:
    """The row count in a command tag such as `INSERT 0 3` or `DELETE 1`."""
    return int(status.rsplit(" ", 1)[-1])


def _operation(row: Any) -> Operation:
    """An operation from a row (an asyncpg Record, or a mapping) holding `_COLUMNS` and maybe more."""
    values = {name: row[name] for name in _NAMES}
    values["recipients"] = json.loads(values["recipients"])
    values["result"] = json.loads(values["result"]) if values["result"] is not None else None
    values["sender"] = json.loads(values["sender"])
    return Operation.model_validate(values)
