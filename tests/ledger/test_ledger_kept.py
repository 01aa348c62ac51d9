"""The ledger contract, continued, on every backend: what the ledger keeps beside the operations.

Webhooks that arrive before their message's id is known (an `unknown` send whose answer was lost) are
kept and applied in the transaction that records the id; the console's sign-ins, by a hash of their
id; and the heartbeats of whoever is sending.
"""

from __future__ import annotations

import hashlib

import anyio
import pytest

from hail_guard.ledger import Heartbeat, Ledger, core
from hail_guard.models import DeliveryState, Operation, Outcome, State, WebhookOutcome
from tests.ledger.test_ledger_contract import ACCEPTED, LOST, in_review, intent, webhook


async def lost(ledger: Ledger, key: str = "k1") -> Operation:
    """A send whose answer was lost: `unknown`, no provider id."""
    op = (await ledger.begin_send(intent(key, body=key), owner="w1", lease_seconds=60)).operation
    return await ledger.record_outcome(op.id, owner="w1", outcome=LOST, actor="w1")


async def settled(ledger: Ledger, op: Operation, provider_id: str) -> Operation:
    """Reconcile's claim and outcome: Hail had it, under `provider_id`."""
    [claimed] = await ledger.claim_unknown(owner="r1", lease_seconds=60, operation_id=op.id)
    found = ACCEPTED.model_copy(update={"provider_id": provider_id, "result": {"id": provider_id}})
    return await ledger.record_outcome(claimed.id, owner="r1", outcome=found, actor="r1")


async def test_webhooks_before_the_message_id_is_known_are_applied_when_reconcile_records_it(ledger: Ledger) -> None:
    op = await lost(ledger)
    assert await ledger.record_webhook(webhook("d1", "email.delivered", "e-9")) is WebhookOutcome.PARKED
    assert await ledger.record_webhook(webhook("d2", "email.bounced", "e-9")) is WebhookOutcome.PARKED
    retried = webhook("d1", "email.delivered", "e-9", signature="sig-d1-again")
    assert await ledger.record_webhook(retried) is WebhookOutcome.DUPLICATE
    assert (await ledger.get(op.id)).delivery_state is None
    accepted = await settled(ledger, op, "e-9")
    assert (accepted.state, accepted.delivery_state) == (State.ACCEPTED, DeliveryState.BOUNCED)
    events = await ledger.delivery_events(op.id)
    assert [(e.state, e.source, e.detail) for e in events] == [
        (DeliveryState.DELIVERED, "webhook", "d1"),
        (DeliveryState.BOUNCED, "webhook", "d2"),
    ]
    later = await ledger.record_webhook(webhook("d3", "email.opened", "e-9"))  # once the id is known: at once
    assert later is WebhookOutcome.APPLIED
    assert len(await ledger.delivery_events(op.id)) == 3


async def test_a_webhook_before_a_review_decision_names_the_id_is_applied_by_the_decision(ledger: Ledger) -> None:
    op = await in_review(ledger)
    assert await ledger.record_webhook(webhook("d1", "email.complained", "e-7")) is WebhookOutcome.PARKED
    resolved = await ledger.resolve_review(
        op.id, state=State.ACCEPTED, reason="found it in Hail's console", actor="alice", provider_id="e-7"
    )
    assert (resolved.provider_id, resolved.delivery_state) == ("e-7", DeliveryState.COMPLAINED)
    other = await in_review(ledger, "k2")
    await ledger.resolve_review(other.id, state=State.FAILED, reason="refused", actor="alice")
    assert (await ledger.get(other.id)).delivery_state is None


async def test_webhooks_kept_waiting_are_bounded_in_number_and_expire(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "PARKED_WEBHOOKS_MAX", 2)
    outcomes = [await ledger.record_webhook(webhook(f"d{n}", "email.delivered", f"e-{n}")) for n in range(3)]
    assert outcomes == [WebhookOutcome.PARKED, WebhookOutcome.PARKED, WebhookOutcome.UNKNOWN_OPERATION]
    assert await ledger.record_webhook(webhook("d9", "email.clicked", "e-0")) is WebhookOutcome.IGNORED
    monkeypatch.setattr(core, "PARKED_WEBHOOK_SECONDS", 0.0)  # everything kept so far is now too old
    assert (await settled(ledger, await lost(ledger), "e-0")).delivery_state is None
    assert await ledger.record_webhook(webhook("d3", "email.delivered", "e-3")) is WebhookOutcome.PARKED  # room again


async def test_a_webhook_and_the_outcome_that_records_its_id_at_the_same_moment_always_meet(ledger: Ledger) -> None:
    for n in range(12):
        op = await lost(ledger, f"k{n}")
        async with anyio.create_task_group() as tg:
            tg.start_soon(ledger.record_webhook, webhook(f"d{n}", "email.delivered", f"e-{n}"))
            tg.start_soon(settled, ledger, op, f"e-{n}")
        assert (await ledger.get(op.id)).delivery_state is DeliveryState.DELIVERED, n


async def test_a_console_session_is_kept_by_a_hash_until_it_ends_or_expires(ledger: Ledger) -> None:
    digest = hashlib.sha256(b"the session id").hexdigest()
    assert await ledger.find_session(digest) is None
    await ledger.start_session(digest, name="Ada", seconds=3600)
    found = await ledger.find_session(digest)
    assert found is not None
    assert found.name == "Ada"
    assert 3590 < (found.expires_at - found.created_at).total_seconds() <= 3600
    await ledger.end_session(digest)
    assert await ledger.find_session(digest) is None
    await ledger.start_session("expired", name="Bo", seconds=-1)
    assert await ledger.find_session("expired") is None
    await ledger.start_session(digest, name="Ada", seconds=60)  # the expired one is cleared on the way
    assert await ledger.find_session(digest) is not None


async def test_a_heartbeat_keeps_its_start_moves_its_last_beat_and_goes_when_it_ends(ledger: Ledger) -> None:
    assert await ledger.heartbeats() == []
    worker = Heartbeat("beat-1", "host-a:101", "worker")
    run = Heartbeat("beat-2", "host-b:202", "batch run", batch_id="B1")
    await ledger.record_heartbeat(worker)
    await ledger.record_heartbeat(run)
    first = {beat.id: beat for beat in await ledger.heartbeats()}
    await ledger.record_heartbeat(worker)
    [again, same_run] = await ledger.heartbeats()
    assert (again.who, again.role, again.batch_id, again.started_at) == (
        "host-a:101",
        "worker",
        None,
        first["beat-1"].started_at,
    )
    before = first["beat-1"].seen_at
    assert again.seen_at is not None
    assert before is not None
    assert again.seen_at >= before
    assert (same_run.role, same_run.batch_id) == ("batch run", "B1")
    await ledger.end_heartbeat("beat-1")
    assert [beat.id for beat in await ledger.heartbeats()] == ["beat-2"]


async def test_an_outcome_with_no_new_id_leaves_webhooks_kept_for_others_alone(ledger: Ledger) -> None:
    assert await ledger.record_webhook(webhook("d1", "email.delivered", "e-other")) is WebhookOutcome.PARKED
    op = await lost(ledger)
    [claimed] = await ledger.claim_unknown(owner="r1", lease_seconds=60, operation_id=op.id)
    refused = Outcome(state=State.FAILED, reason="refused", error="consent")
    assert (await ledger.record_outcome(claimed.id, owner="r1", outcome=refused, actor="r1")).delivery_state is None
    assert (await settled(ledger, await lost(ledger, "k2"), "e-other")).delivery_state is DeliveryState.DELIVERED
