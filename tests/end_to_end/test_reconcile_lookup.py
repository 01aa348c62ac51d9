"""Reconcile and `review resend` read a send back by the upstream's own id, for real, through the guard.

An `unknown` send whose id hail-guard knows is never replayed: reconcile asks Hail for that message (the
profile's `lookup`, Hail's `get_email`) and records what Hail has; a resend is refused while Hail has the
message. The ledger's own calls make the operation `unknown` with an id (as it records an answer that carried
one); everything after that is the agent's and the operator's tools against the sandbox.
"""

from __future__ import annotations

from pathlib import Path

from hail_guard.models import Operation, Outcome, State
from tests.conftest import Harness, data, email, open_harness, text

OWNER = "worker-1"


async def unknown_with_id(harness: Harness, provider_id: str | None = None) -> Operation:
    """An `unknown` send of `email()` whose upstream id is known: `provider_id`, else the id of the message the
    sandbox accepted for it (Hail has it)."""
    guard = harness.proxy.guard
    intent, _ = guard.prepare("send_email", email(), harness.proxy.tools["send_email"].input_schema)
    begin = await harness.ledger.begin_send(intent, owner=OWNER, lease_seconds=60.0, rules=guard.rules)
    if provider_id is None:
        await harness.sandbox.invoke("send_email", begin.operation.arguments())
        provider_id = harness.sandbox.outbox[-1]["id"]
    outcome = Outcome(
        state=State.UNKNOWN, reason="the answer was lost after Hail named the message", provider_id=provider_id
    )
    return await harness.ledger.record_outcome(begin.operation.id, owner=OWNER, outcome=outcome, actor=OWNER)


async def test_reconcile_looks_an_unknown_send_up_by_its_id_and_records_it_accepted_without_a_replay(
    tmp_path: Path,
) -> None:
    async with open_harness(tmp_path) as harness:
        operation = await unknown_with_id(harness)
        settled = await harness.call("reconcile", {"operation_id": operation.id})
        assert not settled.is_error, text(settled)
        after = await harness.ledger.get(operation.id)
        assert after.state is State.ACCEPTED
        assert after.provider_id == operation.provider_id
        assert after.result is not None
        assert after.result["id"] == operation.provider_id
        assert after.result["subject"] == "Hello"
        assert (await harness.ledger.events(operation.id))[-1].reason == "get_email found the message"
        assert harness.sandbox.calls("get_email") == 1
        assert harness.sandbox.calls("send_email") == 1  # the first send only: nothing was replayed
        assert len(harness.sandbox.outbox) == 1


async def test_reconcile_of_an_id_hail_does_not_have_sends_it_to_review_and_sends_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        operation = await unknown_with_id(harness, provider_id="email-hail-never-made")
        await harness.call("reconcile", {})
        after = await harness.ledger.get(operation.id)
        assert after.state is State.NEEDS_REVIEW
        assert after.review_reason == "get_email did not find email-hail-never-made"
        assert harness.sandbox.calls("get_email") == 1
        assert harness.sandbox.calls("send_email") == 0


async def test_a_look_up_that_gets_no_answer_leaves_the_send_unknown_and_sends_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "get_email:1:error_after_accept:502") as harness:
        operation = await unknown_with_id(harness)
        await harness.call("reconcile", {"operation_id": operation.id})
        after = await harness.ledger.get(operation.id)
        assert after.state is State.UNKNOWN
        assert (await harness.ledger.events(operation.id))[-1].reason == "the lookup got no answer"
        assert "hail upstream error: 502" in (after.last_error or "")
        assert after.next_check_at is not None
        assert after.next_check_at > after.updated_at  # looked up again later, not in a loop
        assert harness.sandbox.calls("send_email") == 1


async def test_review_resend_is_refused_while_a_look_up_by_id_finds_the_message(tmp_path: Path) -> None:
    """Hail's read lagged at reconcile (404), so the send went to review; by the time an operator resends, Hail
    shows it: the resend is refused naming it, and nothing is sent."""
    async with open_harness(tmp_path, "get_email:1:fail_before_accept:404") as harness:
        harness.proxy.expose_review = True
        operation = await unknown_with_id(harness)
        await harness.call("reconcile", {"operation_id": operation.id})
        assert (await harness.ledger.get(operation.id)).state is State.NEEDS_REVIEW
        refused = await harness.call("review_resend", {"operation_id": operation.id, "reason": "lead asked again"})
        assert refused.is_error
        assert f"Hail has this message (get_email {operation.provider_id} found {operation.provider_id}" in text(
            refused
        )
        assert "nothing was resent" in text(refused)
        assert harness.sandbox.calls("get_email") == 2
        assert harness.sandbox.calls("send_email") == 1
        assert (await harness.ledger.get(operation.id)).state is State.NEEDS_REVIEW


async def test_review_resend_sends_a_new_operation_when_a_look_up_by_id_finds_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        harness.proxy.expose_review = True
        operation = await unknown_with_id(harness, provider_id="email-hail-never-made")
        await harness.call("reconcile", {"operation_id": operation.id})
        resent = await harness.call("review_resend", {"operation_id": operation.id, "reason": "Hail has nothing"})
        assert not resent.is_error, text(resent)
        assert harness.sandbox.calls("get_email") == 2  # reconcile's look-up, then the resend's
        [line] = harness.sandbox.outbox
        assert line["idempotency_key"] == f"{operation.idempotency_key}:resend:1"
        old = await harness.ledger.get(operation.id)
        assert old.state is State.CANCELLED
        assert old.resent_as == data(resent)["operation_id"]
