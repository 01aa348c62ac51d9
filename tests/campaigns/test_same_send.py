"""The same send by intent: a campaign plans, and a paraphrase, a channel switch or a second ledger never sends twice.

Each test drives a real MCP client through hail-guard to the sandbox (a fake Hail that keys sends as Hail does)
and counts what the sandbox accepted for each recipient. The numbers name the cases of the issue that found them
("The same send by intent"); each failed on the code before it.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hail_guard import lifecycle, same_send
from hail_guard.cli import main
from hail_guard.models import State
from hail_guard.recipients import normalise_recipient
from hail_guard.sandbox import Sandbox
from tests.conftest import data, open_harness, text
from tests.end_to_end.test_retries import ADA, BOB, delivered, message
from tests.postgres import PostgresServer

OFFER = {"subject": "Our spring offer", "body_text": "Hello! Here is our spring offer: 20% off every plan until May."}
"""The seed's campaign: one template for every lead."""
CAMPAIGN_LEADS = 100
DROPPED_AFTER = 40


def lead(n: int) -> str:
    return f"lead{n:03d}@example.com"


def campaign_send(n: int, **metadata: Any) -> dict[str, Any]:
    """One lead's send of the campaign: the same subject and body as every other lead's."""
    ids = {"campaign_id": "spring", "lead_id": f"lead{n:03d}", "message_id": "offer", **metadata}
    arguments = {"to": [lead(n)], **OFFER, "recipient_consent": True, "metadata": ids}
    return {"tool": "send_email", "arguments": arguments}


def view(result: Any) -> dict[str, Any]:
    found: dict[str, Any] = data(result)["hail_guard"]
    return found


# --- 1. a campaign plans -----------------------------------------------------------------------------------


async def test_the_seeds_campaign_of_one_template_plans_runs_drops_after_the_40th_and_resumes_each_lead_once(
    tmp_path: Path, ledger_url: str
) -> None:
    """It was refused whole: "send 1 and send 2 have the same content"."""
    fault = f"send_email:{DROPPED_AFTER}:drop_after_accept"
    async with open_harness(tmp_path, fault, ledger_url=ledger_url) as harness, harness.client() as agent:
        sends = [campaign_send(n) for n in range(CAMPAIGN_LEADS)]
        planned = data(await agent.call_tool("plan_batch", {"sends": sends, "name": "spring"}))
        assert planned["counts"] == {"ready": CAMPAIGN_LEADS}
        first = data(await agent.call_tool("run_batch", {"batch_id": planned["batch_id"]}))
        # the dropped link loses the 40th answer (and any other in flight on it): unknown, never sent again
        assert first["counts"]["unknown"] >= 1
        assert first["counts"]["accepted"] + first["counts"]["unknown"] == CAMPAIGN_LEADS
        resumed = data(await agent.call_tool("run_batch", {"batch_id": planned["batch_id"]}))
        assert resumed["counts"] == {"accepted": CAMPAIGN_LEADS}
        assert delivered(harness.sandbox) == Counter({lead(n): 1 for n in range(CAMPAIGN_LEADS)})


async def test_a_campaign_of_one_text_under_the_callers_own_keys_plans(tmp_path: Path) -> None:
    sends = [campaign_send(n) for n in range(3)]
    for n, send in enumerate(sends):
        send["arguments"]["idempotency_key"] = f"spring-{n}"
    async with open_harness(tmp_path) as harness:
        planned = data(await harness.call("plan_batch", {"sends": sends}))
        assert planned["counts"] == {"ready": 3}


def test_batch_plan_on_the_command_line_plans_a_campaign_of_one_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hail-guard.toml"
    config.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[delivery]\npoll = false\n')
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(config))
    leads = tmp_path / "leads.jsonl"
    leads.write_text("".join(json.dumps(campaign_send(n)) + "\n" for n in range(5)))
    assert main(["batch", "plan", str(leads)]) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"ready": 5}


async def test_the_same_message_twice_to_one_lead_in_a_batch_is_refused_naming_both(tmp_path: Path) -> None:
    again = campaign_send(1, message_id="offer-again")  # its own key: the same message to the same lead
    async with open_harness(tmp_path) as harness:
        refused = await harness.call("plan_batch", {"sends": [campaign_send(0), campaign_send(1), again]})
        assert refused.is_error
        assert f"send 2 and send 3 have the same message for {lead(1)}" in text(refused)
        assert await harness.ledger.list_batches() == []


# --- 2. a reworded retry, 3. a channel switch: held while the first is unresolved -----------------------

REWORDED = {
    "the body reworded": {"body_text": "Hi Ada, nice to meet you today."},
    "the subject with Re:": {"subject": "Re: Hello"},
    "a typo fixed": {"body_text": "Hi Ada, nice to meet you!"},
}


@pytest.mark.parametrize("change", sorted(REWORDED))
async def test_a_reworded_retry_of_an_unknown_send_is_held_then_refused_as_a_near_duplicate(
    tmp_path: Path, change: str
) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        async with harness.client() as agent:
            first = view(await agent.call_tool("send_email", message()))
            assert first["state"] == "unknown"
            held = await agent.call_tool("send_email", message(**REWORDED[change]))
            assert held.is_error
            assert "not settled" not in text(held)  # the word is "unsettled", and the operation is named
            assert f"operation {first['operation_id']} is unknown" in text(held)
            assert f"operation_id={first['operation_id']}" in text(held)  # reconcile it
            assert harness.sandbox.calls("send_email") == 1
            settled = data(await agent.call_tool("reconcile", {"operation_id": first["operation_id"]}))
            assert settled["reconciled"][0]["state"] == "accepted"
            again = await agent.call_tool("send_email", message(**REWORDED[change]))
            assert again.is_error
            assert "probably a duplicate" in text(again)
            assert first["operation_id"] in text(again)
        assert delivered(harness.sandbox) == {ADA: 1}


async def test_a_new_message_to_a_recipient_goes_once_their_last_send_settled(tmp_path: Path) -> None:
    """Held is not refused for ever: another message (not near the same) goes once the first is settled."""
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        assert view(await agent.call_tool("send_email", message()))["state"] == "accepted"
        later = message(subject="Your invoice", body_text="Invoice 2026-0042 is attached; due in 30 days.")
        assert view(await agent.call_tool("send_email", later))["state"] == "accepted"
        assert delivered(harness.sandbox) == {ADA: 2}


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("send_sms", {"to": "+14155550123", "body": "Hi Ada, it's Sam from Acme."}),
        ("place_call", {"to": "+14155550123", "system_prompt": "Introduce Acme to Ada, politely."}),
    ],
)
async def test_a_channel_switch_to_the_same_lead_is_held_while_the_email_is_unknown(
    tmp_path: Path, tool: str, arguments: dict[str, Any]
) -> None:
    lead_ids = {"campaign_id": "spring", "lead_id": "ada"}
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        async with harness.client() as agent:
            email = view(await agent.call_tool("send_email", message(metadata=lead_ids)))
            assert email["state"] == "unknown"
            switched = {**arguments, "recipient_consent": True, "metadata": {**lead_ids, "message_id": "hello"}}
            held = await agent.call_tool(tool, switched)
            assert held.is_error
            assert "the same lead has an unsettled email send" in text(held)
            assert harness.sandbox.calls(tool) == 0
            await agent.call_tool("reconcile", {"operation_id": email["operation_id"]})
            assert not (await agent.call_tool(tool, switched)).is_error  # settled: the other channel goes
        assert harness.sandbox.calls(tool) == 1


async def test_with_hold_lead_across_channels_off_an_sms_to_the_same_lead_goes(tmp_path: Path) -> None:
    lead_ids = {"campaign_id": "spring", "lead_id": "ada"}
    sms = {"to": "+14155550123", "body": "Hi Ada", "recipient_consent": True, "metadata": lead_ids}
    async with open_harness(
        tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5, hold_lead_across_channels=False
    ) as harness:
        assert view(await harness.call("send_email", message(metadata=lead_ids)))["state"] == "unknown"
        assert not (await harness.call("send_sms", sms)).is_error
        assert harness.sandbox.calls("send_sms") == 1


async def test_allow_duplicate_never_passes_a_hold(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        assert view(await harness.call("send_email", message()))["state"] == "unknown"
        other = message(subject="Something else entirely", body_text="A different message.", allow_duplicate=True)
        held = await harness.call("send_email", other)
        assert held.is_error
        assert "unsettled" in text(held)
        assert harness.sandbox.calls("send_email") == 1


async def test_a_campaign_of_personalised_texts_is_never_compared_across_leads(tmp_path: Path) -> None:
    """Greetings that differ by a name are near the same text, but to different people: all go."""
    async with open_harness(tmp_path) as harness, harness.client() as agent:
        for name in ("Ada", "Bob", "Cy"):
            greeting = message(to=[f"{name.lower()}@example.com"], body_text=f"Hi {name}, nice to meet you.")
            assert view(await agent.call_tool("send_email", greeting))["state"] == "accepted"
        assert len(harness.sandbox.outbox) == 3


async def test_a_planned_send_to_a_held_recipient_waits_ready_and_the_rest_of_the_campaign_goes(
    tmp_path: Path,
) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        async with harness.client() as agent:
            direct = view(await agent.call_tool("send_email", message(to=[lead(1)])))
            assert direct["state"] == "unknown"
            planned = data(await agent.call_tool("plan_batch", {"sends": [campaign_send(n) for n in range(3)]}))
            run = data(await agent.call_tool("run_batch", {"batch_id": planned["batch_id"]}))
            assert run["counts"] == {"accepted": 2, "ready": 1}
            [held] = run["held"]
            assert (held["recipients"], held["held_by"]) == ([lead(1)], direct["operation_id"])
            assert "wait while another send to the same recipient" in run["next_step"]
            await agent.call_tool("reconcile", {"operation_id": direct["operation_id"]})
            after = data(await agent.call_tool("run_batch", {"batch_id": planned["batch_id"]}))
            assert (after["counts"], after["held"]) == ({"accepted": 3}, [])
        assert delivered(harness.sandbox) == Counter({lead(0): 1, lead(1): 2, lead(2): 1})  # two messages to lead 1


# --- 4. a second ledger ---------------------------------------------------------------------------------

REGENERATED: dict[str, dict[str, Any]] = {
    "a null added": {"cc": None},
    "a trailing space": {"body_text": "Hi Ada, nice to meet you. "},
    "the recipient re-cased": {"to": ["ADA@Example.com"]},
}


@pytest.mark.parametrize("form", sorted(REGENERATED))
async def test_a_second_ledger_derives_the_same_key_for_a_regenerated_retry(tmp_path: Path, form: str) -> None:
    """Two hail-guards with separate ledgers in front of one Hail: Hail's own key stops the second copy."""
    sandbox = Sandbox()
    async with (
        open_harness(tmp_path / "laptop", sandbox=sandbox) as laptop,
        open_harness(tmp_path / "container", sandbox=sandbox) as container,
    ):
        first = view(await laptop.call("send_email", message()))
        assert first["state"] == "accepted"
        second = view(await container.call("send_email", message(**REGENERATED[form])))
        assert second["idempotency_key"] == first["idempotency_key"]
        assert second["state"] in ("accepted", "needs_review")  # Hail's saved answer, or its 409 for other bytes
        assert delivered(sandbox) == {ADA: 1}


async def test_a_ledger_restored_from_an_old_backup_finds_the_legacy_key_of_a_send(tmp_path: Path) -> None:
    """A send recorded under the key an earlier version derived from its bytes (`hg:`) is found by a retry now."""
    async with open_harness(tmp_path) as harness:
        first = view(await harness.call("send_email", message()))
        schema = harness.proxy.tools["send_email"].input_schema
        old_key = harness.proxy.guard.prepare("send_email", message(), schema)[0].legacy_key
    assert old_key is not None
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as db, db:  # the row as an earlier version wrote it
        db.execute("UPDATE operations SET idempotency_key = ? WHERE id = ?", (old_key, first["operation_id"]))
    async with open_harness(tmp_path) as harness:
        retry = view(await harness.call("send_email", message(bcc=[])))
        assert (retry["operation_id"], retry["idempotency_key"]) == (first["operation_id"], old_key)
        assert retry["replayed"] is True
        assert harness.sandbox.calls("send_email") == 0


# --- 5. the window ------------------------------------------------------------------------------------------


async def test_a_window_of_0_still_answers_and_holds_for_an_unknown_send(tmp_path: Path) -> None:
    async with open_harness(
        tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5, duplicate_window_hours=0.0
    ) as harness:
        first = view(await harness.call("send_email", message()))
        assert first["state"] == "unknown"
        minted = view(await harness.call("send_email", message(idempotency_key="agent-made-up-1")))
        assert (minted["operation_id"], minted["replayed"]) == (first["operation_id"], True)
        assert (await harness.call("send_email", message(body_text="Hi Ada, great to meet you."))).is_error
        assert harness.sandbox.calls("send_email") == 1


async def test_a_window_of_0_compares_no_settled_send(tmp_path: Path) -> None:
    async with open_harness(tmp_path, duplicate_window_hours=0.0) as harness:
        assert view(await harness.call("send_email", message()))["state"] == "accepted"
        again = view(await harness.call("send_email", message(idempotency_key="a-second-copy-on-purpose")))
        assert (again["state"], again["replayed"]) == ("accepted", False)
        assert delivered(harness.sandbox) == {ADA: 2}


# --- 6. recipients --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    [
        "ａｄａ@ｅｘａｍｐｌｅ．ｃｏｍ",
        "ada@example。com",
        '"ada"@example.com',
        "ADA@EXAMPLE.COM.",
        "ada+news@example.com",
    ],
)
async def test_every_spelling_of_a_recipient_is_held_and_opted_out_alike(tmp_path: Path, spelling: str) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        assert view(await harness.call("send_email", message()))["state"] == "unknown"
        held = await harness.call("send_email", message(to=[spelling], subject="Other", body_text="Other text."))
        assert held.is_error
        assert "unsettled" in text(held)
        await harness.call("record_opt_out", {"recipient": spelling, "channel": "email", "reason": "STOP"})
        stopped = await harness.call("send_email", message(to=[BOB], cc=["ada@example.com"], subject="Another"))
        assert "opted out of email" in text(stopped)
        assert harness.sandbox.calls("send_email") == 1


def test_sharp_s_and_ss_stay_two_domains() -> None:
    assert normalise_recipient("ada@straße.de", "email") == "ada@straße.de"
    assert normalise_recipient("ADA@STRASSE.DE", "email") == "ada@strasse.de"


async def test_a_send_to_straße_is_not_answered_by_one_to_strasse(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        assert view(await harness.call("send_email", message(to=["ada@strasse.de"])))["state"] == "accepted"
        other = view(await harness.call("send_email", message(to=["ada@straße.de"])))
        assert (other["state"], other["replayed"]) == ("accepted", False)


# --- 7. the ledger before the schema ----------------------------------------------------------------------


async def test_a_retry_whose_new_form_breaks_the_schema_is_answered_from_the_ledger(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        first = view(await harness.call("send_email", message()))
        assert first["state"] == "unknown"
        # message_type: null breaks the schema (an enum of texts), as cc: null breaks resend-mcp's
        retry = await harness.call("send_email", message(message_type=None, subject=" Hello "))
        assert (view(retry)["operation_id"], view(retry)["replayed"]) == (first["operation_id"], True)
        assert "reconcile" in text(retry)
        assert "invalid arguments" not in text(retry)


async def test_a_new_send_that_breaks_the_schema_is_still_refused_and_nothing_is_recorded(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        refused = await harness.call("send_email", message(message_type=None))
        assert "invalid arguments for send_email: message_type" in text(refused)
        assert await harness.ledger.list_operations() == []


# --- 8. one upstream id, one operation: tests/ledger/test_ledger_contract.py ----------------------------------------


def test_the_states_the_rules_compare_are_carved_from_the_lifecycle() -> None:
    """Holding, waiting and settled are parts of `lifecycle.LIVE`: a new state must be placed in one of them."""
    assert same_send.HOLDING == lifecycle.UNRESOLVED
    assert same_send.HOLDING | same_send.WAITING | same_send.SETTLED_LIVE == lifecycle.LIVE
    assert not same_send.HOLDING & same_send.WAITING
    assert not same_send.WAITING & same_send.SETTLED_LIVE
    assert {State.ACCEPTED} == same_send.SETTLED_LIVE


# --- campaigns, generated -------------------------------------------------------------------------------------

NAMES = ("Ada", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kit", "Lu")


@st.composite
def _campaigns(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[str]]:
    """A campaign (one text for all, or each lead greeted by name) and the faults Hail shows while it runs."""
    leads = draw(st.integers(min_value=1, max_value=len(NAMES)))
    personal = draw(st.booleans())
    sends = []
    for n in range(leads):
        body = f"Hi {NAMES[n]}, here is our spring offer." if personal else OFFER["body_text"]
        send = campaign_send(n)
        send["arguments"]["body_text"] = body
        if draw(st.booleans()):
            del send["arguments"]["metadata"]["message_id"]  # keyed by its meaning instead
        sends.append(send)
    faults = draw(
        st.lists(
            st.sampled_from(
                ["drop_after_accept", "hang_after_accept", "error_after_accept:502", "fail_before_accept:429:0"]
            ),
            max_size=3,
        )
    )
    at = draw(st.lists(st.integers(min_value=1, max_value=leads), min_size=len(faults), max_size=len(faults)))
    return sends, [f"send_email:{n}:{fault}" for n, fault in zip(at, faults, strict=True)]


async def _each_lead_once(folder: Path, sends: list[dict[str, Any]], faults: list[str], url: str | None) -> None:
    async with open_harness(folder, *faults, ledger_url=url, timeout_seconds=0.3) as harness:
        async with harness.client() as agent:
            planned = data(await agent.call_tool("plan_batch", {"sends": sends}))
            assert planned["counts"] == {"ready": len(sends)}  # a campaign always plans
            for _ in range(4):  # resumed until every send is settled (a 429 waits a moment: `not_before`)
                run = data(await agent.call_tool("run_batch", {"batch_id": planned["batch_id"]}))
                if run["counts"] == {"accepted": len(sends)}:
                    break
        assert run["counts"] == {"accepted": len(sends)}, (faults, run)
        assert delivered(harness.sandbox) == Counter({lead(n): 1 for n in range(len(sends))}), faults


_CAMPAIGN_EXAMPLES = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_CAMPAIGN_EXAMPLES
@given(_campaigns())
def test_any_campaign_reaches_each_lead_exactly_once_on_sqlite(
    tmp_path_factory: pytest.TempPathFactory, campaign: tuple[list[dict[str, Any]], list[str]]
) -> None:
    anyio.run(_each_lead_once, tmp_path_factory.mktemp("campaign"), *campaign, None)


@_CAMPAIGN_EXAMPLES
@given(_campaigns())
def test_any_campaign_reaches_each_lead_exactly_once_on_postgresql(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    campaign: tuple[list[dict[str, Any]], list[str]],
) -> None:
    async def check() -> None:
        async with postgres_server.database() as url:
            await _each_lead_once(tmp_path_factory.mktemp("campaign"), *campaign, url)

    anyio.run(check)
