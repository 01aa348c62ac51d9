"""The sandbox's sends: results, refusals and their exact texts, idempotency keys, the outbox."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import mcp.types as types
import pytest
from mcp import Client

from hail_guard.sandbox import KEY_RETENTION_SECONDS, ManualClock, Sandbox

CONSENT_REFUSED = (
    "[{'loc': ['body', 'recipient_consent'], 'msg': 'recipient_consent must be true to send', 'type': 'value_error'}]"
)
MARKETING_REFUSED = (
    "[{'loc': ['body', 'consent_source'], 'msg': 'marketing sends require a non-empty consent_source', "
    "'type': 'value_error'}]"
)
CONFLICT = {"error": "idempotency key reused with a different request body"}


def email(**changes: Any) -> dict[str, Any]:
    return {"to": ["lead@example.com"], "subject": "Hello", "body_text": "Hi!", "recipient_consent": True} | changes


def sms(**changes: Any) -> dict[str, Any]:
    return {"to": "+14155550100", "body": "Hi!", "recipient_consent": True} | changes


def call(**changes: Any) -> dict[str, Any]:
    return {"to": "+14155550100", "system_prompt": "Be brief.", "recipient_consent": True} | changes


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sandbox(clock: ManualClock) -> Sandbox:
    return Sandbox(clock=clock, sleep=clock.sleep)


@pytest.fixture(params=["legacy", "auto"])
def mode(request: pytest.FixtureRequest) -> str:
    """Both ways an in-process client talks to a server: JSON-RPC streams, and direct dispatch."""
    return str(request.param)


async def result_of(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The ordinary (not isError) result of a call, checked to be the same dict as its JSON text."""
    with anyio.fail_after(5):
        answer = await client.call_tool(tool, arguments)
    assert answer.is_error is False
    assert answer.structured_content is not None
    assert isinstance(answer.content[0], types.TextContent)
    assert json.loads(answer.content[0].text) == answer.structured_content
    return dict(answer.structured_content)


async def refusal_of(client: Client, tool: str, arguments: dict[str, Any]) -> str:
    with anyio.fail_after(5):
        answer = await client.call_tool(tool, arguments)
    assert answer.is_error is True
    assert isinstance(answer.content[0], types.TextContent)
    return answer.content[0].text


async def test_send_email_returns_the_sent_record_with_its_key(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        result = await result_of(client, "send_email", email(idempotency_key="k1", metadata={"lead": 7}))

        assert result["status"] == "sent"
        assert result["idempotency_key"] == "k1"
        assert result["to_addresses"] == ["lead@example.com"]
        assert result["metadata"] == {"lead": 7}
        assert result["sent_at"] == result["requested_at"]
        assert [entry["id"] for entry in sandbox.outbox] == [result["id"]]


async def test_send_sms_and_place_call_return_their_records_with_keys(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        text = await result_of(client, "send_sms", sms(idempotency_key="s1"))
        voice = await result_of(client, "place_call", call(idempotency_key="c1"))

        assert (text["status"], text["segment_count"], text["idempotency_key"]) == ("sent", 1, "s1")
        assert (voice["status"], voice["idempotency_key"]) == ("dialing", "c1")


async def test_every_tool_declares_an_open_object_output_schema(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        tools = (await client.list_tools()).tools

        assert {tool.name for tool in tools} >= {
            "send_email",
            "send_sms",
            "place_call",
            "get_email",
            "get_sms",
            "get_call",
            "list_emails",
            "list_sms",
            "list_calls",
            "get_email_events",
            "get_events",
            "whoami",
            "create_contact",
        }
        assert all(tool.output_schema == {"type": "object", "additionalProperties": True} for tool in tools)


async def test_only_send_tools_take_an_optional_idempotency_key(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        schemas = {tool.name: tool.input_schema for tool in (await client.list_tools()).tools}

        for name, schema in schemas.items():
            has_key = "idempotency_key" in schema["properties"]
            assert has_key == (name in {"send_email", "send_sms", "place_call"}), name
            assert "idempotency_key" not in schema.get("required", [])
        assert "from_" in schemas["send_email"]["properties"]
        assert schemas["send_email"]["properties"]["recipient_consent"]["type"] == "boolean"


@pytest.mark.parametrize("consent", ["yes", "true", 1, None])
async def test_non_boolean_consent_is_a_schema_refusal_and_nothing_is_sent(
    mode: str, sandbox: Sandbox, consent: object
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        text = await refusal_of(client, "send_email", email(recipient_consent=consent, idempotency_key="k"))

        assert text.startswith("Error executing tool send_email: 1 validation error for send_emailArguments\n")
        assert "recipient_consent\n  Input should be a valid boolean" in text
        assert sandbox.outbox == []
        assert (await result_of(client, "send_email", email(idempotency_key="k")))["status"] == "sent"


async def test_a_missing_required_field_is_a_schema_refusal_naming_it(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        arguments = email()
        del arguments["subject"]

        text = await refusal_of(client, "send_email", arguments)

        assert text == (
            "Error executing tool send_email: 1 validation error for send_emailArguments\n"
            "subject\n  Field required [type=missing]"
        )


async def test_wrong_types_are_a_schema_refusal_listing_each(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        text = await refusal_of(client, "send_sms", sms(body=5, metadata="x"))

        assert text.startswith("Error executing tool send_sms: 2 validation errors for send_smsArguments\n")
        assert "body\n  Input should be a valid string" in text
        assert "metadata\n  Input should be a valid dictionary" in text


async def test_an_unknown_tool_is_an_error_result(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        assert await refusal_of(client, "acquire_spaceship", {}) == "Unknown tool: acquire_spaceship"


async def test_false_consent_is_refused_and_the_refusal_is_replayed_under_its_key(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", email(recipient_consent=False, idempotency_key="k"))
        again = await result_of(client, "send_email", email(recipient_consent=False, idempotency_key="k"))

        assert first == again == {"error": CONSENT_REFUSED}
        assert sandbox.outbox == []


async def test_marketing_without_consent_source_is_refused_and_replayed(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        arguments = sms(message_type="marketing", consent_source="  ", idempotency_key="m")

        assert await result_of(client, "send_sms", arguments) == {"error": MARKETING_REFUSED}
        assert await result_of(client, "send_sms", arguments) == {"error": MARKETING_REFUSED}
        assert sandbox.outbox == []


async def test_marketing_with_a_consent_source_is_sent(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        result = await result_of(client, "send_sms", sms(message_type="marketing", consent_source="signup form"))

        assert (result["status"], result["message_type"]) == ("sent", "marketing")


async def test_the_same_key_after_completion_replays_the_saved_result_and_sends_nothing(
    mode: str, sandbox: Sandbox, clock: ManualClock
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", email(idempotency_key="k"))
        clock.advance(60)
        again = await result_of(client, "send_email", email(idempotency_key="k"))

        assert again == first
        assert len(sandbox.outbox) == 1


async def test_the_same_key_with_a_different_body_is_a_conflict(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        await result_of(client, "send_email", email(idempotency_key="k", metadata={"step": 1}))

        assert await result_of(client, "send_email", email(idempotency_key="k", metadata={"step": 2})) == CONFLICT
        assert len(sandbox.outbox) == 1


async def test_a_request_with_its_fields_in_another_order_is_the_same_request(mode: str, sandbox: Sandbox) -> None:
    forwards = email(idempotency_key="k", metadata={"campaign": "c1", "lead": 7})
    backwards = dict(reversed(list(email(idempotency_key="k", metadata={"lead": 7, "campaign": "c1"}).items())))
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", forwards)
        again = await result_of(client, "send_email", backwards)

    assert again == first
    assert len(sandbox.outbox) == 1


async def test_keys_are_shared_across_the_send_tools(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        await result_of(client, "send_email", email(idempotency_key="k"))

        assert await result_of(client, "send_sms", sms(idempotency_key="k")) == CONFLICT
        assert await result_of(client, "place_call", call(idempotency_key="k")) == CONFLICT
        assert [entry["tool"] for entry in sandbox.outbox] == ["send_email"]


async def test_a_retry_without_a_key_gets_a_fresh_key_and_sends_twice(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", email())
        second = await result_of(client, "send_email", email())

        assert first["idempotency_key"] != second["idempotency_key"]
        assert first["id"] != second["id"]
        assert len(sandbox.outbox) == 2


async def test_a_tool_layer_validation_error_names_the_field_and_leaves_the_key_free(
    mode: str, sandbox: Sandbox
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        refused = await result_of(client, "send_sms", sms(to="0415 555 0100", idempotency_key="k"))
        sent = await result_of(client, "send_sms", sms(idempotency_key="k"))

        assert refused == {"error": r"to: String should match pattern '^\+[1-9]\d{1,14}$'"}
        assert sent["status"] == "sent"
        assert len(sandbox.outbox) == 1


@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("send_email", email(to=[]), "to: List should have at least 1 item after validation, not 0"),
        ("send_email", email(subject=""), "subject: String should have at least 1 character"),
        ("send_email", email(body_text=None), "body_text or body_html is required"),
        ("send_sms", sms(body="x" * 1601), "body: String should have at most 1600 characters"),
        ("place_call", call(system_prompt=None), "exactly one of system_prompt, llm or agent_id is required"),
        ("place_call", call(agent_id="a1"), "exactly one of system_prompt, llm or agent_id is required"),
    ],
)
async def test_tool_layer_refusals_read_as_field_and_message(
    mode: str, sandbox: Sandbox, tool: str, arguments: dict[str, Any], error: str
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        assert await result_of(client, tool, arguments) == {"error": error}


async def test_a_key_older_than_the_retention_is_forgotten_so_a_replay_sends_again(
    mode: str, sandbox: Sandbox, clock: ManualClock
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", email(idempotency_key="k"))
        clock.advance(KEY_RETENTION_SECONDS + 1)
        again = await result_of(client, "send_email", email(idempotency_key="k"))

        assert again["id"] != first["id"]
        assert len(sandbox.outbox) == 2


async def test_the_outbox_file_gets_one_json_line_per_accepted_message(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "outbox.jsonl"
    sandbox = Sandbox(outbox_path=path, clock=clock, sleep=clock.sleep)
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_email", email(idempotency_key="k", metadata={"lead": 1}))
        await result_of(client, "send_email", email(idempotency_key="k", metadata={"lead": 1}))
        await result_of(client, "send_email", email(recipient_consent=False))
        await result_of(client, "send_sms", sms(idempotency_key="s"))

    lines = [json.loads(line) for line in path.read_text().splitlines()]

    assert lines == sandbox.outbox
    assert [(line["tool"], line["idempotency_key"]) for line in lines] == [("send_email", "k"), ("send_sms", "s")]
    assert lines[0]["id"] == sent["id"]
    assert lines[0]["to"] == ["lead@example.com"]
    assert lines[0]["request"] == email(metadata={"lead": 1})
    assert lines[1]["to"] == "+14155550100"
