"""What the console's pages say beside the operations: who is sending (and plainly when nobody is), which tools
are guarded and by which profile, a reason's times and a claim's owner as a person reads them, and an error
only while it is current.

In process over ASGI (httpx), against a real ledger and the sandbox through the real proxy. How tables wrap
in a browser: tests/browser/test_console_browser.py.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from hail_guard.guard import PROCESS_ID, claim_token
from hail_guard.ledger import Heartbeat
from hail_guard.models import Outcome, State
from tests.conftest import email, open_harness
from tests.console_site import OPERATOR_ENV, OPERATOR_TOKEN, console_client, console_site, in_review, signed_in

FIRST_SENT = "2026-12-04T22:51:52.123456+00:00"


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR_TOKEN)


def text_of(page: str) -> str:
    """What a reader sees of a page, on one line: cells and blocks apart, inline tags gone, entities read."""
    spaced = re.sub(r"</?(?:td|th|tr|dt|dd|p|li|h\d|div|section|table|br)\b[^>]*>", " ", page)
    return html.unescape(" ".join(re.sub(r"<[^>]+>", "", spaced).split()))


async def test_a_campaign_of_ready_sends_says_plainly_that_nobody_is_sending_then_who_is(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        sends = [
            {
                "tool": "send_email",
                "arguments": email(to=[f"l{n}@example.com"], body_text=f"Hi {n}", metadata={"lead_id": f"l{n}"}),
            }
            for n in (1, 2)
        ]
        async with harness.client() as agent:
            batch_id = (await agent.call_tool("plan_batch", {"sends": sends})).structured_content["batch_id"]
        await signed_in(client)
        page = text_of((await client.get(f"/console/campaigns/{batch_id}")).text)
        assert (
            "Nobody is sending: no worker or batch run is at work on this ledger, so the 2 ready send(s) wait" in page
        )
        assert f"hail-guard batch run {batch_id}" in page
        assert "nobody no worker or batch run is sending from this ledger" in text_of(
            (await client.get("/console/")).text
        )
        await harness.ledger.record_heartbeat(Heartbeat("beat-1", "worker-host:4242", "worker"))
        await harness.ledger.record_heartbeat(Heartbeat("beat-2", "other-host:7", "batch run", batch_id="batch-other"))
        progress = text_of((await client.get(f"/console/campaigns/{batch_id}/progress")).text)
        assert "Sending now: worker-host, process 4242 (worker, every batch, since" in progress
        assert "other-host" not in progress  # it sends another batch
        assert "Nobody is sending" not in progress
        overview = text_of((await client.get("/console/")).text)
        assert "worker worker-host, process 4242, every batch, since" in overview
        assert "batch run other-host, process 7, batch-other, since" in overview


async def test_the_upstream_tools_page_names_the_profile_and_the_tools_it_guards(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        await signed_in(client)
        page = text_of((await client.get("/console/tools")).text)
    assert "The profile hail guards place_call, send_email, send_sms: each of their sends is recorded" in page
    assert "send_email guarded: at most once" in page
    assert "get_email passed through" in page


async def test_a_review_reason_shows_its_times_as_times_are_shown_everywhere(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        reason = f"first sent {FIRST_SENT}, older than Hail's key retention (24 h) less a margin"
        op = await in_review(harness)
        schema = dict(harness.proxy.tools["send_email"].input_schema)
        other, _ = harness.proxy.guard.prepare("send_email", email(to=["bo@example.com"], subject="Old"), schema)
        begun = await harness.ledger.begin_send(other, owner="w1", lease_seconds=60)
        old = Outcome(state=State.NEEDS_REVIEW, reason=reason, review_reason=reason)
        await harness.ledger.record_outcome(begun.operation.id, owner="w1", outcome=old, actor="w1")
        await signed_in(client)
        for path in ("/review", f"/operations/{begun.operation.id}"):
            page = text_of((await client.get(f"/console{path}")).text)
            assert "first sent 2026-12-04 22:51:52 UTC, older than" in page, path
            assert FIRST_SENT not in page, path
        assert op.id in (await client.get("/console/review")).text


async def test_who_is_a_host_and_a_process_and_an_error_is_shown_only_while_it_is_current(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        schema = dict(harness.proxy.tools["send_email"].input_schema)
        intent, _ = harness.proxy.guard.prepare("send_email", email(), schema)
        owner = claim_token()
        begun = await harness.ledger.begin_send(intent, owner=owner, lease_seconds=60)
        said = "no usable answer: the request may have been sent"
        lost = Outcome(state=State.UNKNOWN, reason=said, error=said)
        op = await harness.ledger.record_outcome(begun.operation.id, owner=owner, outcome=lost, actor=owner)
        await signed_in(client)
        unknown = text_of((await client.get(f"/console/operations/{op.id}")).text)
        assert "last error no usable answer: the request may have been sent" in unknown
        host, pid = PROCESS_ID.rsplit(":", 1)
        assert f"{host}, process {pid}" in unknown
        assert owner not in unknown  # the claim's fence is left out
        [claimed] = await harness.ledger.claim_unknown(owner=owner, lease_seconds=60, operation_id=op.id)
        found = Outcome(state=State.ACCEPTED, reason="found", provider_id="e-1", result={"id": "e-1", "status": "sent"})
        await harness.ledger.record_outcome(claimed.id, owner=owner, outcome=found, actor=owner)
        accepted = text_of((await client.get(f"/console/operations/{op.id}")).text)
        assert "last error" not in accepted
        assert "may have been sent" in accepted  # the timeline keeps what happened


async def test_a_campaigns_held_sends_are_shown_with_what_holds_each(tmp_path: Path) -> None:
    async with (
        open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness,
        console_client(console_site(harness)) as client,
    ):
        async with harness.client() as agent:
            direct = (await agent.call_tool("send_email", email(to=["l1@example.com"], metadata={}))).structured_content
            assert direct is not None
            held_by = direct["hail_guard"]["operation_id"]
            offer = {"subject": "Spring", "body_text": "Our spring offer, for every lead."}
            ids = {"campaign_id": "spring", "message_id": "offer"}
            sends = [
                {
                    "tool": "send_email",
                    "arguments": email(to=[f"l{n}@example.com"], **offer, metadata={**ids, "lead_id": f"l{n}"}),
                }
                for n in (1, 2)
            ]
            batch_id = (await agent.call_tool("plan_batch", {"sends": sends})).structured_content["batch_id"]
            await agent.call_tool("run_batch", {"batch_id": batch_id})
        await signed_in(client)
        page = text_of((await client.get(f"/console/campaigns/{batch_id}")).text)
        assert "1 ready send(s) wait: another send to the same recipient (or lead) is unresolved" in page
        [held] = (await harness.ledger.batch_status(batch_id)).held
        assert held.held_by.id == held_by
        assert f"{held.operation.idempotency_key} l1@example.com {held.held_by.idempotency_key} unknown" in page
