"""A real MCP client -> hail-guard -> the sandbox: the durable send, end to end, in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hail_guard import keys
from hail_guard.models import State
from hail_guard.policy import LEDGER_UNAVAILABLE
from hail_guard.profiles import hail
from tests.conftest import data, email, open_harness, text


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_send_reaches_hail_once_and_a_repeat_is_answered_from_the_ledger(tmp_path: Path, mode: str) -> None:
    async with open_harness(tmp_path) as harness:
        first = await harness.call("send_email", email(), mode)
        again = await harness.call("send_email", email(), mode)

        assert not first.is_error
        assert not again.is_error
        assert len(harness.sandbox.outbox) == 1
        assert harness.sandbox.calls("send_email") == 1
        sent = harness.sandbox.outbox[0]
        assert data(first)["id"] == data(again)["id"] == sent["id"]
        assert sent["idempotency_key"] == "c1:l1:email:intro"
        assert data(first)["hail_guard"]["replayed"] is False
        assert data(again)["hail_guard"]["replayed"] is True
        assert data(again)["hail_guard"]["state"] == "accepted"


async def test_the_key_and_content_key_forwarded_are_the_derived_ones(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        plain = email(metadata={"note": "no ids"})
        result = await harness.call("send_email", plain)
        key = data(result)["hail_guard"]["idempotency_key"]
        assert key.startswith("hgm:email:")
        assert harness.sandbox.outbox[0]["idempotency_key"] == key


async def test_a_timeout_after_acceptance_is_unknown_not_resent(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.5) as harness:
        first = await harness.call("send_email", email())
        assert first.is_error
        operation_id = data(first)["hail_guard"]["operation_id"]
        assert data(first)["hail_guard"]["state"] == "unknown"
        assert "do NOT resend" in text(first).replace("Do NOT", "do NOT")
        assert f"operation_id={operation_id}" in text(first)

        again = await harness.call("send_email", email())
        assert again.is_error
        assert data(again)["hail_guard"]["replayed"] is True
        assert harness.sandbox.calls("send_email") == 1

        settled = await harness.call("reconcile", {"operation_id": operation_id})
        [view] = data(settled)["reconciled"]
        assert view["state"] == "accepted"
        assert view["provider_id"] == harness.sandbox.outbox[0]["id"]
        assert len(harness.sandbox.outbox) == 1

        after = await harness.call("send_email", email())
        assert not after.is_error
        assert data(after)["id"] == view["provider_id"]


async def test_a_dropped_connection_after_acceptance_is_reconciled_to_one_message(
    tmp_path: Path,
) -> None:
    async with open_harness(tmp_path, "send_email:1:drop_after_accept") as harness:
        first = await harness.call("send_email", email())
        assert data(first)["hail_guard"]["state"] == "unknown"
        settled = await harness.call("reconcile", {})
        assert [v["state"] for v in data(settled)["reconciled"]] == ["accepted"]
        assert len(harness.sandbox.outbox) == 1


async def test_a_changed_message_under_the_same_key_is_refused_naming_the_fields(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        await harness.call("send_email", email())
        changed = await harness.call("send_email", email(subject="Hello again", body_text="Other"))
        assert changed.is_error
        assert "body_text, subject" in text(changed)
        assert data(changed)["differing_fields"] == ["body_text", "subject"]
        assert len(harness.sandbox.outbox) == 1
        assert harness.sandbox.calls("send_email") == 1


@pytest.mark.parametrize(
    ("consent", "message"),
    [
        ("yes", "recipient_consent: 'yes' is not of type 'boolean'"),  # the schema's word
        (1, "recipient_consent: 1 is not of type 'boolean'"),
        (False, "recipient_consent must be the JSON boolean true (got false)"),  # the consent rule's
    ],
)
async def test_consent_that_is_not_true_records_and_sends_nothing(
    tmp_path: Path, consent: object, message: str
) -> None:
    async with open_harness(tmp_path) as harness:
        result = await harness.call("send_email", email(recipient_consent=consent))
        assert result.is_error
        assert message in text(result)
        assert await harness.ledger.list_operations() == []
        assert harness.sandbox.calls("send_email") == 0


async def test_a_refused_request_leaves_the_key_free_for_the_corrected_one(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        refused = await harness.call("send_email", email(message_type="marketing"))
        assert "consent_source" in text(refused)
        fixed = await harness.call("send_email", email(message_type="marketing", consent_source="signup form"))
        assert not fixed.is_error
        assert len(harness.sandbox.outbox) == 1


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        (email(to=[]), "to"),
        (email(subject=""), "subject"),
        (email(idempotency_key=""), "idempotency_key"),
        (email(idempotency_key="x" * 300), "idempotency_key"),
        (email(cc="not-a-list"), "cc"),
        (email(body_text=""), "body_text or body_html"),
        (email(subject="x" * 999), "subject"),
    ],
)
async def test_invalid_arguments_are_refused_before_anything_is_recorded(
    tmp_path: Path, arguments: dict[str, object], field: str
) -> None:
    async with open_harness(tmp_path) as harness:
        result = await harness.call("send_email", arguments)
        assert result.is_error
        assert field in text(result)
        assert await harness.ledger.list_operations() == []
        assert harness.sandbox.calls("send_email") == 0


async def test_reads_and_unguarded_writes_pass_through_unchanged(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        whoami = await harness.call("whoami", {})
        contact = await harness.call("create_contact", {"email": "x@example.com"})
        assert not whoami.is_error
        assert "hail_guard" not in data(whoami)
        assert "hail_guard" not in data(contact)
        assert await harness.ledger.list_operations() == []


async def test_upstream_tools_are_listed_verbatim_beside_our_own(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        async with harness.client() as client:
            listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert {"reconcile", "get_operation", "list_operations"} <= set(listed)
        assert {"send_email", "send_sms", "place_call", "whoami", "create_contact"} <= set(listed)
        assert harness.proxy.guarded == {"send_email", "send_sms", "place_call"}
        upstream_schema = harness.proxy.tools["send_email"].input_schema
        listed_schema = listed["send_email"].input_schema
        assert {**listed_schema, "properties": {**listed_schema["properties"]}} != upstream_schema
        listed_schema["properties"].pop("allow_duplicate")
        assert listed_schema == upstream_schema
        assert listed["send_email"].description == harness.proxy.tools["send_email"].description
        assert listed["whoami"] == harness.proxy.tools["whoami"]
        assert listed["send_email"].annotations == harness.proxy.tools["send_email"].annotations


async def test_get_and_list_operations_show_state_and_history(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        sent = data(await harness.call("send_email", email()))
        operation_id = sent["hail_guard"]["operation_id"]
        by_id = data(await harness.call("get_operation", {"operation_id": operation_id}))
        by_key = data(await harness.call("get_operation", {"idempotency_key": "c1:l1:email:intro"}))
        assert by_id["state"] == by_key["state"] == "accepted"
        assert [e["to_state"] for e in by_id["history"]] == ["sending", "accepted"]
        listed = data(await harness.call("list_operations", {"state": "accepted", "campaign_id": "c1"}))
        assert [op["operation_id"] for op in listed["operations"]] == [operation_id]
        missing = await harness.call("get_operation", {"operation_id": "nope"})
        assert missing.is_error
        assert "no operation has the id or key 'nope'" in text(missing)


async def test_every_tool_that_names_an_operation_takes_its_id_or_its_key(tmp_path: Path) -> None:
    """An operation named by its key where an id is asked (and the other way round) is found, never "missing"."""
    key = "c1:l1:email:intro"
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.3) as harness:
        sent = data(await harness.call("send_email", email()))["hail_guard"]
        assert sent["state"] == "unknown"
        by_key_as_id = data(await harness.call("get_operation", {"operation_id": key}))
        by_id_as_key = data(await harness.call("get_operation", {"idempotency_key": sent["operation_id"]}))
        assert by_key_as_id["operation_id"] == by_id_as_key["operation_id"] == sent["operation_id"]
        [settled] = data(await harness.call("reconcile", {"operation_id": key}))["reconciled"]
        assert (settled["operation_id"], settled["state"]) == (sent["operation_id"], "accepted")
        [again] = data(await harness.call("reconcile", {"operation_id": key}))["reconciled"]
        assert again["state"] == "accepted"  # settled already: shown as it stands, not "no operation"


async def test_a_cancelled_call_is_recorded_unknown_and_reconciled(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=30) as harness:
        async with harness.client() as client:
            with anyio.move_on_after(0.5):
                await client.call_tool("send_email", email())
        [operation] = await harness.ledger.list_operations(state=State.UNKNOWN)
        settled = await harness.proxy.guard.reconcile(operation.id)
        assert [op.state for op in settled] == [State.ACCEPTED]
        assert len(harness.sandbox.outbox) == 1


async def test_the_ledger_cannot_record_so_nothing_is_forwarded(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        import sqlite3

        holder = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)  # the harness's ledger file
        holder.execute("BEGIN IMMEDIATE")
        try:
            with capture_logs() as logs:
                result = await harness.call("send_email", email())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert result.is_error
        assert text(result) == LEDGER_UNAVAILABLE  # the agent is told it failed; the operator's log says why
        assert "locked" in next(entry["error"] for entry in logs if entry["event"] == "call_failed")
        assert harness.sandbox.calls("send_email") == 0


async def test_an_unreachable_upstream_refuses_sends_before_recording_anything(tmp_path: Path) -> None:
    from hail_guard.guard import GuardSettings
    from hail_guard.ledger import open_ledger
    from hail_guard.server import Proxy
    from hail_guard.upstream import UpstreamTarget, connect_upstream
    from tests.end_to_end.test_stdio import free_port

    target = UpstreamTarget(kind="http", url=f"http://127.0.0.1:{free_port()}/")
    async with (
        open_ledger(str(tmp_path / "ledger.db")) as ledger,
        connect_upstream(target, timeout_seconds=1, connect_timeout_seconds=0.3, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream, GuardSettings(timeout_seconds=1))
        proxy.tools = {"send_email": _send_email_tool()}
        proxy.guarded = {"send_email"}
        result = await proxy.call("send_email", email())
        assert result.is_error
        assert "is not reachable" in text(result)
        assert "nothing was sent" in text(result)
        assert await ledger.list_operations() == []


def _send_email_tool() -> Any:
    from mcp import types

    from hail_guard.sandbox.tools import tool_list

    [tool] = [t for t in tool_list() if t.name == "send_email"]
    assert isinstance(tool, types.Tool)
    return tool


async def test_a_retry_that_writes_2_as_2_0_is_the_same_message(tmp_path: Path) -> None:
    call: dict[str, Any] = {
        "to": "+14155550123",
        "recipient_consent": True,
        "first_message": "Hello",
        "llm": {"base_url": "https://llm.example/v1", "model": "m", "temperature": 1, "max_tokens": 200},
    }
    async with open_harness(tmp_path) as harness:
        first = data(await harness.call("place_call", call))["hail_guard"]
        regenerated = {**call, "llm": {**call["llm"], "temperature": 1.0, "max_tokens": 200.0}}
        again = data(await harness.call("place_call", regenerated))["hail_guard"]
        assert (again["operation_id"], again["replayed"]) == (first["operation_id"], True)
        assert harness.sandbox.calls("place_call") == 1
    spec = hail().spec("place_call")
    assert keys.derive_key(spec, regenerated) == keys.derive_key(spec, call) == first["idempotency_key"]
    assert keys.derive_key(spec, {**call, "llm": {**call["llm"], "temperature": 1.5}}) != first["idempotency_key"]


@pytest.mark.parametrize(
    ("field", "said"),
    [
        ("from_", "the arguments for send_sms cannot be checked: Exceeds the limit (4300 digits)"),  # by the schema
        ("metadata", "the arguments are not a JSON value hail-guard can record: Exceeds the limit (4300 digits)"),
    ],
)
async def test_an_integer_too_long_to_write_is_refused_clearly_and_nothing_is_recorded(
    tmp_path: Path, field: str, said: str
) -> None:
    """Where the schema refuses it, the ledger is still asked whether the call is a retry, from its arguments read
    without the schema; in a free-form object the schema does not read it: neither may crash on it."""
    huge = 10**4301
    value = huge if field == "from_" else {"campaign_id": "c", "lead_id": huge, "message_id": "m"}
    async with open_harness(tmp_path) as harness:
        sms = {"to": "+14155551234", "body": "Hi", "recipient_consent": True, field: value}
        result = await harness.call("send_sms", sms)
        assert result.is_error
        assert text(result).startswith(said)
        assert await harness.ledger.list_operations() == []
        assert harness.sandbox.calls("send_sms") == 0
