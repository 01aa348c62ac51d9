"""Other MCP servers behind hail-guard: the chat example, Resend's and AgentMail's profiles, each in front of a
fake that follows that server's schema (`hail_guard.fake`), with scripted faults; the outbox is the truth."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, types
from structlog.testing import capture_logs

from hail_guard import review
from hail_guard.cli.fake import faults_for, from_profile
from hail_guard.fake import FakeUpstream
from hail_guard.fake.servers import agentmail, resend
from hail_guard.guard import GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import DeliveryState, State
from hail_guard.profiles import Profile, built_in, load_profile, parse_profile
from hail_guard.server import Proxy, build_server
from hail_guard.tracker import Tracker, TrackerSettings
from hail_guard.upstream import UpstreamTarget, connect_upstream
from tests.conftest import data, text

EXAMPLES = Path(__file__).parents[2] / "examples"


@dataclass
class Rig:
    fake: FakeUpstream
    ledger: Ledger
    proxy: Proxy

    async def call(self, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        async with Client(build_server(self.proxy), mode="legacy") as client:
            return await client.call_tool(tool, arguments)

    async def reconcile(self) -> dict[str, str]:
        """Every due unknown settled: its state, by operation id."""
        return {op.id: op.state.value for op in await self.proxy.guard.reconcile()}

    def sent(self) -> Counter[str]:
        """How often the fake really sent each message (by its text or subject)."""
        return Counter(str(e["request"].get("text") or e["request"].get("subject")) for e in self.fake.outbox)


@asynccontextmanager
async def rig(tmp_path: Path, profile: Profile, fake: FakeUpstream, *faults: str) -> AsyncIterator[Rig]:
    for fault in faults_for(fake.surface, list(faults)):
        fake.add_fault(fault)
    tmp_path.mkdir(exist_ok=True)
    settings = GuardSettings(profile=profile, timeout_seconds=0.5)
    target = UpstreamTarget(kind="inprocess", server=fake.server())
    async with (
        open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        connect_upstream(target, timeout_seconds=0.5, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream, settings)
        await proxy.refresh_tools()
        yield Rig(fake, ledger, proxy)


def chat() -> tuple[Profile, FakeUpstream]:
    profile = load_profile(str(EXAMPLES / "chat.toml"))
    return profile, FakeUpstream(from_profile(profile))


def guard_view(result: types.CallToolResult) -> dict[str, Any]:
    view: dict[str, Any] = data(result)["hail_guard"]
    return view


# --- the chat example: no key ---------------------------------------------------------------------------


async def test_a_repeated_chat_post_is_answered_from_the_ledger(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat()) as r:
        first = await r.call("post_message", {"channel": "#general", "text": "Deploy at 5"})
        again = await r.call("post_message", {"channel": "#general", "text": " Deploy  at 5 "})
        assert guard_view(first)["state"] == "accepted"
        assert not guard_view(first)["replayed"]
        assert guard_view(again)["replayed"] is True
        assert data(again)["id"] == r.fake.outbox[0]["id"]
        assert r.sent() == {"Deploy at 5": 1}


async def test_a_lost_chat_answer_is_unknown_and_reconcile_finds_it_with_list_messages(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat(), "post_message:1:drop_after_accept") as r:
        lost = await r.call("post_message", {"channel": "#ops", "text": "Rollback done"})
        assert lost.is_error
        assert guard_view(lost)["state"] == "unknown"
        again = await r.call("post_message", {"channel": "#ops", "text": "Rollback done"})
        assert guard_view(again)["replayed"] is True  # never posted a second time while unknown
        assert await r.reconcile() == {guard_view(lost)["operation_id"]: "accepted"}
        operation = await r.ledger.get(guard_view(lost)["operation_id"])
        assert operation.provider_id == r.fake.outbox[0]["id"]
        assert r.fake.calls("list_messages") == 1
        assert r.sent() == {"Rollback done": 1}


async def test_a_chat_post_the_server_never_recorded_goes_to_review_and_is_never_resent(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat(), "post_message:1:delay:5000") as r:
        lost = await r.call("post_message", {"channel": "#ops", "text": "Paging on-call"})
        assert guard_view(lost)["state"] == "unknown"
        assert await r.reconcile() == {guard_view(lost)["operation_id"]: "needs_review"}
        operation = await r.ledger.get(guard_view(lost)["operation_id"])
        assert "found no such message" in (operation.review_reason or "")
        assert r.fake.calls("post_message") == 1
        assert r.fake.outbox == []


async def test_a_message_another_operation_holds_does_not_settle_a_second_copy(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat(), "post_message:2:delay:5000") as r:
        arguments = {"channel": "#ops", "text": "Standup"}
        await r.call("post_message", arguments)
        second = await r.call("post_message", {**arguments, "allow_duplicate": True, "idempotency_key": "standup-2"})
        assert guard_view(second)["state"] == "unknown"
        assert await r.reconcile() == {guard_view(second)["operation_id"]: "needs_review"}
        assert r.sent() == {"Standup": 1}


async def test_an_operator_resend_of_a_keyless_post_in_review_posts_it_once(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat(), "post_message:1:delay:5000") as r:
        lost = await r.call("post_message", {"channel": "#ops", "text": "Paging on-call"})
        await r.reconcile()
        resent = await review.resend(
            r.ledger, r.proxy.guard, guard_view(lost)["operation_id"], reason="never left", actor="op"
        )
        assert resent.state is State.ACCEPTED
        assert resent.provider_id == r.fake.outbox[0]["id"]
        assert [entry["request"] for entry in r.fake.outbox] == [{"channel": "#ops", "text": "Paging on-call"}]
        assert (await r.ledger.get(guard_view(lost)["operation_id"])).state is State.CANCELLED


async def test_a_profile_tool_the_upstream_does_not_list_is_named_in_a_warning(tmp_path: Path) -> None:
    misspelt = parse_profile((EXAMPLES / "chat.toml").read_text().replace('"post_message"', '"post_mesage"'), "typo")
    with capture_logs() as logs:
        async with rig(tmp_path, misspelt, FakeUpstream(from_profile(load_profile(str(EXAMPLES / "chat.toml"))))) as r:
            await r.proxy.refresh_tools()
    warned = [entry for entry in logs if entry["event"] == "guarded_tools_not_listed"]
    assert [(entry["tools"], entry["profile"]) for entry in warned] == [(["post_mesage"], "typo")]  # once, not per list
    assert r.proxy.guarded == set()


async def test_a_keyless_tool_takes_hail_guards_own_key_and_never_forwards_it(tmp_path: Path) -> None:
    async with rig(tmp_path, *chat()) as r:
        async with Client(build_server(r.proxy), mode="legacy") as client:
            [tool] = [t for t in (await client.list_tools()).tools if t.name == "post_message"]
        assert {"idempotency_key", "allow_duplicate"} <= set(tool.input_schema["properties"])
        sent = await r.call("post_message", {"channel": "#a", "text": "hi", "idempotency_key": "note-1"})
        assert guard_view(sent)["idempotency_key"] == "note-1"
        assert r.fake.outbox[0]["request"] == {"channel": "#a", "text": "hi"}


# --- Resend: idempotencyKey, answers in words ------------------------------------------------------------

RESEND_EMAIL = {"to": ["ada@example.com"], "subject": "Welcome", "text": "Hi Ada", "from": "Acme <hi@acme.test>"}


async def test_resend_sends_under_idempotency_key_and_reads_the_id_from_its_words(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("resend"), FakeUpstream(resend())) as r:
        sent = await r.call("send-email", RESEND_EMAIL)
        assert guard_view(sent)["state"] == "accepted"
        assert data(sent)["id"] == r.fake.outbox[0]["id"]
        assert r.fake.outbox[0]["idempotency_key"] == guard_view(sent)["idempotency_key"]


async def test_a_lost_resend_answer_is_replayed_under_the_same_key_and_sent_once(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("resend"), FakeUpstream(resend()), "send-email:1:hang_after_accept") as r:
        lost = await r.call("send-email", RESEND_EMAIL)
        assert guard_view(lost)["state"] == "unknown"
        assert await r.reconcile() == {guard_view(lost)["operation_id"]: "accepted"}
        assert r.fake.calls("send-email") == 2  # the replay, under the same key, answered the first id
        operation = await r.ledger.get(guard_view(lost)["operation_id"])
        assert operation.provider_id == r.fake.outbox[0]["id"]
        assert len(r.fake.outbox) == 1


@pytest.mark.parametrize(
    ("fault", "state"),
    [
        ("send-email:1:fail_before_accept:429", "ready"),
        ("send-email:1:fail_before_accept:422", "failed"),
        ("send-email:1:error_after_accept:502", "unknown"),
        ("send-email:1:malformed", "unknown"),
    ],
)
async def test_resends_failures_are_classified_by_its_profile(tmp_path: Path, fault: str, state: str) -> None:
    async with rig(tmp_path, built_in("resend"), FakeUpstream(resend()), fault) as r:
        assert guard_view(await r.call("send-email", RESEND_EMAIL))["state"] == state


async def test_a_key_resend_holds_for_another_email_is_for_a_human(tmp_path: Path) -> None:
    fake = FakeUpstream(resend())
    async with rig(tmp_path / "one", built_in("resend"), fake) as first:
        await first.call("send-email", {**RESEND_EMAIL, "idempotencyKey": "welcome-ada"})
    async with rig(tmp_path / "another", built_in("resend"), fake) as second:  # another ledger, the same key
        conflict = await second.call("send-email", {**RESEND_EMAIL, "text": "Hi!", "idempotencyKey": "welcome-ada"})
        assert guard_view(conflict)["state"] == "needs_review"
        assert "different request" in text(conflict)
    assert len(fake.outbox) == 1


async def test_resend_sends_are_polled_for_delivery_through_get_emails_words(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("resend"), FakeUpstream(resend())) as r:
        sent = await r.call("send-email", RESEND_EMAIL)
        settings = TrackerSettings(profile=built_in("resend"), first_backoff_seconds=0.0, timeout_seconds=5.0)
        tracker = Tracker(r.ledger, r.proxy.upstream, settings)
        assert await tracker.poll_once() == 1
        polled = await r.ledger.get(guard_view(sent)["operation_id"])
        assert polled.delivery_state is DeliveryState.DELIVERED
        assert r.fake.calls("get-email") == 1


# --- AgentMail: no key, structured answers ----------------------------------------------------------------

AGENTMAIL_EMAIL = {"inboxId": "agent@agentmail.to", "to": ["bob@example.com"], "subject": "Hello", "text": "Hi Bob"}


async def test_agentmail_accepts_with_its_message_id(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("agentmail"), FakeUpstream(agentmail())) as r:
        sent = await r.call("send_message", AGENTMAIL_EMAIL)
        assert guard_view(sent)["state"] == "accepted"
        assert data(sent)["messageId"] == r.fake.outbox[0]["id"]


async def test_a_lost_agentmail_send_is_found_by_list_messages_never_sent_again(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("agentmail"), FakeUpstream(agentmail()), "send_message:1:hang_after_accept") as r:
        lost = await r.call("send_message", AGENTMAIL_EMAIL)
        assert guard_view(lost)["state"] == "unknown"
        assert await r.reconcile() == {guard_view(lost)["operation_id"]: "accepted"}
        operation = await r.ledger.get(guard_view(lost)["operation_id"])
        assert operation.provider_id == r.fake.outbox[0]["id"]
        assert r.fake.calls("send_message") == 1
        assert operation.state is State.ACCEPTED


async def test_an_agentmail_send_that_never_left_goes_to_review(tmp_path: Path) -> None:
    async with rig(tmp_path, built_in("agentmail"), FakeUpstream(agentmail()), "send_message:1:delay:5000") as r:
        lost = await r.call("send_message", AGENTMAIL_EMAIL)
        assert await r.reconcile() == {guard_view(lost)["operation_id"]: "needs_review"}
        assert r.fake.outbox == []


async def test_agentmails_refusals_and_rate_limits_follow_its_profile(tmp_path: Path) -> None:
    async with rig(
        tmp_path,
        built_in("agentmail"),
        FakeUpstream(agentmail()),
        "send_message:1:fail_before_accept:404",
        "send_message:2:fail_before_accept:429",
    ) as r:
        refused = await r.call("send_message", AGENTMAIL_EMAIL)
        assert guard_view(refused)["state"] == "failed"
        later = await r.call("send_message", {**AGENTMAIL_EMAIL, "subject": "Other"})
        assert guard_view(later)["state"] == "ready"
        assert r.fake.outbox == []
