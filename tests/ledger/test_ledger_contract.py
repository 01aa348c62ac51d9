"""The ledger contract: every backend must pass these, unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import partial

import anyio
import pytest

from hail_guard import delivery, keys
from hail_guard.errors import BadInput, Held, LeaseLost, NotFound, ProbableDuplicate, RefusedByPolicy, Suppressed
from hail_guard.ledger import Ledger, find_operation
from hail_guard.models import (
    DeliveryObservation,
    DeliveryState,
    Intent,
    Operation,
    Outcome,
    State,
    Suppression,
    Webhook,
    WebhookOutcome,
)
from hail_guard.same_send import Rules


def intent(key: str = "c1:l1:email:intro", body: str = "Hello", to: str = "a@example.com") -> Intent:
    request = keys.canonical_json({"to": [to], "body_text": body, "idempotency_key": key})
    return Intent(
        idempotency_key=key,
        tool="send_email",
        channel="email",
        recipients=(to,),
        request=request,
        request_fingerprint=keys.fingerprint(request),
        content_fingerprint=keys.fingerprint(body),
        campaign_id="c1",
        lead_id="l1",
        message_id="intro",
    )


ACCEPTED = Outcome(state=State.ACCEPTED, reason="ok", provider_id="e-1", result={"id": "e-1", "status": "sent"})


def accepted_outcome(operation_id: str) -> Outcome:
    """The upstream's acceptance of one send, with a message id of its own (one message is one send)."""
    provider_id = f"e-{operation_id}"
    return ACCEPTED.model_copy(update={"provider_id": provider_id, "result": {"id": provider_id, "status": "sent"}})


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


async def test_an_upstream_id_another_operation_holds_sends_the_second_to_review_naming_both(ledger: Ledger) -> None:
    first = (await ledger.begin_send(intent("k1", to="a@example.com"), owner="w1", lease_seconds=60)).operation
    second = (await ledger.begin_send(intent("k2", to="b@example.com"), owner="w1", lease_seconds=60)).operation
    assert (await ledger.record_outcome(first.id, owner="w1", outcome=ACCEPTED, actor="w1")).provider_id == "e-1"
    reviewed = await ledger.record_outcome(second.id, owner="w1", outcome=ACCEPTED, actor="w1")
    assert reviewed.state is State.NEEDS_REVIEW
    assert reviewed.provider_id is None  # the id stays with the operation that had it first
    assert first.id in (reviewed.review_reason or "")
    assert "e-1" in (reviewed.review_reason or "")
    assert reviewed.result == ACCEPTED.result  # what the upstream said is kept for the human
    [event] = [e for e in await ledger.events(second.id) if e.to_state is State.NEEDS_REVIEW]
    assert first.id in event.reason
    assert (await ledger.get(first.id)).state is State.ACCEPTED
    delivered = Webhook(
        delivery_id="d-1",
        signature="s-1",
        event_type="email.delivered",
        provider_id="e-1",
        payload="{}",
        observation=DeliveryObservation(state=DeliveryState.DELIVERED, source="webhook"),
    )
    assert await ledger.record_webhook(delivered) is WebhookOutcome.APPLIED
    assert (await ledger.get(first.id)).delivery_state is DeliveryState.DELIVERED


async def test_a_stale_owner_cannot_overwrite_the_outcome(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=0)).operation
    assert await ledger.expire_leases() == 1
    [claimed] = await ledger.claim_unknown(owner="reconciler", lease_seconds=60)
    with pytest.raises(LeaseLost):
        await ledger.record_outcome(op.id, owner="w1", outcome=accepted_outcome(op.id), actor="w1")
    assert (await ledger.get(op.id)).state is State.UNKNOWN
    settled = await ledger.record_outcome(
        claimed.id, owner="reconciler", outcome=accepted_outcome(claimed.id), actor="reconciler"
    )
    assert settled.state is State.ACCEPTED


async def test_a_terminal_state_is_never_left(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(op.id, owner="w1", outcome=accepted_outcome(op.id), actor="w1")
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
    later = (await ledger.begin_send(intent("k-later", to="b@example.com"), owner="w1", lease_seconds=60)).operation
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


async def test_an_operation_is_found_by_its_id_or_its_key_and_only_a_missing_one_is_missing(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    assert (await find_operation(ledger, op.id)).id == op.id
    assert (await find_operation(ledger, op.idempotency_key)).id == op.id
    with pytest.raises(NotFound, match="no operation has the id or key 'nope'"):
        await find_operation(ledger, "nope")


async def test_the_stored_request_is_the_exact_text_given(ledger: Ledger) -> None:
    given = intent()
    op = (await ledger.begin_send(given, owner="w1", lease_seconds=60)).operation
    assert op.request == given.request
    assert op.arguments()["idempotency_key"] == given.idempotency_key


def batch_intents(n: int, prefix: str = "b") -> list[Intent]:
    return [
        intent(f"{prefix}:{i}", body=f"Hello {i}").model_copy(
            update={"recipients": (f"lead{i}@example.com",), "content_fingerprint": f"{prefix}-content-{i}"}
        )
        for i in range(n)
    ]


async def test_a_batch_is_planned_whole_and_claimed_in_order(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name="spring", intents=batch_intents(5), state=State.READY, actor="op")
    status = await ledger.batch_status("B1")
    assert (status.name, status.counts, status.unresolved) == ("spring", {State.READY: 5}, [])
    claimed = await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1", limit=2)
    assert [op.idempotency_key for op in claimed] == ["b:0", "b:1"]
    assert all(op.state is State.SENDING and op.lease_owner == "w1" and op.attempts == 1 for op in claimed)
    assert (await ledger.batch_status("B1")).counts == {State.READY: 3, State.SENDING: 2}


async def test_one_claim_of_several_takes_one_send_per_recipient_and_per_lead(ledger: Ledger) -> None:
    """The sends one claim takes are not `sending` while it chooses, yet each holds the next to its recipient or
    lead as an unresolved send does."""
    sends = [
        intent("k:0", "Your invoice is attached", to="ada@example.com"),
        intent("k:1", "Meeting moved to Tuesday at nine", to="ada@example.com"),
        intent("k:2", "Welcome aboard, here is your login", to="bob@example.com").model_copy(update={"lead": "L"}),
        intent("k:3", "Quarterly report numbers inside", to="cy@example.com").model_copy(update={"lead": "L"}),
        intent("k:4", "Password reset requested", to="dee@example.com"),
    ]
    await ledger.plan_batch(batch_id="B1", name=None, intents=sends, state=State.READY, actor="op")
    claimed = await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1", limit=10)
    assert [op.idempotency_key for op in claimed] == ["k:0", "k:2", "k:4"]
    assert (await ledger.batch_status("B1")).counts == {State.READY: 2, State.SENDING: 3}


async def test_batches_are_listed_newest_first_with_their_counts(ledger: Ledger) -> None:
    assert await ledger.list_batches() == []
    await ledger.plan_batch(batch_id="B1", name="spring", intents=batch_intents(3), state=State.READY, actor="op")
    await ledger.plan_batch(batch_id="B2", name=None, intents=batch_intents(2, "c"), state=State.PLANNED, actor="op")
    await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1", limit=1)
    listed = await ledger.list_batches()
    assert [(b.batch_id, b.name, b.counts, b.total) for b in listed] == [
        ("B2", None, {State.PLANNED: 2}, 2),
        ("B1", "spring", {State.READY: 2, State.SENDING: 1}, 3),
    ]
    assert listed[0].created_at >= listed[1].created_at
    assert [b.batch_id for b in await ledger.list_batches(limit=1)] == ["B2"]


async def test_a_batch_with_a_known_key_plans_nothing(ledger: Ledger) -> None:
    await ledger.begin_send(intent("b:3", body="Hello 3"), owner="w1", lease_seconds=60)
    with pytest.raises(RefusedByPolicy, match=r"send 4 \(key 'b:3'"):
        await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(5), state=State.READY, actor="op")
    assert await ledger.list_operations(batch_id="B1") == []
    with pytest.raises(NotFound):
        await ledger.batch_status("B1")


async def test_a_batch_refused_part_way_through_its_sends_plans_nothing(ledger: Ledger) -> None:
    def sends_then_a_bad_line() -> Iterator[Intent]:
        yield from batch_intents(1200)  # more than one chunk is staged or written before the refusal
        raise BadInput("line 1201: not valid JSON; nothing was planned")

    with pytest.raises(BadInput, match="line 1201"):
        await ledger.plan_batch(
            batch_id="B1", name=None, intents=sends_then_a_bad_line(), state=State.READY, actor="op"
        )
    assert await ledger.count_by_state() == {}
    with pytest.raises(NotFound):
        await ledger.batch_status("B1")
    assert (
        await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op") == 3
    )


async def test_a_large_batch_is_planned_whole_in_order(ledger: Ledger) -> None:
    planned = await ledger.plan_batch(
        batch_id="B1", name=None, intents=iter(batch_intents(1234)), state=State.READY, actor="op"
    )
    assert planned == 1234
    assert (await ledger.batch_status("B1")).counts == {State.READY: 1234}
    claimed = await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1", limit=3)
    assert [op.idempotency_key for op in claimed] == ["b:0", "b:1", "b:2"]


async def test_planned_operations_wait_for_approval(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.PLANNED, actor="op")
    assert await ledger.claim_ready(owner="w1", lease_seconds=60, limit=10) == []
    assert await ledger.approve_batch("B1", actor="alice") == 3
    assert len(await ledger.claim_ready(owner="w1", lease_seconds=60, limit=10)) == 3
    events = await ledger.events((await ledger.list_operations(batch_id="B1"))[0].id)
    assert [(e.to_state, e.actor) for e in events][:2] == [(State.PLANNED, "op"), (State.READY, "alice")]
    with pytest.raises(NotFound):
        await ledger.approve_batch("nope", actor="alice")


async def test_concurrent_claims_never_take_the_same_operation(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(30), state=State.READY, actor="op")
    taken: list[str] = []

    async def worker(name: str) -> None:
        while claimed := await ledger.claim_ready(owner=name, lease_seconds=60, limit=2):
            taken.extend(op.id for op in claimed)

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(worker, f"w{n}")
    assert len(taken) == len(set(taken)) == 30


async def test_an_opt_out_cancels_unforwarded_sends_and_wins_over_the_claim(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.PLANNED, actor="op")
    await ledger.approve_batch("B1", actor="op")
    stop = Suppression(recipient=" Lead1@Example.com ", channel="email", reason="STOP", source="sms reply")
    cancelled = await ledger.add_suppression(stop, actor="agent")
    assert len(cancelled) == 1
    cancelled_op = await ledger.get(cancelled[0])
    assert (cancelled_op.state, cancelled_op.recipients) == (State.CANCELLED, ["lead1@example.com"])
    assert "STOP" in (cancelled_op.cancel_reason or "")
    claimed = await ledger.claim_ready(owner="w1", lease_seconds=60, limit=10)
    assert sorted(op.recipients[0] for op in claimed) == ["lead0@example.com", "lead2@example.com"]
    assert await ledger.is_suppressed(["LEAD1@example.com"], "email")
    assert not await ledger.is_suppressed(["lead1@example.com"], "sms")
    assert [s.recipient for s in await ledger.list_suppressions()] == ["lead1@example.com"]


async def test_an_opt_out_on_all_channels_refuses_a_new_send(ledger: Ledger) -> None:
    await ledger.add_suppression(Suppression(recipient="a@example.com", reason="r", source="s"), actor="op")
    with pytest.raises(Suppressed, match="opted out"):
        await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
    assert await ledger.find_by_key(intent().idempotency_key) is None
    assert await ledger.remove_suppression("A@example.com", "all")
    assert (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).claimed


async def test_a_batch_to_an_opted_out_recipient_plans_it_cancelled(ledger: Ledger) -> None:
    await ledger.add_suppression(
        Suppression(recipient="lead2@example.com", channel="email", reason="r", source="s"), actor="op"
    )
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
    assert (await ledger.batch_status("B1")).counts == {State.READY: 2, State.CANCELLED: 1}


def to(key: str, *people: str, body: str = "Hello") -> Intent:
    """The same message (`body`) under `key` to `people`."""
    return intent(key, body=body).model_copy(update={"recipients": people})


WINDOW = 3600.0


async def test_a_new_key_for_the_same_message_to_the_same_people_is_answered_from_the_first(ledger: Ledger) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    again = await ledger.begin_send(
        to("k2", "a@example.com"), owner="w2", lease_seconds=60, rules=Rules(window_seconds=WINDOW)
    )
    assert (again.claimed, again.operation.id) == (False, first.id)
    assert await ledger.find_by_key("k2") is None


async def test_the_same_message_to_overlapping_people_is_refused_naming_who_has_it(ledger: Ledger) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    for people in (("a@example.com", "b@example.com"), ("b@example.com", "a@example.com")):
        with pytest.raises(ProbableDuplicate) as refused:
            await ledger.begin_send(to("k2", *people), owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))
        assert refused.value.operation_id == first.id
        assert "a@example.com already has this message" in str(refused.value)
        assert "to the others alone (b@example.com) is fine" in str(refused.value)
    assert await ledger.find_by_key("k2") is None
    other = await ledger.begin_send(
        to("k3", "b@example.com"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW)
    )
    assert other.claimed


async def test_a_subset_of_the_people_is_refused_too(ledger: Ledger) -> None:
    await ledger.begin_send(to("k1", "a@example.com", "b@example.com"), owner="w1", lease_seconds=60)
    with pytest.raises(ProbableDuplicate, match="Everyone this send names already has it"):
        await ledger.begin_send(
            to("k2", "a@example.com"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW)
        )


async def test_another_message_to_the_same_people_is_a_new_send_once_the_first_is_settled(ledger: Ledger) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(first.id, owner="w1", outcome=accepted_outcome(first.id), actor="w1")
    later = to("k2", "a@example.com").model_copy(update={"content_fingerprint": "another message"})
    assert (await ledger.begin_send(later, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))).claimed


async def test_senders_are_compared_only_where_both_sends_give_them(ledger: Ledger) -> None:
    first = await ledger.begin_send(
        to("k1", "a@example.com").model_copy(update={"sender": '{"from_":"sales@example.com"}'}),
        owner="w1",
        lease_seconds=60,
    )
    await ledger.record_outcome(
        first.operation.id, owner="w1", outcome=accepted_outcome(first.operation.id), actor="w1"
    )
    default_sender = await ledger.begin_send(
        to("k2", "a@example.com"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW)
    )
    assert not default_sender.claimed
    other_sender = to("k3", "a@example.com").model_copy(update={"sender": '{"from_":"ceo@example.com"}'})
    assert (
        await ledger.begin_send(other_sender, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))
    ).claimed


@pytest.mark.parametrize("state", [State.SENDING, State.UNKNOWN, State.NEEDS_REVIEW])
async def test_allow_duplicate_is_refused_while_the_first_may_be_in_flight_or_sent_unseen(
    ledger: Ledger, state: State
) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    if state is not State.SENDING:
        outcome = Outcome(state=state, reason="r", review_reason="r" if state is State.NEEDS_REVIEW else None)
        await ledger.record_outcome(first.id, owner="w1", outcome=outcome, actor="w1")
    deliberate = to("k2", "a@example.com").model_copy(update={"allow_duplicate": True})
    with pytest.raises(ProbableDuplicate) as refused:
        await ledger.begin_send(deliberate, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))
    assert refused.value.operation_id == first.id
    assert "new key" not in str(refused.value)
    assert "allow_duplicate: true" not in str(refused.value)
    assert await ledger.find_by_key("k2") is None


async def test_allow_duplicate_sends_a_second_copy_of_an_accepted_message(ledger: Ledger) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(first.id, owner="w1", outcome=accepted_outcome(first.id), actor="w1")
    deliberate = to("k2", "a@example.com").model_copy(update={"allow_duplicate": True})
    assert (
        await ledger.begin_send(deliberate, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))
    ).claimed


async def test_a_ready_operation_repeated_under_another_key_is_claimed_and_sent_under_its_own(ledger: Ledger) -> None:
    [planned] = [i.model_copy(update={"content_fingerprint": "hello"}) for i in batch_intents(1)]
    await ledger.plan_batch(batch_id="B1", name=None, intents=[planned], state=State.READY, actor="op")
    again = planned.model_copy(update={"idempotency_key": "direct"})
    begin = await ledger.begin_send(again, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))
    assert begin.claimed
    assert (begin.operation.idempotency_key, begin.operation.state) == (planned.idempotency_key, State.SENDING)
    assert await ledger.find_by_key("direct") is None


@pytest.mark.parametrize("decision", [State.CANCELLED, State.FAILED])
async def test_an_operators_close_after_it_may_have_left_still_counts_as_sent(ledger: Ledger, decision: State) -> None:
    first = (await ledger.begin_send(to("k1", "a@example.com"), owner="w1", lease_seconds=60)).operation
    review = Outcome(state=State.NEEDS_REVIEW, reason="unclear", review_reason="unclear")
    await ledger.record_outcome(first.id, owner="w1", outcome=review, actor="w1")
    closed = await ledger.resolve_review(first.id, state=decision, reason="the lead left", actor="op")
    assert closed.may_have_left
    again = await ledger.begin_send(
        to("k2", "a@example.com"), owner="w2", lease_seconds=60, rules=Rules(window_seconds=WINDOW)
    )
    assert (again.claimed, again.operation.id) == (False, first.id)


async def test_a_send_cancelled_before_it_left_does_not_count(ledger: Ledger) -> None:
    [planned] = [i.model_copy(update={"content_fingerprint": "hello"}) for i in batch_intents(1)]
    await ledger.plan_batch(batch_id="B1", name=None, intents=[planned], state=State.READY, actor="op")
    stop = Suppression(recipient=planned.recipients[0], channel="email", reason="STOP", source="s")
    [cancelled] = await ledger.add_suppression(stop, actor="op")
    assert not (await ledger.get(cancelled)).may_have_left
    await ledger.remove_suppression(planned.recipients[0], "email")
    again = planned.model_copy(update={"idempotency_key": "again"})
    assert (await ledger.begin_send(again, owner="w1", lease_seconds=60, rules=Rules(window_seconds=WINDOW))).claimed


async def test_a_batch_repeating_a_live_message_plans_nothing(ledger: Ledger) -> None:
    await ledger.begin_send(
        to("k1", "lead1@example.com", body="Hello 1").model_copy(update={"content_fingerprint": "b-content-1"}),
        owner="w1",
        lease_seconds=60,
    )
    with pytest.raises(ProbableDuplicate, match=r"^send 2: lead1@example.com already has this message"):
        await ledger.plan_batch(
            batch_id="B1",
            name=None,
            intents=batch_intents(3),
            state=State.READY,
            actor="op",
            rules=Rules(window_seconds=WINDOW),
        )
    assert await ledger.list_operations(batch_id="B1") == []


async def test_a_batch_overlapping_a_live_message_plans_nothing(ledger: Ledger) -> None:
    await ledger.begin_send(
        to("k1", "lead1@example.com").model_copy(update={"content_fingerprint": "b-content-1"}),
        owner="w1",
        lease_seconds=60,
    )
    sends = batch_intents(3)
    sends[1] = sends[1].model_copy(update={"recipients": ("lead1@example.com", "x@example.com")})
    with pytest.raises(
        ProbableDuplicate,
        match=r"^send 2: .*Leave send 2 out of the batch, or give it only the others \(x@example.com\)\.$",
    ):
        await ledger.plan_batch(
            batch_id="B1", name=None, intents=sends, state=State.READY, actor="op", rules=Rules(window_seconds=WINDOW)
        )
    assert await ledger.list_operations(batch_id="B1") == []


async def test_the_same_key_again_is_not_a_duplicate_of_itself(ledger: Ledger) -> None:
    await ledger.begin_send(intent("k1"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=3600))
    again = await ledger.begin_send(intent("k1"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=3600))
    assert not again.claimed


async def test_failed_content_may_be_sent_again_under_a_new_key(ledger: Ledger) -> None:
    op = (await ledger.begin_send(intent("k1"), owner="w1", lease_seconds=60)).operation
    await ledger.record_outcome(op.id, owner="w1", outcome=Outcome(state=State.FAILED, reason="402"), actor="w1")
    assert (
        await ledger.begin_send(intent("k2"), owner="w1", lease_seconds=60, rules=Rules(window_seconds=3600))
    ).claimed


async def test_counts_by_state(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
    await ledger.claim_ready(owner="w1", lease_seconds=60)
    assert await ledger.count_by_state() == {State.READY: 2, State.SENDING: 1}


async def test_an_opt_out_wins_whatever_the_letter_case(ledger: Ledger) -> None:
    """Recipients are compared as `normalise_recipient` writes them, Unicode case included."""
    stop = Suppression(recipient="ÉLODIE@example.com", reason="STOP", source="sms reply")
    [send] = [i.model_copy(update={"recipients": ("\tÉlodie@Example.com ",)}) for i in batch_intents(1)]
    await ledger.plan_batch(batch_id="B0", name=None, intents=[send], state=State.READY, actor="op")
    await ledger.add_suppression(stop, actor="op")
    assert await ledger.claim_ready(owner="w1", lease_seconds=60, limit=5) == []
    assert (await ledger.batch_status("B0")).counts == {State.CANCELLED: 1}


async def test_tools_seen_first_are_accepted_and_changes_are_kept_until_accepted(ledger: Ledger) -> None:
    pins = await ledger.observe_tools({"send_email": "f1", "whoami": "w1"})
    assert [(p.name, p.changed) for p in pins] == [("send_email", False), ("whoami", False)]
    pins = await ledger.observe_tools({"send_email": "f2", "whoami": "w1"})
    assert [(p.name, p.changed) for p in pins] == [("send_email", True), ("whoami", False)]
    assert pins[0].changed_at is not None
    assert await ledger.accept_tools(["whoami"]) == []
    assert await ledger.accept_tools() == ["send_email"]
    assert not any(p.changed for p in await ledger.tool_pins())


async def test_the_oldest_operation_in_a_state(ledger: Ledger) -> None:
    assert await ledger.oldest(State.SENDING) is None
    first = (await ledger.begin_send(intent("k1"), owner="w1", lease_seconds=60)).operation
    await ledger.begin_send(intent("k2", body="other", to="b@example.com"), owner="w1", lease_seconds=60)
    oldest = await ledger.oldest(State.SENDING)
    assert oldest is not None
    assert oldest.id == first.id


# Delivery, webhooks, review decisions and pruning (issue 6).


def observed(state: DeliveryState, at: datetime | None = None, source: str = "webhook") -> DeliveryObservation:
    return DeliveryObservation(state=state, occurred_at=at, source=source)


async def accepted(ledger: Ledger, key: str = "c1:l1:email:intro", provider_id: str = "e-1") -> Operation:
    op = (await ledger.begin_send(intent(key, body=key), owner="w1", lease_seconds=60)).operation
    outcome = ACCEPTED.model_copy(update={"provider_id": provider_id, "result": {"id": provider_id}})
    return await ledger.record_outcome(op.id, owner="w1", outcome=outcome, actor="w1")


async def in_review(ledger: Ledger, key: str = "c1:l1:email:intro") -> Operation:
    op = (await ledger.begin_send(intent(key, body=key), owner="w1", lease_seconds=60)).operation
    unclear = Outcome(state=State.NEEDS_REVIEW, reason="still unclear", review_reason="still unclear")
    return await ledger.record_outcome(op.id, owner="w1", outcome=unclear, actor="w1")


def webhook(delivery_id: str, event: str, provider_id: str | None, **changes: object) -> Webhook:
    state = delivery.EVENT_TYPES.get(event)
    base: dict[str, object] = {
        "delivery_id": delivery_id,
        "signature": f"sig-{delivery_id}",
        "event_type": event,
        "provider_id": provider_id,
        "payload": "{}",
        "observation": observed(state) if state is not None else None,
    }
    return Webhook.model_validate({**base, **changes})


async def test_delivery_moves_only_forward_and_never_changes_the_state(ledger: Ledger) -> None:
    op = await accepted(ledger)
    bounced_at = datetime(2030, 1, 1, 9, 0, 5, tzinfo=UTC)
    after = await ledger.record_delivery(op.id, [observed(DeliveryState.BOUNCED, bounced_at)])
    assert (after.state, after.delivery_state, after.delivery_at) == (State.ACCEPTED, DeliveryState.BOUNCED, bounced_at)
    late = await ledger.record_delivery(op.id, [observed(DeliveryState.DELIVERED), observed(DeliveryState.BOUNCED)])
    assert (late.state, late.delivery_state, late.delivery_at) == (State.ACCEPTED, DeliveryState.BOUNCED, bounced_at)
    events = await ledger.delivery_events(op.id)
    assert [(e.state, e.occurred_at) for e in events] == [
        (DeliveryState.BOUNCED, bounced_at),
        (DeliveryState.DELIVERED, None),
    ]
    assert [e.to_state for e in await ledger.events(op.id)] == [State.SENDING, State.ACCEPTED]


async def test_email_events_in_any_order_end_in_the_furthest_state(ledger: Ledger) -> None:
    op = await accepted(ledger)
    for state in (DeliveryState.DELIVERED, DeliveryState.DELIVERY_DELAYED, DeliveryState.OPENED):
        await ledger.record_delivery(op.id, [observed(state)])
    await ledger.record_delivery(op.id, [observed(DeliveryState.DELIVERED)])
    final = await ledger.get(op.id)
    assert final.delivery_state is DeliveryState.OPENED
    assert final.delivery_at is not None
    assert sorted(e.state for e in await ledger.delivery_events(op.id)) == sorted(
        [DeliveryState.DELIVERED, DeliveryState.DELIVERY_DELAYED, DeliveryState.OPENED]
    )


async def test_delivery_checks_are_held_for_one_tracker_backed_off_and_stop_when_settled(ledger: Ledger) -> None:
    first = await accepted(ledger, "k1", "e-1")
    second = await accepted(ledger, "k2", "e-2")
    await in_review(ledger, "k3")
    claim = partial(ledger.claim_delivery_checks, max_age_seconds=3600.0)
    assert [op.id for op in await claim(channels=["email"], hold_seconds=60.0)] == [first.id, second.id]
    assert await claim(channels=["email"], hold_seconds=60.0) == []
    assert await claim(channels=["sms"], hold_seconds=0.0) == []
    checked = await ledger.record_delivery(first.id, [], next_check_seconds=0.0)
    assert checked.delivery_checks == 1
    await ledger.record_delivery(second.id, [observed(DeliveryState.DELIVERED, source="poll")], next_check_seconds=0.0)
    assert [op.id for op in await claim(channels=["email"], hold_seconds=60.0)] == [first.id]
    await ledger.record_delivery(first.id, [], next_check_seconds=3600.0)
    assert await claim(channels=["email"], hold_seconds=60.0) == []


async def test_delivery_checks_stop_at_the_maximum_age(ledger: Ledger) -> None:
    await accepted(ledger)
    assert await ledger.claim_delivery_checks(channels=["email"], max_age_seconds=0.0, hold_seconds=60.0) == []


async def test_a_webhook_applies_once_and_a_replayed_signature_changes_nothing(ledger: Ledger) -> None:
    op = await accepted(ledger)
    assert await ledger.record_webhook(webhook("d1", "email.delivered", "e-1")) is WebhookOutcome.APPLIED
    assert (await ledger.get(op.id)).delivery_state is DeliveryState.DELIVERED
    retry = webhook("d1", "email.delivered", "e-1", signature="sig-d1-retry")
    assert await ledger.record_webhook(retry) is WebhookOutcome.DUPLICATE
    replay = webhook("d9", "email.bounced", "e-1", signature="sig-d1")
    assert await ledger.record_webhook(replay) is WebhookOutcome.REPLAYED
    assert (await ledger.get(op.id)).delivery_state is DeliveryState.DELIVERED
    assert [e.state for e in await ledger.delivery_events(op.id)] == [DeliveryState.DELIVERED]


async def test_a_webhook_for_an_id_no_operation_has_is_kept_and_an_unknown_type_ignored(ledger: Ledger) -> None:
    op = await accepted(ledger)
    assert await ledger.record_webhook(webhook("d1", "email.bounced", "e-404")) is WebhookOutcome.PARKED
    assert await ledger.record_webhook(webhook("d1", "email.bounced", "e-404", signature="s2")) is (
        WebhookOutcome.DUPLICATE
    )
    assert await ledger.record_webhook(webhook("d2", "email.clicked", "e-1")) is WebhookOutcome.IGNORED
    assert (await ledger.get(op.id)).delivery_state is None


async def test_an_opt_out_by_webhook_suppresses_the_sender_and_cancels_pending_sms(ledger: Ledger) -> None:
    sms = [
        i.model_copy(update={"channel": "sms", "tool": "send_sms", "recipients": ("+14155550100",)})
        for i in batch_intents(1)
    ]
    await ledger.plan_batch(batch_id="B1", name=None, intents=sms, state=State.READY, actor="op")
    stop = Suppression(recipient="+14155550100", channel="sms", reason='replied "STOP"', source="hail sms.received")
    assert await ledger.record_webhook(webhook("d1", "sms.received", None, opt_out=stop)) is WebhookOutcome.OPTED_OUT
    assert (await ledger.batch_status("B1")).counts == {State.CANCELLED: 1}
    assert await ledger.is_suppressed(["+14155550100"], "sms")
    assert await ledger.record_webhook(webhook("d1", "sms.received", None, opt_out=stop, signature="s2")) is (
        WebhookOutcome.DUPLICATE
    )


async def test_a_review_decision_is_recorded_with_who_and_why(ledger: Ledger) -> None:
    op = await in_review(ledger)
    resolved = await ledger.resolve_review(
        op.id, state=State.ACCEPTED, reason="found it in Hail's console", actor="alice", provider_id="e-7"
    )
    assert (resolved.state, resolved.provider_id) == (State.ACCEPTED, "e-7")
    last = (await ledger.events(op.id))[-1]
    assert (last.from_state, last.to_state, last.actor) == (State.NEEDS_REVIEW, State.ACCEPTED, "alice")
    assert last.reason == "review: resolved as accepted (provider id e-7): found it in Hail's console"
    cancelled = await ledger.resolve_review(
        (await in_review(ledger, "k2")).id, state=State.CANCELLED, reason="lead left", actor="bob"
    )
    assert (cancelled.state, cancelled.cancel_reason) == (State.CANCELLED, "review: resolved as cancelled: lead left")


async def test_resolving_an_operation_that_is_not_in_review_is_refused(ledger: Ledger) -> None:
    op = await accepted(ledger)
    with pytest.raises(RefusedByPolicy, match="is accepted, not in review"):
        await ledger.resolve_review(op.id, state=State.FAILED, reason="oops", actor="alice")
    with pytest.raises(BadInput, match="resolved as one of"):
        await ledger.resolve_review((await in_review(ledger, "k2")).id, state=State.READY, reason="x", actor="a")
    with pytest.raises(NotFound):
        await ledger.resolve_review("missing", state=State.FAILED, reason="x", actor="a")
    assert (await ledger.get(op.id)).state is State.ACCEPTED
    assert [e.to_state for e in await ledger.events(op.id)] == [State.SENDING, State.ACCEPTED]


def resend_of(op: Operation) -> Intent:
    key = keys.resend_key(op.idempotency_key)
    request = keys.canonical_json({**op.arguments(), "idempotency_key": key})
    return intent(key, body=op.idempotency_key).model_copy(
        update={"request": request, "request_fingerprint": keys.fingerprint(request)}
    )


async def test_a_resend_supersedes_the_review_with_a_new_linked_operation(ledger: Ledger) -> None:
    old = await in_review(ledger)
    new = await ledger.resend(old.id, resend_of(old), reason="Hail has no trace of it", actor="alice")
    assert (new.state, new.idempotency_key, new.resend_of) == (State.READY, "c1:l1:email:intro:resend:1", old.id)
    superseded = await ledger.get(old.id)
    assert (superseded.state, superseded.resent_as) == (State.CANCELLED, new.id)
    assert f"superseded by resend {new.id}" in (superseded.cancel_reason or "")
    old_last, [new_first] = (await ledger.events(old.id))[-1], await ledger.events(new.id)
    assert (old_last.actor, old_last.to_state, new_first.actor, new_first.to_state) == (
        "alice",
        State.CANCELLED,
        "alice",
        State.READY,
    )
    assert "Hail has no trace of it" in old_last.reason
    assert "Hail has no trace of it" in new_first.reason
    with pytest.raises(RefusedByPolicy, match="not in review"):
        await ledger.resend(old.id, resend_of(old), reason="again", actor="alice")


async def test_a_resend_to_a_recipient_who_opted_out_is_refused_and_the_review_stays(ledger: Ledger) -> None:
    old = await in_review(ledger)
    await ledger.add_suppression(Suppression(recipient="a@example.com", reason="r", source="s"), actor="op")
    with pytest.raises(Suppressed):
        await ledger.resend(old.id, resend_of(old), reason="resend", actor="alice")
    assert (await ledger.get(old.id)).state is State.NEEDS_REVIEW
    assert await ledger.find_by_key(resend_of(old).idempotency_key) is None


async def test_prune_removes_old_resolved_operations_with_their_events_and_nothing_unresolved(ledger: Ledger) -> None:
    done = await accepted(ledger, "k1", "e-1")
    await ledger.record_delivery(done.id, [observed(DeliveryState.DELIVERED)])
    review = await in_review(ledger, "k2")
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(2), state=State.PLANNED, actor="op")
    unknown = (
        await ledger.begin_send(intent("k3", body="k3", to="b@example.com"), owner="w1", lease_seconds=60)
    ).operation
    await ledger.record_outcome(unknown.id, owner="w1", outcome=LOST, actor="w1")
    assert (await ledger.prune(older_than_seconds=3600.0)).operations == 0
    report = await ledger.prune(older_than_seconds=1e-3)
    assert (report.operations, report.events) == (1, 2)
    with pytest.raises(NotFound):
        await ledger.get(done.id)
    assert await ledger.events(done.id) == []
    assert await ledger.delivery_events(done.id) == []
    assert (await ledger.get(review.id)).state is State.NEEDS_REVIEW
    assert await ledger.count_by_state() == {State.NEEDS_REVIEW: 1, State.PLANNED: 2, State.UNKNOWN: 1}
    with pytest.raises(BadInput, match="positive age"):
        await ledger.prune(older_than_seconds=0.0)


async def test_listing_by_recipient_and_time_and_page_after_page(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(5), state=State.READY, actor="op")
    [lead3] = await ledger.list_operations(recipient=" LEAD3@example.com")
    assert lead3.recipients == ["lead3@example.com"]
    now = await ledger.now()
    assert len(await ledger.list_operations(since=now - timedelta(hours=1))) == 5
    assert await ledger.list_operations(since=now + timedelta(hours=1)) == []
    pages, before = [], None
    while page := await ledger.list_operations(batch_id="B1", before=before, limit=2):
        pages.append([op.idempotency_key for op in page])
        before = page[-1].id
    assert pages == [["b:4", "b:3"], ["b:2", "b:1"], ["b:0"]]


async def test_concurrent_deliveries_of_one_webhook_apply_it_once(ledger: Ledger) -> None:
    op = await accepted(ledger)
    outcomes: list[WebhookOutcome] = []

    async def deliver(attempt: int) -> None:
        outcomes.append(await ledger.record_webhook(webhook("d1", "email.delivered", "e-1", signature=f"s{attempt}")))

    async with anyio.create_task_group() as tg:
        for attempt in range(8):
            tg.start_soon(deliver, attempt)
    assert sorted(outcomes) == sorted([WebhookOutcome.APPLIED] + [WebhookOutcome.DUPLICATE] * 7)
    assert [e.state for e in await ledger.delivery_events(op.id)] == [DeliveryState.DELIVERED]


async def test_concurrent_delivery_facts_settle_on_the_furthest_one(ledger: Ledger) -> None:
    op = await accepted(ledger)
    states = [DeliveryState.OPENED, DeliveryState.DELIVERY_DELAYED, DeliveryState.BOUNCED, DeliveryState.DELIVERED]

    async with anyio.create_task_group() as tg:
        for state in states * 3:
            tg.start_soon(ledger.record_delivery, op.id, [observed(state)])
    assert (await ledger.get(op.id)).delivery_state is DeliveryState.BOUNCED
    assert sorted(e.state for e in await ledger.delivery_events(op.id)) == sorted(states)


# --- What the operator console reads -----------------------------------------------------------------------------


async def test_sends_by_hour_count_what_left_in_each_hour_by_state_and_delivery(ledger: Ledger) -> None:
    op = await accepted(ledger)
    await ledger.record_delivery(op.id, [observed(DeliveryState.BOUNCED)])
    await ledger.begin_send(intent("c1:l2:email:intro", body="other"), owner="w1", lease_seconds=60)
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(2), state=State.READY, actor="op")
    hour = (await ledger.now()).replace(minute=0, second=0, microsecond=0)
    [counted] = await ledger.sends_by_hour(hour - timedelta(hours=3))
    assert (counted.start, counted.sent) == (hour, 2)  # the ready ones have not left
    assert counted.states == {State.ACCEPTED: 1, State.SENDING: 1}
    assert counted.deliveries == {DeliveryState.BOUNCED: 1}
    assert await ledger.sends_by_hour(hour + timedelta(hours=1)) == []


async def test_counts_of_the_states_asked_for(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
    await in_review(ledger, "k-review")
    wanted = [State.READY, State.NEEDS_REVIEW, State.UNKNOWN]
    assert await ledger.count_states(wanted) == {State.READY: 3, State.NEEDS_REVIEW: 1}
    assert await ledger.count_states([]) == {}


async def test_a_search_combines_filters_and_pages_newest_first_or_by_key(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(5), state=State.READY, actor="op")
    await ledger.plan_batch(batch_id="B2", name=None, intents=batch_intents(3, "x"), state=State.PLANNED, actor="op")
    assert [op.idempotency_key for op in await ledger.search_operations(limit=3)] == ["x:2", "x:1", "x:0"]
    assert [op.idempotency_key for op in await ledger.search_operations(state=State.READY, batch_id="B1")] == [
        "b:4",
        "b:3",
        "b:2",
        "b:1",
        "b:0",
    ]
    assert await ledger.search_operations(state=State.PLANNED, batch_id="B1") == []
    [lead3] = await ledger.search_operations(recipient=" LEAD3@Example.com", batch_id="B1")
    assert lead3.idempotency_key == "b:3"
    pages, after = [], None
    while page := await ledger.search_operations(key_prefix="b:", after=after, limit=2):
        pages.append([op.idempotency_key for op in page])
        after = page[-1].id
    assert pages == [["b:0", "b:1"], ["b:2", "b:3"], ["b:4"]]
    pages, after = [], None
    while page := await ledger.search_operations(state=State.PLANNED, after=after, limit=2):
        pages.append([op.idempotency_key for op in page])
        after = page[-1].id
    assert pages == [["x:2", "x:1"], ["x:0"]]
    now = await ledger.now()
    assert await ledger.search_operations(since=now + timedelta(hours=1)) == []
    assert await ledger.search_operations(key_prefix="b:%") == []  # a prefix, never a pattern
    with pytest.raises(NotFound):
        await ledger.search_operations(after="no-such-operation")


async def test_batches_are_listed_a_page_at_a_time(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name="first", intents=batch_intents(3), state=State.READY, actor="ada")
    await ledger.plan_batch(batch_id="B2", name=None, intents=batch_intents(2, "x"), state=State.PLANNED, actor="bo")
    [first] = await ledger.list_batches(limit=1)
    [second] = await ledger.list_batches(after=first.batch_id, limit=1)
    assert (first.batch_id, second.batch_id, second.counts) == ("B2", "B1", {State.READY: 3})
    assert await ledger.list_batches(after="B1") == []


async def test_cancelling_a_batch_cancels_only_what_was_not_sent_and_needs_a_reason(ledger: Ledger) -> None:
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
    [sending] = await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1")
    with pytest.raises(BadInput, match="needs a reason"):
        await ledger.cancel_batch("B1", reason=" ", actor="ada")
    cancelled = await ledger.cancel_batch("B1", reason="wrong list", actor="ada")
    assert len(cancelled) == 2
    assert sending.id not in cancelled
    status = await ledger.batch_status("B1")
    assert status.counts == {State.SENDING: 1, State.CANCELLED: 2}
    [event] = [e for e in await ledger.events(cancelled[0]) if e.to_state is State.CANCELLED]
    assert (event.from_state, event.actor) == (State.READY, "ada")
    assert "wrong list" in event.reason
    assert not (await ledger.get(cancelled[0])).may_have_left
    with pytest.raises(NotFound):
        await ledger.cancel_batch("B9", reason="x", actor="ada")


async def test_opt_outs_are_searched_by_prefix_page_by_page(ledger: Ledger) -> None:
    for name in ("ada", "adam", "bo", "Ada+news"):
        await ledger.add_suppression(
            Suppression(recipient=f"{name}@example.com", channel="email", reason="stop", source="t"), actor="op"
        )
    await ledger.add_suppression(Suppression(recipient="ada@example.com", reason="all", source="t"), actor="op")
    found = [(s.recipient, s.channel) for s in await ledger.search_suppressions(prefix="ADA")]
    assert found == [  # an opt-out of a sub-address is one of its mailbox (ada+news@ is ada@)
        ("ada@example.com", "all"),
        ("ada@example.com", "email"),
        ("adam@example.com", "email"),
    ]
    page = await ledger.search_suppressions(after=("ada@example.com", "email"), limit=2)
    assert [s.recipient for s in page] == ["adam@example.com", "bo@example.com"]


async def test_what_an_opt_out_cancelled_includes_sub_addresses_and_not_other_closes(ledger: Ledger) -> None:
    sends = [to("k1", "ada@example.com"), to("k2", "ada+news@example.com", body="News"), to("k3", "adam@example.com")]
    await ledger.plan_batch(batch_id="B1", name=None, intents=sends, state=State.READY, actor="op")
    review = await in_review(ledger, "k4")
    await ledger.resolve_review(review.id, state=State.CANCELLED, reason="lead left", actor="op")
    opt_out = Suppression(recipient="ada@example.com", channel="email", reason="replied STOP", source="t")
    cancelled = await ledger.add_suppression(opt_out, actor="op")
    shown = await ledger.opt_out_cancellations("ADA@example.com", "email")
    assert sorted(op.id for op in shown) == sorted(cancelled)
    assert sorted(op.idempotency_key for op in shown) == ["k1", "k2"]
    assert await ledger.opt_out_cancellations("bo@example.com", "email") == []


async def test_tool_definitions_are_kept_by_fingerprint(ledger: Ledger) -> None:
    await ledger.remember_tool_definitions({"fp1": '{"name":"send_email"}', "fp2": '{"name":"send_sms"}'})
    await ledger.remember_tool_definitions({"fp1": '{"name":"changed?"}'})  # a fingerprint names one text
    assert await ledger.tool_definitions(["fp1", "fp3"]) == {"fp1": '{"name":"send_email"}'}
    assert await ledger.tool_definitions([]) == {}


# The same send by intent: holds, at once (hail_guard.same_send).


async def test_of_many_different_messages_to_one_recipient_at_once_exactly_one_is_recorded(ledger: Ledger) -> None:
    """A recipient with a send in flight is held: concurrent sends to them never both go (PostgreSQL: the
    recipient's advisory lock; SQLite: the one writer)."""
    claimed, held = [], []

    async def send(n: int) -> None:
        try:
            begin = await ledger.begin_send(intent(f"k{n}", body=f"message {n}"), owner=f"w{n}", lease_seconds=60)
        except Held:
            held.append(n)
        else:
            claimed.append(begin.claimed)

    async with anyio.create_task_group() as tg:
        for n in range(8):
            tg.start_soon(send, n)
    assert (claimed, len(held)) == ([True], 7)


async def test_claims_never_take_two_sends_to_one_recipient_at_once(ledger: Ledger) -> None:
    sends = [
        intent(f"b:{n}", body=f"message {n}").model_copy(update={"content_fingerprint": f"m{n}"}) for n in range(4)
    ]
    await ledger.plan_batch(batch_id="B1", name=None, intents=sends, state=State.READY, actor="op")
    taken: list[Operation] = []

    async def worker(name: str) -> None:
        taken.extend(await ledger.claim_ready(owner=name, lease_seconds=60, batch_id="B1", limit=2))

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(worker, f"w{n}")
    assert [op.idempotency_key for op in taken] == ["b:0"]
    status = await ledger.batch_status("B1")
    assert [(held.operation.idempotency_key, held.held_by.id) for held in status.held] == [
        ("b:1", taken[0].id),
        ("b:2", taken[0].id),
        ("b:3", taken[0].id),
    ]
    await ledger.record_outcome(taken[0].id, owner=taken[0].lease_owner or "", outcome=ACCEPTED, actor="w")
    [second] = await ledger.claim_ready(owner="w", lease_seconds=60, batch_id="B1", limit=5)
    assert second.idempotency_key == "b:1"


async def test_a_lead_held_on_one_channel_is_held_on_another_unless_leads_are_not_held(ledger: Ledger) -> None:
    email = intent("e1").model_copy(update={"lead": '["c1","l1"]'})
    await ledger.begin_send(email, owner="w", lease_seconds=60)
    sms = intent("s1", to="+14155550100").model_copy(
        update={"channel": "sms", "tool": "send_sms", "lead": '["c1","l1"]'}
    )
    with pytest.raises(Held, match="the same lead has an unsettled email send"):
        await ledger.begin_send(sms, owner="w", lease_seconds=60)
    assert (await ledger.begin_send(sms, owner="w", lease_seconds=60, rules=Rules(hold_lead=False))).claimed
