"""What each console page shows, read from the ledger (and, for the upstream, from the proxy).

Operations themselves are shown through `hail_guard.views` (`operation_view`, and `request_view`: the
stored request with its secrets redacted), as `hail-guard ops` and the agent's `get_operation` show
them. Every list is one page read through an index (`Ledger.search_operations`...).
Sends per hour over the week come in one read of the counts the ledger keeps as it writes
(`Ledger.sends_by_hour`): nothing is counted over the operations, and nothing is kept between views.
Who is sending comes from the heartbeats workers and batch runs keep (`Ledger.heartbeats`); a process
is shown as its host and pid (`batch.sender_name`), never as a claim's fence.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hail_guard.batch import STALE_SECONDS, sender_name
from hail_guard.ledger import Heartbeat, Heartbeats, Ledger, Overview, ToolPins, Tracking
from hail_guard.lifecycle import OPEN, STATES
from hail_guard.models import DeliveryState, Event, HourOfSends, Operation, State, ToolPin
from hail_guard.server import UpstreamTools

WEEK_HOURS = 7 * 24
OPEN_STATES = tuple(state for state in STATES if state in OPEN)
"""Counted exactly on every view (`Ledger.count_states`): what waits for someone (`lifecycle.OPEN`)."""
SUMMARY_FIELDS = ("subject", "body_text", "body", "first_message", "from_", "cc", "bcc")
"""What a request summary shows of the stored request (never a secret the upstream needs, such as an LLM key)."""
SUMMARY_CHARACTERS = 300
OUTCOMES = (
    ("delivered", (DeliveryState.DELIVERED, DeliveryState.OPENED, DeliveryState.COMPLETED)),
    ("bounced", (DeliveryState.BOUNCED,)),
    ("complained", (DeliveryState.COMPLAINED,)),
    ("undelivered", (DeliveryState.UNDELIVERED, DeliveryState.FAILED, DeliveryState.NO_ANSWER, DeliveryState.BUSY)),
)
"""Delivery outcomes as the overview counts them, each over what Hail accepted."""


@dataclass(frozen=True)
class Outcome:
    name: str
    count: int
    rate: float | None


def outcomes(hours: list[HourOfSends]) -> tuple[int, list[Outcome]]:
    """(accepted, each outcome with its share of accepted) over these hours."""
    accepted = sum(hour.states.get(State.ACCEPTED, 0) for hour in hours)
    found = []
    for name, states in OUTCOMES:
        count = sum(hour.deliveries.get(state, 0) for hour in hours for state in states)
        found.append(Outcome(name, count, count / accepted if accepted else None))
    return accepted, found


async def week_of_sends(ledger: Overview, now: datetime) -> tuple[list[tuple[datetime, int]], list[HourOfSends]]:
    """(each hour of the last week with its sends, oldest first, the current hour last; the last day's hours
    that had sends, in detail): one read of the counts the ledger keeps (`Ledger.sends_by_hour`)."""
    current = now.replace(minute=0, second=0, microsecond=0)
    starts = [current - timedelta(hours=back) for back in range(WEEK_HOURS - 1, -1, -1)]
    found = {hour.start: hour for hour in await ledger.sends_by_hour(starts[0])}
    week = [(start, found[start].sent if start in found else 0) for start in starts]
    return week, [found[start] for start in starts[-24:] if start in found]


@dataclass(frozen=True)
class Sender:
    """A heartbeat as a page shows it."""

    who: str
    role: str
    batch_id: str | None
    since: datetime | None
    seen: datetime | None
    stale: bool
    """Silent for longer than `batch.STALE_SECONDS`: it may have stopped."""


def sender(beat: Heartbeat, now: datetime) -> Sender:
    stale = beat.seen_at is None or (now - beat.seen_at).total_seconds() > STALE_SECONDS
    return Sender(sender_name(beat.who), beat.role, beat.batch_id, beat.started_at, beat.seen_at, stale)


async def senders(ledger: Heartbeats, now: datetime, batch_id: str | None = None) -> list[Sender]:
    """Who is sending (from `batch_id`: those sending it, or every batch), live ones first."""
    beats = [beat for beat in await ledger.heartbeats() if batch_id is None or beat.batch_id in (None, batch_id)]
    return sorted((sender(beat, now) for beat in beats), key=lambda found: found.stale)


def current_error(operation: Operation) -> str | None:
    """The last error while it still says something: once Hail's acceptance is known (reconcile found it, an
    operator resolved it) or the send was cancelled, an earlier error ("it may have been sent") is history,
    which the timeline keeps."""
    return None if operation.state in (State.ACCEPTED, State.CANCELLED) else operation.last_error


async def overview(ledger: Ledger, upstream: UpstreamTools) -> dict[str, Any]:
    await ledger.expire_leases()  # what the operator sees is what is true now
    now = await ledger.now()
    week, day = await week_of_sends(ledger, now)
    accepted, delivery = outcomes(day)
    pins = await ledger.tool_pins()
    return {
        "now": now,
        "open": OPEN_STATES,
        "counts": await ledger.count_states(OPEN_STATES),
        "settled_day": {
            state: sum(hour.states.get(state, 0) for hour in day) for state in (State.ACCEPTED, State.FAILED)
        },
        "oldest_unknown": await ledger.oldest(State.UNKNOWN),
        "oldest_review": await ledger.oldest(State.NEEDS_REVIEW),
        "day": week[-24:],
        "week": week,
        "accepted_day": accepted,
        "outcomes": delivery,
        "connected": upstream.connected,
        "sign_in_problem": upstream.sign_in_problem,
        "changed_tools": [pin.name for pin in pins if pin.changed],
        "tools": len(pins),
        "senders": await senders(ledger, now),
    }


def summary(operation: Operation) -> list[tuple[str, str]]:
    """The message in a few fields (`SUMMARY_FIELDS`), each cut to `SUMMARY_CHARACTERS`."""
    arguments = operation.arguments()
    shown = []
    for name in SUMMARY_FIELDS:
        value = arguments.get(name)
        if value in (None, "", []):
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        shown.append((name, text if len(text) <= SUMMARY_CHARACTERS else text[:SUMMARY_CHARACTERS] + "…"))
    return shown


async def timeline(ledger: Tracking, operation: Operation) -> list[dict[str, Any]]:
    """Everything that happened to an operation, oldest first: state moves, decisions, delivery."""
    moves = [
        {"at": e.at, "kind": "decision" if _decided(e) else "state", "what": _move(e), "who": sender_name(e.actor),
         "why": e.reason}
        for e in await ledger.events(operation.id)
    ]  # fmt: skip
    delivered = [
        {"at": d.recorded_at, "kind": "delivery", "what": f"delivery: {d.state.value}", "who": d.source,
         "why": f"happened {when(d.occurred_at) if d.occurred_at else 'at a time not given'}"
         + (f" ({d.detail})" if d.detail else "")}
        for d in await ledger.delivery_events(operation.id)
    ]  # fmt: skip
    return sorted(moves + delivered, key=lambda item: item["at"])


def when(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _move(event: Event) -> str:
    before = event.from_state.value if event.from_state is not None else "new"
    return f"{before} → {event.to_state.value}"


def _decided(event: Event) -> bool:
    """A person's decision: a review resolved or resent, or a batch approved."""
    leaving_review = event.from_state is State.NEEDS_REVIEW or event.reason.startswith("review:")
    return leaving_review or (event.from_state, event.to_state) == (State.PLANNED, State.READY)


@dataclass(frozen=True)
class ToolChange:
    pin: ToolPin
    diff: list[str]
    """Unified diff of the accepted definition against the current one; empty when either was not kept."""


async def tool_changes(ledger: ToolPins) -> list[ToolChange]:
    pins = await ledger.tool_pins()
    wanted = [fp for pin in pins if pin.changed for fp in (pin.accepted_fingerprint, pin.fingerprint)]
    known = await ledger.tool_definitions(wanted) if wanted else {}
    changes = []
    for pin in pins:
        before, after = known.get(pin.accepted_fingerprint), known.get(pin.fingerprint)
        diff = []
        if pin.changed and before is not None and after is not None:
            diff = list(
                difflib.unified_diff(_pretty(before), _pretty(after), "accepted", "now offered", lineterm="", n=3)
            )
        changes.append(ToolChange(pin, diff))
    return changes


def _pretty(definition: str) -> list[str]:
    return json.dumps(json.loads(definition), indent=2, sort_keys=True, ensure_ascii=False).splitlines()
