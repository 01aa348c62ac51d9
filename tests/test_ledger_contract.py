"""The ledger contract: every backend must pass these, unchanged."""

from __future__ import annotations

import anyio
import pytest

from hail_guard import keys
from hail_guard.errors import LeaseLost, NotFound
from hail_guard.ledger import Ledger
from hail_guard.models import Intent, Outcome, State


def intent(key: str = "c1:l1:email:intro", body: str = "Hello") -> Intent:
    request = keys.canonical_json({"to": ["a@example.com"], "body_text": body, "idempotency_key": key})
    return Intent(
        idempotency_key=key,
        tool="send_email",
        channel="email",
        recipients=("a@example.com",),
        request=request,
        request_fingerprint=keys.fingerprint(request),
        content_fingerprint=keys.fingerprint(body),
        campaign_id="c1",
        lead_id="l1",
        message_id="intro",
    )


ACCEPTED = Outcome(state=State.ACCEPTED, reason="ok", provider_id="e-1", result={"id": "e-1", "status": "sent"})
LOST = Outcome(state=State.UNKNOWN, reason="timeout", error="no answer", check_after_seconds=0.0)


async def test_a_new_intent_is_committed_as_sending_under_a_lease(ledger: Ledger) -> None:
    begin = await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
    assert begin.claimed
    op = begin.operation
    assert (op.state, op.attempts, op.lease_owner, op.campaign_id) == (State.SENDING, 1, "w1", "c1")
    assert op.lease_expires_at is not None
    assert op.lease_expires_at > await ledger.now()
    assert [(e.from_state, e.to_state) for e in await ledger.events(op.id)] == [(None, State.SENDING)]


async def test_the_same_key_is_never_claimed_twice(ledger: Ledger) -> None:
    first = await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
    second = await ledger.begin_send(intent(), owner="w2", lease_seconds=60)
    assert not second.claimed
    assert second.operation.id == first.operation.id


async def test_concurrent_begins_on_one_key_claim_exactly_once(ledger: Ledger) -> None:
    results = []

    async def begin(owner: str) -> None:
        results.append(await ledger.begin_send(intent(), owner=owner, lease_seconds=60))

    async with anyio.create_task_group() as tg:
        for n in range(10):
            tg.start_soon(begin, f"w{n}")
    assert sum(r.claimed for r in results) == 1
    assert len({r.operation.id for r in results}) == 1


async def test_a_different_request_under_the_key_is_returned_unclaimed_for_the_caller_to_refuse(
    ledger: Ledger,
) -> None:
    await ledger.begin_send(intent(body="Hello"), owner="w1", lease_seconds=60)
    again = await ledger.begin_send(intent(body="Changed"), owner="w2", lease_seconds=60)
    assert not again.claimed
    assert again.operation.request_fingerprint == intent(body="Hello").request_fingerprint


async def test_the_outcome_is_recorded_with_its_event(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    recorded = await ledger.record_outcome(op.id, owner="w1", outcome=ACCEPTED, actor="w1")
    assert (recorded.state, recorded.provider_id, recorded.result) == (State.ACCEPTED, "e-1", ACCEPTED.result)
    assert recorded.lease_expires_at is None
    events = await ledger.events(op.id)
    assert [(e.to_state, e.reason) for e in events][-1] == (State.ACCEPTED, "ok")


async def test_a_stale_owner_cannot_overwrite_the_outcome(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=0)).operation
    assert await ledger.expire_leases() == 1
    [claimed] = await ledger.claim_unknown(owner="reconciler", lease_seconds=60)
    with pytest.raises(LeaseLost):
        await ledger.record_outcome(op.id, owner="w1", outcome=ACCEPTED, actor="w1")
    assert (await ledger.get(op.id)).state is State.UNKNOWN
    settled = await ledger.record_outcome(claimed.id, owner="reconciler", outcome=ACCEPTED, actor="reconciler")
    assert settled.state is State.ACCEPTED


async def test_a_terminal_state_is_never_left(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(op.id, owner="w1", outcome=ACCEPTED, actor="w1")
    with pytest.raises(LeaseLost):
        await ledger.record_outcome(op.id, owner="w1", outcome=LOST, actor="w1")
    assert (await ledger.get(op.id)).state is State.ACCEPTED


async def test_an_expired_sending_lease_becomes_unknown_never_ready(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=0)).operation
    again = await ledger.begin_send(intent(), owner="w2", lease_seconds=60)
    assert not again.claimed
    assert again.operation.state is State.UNKNOWN
    events = await ledger.events(op.id)
    assert (events[-1].from_state, events[-1].to_state) == (State.SENDING, State.UNKNOWN)


async def test_a_live_lease_is_not_expired(ledger: Ledger) -> None:
    await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
    assert await ledger.expire_leases() == 0


async def test_a_ready_operation_with_the_same_request_is_claimed_again(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    rate_limited = Outcome(state=State.READY, reason="429", error="rate", not_before_seconds=0.0)
    await ledger.record_outcome(op.id, owner="w1", outcome=rate_limited, actor="w1")
    again = await ledger.begin_send(intent(), owner="w2", lease_seconds=60)
    assert again.claimed
    assert (again.operation.state, again.operation.attempts, again.operation.lease_owner) == (State.SENDING, 2, "w2")


async def test_a_ready_operation_is_not_claimed_before_its_not_before(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    rate_limited = Outcome(state=State.READY, reason="429", error="rate", not_before_seconds=3600.0)
    await ledger.record_outcome(op.id, owner="w1", outcome=rate_limited, actor="w1")
    again = await ledger.begin_send(intent(), owner="w2", lease_seconds=60)
    assert not again.claimed
    assert again.operation.state is State.READY
    assert again.operation.not_before is not None
    assert again.operation.not_before > await ledger.now()


async def test_claim_unknown_takes_only_due_operations_and_only_once(ledger: Ledger) -> None:
    due = (await ledger.begin_send(intent("k-due"), owner="w1", lease_seconds=60)).operation
    later = (await ledger.begin_send(intent("k-later"), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(due.id, owner="w1", outcome=LOST, actor="w1")
    await ledger.record_outcome(
        later.id, owner="w1", outcome=LOST.model_copy(update={"check_after_seconds": 3600.0}), actor="w1"
    )
    first = await ledger.claim_unknown(owner="r1", lease_seconds=60)
    second = await ledger.claim_unknown(owner="r2", lease_seconds=60)
    assert [op.id for op in first] == [due.id]
    assert second == []
    assert first[0].attempts == 2


async def test_claim_unknown_by_id_ignores_the_schedule(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(
        op.id, owner="w1", outcome=LOST.model_copy(update={"check_after_seconds": 3600.0}), actor="w1"
    )
    [claimed] = await ledger.claim_unknown(owner="r1", lease_seconds=60, operation_id=op.id)
    assert claimed.lease_owner == "r1"


async def test_lookups_by_id_key_state_and_campaign(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    assert (await ledger.get(op.id)).idempotency_key == op.idempotency_key
    assert (await ledger.find_by_key(op.idempotency_key)) == await ledger.get(op.id)
    assert await ledger.find_by_key("nope") is None
    assert [o.id for o in await ledger.list_operations(state=State.SENDING)] == [op.id]
    assert await ledger.list_operations(state=State.ACCEPTED) == []
    assert [o.id for o in await ledger.list_operations(campaign_id="c1")] == [op.id]
    with pytest.raises(NotFound):
        await ledger.get("missing")


async def test_the_stored_request_is_the_exact_text_given(ledger: Ledger) -> None:
    given = intent()
    op = (await ledger.begin_send(given, owner="w1", lease_seconds=60)).operation
    assert op.request == given.request
    assert op.arguments()["idempotency_key"] == given.idempotency_key
