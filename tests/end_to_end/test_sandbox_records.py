"""What the sandbox has on file: delivery progress over time, special recipients, reads and lists."""

from __future__ import annotations

import json
from typing import Any

import anyio
import mcp.types as types
import pytest
from mcp import Client

from hail_guard.sandbox import (
    CALL_BUSY,
    CALL_NO_ANSWER,
    SMS_CARRIER_REFUSED,
    SMS_UNDELIVERED,
    SPECIAL_ADDRESSES,
    ManualClock,
    Sandbox,
)

STEP_SECONDS = 2.0
NOT_FOUND = {"error": "resource not found"}


def email(to: str = "lead@example.com", **changes: Any) -> dict[str, Any]:
    return {"to": [to], "subject": "Hello", "body_text": "Hi!", "recipient_consent": True} | changes


def sms(to: str = "+14155550100") -> dict[str, Any]:
    return {"to": to, "body": "Hi!", "recipient_consent": True}


def call(to: str = "+14155550100") -> dict[str, Any]:
    return {"to": to, "system_prompt": "Be brief.", "recipient_consent": True}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sandbox(clock: ManualClock) -> Sandbox:
    return Sandbox(clock=clock, sleep=clock.sleep, delivery_delay_seconds=STEP_SECONDS)


@pytest.fixture(params=["legacy", "auto"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def result_of(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    with anyio.fail_after(5):
        answer = await client.call_tool(tool, arguments)
    assert answer.is_error is False
    assert isinstance(answer.content[0], types.TextContent)
    assert answer.structured_content == json.loads(answer.content[0].text)
    return dict(answer.structured_content)


async def statuses(
    client: Client, clock: ManualClock, tool: str, id_name: str, record_id: str, steps: int
) -> list[str]:
    """The record's status now and after each of the next `steps` delivery steps."""
    seen = []
    for _ in range(steps + 1):
        seen.append((await result_of(client, tool, {id_name: record_id}))["status"])
        clock.advance(STEP_SECONDS)
    return seen


async def test_an_email_is_sent_then_delivered_with_events(mode: str, sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        sent = await result_of(client, "send_email", email())
        seen = await statuses(client, clock, "get_email", "email_id", sent["id"], 2)
        events = await result_of(client, "get_email_events", {"email_id": sent["id"]})
        same_events = await result_of(client, "get_events", {"id": f"email:{sent['id']}"})
        record = await result_of(client, "get_email", {"email_id": sent["id"]})

    assert seen == ["sent", "delivered", "delivered"]
    assert [event["type"] for event in events["events"]] == ["sent", "delivered"]
    assert same_events["data"] == list(reversed(events["events"]))
    assert record["delivered_at"] > record["sent_at"]


async def test_an_html_email_is_later_opened(sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_email", email(body_html="<p>Hi</p>"))
        clock.advance(3 * STEP_SECONDS)
        events = await result_of(client, "get_email_events", {"email_id": sent["id"]})

    assert [event["type"] for event in events["events"]] == ["sent", "delivered", "opened"]


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("bounce@example.com", ["sent", "bounced", "bounced", "bounced"]),
        ("bounce+lead7@example.com", ["sent", "bounced", "bounced", "bounced"]),
        ("complaint@example.com", ["sent", "delivered", "complained", "complained"]),
        ("delayed@example.com", ["sent", "sent", "delivered", "delivered"]),
    ],
)
async def test_special_email_addresses_misbehave_as_documented(
    sandbox: Sandbox, clock: ManualClock, address: str, expected: list[str]
) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_email", email(address))
        seen = await statuses(client, clock, "get_email", "email_id", sent["id"], 3)

    assert seen == expected
    assert address.split("+")[0].split("@")[0] + "@<any domain>" in SPECIAL_ADDRESSES


async def test_an_sms_is_sent_then_delivered(mode: str, sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        sent = await result_of(client, "send_sms", sms())
        seen = await statuses(client, clock, "get_sms", "sms_id", sent["id"], 1)

    assert seen == ["sent", "delivered"]


async def test_an_sms_the_carrier_refuses_fails_in_the_send_with_an_error_code(
    sandbox: Sandbox, clock: ManualClock
) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_sms", sms(SMS_CARRIER_REFUSED))
        clock.advance(10 * STEP_SECONDS)
        later = await result_of(client, "get_sms", {"sms_id": sent["id"]})

    assert (sent["status"], sent["error_code"]) == ("failed", "30007")
    assert later["status"] == "failed"
    assert [entry["status"] for entry in sandbox.outbox] == ["failed"]


async def test_an_undeliverable_sms_is_sent_then_undelivered(sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_sms", sms(SMS_UNDELIVERED))
        clock.advance(STEP_SECONDS)
        later = await result_of(client, "get_sms", {"sms_id": sent["id"]})

    assert sent["status"] == "sent"
    assert (later["status"], later["error_code"]) == ("undelivered", "30003")


@pytest.mark.parametrize(
    ("number", "expected"),
    [
        ("+14155550100", ["dialing", "ringing", "in_progress", "completed", "completed"]),
        (CALL_BUSY, ["dialing", "busy", "busy", "busy", "busy"]),
        (CALL_NO_ANSWER, ["dialing", "ringing", "no_answer", "no_answer", "no_answer"]),
    ],
)
async def test_a_call_progresses_to_its_terminal_state_and_stays_there(
    mode: str, sandbox: Sandbox, clock: ManualClock, number: str, expected: list[str]
) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        placed = await result_of(client, "place_call", call(number))
        seen = await statuses(client, clock, "get_call", "call_id", placed["id"], 4)
        events = await result_of(client, "get_events", {"id": f"call:{placed['id']}"})

    assert seen == expected
    assert [event["type"] for event in reversed(events["data"])] == list(dict.fromkeys(expected))


async def test_lists_are_newest_first_and_page_with_a_cursor(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        sent = [(await result_of(client, "send_email", email(f"lead{n}@example.com")))["id"] for n in range(3)]
        first = await result_of(client, "list_emails", {"limit": 2})
        second = await result_of(client, "list_emails", {"limit": 2, "cursor": first["next_cursor"]})

    assert [row["id"] for row in first["data"]] == [sent[2], sent[1]]
    assert first["has_more"] is True
    assert [row["id"] for row in second["data"]] == [sent[0]]
    assert (second["has_more"], second["next_cursor"]) == (False, None)


async def test_lists_filter_by_recipient_and_current_status(sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        delivered = await result_of(client, "send_sms", sms("+14155550101"))
        clock.advance(STEP_SECONDS)
        fresh = await result_of(client, "send_sms", sms("+14155550102"))
        by_number = await result_of(client, "list_sms", {"to": "+14155550101"})
        by_status = await result_of(client, "list_sms", {"status": "sent"})

    assert [row["id"] for row in by_number["data"]] == [delivered["id"]]
    assert [row["id"] for row in by_status["data"]] == [fresh["id"]]


async def test_org_wide_events_are_newest_first_and_filter_by_kind(sandbox: Sandbox, clock: ManualClock) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        sent = await result_of(client, "send_email", email())
        clock.advance(1.5 * STEP_SECONDS)
        placed = await result_of(client, "place_call", call())
        everything = await result_of(client, "get_events", {})
        emails_only = await result_of(client, "get_events", {"kind": "email"})

    assert [(event["resource"], event["type"]) for event in everything["data"]] == [
        (f"call:{placed['id']}", "dialing"),
        (f"email:{sent['id']}", "delivered"),
        (f"email:{sent['id']}", "sent"),
    ]
    assert {event["resource"] for event in emails_only["data"]} == {f"email:{sent['id']}"}


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("get_email", {"email_id": "9b2f0f55-0000-4000-8000-000000000000"}),
        ("get_sms", {"sms_id": "nope"}),
        ("get_call", {"call_id": "nope"}),
        ("get_email_events", {"email_id": "nope"}),
        ("get_events", {"id": "sms:9b2f0f55-0000-4000-8000-000000000000"}),
    ],
)
async def test_an_unknown_id_is_resource_not_found(mode: str, sandbox: Sandbox, tool: str, arguments: Any) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        assert await result_of(client, tool, arguments) == NOT_FOUND


async def test_get_events_refuses_an_id_without_a_kind_prefix(sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode="legacy") as client:
        answer = await result_of(client, "get_events", {"id": "9b2f0f55"})

    assert answer == {"error": "id must look like email:<uuid>, sms:<uuid> or call:<uuid>"}


async def test_whoami_names_the_organisation_and_user(mode: str, sandbox: Sandbox) -> None:
    async with Client(sandbox.server(), mode=mode) as client:
        me = await result_of(client, "whoami", {})

    assert me["org"]["name"] == "Hail Sandbox"
    assert me["user"]["email"] == "agent@sandbox.hail.test"


async def test_create_contact_has_no_key_so_each_call_creates_one(mode: str, sandbox: Sandbox) -> None:
    contact = {"name": "Ada", "email": "ada@example.com", "metadata": {"lead": 1}}
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "create_contact", contact)
        second = await result_of(client, "create_contact", contact)
        refused = await result_of(client, "create_contact", {"name": "Nobody"})

    assert first["id"] != second["id"]
    assert (first["name"], first["email"], first["metadata"]) == ("Ada", "ada@example.com", {"lead": 1})
    assert refused == {"error": "email or phone is required"}
    assert sandbox.outbox == []
