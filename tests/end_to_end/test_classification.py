"""Every row of the classification table (docs/explanation/hail.md), driven through hail-guard against the sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from hail_guard.models import State
from hail_guard.sandbox import SMS_CARRIER_REFUSED
from hail_guard.upstream import UpstreamTarget, connect_upstream
from tests.conftest import Harness, data, email, open_harness, text
from tests.end_to_end.test_stdio import outbox_lines, running_sandbox, serve_params

KEY = "c1:l1:email:intro"


def sms(to: str = "+14155550100") -> dict[str, Any]:
    return {"to": to, "body": "Hi!", "recipient_consent": True, "idempotency_key": "sms-1"}


def call(to: str = "+14155550100") -> dict[str, Any]:
    return {"to": to, "system_prompt": "Say hello.", "recipient_consent": True, "idempotency_key": "call-1"}


async def state_of(harness: Harness, result: Any) -> State:
    return (await harness.ledger.get(data(result)["hail_guard"]["operation_id"])).state


async def test_an_sms_the_carrier_refused_is_failed_with_hails_id(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        result = await harness.call("send_sms", sms(SMS_CARRIER_REFUSED))
        operation = await harness.ledger.get(data(result)["hail_guard"]["operation_id"])
        assert operation.state is State.FAILED
        assert operation.provider_id == data(result)["id"]
        assert data(result)["error_code"]


async def test_a_key_still_processing_upstream_is_unknown_then_reconciled(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:processing:800") as harness:
        forwarded = {**email(), "idempotency_key": KEY}
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.sandbox.invoke, "send_email", forwarded)  # another caller holds the key
            await anyio.wait_all_tasks_blocked()
            result = await harness.call("send_email", email())
            assert await state_of(harness, result) is State.UNKNOWN
            unknown = await harness.ledger.get(data(result)["hail_guard"]["operation_id"])
            assert "still processing" in (unknown.last_error or "")
        [settled] = await harness.proxy.guard.reconcile(data(result)["hail_guard"]["operation_id"])
        assert settled.state is State.ACCEPTED
        assert len(harness.sandbox.outbox) == 1


async def test_a_key_hail_holds_for_another_request_goes_to_review(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        await harness.sandbox.invoke("send_email", {**email(subject="Other"), "idempotency_key": KEY})
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.NEEDS_REVIEW
        assert "NEEDS REVIEW" in text(result)
        assert len(harness.sandbox.outbox) == 1


async def test_a_rate_limit_saves_nothing_and_the_same_key_is_safe_later(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:429:0") as harness:
        limited = await harness.call("send_email", email())
        assert await state_of(harness, limited) is State.READY
        assert "NOT SENT" in text(limited)
        retried = await harness.call("send_email", email())
        assert not retried.is_error
        assert data(retried)["hail_guard"]["state"] == "accepted"
        assert [m["idempotency_key"] for m in harness.sandbox.outbox] == [KEY]


async def test_a_rate_limit_is_not_retried_before_its_retry_after(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:429:600") as harness:
        await harness.call("send_email", email())
        again = await harness.call("send_email", email())
        assert data(again)["hail_guard"]["state"] == "ready"
        assert "not_before" in data(again)["hail_guard"]
        assert harness.sandbox.calls("send_email") == 1


async def test_an_auth_failure_saves_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:401") as harness:
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.READY
        assert "auth failed" in text(result)


async def test_a_call_503_releases_the_key_and_a_retry_places_the_call(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "place_call:1:fail_before_accept:503") as harness:
        first = await harness.call("place_call", call())
        assert await state_of(harness, first) is State.READY
        second = await harness.call("place_call", call())
        assert data(second)["hail_guard"]["state"] == "accepted"
        assert len(harness.sandbox.outbox) == 1


async def test_a_definitive_refusal_is_failed_and_never_forwarded_again(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:402") as harness:
        first = await harness.call("send_email", email())
        assert await state_of(harness, first) is State.FAILED
        assert "insufficient credit" in data(first)["error"]
        again = await harness.call("send_email", email())
        assert data(again)["hail_guard"] == {**data(first)["hail_guard"], "replayed": True}
        assert harness.sandbox.calls("send_email") == 1


async def test_a_saved_validation_failure_is_failed(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:422") as harness:
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.FAILED


async def test_a_gateway_5xx_that_hid_a_success_is_unknown_until_reconcile_finds_it(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:error_after_accept:502") as harness:
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.UNKNOWN
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.ACCEPTED
        assert settled.provider_id == harness.sandbox.outbox[0]["id"]
        assert len(harness.sandbox.outbox) == 1


async def test_a_success_hail_could_not_read_is_unknown_and_a_repeat_goes_to_review(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:malformed") as harness:
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.UNKNOWN
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.NEEDS_REVIEW
        assert len(harness.sandbox.outbox) == 1


async def test_an_unrecognised_error_that_a_replay_repeats_is_a_saved_failure(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:fail_before_accept:409") as harness:
        result = await harness.call("send_email", email())
        assert await state_of(harness, result) is State.UNKNOWN
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.FAILED
        assert harness.sandbox.outbox == []


async def test_an_unknown_older_than_hails_key_retention_goes_to_review_without_a_replay(tmp_path: Path) -> None:
    async with open_harness(
        tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.3, key_retention_hours=0.5
    ) as harness:
        await harness.call("send_email", email())
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.NEEDS_REVIEW
        assert "retention" in (settled.review_reason or "")
        assert harness.sandbox.calls("send_email") == 1


async def test_replays_that_stay_unclear_end_in_review(tmp_path: Path) -> None:
    async with open_harness(
        tmp_path, "send_email:1:processing:3000", timeout_seconds=0.3, max_reconcile_attempts=1
    ) as harness:
        await harness.call("send_email", email())
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.NEEDS_REVIEW
        assert "after 1 reconcile attempts" in (settled.review_reason or "")


STDIO_ROWS: list[tuple[str, str, dict[str, Any], str | None, str]] = [
    # (row of the README's table, tool, arguments, the sandbox's fault on its call, the first attempt's state)
    ("a record with id and status", "send_email", {}, None, "accepted"),
    ("an SMS the carrier refused", "send_sms", {"to": SMS_CARRIER_REFUSED}, None, "failed"),
    ("a key Hail holds for another request", "send_email", {"idempotency_key": "held-by-hail"}, None, "needs_review"),
    ("a 429 with its retry-after", "send_email", {}, "fail_before_accept:429", "ready"),
    ("auth failed", "send_email", {}, "fail_before_accept:401", "ready"),
    ("a call's no free number", "place_call", {}, "fail_before_accept:503", "ready"),
    ("another 4xx", "send_email", {}, "fail_before_accept:402", "failed"),
    ("a 422 detail list", "send_email", {}, "fail_before_accept:422", "failed"),
    ("hail upstream error: 5xx", "send_email", {}, "error_after_accept:502", "unknown"),
    ("a timeout", "send_email", {}, "hang_after_accept", "unknown"),
    ("a dropped connection", "send_email", {}, "drop_after_accept", "unknown"),
    ("a field the request never had", "send_email", {}, "malformed", "unknown"),
]
"""Each row of the README's classification table an upstream answers by itself, as it reaches `serve` over stdio."""


def stdio_request(row: int, tool: str, changes: dict[str, Any]) -> dict[str, Any]:
    """A message of its own to a recipient of its own: no row is held or matched by another."""
    metadata = {"campaign_id": "table", "lead_id": f"row{row}", "message_id": "m"}
    if tool == "send_email":
        mail = email(to=[f"row{row}@example.com"], subject=f"Row {row}", body_text=f"Row {row} of the table.")
        return {**mail, "metadata": metadata, **changes}
    number = f"+1415555{row:04d}"
    if tool == "send_sms":
        return {"to": number, "body": f"Row {row}", "recipient_consent": True, "metadata": metadata, **changes}
    return {**call(number), "idempotency_key": f"row-{row}", **changes}


async def test_every_row_of_the_classification_table_over_stdio(tmp_path: Path) -> None:
    calls: dict[str, int] = {"send_email": 1}  # the seeding call below is send_email's first
    faults = []
    for _, tool, _, fault, _ in STDIO_ROWS:
        calls[tool] = calls.get(tool, 0) + 1
        if fault is not None:
            faults.append(f"{tool}:{calls[tool]}:{fault}")
    async with running_sandbox(tmp_path, *faults) as (url, outbox):
        async with connect_upstream(UpstreamTarget(kind="http", url=url), heartbeat_seconds=None) as hail:
            seeded = {**email(subject="Another request"), "idempotency_key": "held-by-hail"}
            assert not (await hail.call_tool("send_email", seeded)).is_error
        async with Client(serve_params(tmp_path, url, timeout=1.0), mode="legacy") as agent:
            seen = {}
            for row, (name, tool, changes, _, _) in enumerate(STDIO_ROWS):
                answer = data(await agent.call_tool(tool, stdio_request(row, tool, changes)))
                seen[name] = answer["hail_guard"]
            settled = {
                view["operation_id"]: view for view in data(await agent.call_tool("reconcile", {}))["reconciled"]
            }
    assert {name: view["state"] for name, view in seen.items()} == {row[0]: row[4] for row in STDIO_ROWS}
    assert "not_before" in seen["a 429 with its retry-after"]  # not before the wait Hail named
    replayed = {name: settled[seen[name]["operation_id"]]["state"] for name in seen if seen[name]["state"] == "unknown"}
    assert replayed == {
        "hail upstream error: 5xx": "accepted",  # the replay finds the success the gateway hid
        "a timeout": "accepted",
        "a dropped connection": "accepted",
        "a field the request never had": "needs_review",  # the replay repeats it: a human decides
    }
    keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
    assert len(keys) == len(set(keys))  # each accepted once, replays included
