"""Scripted faults: how they are written, and what each kind does to a call."""

from __future__ import annotations

import json
from typing import Any

import anyio
import mcp.types as types
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client, MCPError

from hail_guard.sandbox import Fault, ManualClock, Sandbox, parse_fault

NO_CALLER_NUMBER = "no shared caller number is free right now; retry shortly"
PROCESSING = {"error": "request with this idempotency key is still processing"}
CONFLICT = {"error": "idempotency key reused with a different request body"}


def email(**changes: Any) -> dict[str, Any]:
    return {"to": ["lead@example.com"], "subject": "Hello", "body_text": "Hi!", "recipient_consent": True} | changes


def call(**changes: Any) -> dict[str, Any]:
    return {"to": "+14155550100", "system_prompt": "Be brief.", "recipient_consent": True} | changes


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["legacy", "auto"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sandbox_with(clock: ManualClock, *specs: str, **options: Any) -> Sandbox:
    return Sandbox(faults=[parse_fault(spec) for spec in specs], clock=clock, sleep=clock.sleep, **options)


async def result_of(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    with anyio.fail_after(5):
        answer = await client.call_tool(tool, arguments)
    assert answer.is_error is False
    assert isinstance(answer.content[0], types.TextContent)
    assert answer.structured_content == json.loads(answer.content[0].text)
    return dict(answer.structured_content)


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("send_email:2:hang_after_accept", Fault("send_email", 2, "hang_after_accept")),
        ("send_sms:*:delay:500", Fault("send_sms", None, "delay", 500)),
        ("place_call:1:fail_before_accept:503", Fault("place_call", 1, "fail_before_accept", 503)),
        ("send_email:1:fail_before_accept:429", Fault("send_email", 1, "fail_before_accept", 429)),
        (
            "send_email:3:fail_before_accept:429:2",
            Fault("send_email", 3, "fail_before_accept", 429, retry_after_seconds=2),
        ),
        ("get_email:*:error_after_accept:504", Fault("get_email", None, "error_after_accept", 504)),
        ("send_email:1:processing:250", Fault("send_email", 1, "processing", 250)),
        ("send_email:1:malformed", Fault("send_email", 1, "malformed")),
        ("send_sms:4:drop_after_accept", Fault("send_sms", 4, "drop_after_accept")),
    ],
)
def test_parse_fault_reads_tool_call_number_kind_and_argument(spec: str, fault: Fault) -> None:
    assert parse_fault(spec) == fault
    assert parse_fault(fault.spec()) == fault


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("", "expected TOOL:N:KIND[:ARG]"),
        ("send_email:1", "expected TOOL:N:KIND[:ARG]"),
        ("send_email::hang_after_accept", "expected TOOL:N:KIND[:ARG]"),
        ("send_mail:1:hang_after_accept", "unknown tool 'send_mail'"),
        ("send_email:0:hang_after_accept", "N must be a call number from 1, or * for every call"),
        ("send_email:x:hang_after_accept", "N must be a whole number, not 'x'"),
        ("send_email:1:explode", "unknown fault kind 'explode'"),
        ("send_email:1:delay", "delay needs a duration in milliseconds"),
        ("send_email:1:delay:-5", "ARG must be a whole number, not '-5'"),
        ("send_email:1:delay:5:6", "too many parts"),
        ("send_email:1:fail_before_accept:200", "fail_before_accept needs an HTTP status from 400 to 599"),
        ("send_email:1:error_after_accept:404", "error_after_accept needs a gateway status from 500 to 599"),
        ("send_email:1:hang_after_accept:5", "hang_after_accept takes no argument"),
        ("get_email:1:processing:100", "processing applies to the send tools only"),
        ("whoami:1:malformed", "malformed applies to the send tools only"),
    ],
)
def test_parse_fault_refuses_a_bad_spec_saying_why(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match="bad fault") as raised:
        parse_fault(spec)

    assert reason in str(raised.value)
    assert repr(spec) in str(raised.value)


SEND_TOOLS = ["send_email", "send_sms", "place_call"]
NTH = st.none() | st.integers(min_value=1, max_value=10_000)
VALID_FAULTS = st.one_of(
    st.builds(Fault, st.sampled_from(SEND_TOOLS), NTH, st.sampled_from(["delay", "processing"]), st.integers(0, 10**6)),
    st.builds(
        Fault, st.sampled_from([*SEND_TOOLS, "get_email"]), NTH, st.just("error_after_accept"), st.integers(500, 599)
    ),
    st.builds(
        Fault,
        st.sampled_from(SEND_TOOLS),
        NTH,
        st.just("fail_before_accept"),
        st.integers(400, 599),
        retry_after_seconds=st.just(7),
    ),
    st.builds(Fault, st.just("send_sms"), NTH, st.just("fail_before_accept"), st.just(429), st.integers(0, 3600)),
    st.builds(
        Fault,
        st.sampled_from(SEND_TOOLS),
        NTH,
        st.sampled_from(["hang_after_accept", "drop_after_accept", "malformed"]),
    ),
)


@given(VALID_FAULTS)
def test_every_fault_reads_back_from_its_own_spec(fault: Fault) -> None:
    assert parse_fault(fault.spec()) == fault


def test_a_fault_made_in_python_is_checked_like_a_parsed_one() -> None:
    with pytest.raises(ValueError, match="delay needs a duration in milliseconds"):
        Fault("send_email", 1, "delay")


async def test_a_fault_hits_only_the_numbered_call_of_its_tool(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:2:error_after_accept:502")
    async with Client(sandbox.server(), mode=mode) as client:
        first = await result_of(client, "send_email", email())
        other_tool = await result_of(client, "place_call", call())
        second = await result_of(client, "send_email", email())
        third = await result_of(client, "send_email", email())

    assert (first["status"], other_tool["status"], third["status"]) == ("sent", "dialing", "sent")
    assert second == {"error": "hail upstream error: 502"}
    assert sandbox.calls("send_email") == 3


async def test_add_fault_scripts_a_fault_at_run_time(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock)
    async with Client(sandbox.server(), mode=mode) as client:
        await result_of(client, "send_email", email())
        sandbox.add_fault(parse_fault("send_email:*:fail_before_accept:402"))
        refused = await result_of(client, "send_email", email())
        refused_again = await result_of(client, "send_email", email())

    assert refused == refused_again == {"error": "hail api error 402: insufficient credit"}
    assert len(sandbox.outbox) == 1


async def test_delay_waits_before_anything_is_sent(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:1:delay:500")
    results: list[dict[str, Any]] = []
    async with Client(sandbox.server(), mode=mode) as client, anyio.create_task_group() as tg:

        async def send() -> None:
            results.append(await result_of(client, "send_email", email()))

        tg.start_soon(send)
        with anyio.fail_after(5):
            await clock.wait_for_sleepers(1)
        assert sandbox.outbox == []
        clock.advance(0.5)

    assert results[0]["status"] == "sent"
    assert len(sandbox.outbox) == 1


async def test_latency_delays_every_call(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, latency_seconds=2.0)
    async with Client(sandbox.server(), mode=mode) as client, anyio.create_task_group() as tg:
        tg.start_soon(result_of, client, "whoami", {})
        with anyio.fail_after(5):
            await clock.wait_for_sleepers(1)
        clock.advance(1.0)
        assert clock.sleepers == 1
        clock.advance(1.0)

    assert clock.sleepers == 0


async def test_a_rate_limit_comes_before_the_key_check_and_saves_nothing(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:2:fail_before_accept:429:3", "send_email:3:fail_before_accept:429")
    async with Client(sandbox.server(), mode=mode) as client:
        await result_of(client, "send_email", email(idempotency_key="used"))
        changed_body = await result_of(client, "send_email", email(idempotency_key="used", subject="Other"))
        fresh_key = await result_of(client, "send_email", email(idempotency_key="fresh"))
        retried = await result_of(client, "send_email", email(idempotency_key="fresh"))

    assert changed_body == {"error": "hail api error 429: rate limit exceeded (retry after 3 seconds)"}
    assert fresh_key == {"error": "hail api error 429: rate limit exceeded (retry after 7 seconds)"}
    assert retried["status"] == "sent"
    assert len(sandbox.outbox) == 2


async def test_an_auth_failure_saves_nothing(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:1:fail_before_accept:401")
    async with Client(sandbox.server(), mode=mode) as client:
        refused = await result_of(client, "send_email", email(idempotency_key="k"))
        retried = await result_of(client, "send_email", email(idempotency_key="k"))

    assert refused == {"error": "auth failed: token rejected by Hail API"}
    assert retried["status"] == "sent"


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (502, "hail upstream error: 502"),
        (500, "hail upstream error: 500"),
        (402, "hail api error 402: insufficient credit"),
        (403, "hail api error 403: sending to this recipient is blocked by compliance rules"),
        (409, "request conflicts with the current state of the resource"),
        (422, "[{'loc': ['body'], 'msg': 'request rejected by the provider', 'type': 'value_error'}]"),
        (503, "service temporarily unavailable"),
    ],
)
async def test_a_scripted_refusal_is_saved_under_the_key_and_replayed(
    clock: ManualClock, status: int, error: str
) -> None:
    sandbox = sandbox_with(clock, f"send_email:1:fail_before_accept:{status}")
    async with Client(sandbox.server(), mode="legacy") as client:
        refused = await result_of(client, "send_email", email(idempotency_key="k"))
        replayed = await result_of(client, "send_email", email(idempotency_key="k"))
        new_key = await result_of(client, "send_email", email(idempotency_key="k2"))

    assert refused == replayed == {"error": error}
    assert new_key["status"] == "sent"
    assert [entry["idempotency_key"] for entry in sandbox.outbox] == ["k2"]


async def test_a_503_on_place_call_releases_the_key_so_a_same_key_retry_runs(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "place_call:1:fail_before_accept:503")
    async with Client(sandbox.server(), mode=mode) as client:
        refused = await result_of(client, "place_call", call(idempotency_key="k"))
        retried = await result_of(client, "place_call", call(idempotency_key="k"))

    assert refused == {"error": NO_CALLER_NUMBER}
    assert (retried["status"], retried["idempotency_key"]) == ("dialing", "k")
    assert len(sandbox.outbox) == 1


async def test_error_after_accept_saves_the_success_so_a_replay_returns_it(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:*:error_after_accept:502")
    async with Client(sandbox.server(), mode=mode) as client:
        gateway = await result_of(client, "send_email", email(idempotency_key="k"))
        replayed = await result_of(client, "send_email", email(idempotency_key="k"))

    assert gateway == {"error": "hail upstream error: 502"}
    assert (replayed["status"], replayed["id"]) == ("sent", sandbox.outbox[0]["id"])
    assert len(sandbox.outbox) == 1


async def test_processing_keeps_the_key_in_flight_until_the_request_completes(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:1:processing:1000")
    first: list[dict[str, Any]] = []
    async with Client(sandbox.server(), mode=mode) as client:
        async with anyio.create_task_group() as tg:

            async def send() -> None:
                first.append(await result_of(client, "send_email", email(idempotency_key="k")))

            tg.start_soon(send)
            with anyio.fail_after(5):
                await clock.wait_for_sleepers(1)
            assert await result_of(client, "send_email", email(idempotency_key="k")) == PROCESSING
            assert await result_of(client, "send_email", email(idempotency_key="k", subject="x")) == CONFLICT
            assert sandbox.outbox == []
            clock.advance(1.0)
        replayed = await result_of(client, "send_email", email(idempotency_key="k"))

    assert first[0]["status"] == "sent"
    assert replayed == first[0]
    assert len(sandbox.outbox) == 1


async def test_a_malformed_answer_names_a_field_the_request_lacks_though_the_message_was_sent(
    mode: str, clock: ManualClock
) -> None:
    sandbox = sandbox_with(clock, "send_email:1:malformed")
    async with Client(sandbox.server(), mode=mode) as client:
        answer = await result_of(client, "send_email", email(idempotency_key="k"))
        replayed = await result_of(client, "send_email", email(idempotency_key="k"))
        listed = await result_of(client, "list_emails", {"to": "lead@example.com"})

    assert answer == replayed == {"error": "sent_at: Input should be a valid datetime"}
    assert "sent_at" not in email()
    assert [row["id"] for row in listed["data"]] == [entry["id"] for entry in sandbox.outbox]


async def test_hang_after_accept_sends_and_saves_but_never_answers(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:1:hang_after_accept")
    async with Client(sandbox.server(), mode=mode) as client:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("send_email", email(idempotency_key="k"), read_timeout_seconds=0.2)
        replayed = await result_of(client, "send_email", email(idempotency_key="k"))

    assert raised.value.code == types.REQUEST_TIMEOUT
    assert (replayed["status"], replayed["id"]) == ("sent", sandbox.outbox[0]["id"])
    assert len(sandbox.outbox) == 1


async def test_a_hung_call_is_cancelled_with_its_caller(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:*:hang_after_accept")
    async with Client(sandbox.server(), mode=mode) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call_tool, "send_email", email())
            with anyio.fail_after(5):
                await sandbox.wait_for_outbox(1)
            tg.cancel_scope.cancel()
        assert (await result_of(client, "whoami", {}))["sandbox"] is True


async def test_drop_after_accept_closes_the_legacy_connection_after_sending(clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_email:1:drop_after_accept")
    async with Client(sandbox.server(), mode="legacy") as client:
        with pytest.raises(MCPError) as dropped, anyio.fail_after(5):
            await client.call_tool("send_email", email(idempotency_key="k"))
        with pytest.raises(MCPError) as after, anyio.fail_after(5):
            await client.call_tool("whoami", {})
    async with Client(sandbox.server(), mode="legacy") as reconnected:
        replayed = await result_of(reconnected, "send_email", email(idempotency_key="k"))

    assert dropped.value.code == after.value.code == types.CONNECTION_CLOSED
    assert (replayed["status"], replayed["id"]) == ("sent", sandbox.outbox[0]["id"])
    assert len(sandbox.outbox) == 1


async def test_drop_after_accept_in_direct_mode_fails_that_call_as_connection_closed(clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "send_sms:1:drop_after_accept")
    arguments = {"to": "+14155550100", "body": "Hi", "recipient_consent": True, "idempotency_key": "k"}
    async with Client(sandbox.server(), mode="auto") as client:
        with pytest.raises(MCPError) as dropped, anyio.fail_after(5):
            await client.call_tool("send_sms", arguments)
        replayed = await result_of(client, "send_sms", arguments)

    assert (dropped.value.code, dropped.value.message) == (types.CONNECTION_CLOSED, "Connection closed")
    assert replayed["id"] == sandbox.outbox[0]["id"]


async def test_faults_on_read_tools_answer_without_any_key(mode: str, clock: ManualClock) -> None:
    sandbox = sandbox_with(clock, "list_emails:1:fail_before_accept:429", "whoami:1:error_after_accept:503")
    async with Client(sandbox.server(), mode=mode) as client:
        limited = await result_of(client, "list_emails", {})
        gateway = await result_of(client, "whoami", {})
        listed = await result_of(client, "list_emails", {})

    assert limited == {"error": "hail api error 429: rate limit exceeded (retry after 7 seconds)"}
    assert gateway == {"error": "hail upstream error: 503"}
    assert listed == {"data": [], "has_more": False, "next_cursor": None}
