"""What both ledger backends do alike, written once over their named statements.

`LedgerCore` is the half of the `Ledger` protocol that is the same on SQLite and PostgreSQL: reads,
opt-outs, batches' approval and status, delivery and webhooks (one that comes before its message's id
is kept until the id is recorded: `apply_parked`), the review queue, pruning and tool pins. Each runs
as one `Tx` of the backend (`_read`, `_write`), calling statements by name with their parameters
by name (`hail_guard.ledger.sql`: `await tx.rows("list_operations", state=..., campaign_id=..., ...)`):
a statement of one name takes the same parameters on both dialects (`params` builds the long ones), and
rows come back as mappings that `operation_of` and pydantic read alike (SQLite's epoch floats are UTC
datetimes to pydantic, its JSON is text as PostgreSQL's is). A backend adds the send path
(`begin_send`, claims, outcomes, lease expiry, batch planning), where the dialects really differ; where
the protocol's signature is long, the core keeps it and calls the backend's step (`_claim_unknown`,
`_plan_batch`), so the two backends repeat no line of Python. What operators read (the console's
pages) is `reads.OperatorReads`, this core with those reads; each backend is one.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from hail_guard import delivery, lifecycle, policy, recipients
from hail_guard.errors import BadInput, NotFound
from hail_guard.ledger.params import Params, hold_args, intent_values, match_args
from hail_guard.ledger.roles import Plan, Where, send_at
from hail_guard.models import (
    BatchStatus,
    DeliveryEvent,
    DeliveryObservation,
    Event,
    HeldSend,
    Intent,
    Operation,
    PruneReport,
    State,
    Suppression,
    ToolPin,
    Webhook,
    WebhookOutcome,
)
from hail_guard.same_send import Candidates, Rules

Row = Mapping[str, Any]
_P = ParamSpec("_P")
_T = TypeVar("_T")
LEASE_EXPIRED = "lease expired while sending: the request may have left"
DEFAULT_RULES = Rules()
PARKED_WEBHOOKS_MAX = 10_000
"""Webhooks kept at once for a message id no operation has yet; past it one is recorded for audit only."""
PARKED_WEBHOOK_SECONDS = policy.WEBHOOK_DEDUPE_SECONDS
"""How long such a webhook is kept to apply: as long as its delivery id is remembered (Hail retries for a day)."""
Writes = list[tuple[str, list[Params]]]
"""(statement, the parameters of each run) to run in order: the same on both dialects."""


class Tx(Protocol):
    """Statements by name, their parameters by name, in one transaction of a backend (or outside one, for reads).

    A parameter the statement does not use, or one it uses that is not given, is a `TypeError` (`sql.Statement`)."""

    async def rows(self, name: str, /, **params: Any) -> list[Row]: ...

    async def row(self, name: str, /, **params: Any) -> Row | None: ...

    async def run(self, name: str, /, **params: Any) -> int:
        """Run a statement; returns how many rows it changed."""

    async def run_many(self, name: str, params: Sequence[Params], /) -> None: ...


Work = Callable[Concatenate[Tx, _P], Awaitable[_T]]


def operation_of(row: Row) -> Operation:
    """An operation from a row holding `sql.OPERATION_COLUMNS` (and maybe more): JSON read from its text."""
    values = dict(row)
    for name in ("recipients", "result", "sender"):
        if isinstance(values.get(name), str):
            values[name] = json.loads(values[name])
    return Operation.model_validate(values)


def as_time(value: Any) -> datetime:
    """A time as a backend gives it (epoch seconds on SQLite), as a UTC datetime."""
    return value if isinstance(value, datetime) else datetime.fromtimestamp(float(value), tz=UTC)


def epoch(moment: datetime | None) -> float | None:
    """A time as both dialects take it in a parameter: Unix epoch seconds."""
    return moment.timestamp() if moment is not None else None


def opt_out_probes(reached: Sequence[str], channel: str) -> list[str]:
    """The opt-out keys a send to `reached` is checked against (`recipients.keys_of`)."""
    return recipients.keys_of(reached, channel)


def must_row(rows: Sequence[Row], operation_id: str) -> Row:
    if not rows:
        raise not_found(operation_id)
    return rows[0]


def not_found(operation_id: str) -> NotFound:
    return NotFound(f"no operation {operation_id}; list them with `hail-guard ops list`")


class LedgerCore(ABC):
    """The operations both backends do alike (see the module docstring)."""

    @abstractmethod
    async def _read(self, work: Work[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`work(tx, ...)` over statements that only read."""

    @abstractmethod
    async def _write(self, work: Work[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`work(tx, ...)` in one write transaction, durable when it returns: rolled back if it raises."""

    # The backend's own steps, under the names and keywords of the `Ledger` protocol:

    @abstractmethod
    async def _claim_unknown(
        self, owner: str, lease_seconds: float, operation_id: str | None, batch_id: str | None, limit: int
    ) -> list[Operation]:
        """Expire lapsed leases, then claim the `unknown` operation asked for, or up to `limit` that are due."""

    @abstractmethod
    async def _plan_batch(self, intents: Iterable[Intent], plan: Plan) -> int:
        """Stage the intents (`stage_rows`), then check and copy them in one transaction (`plan_staged`)."""

    async def claim_unknown(
        self,
        *,
        owner: str,
        lease_seconds: float,
        operation_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        return await self._claim_unknown(owner, lease_seconds, operation_id, batch_id, limit)

    async def plan_batch(
        self,
        *,
        batch_id: str,
        name: str | None,
        intents: Iterable[Intent],
        state: State,
        actor: str,
        rules: Rules = DEFAULT_RULES,
        where: Where = send_at,
    ) -> int:
        return await self._plan_batch(intents, Plan(batch_id, name, state, actor, rules, where))

    async def now(self) -> datetime:
        return await self._read(_now)

    async def get(self, operation_id: str) -> Operation:
        return await self._read(must, operation_id)

    async def same_send_candidates(self, intent: Intent, rules: Rules) -> Candidates:
        return await self._read(_same_send_candidates, intent, rules)

    async def find_by_key(self, idempotency_key: str) -> Operation | None:
        return await self._read(_one, "operation_by_key", idempotency_key=idempotency_key)

    async def oldest(self, state: State) -> Operation | None:
        return await self._read(_one, "oldest_in_state", state=state.value)

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
        return await self._read(
            _many,
            "list_operations",
            state=state.value if state else None,
            campaign_id=campaign_id,
            batch_id=batch_id,
            recipient=recipients.comparable(recipient) if recipient is not None else None,
            since=epoch(since),
            before=before,
            limit=limit,
        )

    async def events(self, operation_id: str) -> list[Event]:
        rows = await self._read(_rows, "events_of", operation_id=operation_id)
        return [Event.model_validate(dict(row)) for row in rows]

    async def delivery_events(self, operation_id: str) -> list[DeliveryEvent]:
        rows = await self._read(_rows, "delivery_events_of", operation_id=operation_id)
        return [DeliveryEvent.model_validate(dict(row)) for row in rows]

    async def count_by_state(self) -> dict[State, int]:
        rows = await self._read(_rows, "count_by_state")
        return {State(row["state"]): int(row["count"]) for row in rows}

    async def batch_status(self, batch_id: str, *, hold_lead: bool = True) -> BatchStatus:
        return await self._read(_batch_status, batch_id, hold_lead)

    async def approve_batch(self, batch_id: str, *, actor: str) -> int:
        return await self._write(_approve_batch, batch_id, actor)

    async def list_suppressions(self) -> list[Suppression]:
        return [Suppression.model_validate(dict(row)) for row in await self._read(_rows, "suppressions")]

    async def is_suppressed(self, reached: Sequence[str], channel: str) -> bool:
        return await self._read(opted_out, reached, channel)

    async def add_suppression(self, suppression: Suppression, *, actor: str) -> list[str]:
        return await self._write(suppress, suppression, actor)

    async def remove_suppression(self, recipient: str, channel: str) -> bool:
        key = recipients.opt_out_key(recipient, channel)
        return await self._write(_changed, "remove_suppression", recipient=key, channel=channel)

    async def observe_tools(self, fingerprints: Mapping[str, str]) -> list[ToolPin]:
        return await self._write(_observe_tools, dict(fingerprints))

    async def accept_tools(self, names: Sequence[str] | None = None) -> list[str]:
        chosen = json.dumps(list(names)) if names is not None else None
        return sorted(row["name"] for row in await self._write(_rows, "accept_tools", names=chosen))

    async def tool_pins(self) -> list[ToolPin]:
        return [ToolPin.model_validate(dict(row)) for row in await self._read(_rows, "tool_pins")]

    async def record_delivery(
        self,
        operation_id: str,
        observations: Sequence[DeliveryObservation],
        *,
        next_check_seconds: float | None = None,
    ) -> Operation:
        return await self._write(_record_delivery, operation_id, list(observations), next_check_seconds)

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
            raise BadInput("prune needs a positive age; nothing was removed")
        return await self._write(_prune, older_than_seconds)


# --- work, as functions of a Tx ----------------------------------------------------------------------


async def _now(tx: Tx) -> datetime:
    row = await tx.row("now")
    assert row is not None
    return as_time(next(iter(row.values())))


async def _same_send_candidates(tx: Tx, intent: Intent, rules: Rules) -> Candidates:
    """The same message to a shared recipient, and the unresolved sends that hold the send's recipients."""
    matches = [operation_of(row) for row in await tx.rows("matches", **match_args(intent, rules))]
    holds = [operation_of(row) for row in await tx.rows("holds", **hold_args(intent, rules))]
    return Candidates(matches=matches, holds=holds)


async def _rows(tx: Tx, name: str, /, **params: Any) -> list[Row]:
    return await tx.rows(name, **params)


async def _changed(tx: Tx, name: str, /, **params: Any) -> bool:
    return bool(await tx.rows(name, **params))


async def _one(tx: Tx, name: str, /, **params: Any) -> Operation | None:
    row = await tx.row(name, **params)
    return operation_of(row) if row is not None else None


async def _many(tx: Tx, name: str, /, **params: Any) -> list[Operation]:
    return [operation_of(row) for row in await tx.rows(name, **params)]


async def must(tx: Tx, operation_id: str, *, for_update: bool = False) -> Operation:
    name = "operation_by_id_for_update" if for_update else "operation_by_id"
    found = await _one(tx, name, id=operation_id)
    if found is None:
        raise not_found(operation_id)
    return found


async def record_event(tx: Tx, operation_id: str, before: State | None, after: State, actor: str, reason: str) -> None:
    await tx.run("record_event", **event_values(operation_id, before, after, actor, reason))


def event_values(operation_id: str, before: State | None, after: State, actor: str, reason: str) -> Params:
    """The parameters of `record_event`; the table is the rule: a move it lacks (a bug) must not reach the history."""
    if not lifecycle.is_legal(before, after):
        raise AssertionError(f"{before} -> {after} is not a move of hail_guard.lifecycle")
    return {
        "operation_id": operation_id,
        "from_state": before.value if before else None,
        "to_state": after.value,
        "actor": actor,
        "reason": reason,
    }


async def opted_out(tx: Tx, reached: Sequence[str], channel: str) -> bool:
    """Whether any of these recipients (normalised here as `comparable`) opted out of `channel`, or of all."""
    probes = opt_out_probes(reached, channel)
    return bool(probes) and await tx.row("opted_out", keys=json.dumps(probes), channel=channel) is not None


async def cancel_opted_out(tx: Tx, actor: str, reason: str, batch_id: str | None = None) -> list[str]:
    """Cancel every unforwarded operation (of `batch_id`, or of all) a recipient of which opted out."""
    return await cancel_pending(tx, await tx.rows("opted_out_pending", batch_id=batch_id), actor, reason)


async def cancel_pending(tx: Tx, found: Sequence[Row], actor: str, reason: str) -> list[str]:
    """Cancel these unforwarded operations (rows of `id` and `state`), each with its event; the ids cancelled."""
    pending = {row["id"]: State(row["state"]) for row in found}
    if not pending:
        return []
    cancelled = [row["id"] for row in await tx.rows("cancel_operations", ids=json.dumps(list(pending)), reason=reason)]
    events = [event_values(each, pending[each], State.CANCELLED, actor, reason) for each in cancelled]
    await tx.run_many("record_event", events)
    return cancelled


async def suppress(tx: Tx, suppression: Suppression, actor: str) -> list[str]:
    """Record an opt-out (by its recipient's key, `recipients.opt_out_key`: the edges refuse unreadable recipients, a
    webhook's is kept) and cancel what it stops."""
    key = recipients.opt_out_key(suppression.recipient, suppression.channel)
    await tx.run(
        "add_suppression",
        recipient=key,
        channel=suppression.channel,
        reason=suppression.reason,
        source=suppression.source,
    )
    return await cancel_opted_out(tx, actor, policy.suppression_reason(suppression))


async def batch_name(tx: Tx, batch_id: str) -> str | None:
    row = await tx.row("batch_name", batch_id=batch_id)
    if row is None:
        raise NotFound(f"no batch {batch_id}; plan one with `hail-guard batch plan FILE`")
    name: str | None = row["name"]
    return name


async def _batch_status(tx: Tx, batch_id: str, hold_lead: bool) -> BatchStatus:
    name = await batch_name(tx, batch_id)
    counts = {State(row["state"]): int(row["count"]) for row in await tx.rows("batch_counts", batch_id=batch_id)}
    unresolved = await _many(tx, "batch_unresolved", batch_id=batch_id)
    held = await _held(tx, batch_id, hold_lead) if counts.get(State.READY) else []
    return BatchStatus(batch_id=batch_id, name=name, counts=counts, unresolved=unresolved, held=held)


async def _held(tx: Tx, batch_id: str, hold_lead: bool) -> list[HeldSend]:
    """The batch's ready sends that wait, each with the unresolved send that holds it."""
    rows = await tx.rows("batch_held", batch_id=batch_id, hold_lead=hold_lead)
    holders = {holder: await must(tx, holder) for holder in dict.fromkeys(row["held_by"] for row in rows)}
    waiting: dict[str, HeldSend] = {}
    for row in rows:
        operation = operation_of(row)
        waiting.setdefault(operation.id, HeldSend(operation=operation, held_by=holders[row["held_by"]]))
    return list(waiting.values())


async def _approve_batch(tx: Tx, batch_id: str, actor: str) -> int:
    await batch_name(tx, batch_id)
    approved = await tx.rows("approve_batch", batch_id=batch_id)
    for row in approved:
        await record_event(tx, row["id"], State.PLANNED, State.READY, actor, "batch approved")
    return len(approved)


async def _observe_tools(tx: Tx, fingerprints: dict[str, str]) -> list[ToolPin]:
    observed = [{"name": name, "fingerprint": fingerprints[name]} for name in sorted(fingerprints)]
    await tx.run_many("observe_tool", observed)  # one order: no deadlock between processes
    return [ToolPin.model_validate(dict(row)) for row in await tx.rows("tool_pins")]


def delivery_writes(
    operation: Operation, observations: Sequence[DeliveryObservation], next_check_seconds: float | None
) -> Writes:
    """Each state once as an event; the current state only forward (`delivery.settle`); `state` untouched.
    The caller holds the operation's row (`for_update`), so a poll and a webhook settle one after the other."""
    events = [
        {
            "operation_id": operation.id,
            "state": seen.state.value,
            "occurred_at": epoch(seen.occurred_at),
            "source": seen.source,
            "detail": seen.detail,
        }
        for seen in observations
    ]
    writes: Writes = [("record_delivery_event", events)]
    moved = delivery.settle(operation.delivery_state, observations)
    if moved is not None:
        state = {"delivery_state": moved.state.value, "delivery_at": epoch(moved.occurred_at), "id": operation.id}
        writes.append(("set_delivery_state", [state]))
    if next_check_seconds is not None:
        writes.append(("count_delivery_check", [{"next_check_seconds": next_check_seconds, "id": operation.id}]))
    return writes


def parked_writes(operation: Operation, parked: Sequence[Row]) -> Writes:
    """The webhooks kept for `operation`'s provider id (rows of `parked_webhooks`) applied to it, and settled."""
    seen = [
        DeliveryObservation(
            state=row["delivery_state"],
            occurred_at=as_time(row["occurred_at"]) if row["occurred_at"] is not None else None,
            source="webhook",
            detail=row["delivery_id"],
        )
        for row in parked
    ]
    settled = [settle_values(WebhookOutcome.APPLIED, operation.id, row["delivery_id"]) for row in parked]
    return [*delivery_writes(operation, seen, None), ("settle_webhook", settled)]


def settle_values(outcome: WebhookOutcome, operation_id: str | None, delivery_id: str) -> Params:
    """The parameters of `settle_webhook`."""
    return {"outcome": outcome.value, "operation_id": operation_id, "delivery_id": delivery_id}


async def run_writes(tx: Tx, writes: Writes) -> None:
    for name, rows in writes:
        await tx.run_many(name, rows)


async def apply_parked(tx: Tx, operation: Operation) -> bool:
    """Apply the webhooks kept for the provider id just recorded for `operation`; whether there were any. The caller
    holds its row, and took `lock_provider` first: a webhook for that id arriving meanwhile waits, then finds it."""
    if operation.provider_id is None:
        return False
    parked = await tx.rows("parked_webhooks", provider_id=operation.provider_id, within_seconds=PARKED_WEBHOOK_SECONDS)
    if parked:
        await run_writes(tx, parked_writes(operation, parked))
    return bool(parked)


async def _record_delivery(
    tx: Tx, operation_id: str, observations: list[DeliveryObservation], next_check_seconds: float | None
) -> Operation:
    operation = await must(tx, operation_id, for_update=True)
    await run_writes(tx, delivery_writes(operation, observations, next_check_seconds))
    return await must(tx, operation_id)


async def _record_webhook(tx: Tx, webhook: Webhook) -> WebhookOutcome:
    """A seen signature is a replay; a delivery id counts once (a concurrent twin waits, then does nothing)."""
    if await tx.row("signature_seen", signature=webhook.signature) is not None:
        return WebhookOutcome.REPLAYED
    seen = webhook.observation
    claimed = await tx.row(
        "claim_webhook",
        delivery_id=webhook.delivery_id,
        signature=webhook.signature,
        event_type=webhook.event_type,
        provider_id=webhook.provider_id,
        payload=webhook.payload,
        delivery_state=seen.state.value if seen is not None else None,
        occurred_at=epoch(seen.occurred_at) if seen is not None else None,
    )
    if claimed is None:
        replayed = await tx.row("signature_seen", signature=webhook.signature) is not None
        return WebhookOutcome.REPLAYED if replayed else WebhookOutcome.DUPLICATE
    outcome, operation_id = await _apply_webhook(tx, webhook)
    await tx.run("settle_webhook", **settle_values(outcome, operation_id, webhook.delivery_id))
    return outcome


async def _apply_webhook(tx: Tx, webhook: Webhook) -> tuple[WebhookOutcome, str | None]:
    if webhook.opt_out is not None:
        await suppress(tx, webhook.opt_out, "webhook")
        return WebhookOutcome.OPTED_OUT, None
    if webhook.observation is None or webhook.provider_id is None:
        return WebhookOutcome.IGNORED, None
    # then whoever records this id sees it kept, or we see the id:
    await tx.run("lock_provider", provider_id=webhook.provider_id)
    operation = await _one(tx, "operation_by_provider_for_update", provider_id=webhook.provider_id)
    if operation is None:  # its send's answer may be lost: kept (bounded) until reconcile or a human records the id
        kept = await tx.row("parked_count", within_seconds=PARKED_WEBHOOK_SECONDS)
        full = kept is not None and int(kept["count"]) >= PARKED_WEBHOOKS_MAX
        return (WebhookOutcome.UNKNOWN_OPERATION if full else WebhookOutcome.PARKED), None
    await run_writes(tx, delivery_writes(operation, [webhook.observation], None))
    return WebhookOutcome.APPLIED, operation.id


async def _resolve_review(
    tx: Tx, operation_id: str, state: State, reason: str, actor: str, provider_id: str | None
) -> Operation:
    why = policy.review_decision_text(state, reason, provider_id)
    if provider_id is not None:
        # before the row, as a webhook takes them (`_apply_webhook`)
        await tx.run("lock_provider", provider_id=provider_id)
    before = await must(tx, operation_id, for_update=True)
    if before.state not in lifecycle.REVIEWABLE:
        raise policy.not_in_review(before, "resolved")
    cancel_reason = why if state is State.CANCELLED else None
    last_error = why if state is State.FAILED else None
    may_have_left = state is not State.ACCEPTED  # closed by an operator: it may have been sent
    await tx.run(
        "resolve_review",
        state=state.value,
        provider_id=provider_id,
        cancel_reason=cancel_reason,
        last_error=last_error,
        id=operation_id,
        may_have_left=may_have_left,
    )
    await record_event(tx, operation_id, before.state, state, actor, why)
    if provider_id is not None:
        await apply_parked(tx, await must(tx, operation_id))
    return await must(tx, operation_id)


async def _resend(tx: Tx, operation_id: str, intent: Intent, reason: str, actor: str) -> Operation:
    old = await must(tx, operation_id, for_update=True)
    if old.state not in lifecycle.REVIEWABLE:
        raise policy.not_in_review(old, "resent")
    if await opted_out(tx, intent.recipients, intent.channel):
        raise policy.suppressed_refusal(intent.recipients, intent.channel)
    taken = await _one(tx, "operation_by_key", idempotency_key=intent.idempotency_key)
    if taken is not None:
        raise policy.resend_key_taken(intent.idempotency_key, taken)
    new_id = str(uuid.uuid4())
    texts = policy.resend_texts(old.id, new_id, reason)
    await tx.run("insert_operation", id=new_id, **intent_values(intent), state=State.READY.value)
    await tx.run("insert_operation_recipients", id=new_id)
    await tx.run("link_resend", id=new_id, resend_of=old.id)
    await record_event(tx, new_id, None, State.READY, actor, texts.new_event)
    await tx.run("supersede", cancel_reason=texts.cancel_reason, resent_as=new_id, id=old.id)
    await record_event(tx, old.id, old.state, State.CANCELLED, actor, texts.old_event)
    return await must(tx, new_id)


async def _prune(tx: Tx, older_than_seconds: float) -> PruneReport:
    row = await tx.row("prune_cutoff", older_than_seconds=older_than_seconds)
    assert row is not None
    cutoff = next(iter(row.values()))
    events = await tx.run("prune_events", cutoff=cutoff)
    await tx.run("prune_delivery_events", cutoff=cutoff)
    await tx.run("prune_recipients", cutoff=cutoff)
    operations = await tx.run("prune_operations", cutoff=cutoff)
    await tx.run("prune_send_counts")
    hooks = await tx.run("prune_webhooks", older_than_seconds=max(older_than_seconds, policy.WEBHOOK_DEDUPE_SECONDS))
    return PruneReport(operations=operations, events=events, webhook_deliveries=hooks)
