"""An agent regenerates its retry: hail-guard recognises it by meaning, and no answer leads to a second send.

Each test drives a real MCP client through hail-guard to the sandbox, and counts what the sandbox really
delivered to each recipient (to, cc and bcc alike). The numbers name the cases of the issue that found
them ("A retry is recognised whatever the agent changes").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import anyio

from hail_guard.models import State
from hail_guard.recipients import comparable
from hail_guard.sandbox import Sandbox
from tests.campaigns.test_network_faults import on_first_send, open_rig
from tests.conftest import data, open_harness, text
from tests.tcp_faults import Fault

ADA, BOB = "ada@example.com", "bob@example.com"


def message(**changes: Any) -> dict[str, Any]:
    """One email with no key of its own and no campaign ids: the key is a hash of the request."""
    base: dict[str, Any] = {
        "to": [ADA],
        "subject": "Hello",
        "body_text": "Hi Ada, nice to meet you.",
        "from_": "sales@example.com",
        "recipient_consent": True,
    }
    return {name: value for name, value in {**base, **changes}.items() if value is not ...}


def delivered(sandbox: Sandbox) -> Counter[str]:
    """Messages the sandbox accepted, per recipient (to, cc and bcc alike, however spelt)."""
    count: Counter[str] = Counter()
    for entry in sandbox.outbox:
        request = entry["request"]
        for field in ("to", "cc", "bcc"):
            value = request.get(field) or []
            for recipient in value if isinstance(value, list) else [value]:
                count[comparable(recipient)] += 1
    return count


def view(result: Any) -> dict[str, Any]:
    found: dict[str, Any] = data(result)["hail_guard"]
    return found


FORM_ONLY: dict[str, dict[str, Any]] = {
    "cc null": {"cc": None},
    "cc empty": {"cc": []},
    "body_html null": {"body_html": None},
    "recipient in another case": {"to": ["Ada@Example.com"]},
    "recipient with a display name": {"to": ["Ada Lovelace <ada@example.com>"]},
    "a trailing space in the body": {"body_text": "Hi Ada, nice to meet you. "},
    "whitespace inside the body": {"body_text": "Hi Ada,\n  nice to meet you."},
    "from_ left out (the default sender)": {"from_": ...},
    "metadata added": {"metadata": {"note": "retry"}},
    "consent source added": {"consent_source": "signup form"},
}


async def test_1_a_retry_that_differs_only_in_form_is_answered_from_the_first_send(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message()))
        assert first["state"] == "accepted"
        for what, changes in FORM_ONLY.items():
            retry = await agent.call_tool("send_email", message(**changes))
            assert not retry.is_error, what
            assert (view(retry)["operation_id"], view(retry)["replayed"]) == (first["operation_id"], True), what
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_2_a_changed_recipient_list_is_refused_while_the_first_is_unknown(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept") as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message()))
        assert first["state"] == "unknown"
        wider = await agent.call_tool("send_email", message(to=[ADA, BOB]))
        assert wider.is_error
        assert f"{ADA} already has this message" in text(wider)
        assert "call `reconcile`" in text(wider)
        assert f"to the others alone ({BOB}) is fine" in text(wider)
        assert delivered(harness.sandbox) == {ADA: 1}
        alone = view(await agent.call_tool("send_email", message(to=[BOB])))
        assert alone["state"] == "accepted"
        assert delivered(harness.sandbox) == {ADA: 1, BOB: 1}


async def test_2_a_narrower_recipient_list_after_an_accepted_send_is_refused(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        await agent.call_tool("send_email", message(to=[ADA, BOB]))
        narrower = await agent.call_tool("send_email", message(to=[ADA]))
        assert narrower.is_error
        assert "Everyone this send names already has it" in text(narrower)
        assert delivered(harness.sandbox) == {ADA: 1, BOB: 1}


async def test_2_a_recipient_moved_between_to_and_cc_is_the_same_send(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message(to=[ADA], cc=[BOB])))
        moved = await agent.call_tool("send_email", message(to=[ADA, BOB]))
        assert (view(moved)["operation_id"], view(moved)["replayed"]) == (first["operation_id"], True)
        assert delivered(harness.sandbox) == {ADA: 1, BOB: 1}


async def test_2_a_batch_that_widens_a_direct_send_plans_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        await agent.call_tool("send_email", message())
        planned = await agent.call_tool(
            "plan_batch", {"sends": [{"tool": "send_email", "arguments": message(to=[ADA, BOB])}]}
        )
        assert planned.is_error
        assert f"{ADA} already has this message" in text(planned)
        assert await harness.ledger.list_operations(state=State.READY) == []
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_3_allow_duplicate_is_refused_while_the_first_is_unknown_and_never_suggested(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept") as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message()))
        minted = await agent.call_tool("send_email", message(idempotency_key="my-new-key"))
        assert (view(minted)["operation_id"], view(minted)["state"]) == (first["operation_id"], "unknown")
        for answer in (text(minted), first["next_step"]):
            assert "allow_duplicate" not in answer
            assert "new key" not in answer
        forced = await agent.call_tool("send_email", message(idempotency_key="my-new-key", allow_duplicate=True))
        assert forced.is_error
        assert "a second copy cannot be sent yet" in text(forced)
        assert "call `reconcile`" in text(forced)
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_3_allow_duplicate_is_refused_while_the_first_is_being_sent(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept") as harness, harness.client() as agent:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.call_tool, "send_email", message())
            with anyio.fail_after(5):
                await harness.sandbox.wait_for_outbox(1)  # accepted; its answer held: the operation is `sending`
            forced = await agent.call_tool("send_email", message(idempotency_key="k2", allow_duplicate=True))
        assert forced.is_error
        assert "being sent right now" in text(forced)
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_3_allow_duplicate_sends_a_second_copy_once_the_first_was_accepted(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        await agent.call_tool("send_email", message())
        again = view(await agent.call_tool("send_email", message(idempotency_key="again", allow_duplicate=True)))
        assert (again["state"], again["replayed"]) == ("accepted", False)
        assert delivered(harness.sandbox) == {ADA: 2}


async def test_4_a_changed_message_under_a_used_key_names_the_difference_and_no_way_around_it(tmp_path: Path) -> None:
    ids = {"campaign_id": "spring", "lead_id": "ada", "message_id": "intro"}
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        await agent.call_tool("send_email", message(metadata=ids))
        changed = await agent.call_tool("send_email", message(metadata=ids, subject="Hello again"))
        assert changed.is_error
        assert data(changed)["differing_fields"] == ["subject"]
        assert "accepted by Hail" in text(changed)
        for hint in ("new key", "allow_duplicate", "use a new", "change the"):
            assert hint not in text(changed)
        assert delivered(harness.sandbox) == {ADA: 1}


async def in_review_with_a_message_hail_has(harness: Any, **changes: Any) -> str:
    """An email Hail accepted but answered unreadably, twice: needs_review; returns its operation id."""
    first = view(await harness.call("send_email", message(**changes)))
    assert first["state"] == "unknown"
    [settled] = await harness.proxy.guard.reconcile(first["operation_id"])
    assert settled.state is State.NEEDS_REVIEW
    return str(first["operation_id"])


async def test_5_an_operators_cancel_after_it_may_have_left_says_so_and_still_counts(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:*:malformed") as harness:
        operation_id = await in_review_with_a_message_hail_has(harness)
        await harness.ledger.resolve_review(operation_id, state=State.CANCELLED, reason="the lead left", actor="op")
        again = await harness.call("send_email", message())
        assert "may have been sent" in text(again).lower()
        assert "it was not sent" not in text(again)
        minted = await harness.call("send_email", message(idempotency_key="after-the-cancel"))
        assert (view(minted)["operation_id"], view(minted)["replayed"]) == (operation_id, True)
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_6_reconcile_spends_no_attempt_while_hail_is_unreachable(tmp_path: Path) -> None:
    async with open_rig(tmp_path, on_first_send(Fault("drop", "after"))) as rig:
        with anyio.fail_after(30):
            first = view(await rig.harness.call("send_email", message()))
            assert first["state"] == "unknown"
            await rig.link.cut_link()
            for _ in range(5):
                refused = await rig.harness.call("reconcile", {"operation_id": first["operation_id"]})
                assert refused.is_error
                assert "not reachable" in text(refused)
            operation = await rig.harness.ledger.get(first["operation_id"])
            assert (operation.state, operation.attempts) == (State.UNKNOWN, 1)
            rig.link.restore_link()
            settled = data(await rig.harness.call("reconcile", {"operation_id": first["operation_id"]}))
        assert [op["state"] for op in settled["reconciled"]] == ["accepted"]
        assert delivered(rig.sandbox) == {ADA: 1}


async def test_6_a_replay_cut_off_before_it_left_is_not_counted_as_an_attempt(tmp_path: Path) -> None:
    async with open_rig(tmp_path, on_first_send(Fault("drop", "after"))) as rig:
        with anyio.fail_after(30):
            first = view(await rig.harness.call("send_email", message()))
            await rig.link.cut_link()
            assert (await rig.harness.call("whoami", {})).is_error  # now hail-guard knows Hail is down
            outcome = await rig.guard._replay(await rig.harness.ledger.get(first["operation_id"]))
        assert (outcome.state, outcome.attempted) == (State.UNKNOWN, False)


async def test_7_an_unreadable_success_naming_an_undeclared_argument_is_unknown_not_failed(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:malformed") as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message(sent_at="2026-12-01T09:00:00Z")))
        assert first["state"] == "unknown"
        minted = await agent.call_tool("send_email", message(sent_at="2026-12-01T09:00:00Z", idempotency_key="new"))
        assert view(minted)["operation_id"] == first["operation_id"]
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_8_review_resend_looks_in_hail_first_and_refuses_a_message_it_has(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:*:malformed") as harness:
        operation_id = await in_review_with_a_message_hail_has(harness)
        harness.proxy.expose_review = True
        refused = await harness.call("review_resend", {"operation_id": operation_id, "reason": "no record of it"})
        assert refused.is_error
        assert "Hail has this message (list_emails to ada@example.com" in text(refused)
        assert (await harness.ledger.get(operation_id)).state is State.NEEDS_REVIEW
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_8_review_resend_sends_when_hail_has_no_such_message(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        held = {"to": [BOB], "subject": "Another message", "body_text": "B", "recipient_consent": True}
        await harness.proxy.upstream.call_tool("send_email", {**held, "idempotency_key": "held"})
        conflicted = view(await harness.call("send_email", {**message(), "idempotency_key": "held"}))
        assert conflicted["state"] == "needs_review"  # Hail holds the key for another message
        harness.proxy.expose_review = True
        reason = {"operation_id": conflicted["operation_id"], "reason": "Hail never took it"}
        resent = data(await harness.call("review_resend", reason))
        assert resent["state"] == "accepted"
        assert delivered(harness.sandbox) == {ADA: 1, BOB: 1}


async def test_form_only_retries_hold_on_both_ledgers(tmp_path: Path, ledger_url: str) -> None:
    async with open_harness(tmp_path, ledger_url=ledger_url) as harness, harness.client() as agent:
        first = view(await agent.call_tool("send_email", message(bcc=[BOB])))
        for what, changes in FORM_ONLY.items():
            retry = view(await agent.call_tool("send_email", message(**{"bcc": [BOB], **changes})))
            assert retry["operation_id"] == first["operation_id"], what
        assert delivered(harness.sandbox) == {ADA: 1, BOB: 1}
