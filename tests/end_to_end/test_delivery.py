"""Delivery after acceptance: the order of states, and the tracker polling the sandbox as its clock moves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hail_guard import app, delivery
from hail_guard.config import Settings
from hail_guard.errors import LedgerUnavailable
from hail_guard.models import DeliveryObservation, DeliveryState, State
from hail_guard.sandbox import CALL_BUSY, SMS_UNDELIVERED, ManualClock, Sandbox
from hail_guard.sandbox.clock import MANUAL_CLOCK_START
from hail_guard.tracker import Tracker, TrackerSettings
from tests.conftest import Harness, data, email, open_harness

STEP_SECONDS = 60.0
D = DeliveryState


def observed(state: DeliveryState) -> DeliveryObservation:
    return DeliveryObservation(state=state, source="webhook")


@given(
    st.sampled_from(sorted(delivery.CHANNEL_STATES)).flatmap(
        lambda c: st.lists(st.sampled_from(delivery.CHANNEL_STATES[c]))
    )
)
def test_delivery_never_moves_back_and_ends_at_the_furthest_state_seen(states: list[DeliveryState]) -> None:
    current: DeliveryState | None = None
    for state in states:
        moved = delivery.settle(current, [observed(state)])
        if moved is not None:
            assert current is None or delivery.RANK[moved.state] > delivery.RANK[current]
            current = moved.state
        if current in delivery.FINAL:
            assert delivery.settle(current, [observed(other) for other in delivery.RANK]) is None
    if states:
        assert current is not None
        assert delivery.RANK[current] == max(delivery.RANK[state] for state in states)


def test_a_record_says_its_status_and_every_event_time_it_carries() -> None:
    record = {
        "status": "delivered",
        "delivered_at": "2030-01-01T09:01:00Z",
        "delivery_delayed_at": "2030-01-01T09:00:30Z",
        "updated_at": "2030-01-01T09:01:00Z",
    }
    found = delivery.observations_of_record("email", record)
    assert [(o.state, o.occurred_at) for o in found] == [
        (D.DELIVERY_DELAYED, datetime(2030, 1, 1, 9, 0, 30, tzinfo=UTC)),
        (D.DELIVERED, datetime(2030, 1, 1, 9, 1, tzinfo=UTC)),
    ]
    assert delivery.observations_of_record("sms", {"status": "sent"}) == []
    assert [o.state for o in delivery.observations_of_record("call", {"status": "no_answer"})] == [D.NO_ANSWER]


@pytest.mark.parametrize(("body", "word"), [(" stop ", "STOP"), ("Unsubscribe", "UNSUBSCRIBE"), ("QUIT\n", "QUIT")])
def test_opt_out_words_are_whole_bodies_in_any_case(body: str, word: str) -> None:
    assert delivery.opt_out_word(body) == word


@pytest.mark.parametrize("body", ["please stop", "STOPS", "", None, 7])
def test_other_replies_are_not_opt_outs(body: object) -> None:
    assert delivery.opt_out_word(body) is None


def test_checks_back_off_exponentially_up_to_a_cap() -> None:
    waits = [delivery.next_check_seconds(n, first_seconds=30, factor=2, most_seconds=200) for n in range(5)]
    assert waits == [30, 60, 120, 200, 200]


@asynccontextmanager
async def polled(tmp_path: Path) -> AsyncIterator[tuple[Harness, Tracker, ManualClock]]:
    """hail-guard over a sandbox whose delivery moves one step a minute, only when its clock is advanced."""
    clock = ManualClock()
    sandbox = Sandbox(clock=clock, sleep=clock.sleep, delivery_delay_seconds=STEP_SECONDS)
    async with open_harness(tmp_path, sandbox=sandbox) as harness:
        settings = TrackerSettings(interval_seconds=STEP_SECONDS, first_backoff_seconds=0.0, timeout_seconds=5.0)
        yield harness, Tracker(harness.ledger, harness.proxy.upstream, settings, sleep=clock.sleep), clock


async def send(harness: Harness, tool: str, arguments: dict[str, Any]) -> str:
    result = await harness.call(tool, arguments)
    assert not result.is_error, result
    operation_id: str = data(result)["hail_guard"]["operation_id"]
    return operation_id


async def test_a_bounce_is_polled_into_delivery_while_the_state_stays_accepted(tmp_path: Path) -> None:
    async with polled(tmp_path) as (harness, tracker, clock):
        operation_id = await send(harness, "send_email", email(to=["bounce@example.com"]))
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(tracker.run)
                await tracker.wait_for_rounds(1)
                assert (await harness.ledger.get(operation_id)).delivery_state is None
                await clock.wait_for_sleepers(1)
                clock.advance(STEP_SECONDS)
                await tracker.wait_for_rounds(2)
                tg.cancel_scope.cancel()
        shown = data(await harness.call("get_operation", {"operation_id": operation_id}))
    bounced_at = MANUAL_CLOCK_START + timedelta(seconds=STEP_SECONDS)
    assert (shown["state"], shown["delivery_state"]) == ("accepted", "bounced")
    assert shown["delivery_at"] == bounced_at.isoformat()
    [event] = shown["delivery_events"]
    assert (event["state"], delivery.parse_time(event["occurred_at"]), event["source"]) == (
        "bounced",
        bounced_at,
        "poll",
    )
    assert [entry["to_state"] for entry in shown["history"]] == ["sending", "accepted"]


async def test_sms_and_calls_are_polled_to_their_final_delivery_and_then_left_alone(tmp_path: Path) -> None:
    async with polled(tmp_path) as (harness, tracker, clock):
        sms = await send(harness, "send_sms", {"to": SMS_UNDELIVERED, "body": "Hi", "recipient_consent": True})
        call = await send(
            harness, "place_call", {"to": CALL_BUSY, "system_prompt": "Say hi", "recipient_consent": True}
        )
        assert await tracker.poll_once() == 2
        clock.advance(STEP_SECONDS)
        assert await tracker.poll_once() == 2
        assert (await harness.ledger.get(sms)).delivery_state is D.UNDELIVERED
        assert (await harness.ledger.get(call)).delivery_state is D.BUSY
        assert {(await harness.ledger.get(op)).state for op in (sms, call)} == {State.ACCEPTED}
        assert await tracker.poll_once() == 0


async def test_a_delayed_email_is_tracked_through_the_delay_to_delivered(tmp_path: Path) -> None:
    async with polled(tmp_path) as (harness, tracker, clock):
        operation_id = await send(harness, "send_email", email(to=["delayed@example.com"]))
        clock.advance(STEP_SECONDS)
        await tracker.poll_once()
        assert (await harness.ledger.get(operation_id)).delivery_state is D.DELIVERY_DELAYED
        clock.advance(STEP_SECONDS)
        await tracker.poll_once()
        tracked = await harness.ledger.get(operation_id)
        events = await harness.ledger.delivery_events(operation_id)
    assert (tracked.delivery_state, tracked.delivery_checks) == (D.DELIVERED, 2)
    assert [e.state for e in events] == [D.DELIVERY_DELAYED, D.DELIVERED]


async def test_the_app_tracks_beside_serve_and_worker_unless_switched_off(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        off = Settings.model_validate({"delivery": {"poll": False}})
        async with app.tracking(off, harness.opened()) as none:
            assert none is None
        async with app.tracking(Settings(), harness.opened()) as tracker:
            assert tracker is not None
            with anyio.fail_after(10):
                await tracker.wait_for_rounds(1)
            assert tracker.settings.interval_seconds == Settings().delivery.poll_interval_seconds


async def test_an_error_in_the_tracked_block_comes_out_as_raised_not_in_a_group(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        with pytest.raises(LedgerUnavailable, match="disk full"):
            async with app.tracking(Settings(), harness.opened()):
                raise LedgerUnavailable("disk full")
