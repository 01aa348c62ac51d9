"""What each console page shows, read from the ledger (and, for the upstream, from the proxy).

Operations themselves are shown through `hail_guard.views` (`operation_view`, and `request_view`: the
stored request with its secrets redacted), as `hail-guard ops` and the agent's `get_operation` show
them. Every list is one page read through an index (`Ledger.search_operations`...).
Sends per hour come an hour at a time (`Ledger.hour_of_sends`): hours that ended are kept for
`KEEP_HOURS_SECONDS`, the current one is read on every view, so a busy ledger is never counted whole.
"""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hail_guard.ledger import Ledger
from hail_guard.models import DeliveryState, Event, HourOfSends, Operation, State, ToolPin
from hail_guard.server import Proxy

KEEP_HOURS_SECONDS = 600.0
"""How long the detail of an hour of the last day that ended is kept before it is read again (delivery moves on)."""
REFRESHED_PER_VIEW = 3
"""Hours of the last day read again at most per view, the longest kept first: a view never waits for them all."""
LIVE_STATES = (State.PLANNED, State.READY, State.SENDING, State.UNKNOWN, State.NEEDS_REVIEW)
"""Counted exactly on every view (`Ledger.count_states`): what waits for someone."""
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


class SendHistory:
    """Sends per hour over the last week, and the last day's in detail (states, deliveries).

    An hour older than a day is counted once (`Ledger.count_sent`) and kept: when a send first left never
    changes. An hour of the last day is read in detail (`Ledger.hour_of_sends`); the current one on every
    view, the ones that ended again after `KEEP_HOURS_SECONDS`, at most `REFRESHED_PER_VIEW` a view.
    """

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._sent: dict[datetime, int] = {}
        self._detail: dict[datetime, tuple[HourOfSends, float]] = {}

    async def week(self, now: datetime) -> tuple[list[tuple[datetime, int]], list[HourOfSends]]:
        """(each hour of the last week with its sends, oldest first; the last 24 hours in detail)."""
        current = now.replace(minute=0, second=0, microsecond=0)
        starts = [current - timedelta(hours=back) for back in range(7 * 24 - 1, -1, -1)]
        day = [await self._hour(start, current) for start in starts[-24:]]
        await self._refresh(starts[-24:], current)
        for start in starts[:-24]:
            if start not in self._sent:
                self._sent[start] = await self._ledger.count_sent(start, start + timedelta(hours=1))
        self._sent = {start: sent for start, sent in self._sent.items() if start >= starts[0]}
        self._detail = {start: kept for start, kept in self._detail.items() if start >= starts[-24]}
        week = [(start, self._sent[start]) for start in starts[:-24]] + [(hour.start, hour.sent) for hour in day]
        return week, day

    async def _hour(self, start: datetime, current: datetime) -> HourOfSends:
        kept = self._detail.get(start)
        if kept is None or start == current:
            kept = (await self._ledger.hour_of_sends(start), time.monotonic())
            self._detail[start] = kept
        return kept[0]

    async def _refresh(self, starts: list[datetime], current: datetime) -> None:
        """Read again the few hours of the last day kept longest, past `KEEP_HOURS_SECONDS` (for the next view)."""
        stale = [s for s in starts if s != current and self._detail[s][1] < time.monotonic() - KEEP_HOURS_SECONDS]
        for start in sorted(stale, key=lambda s: self._detail[s][1])[:REFRESHED_PER_VIEW]:
            self._detail[start] = (await self._ledger.hour_of_sends(start), time.monotonic())


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


async def overview(proxy: Proxy, history: SendHistory) -> dict[str, Any]:
    ledger = proxy.ledger
    await ledger.expire_leases()  # what the operator sees is what is true now
    now = await ledger.now()
    week, day = await history.week(now)
    accepted, delivery = outcomes(day)
    pins = await ledger.tool_pins()
    return {
        "now": now,
        "live": LIVE_STATES,
        "counts": await ledger.count_states(LIVE_STATES),
        "settled_day": {
            state: sum(hour.states.get(state, 0) for hour in day) for state in (State.ACCEPTED, State.FAILED)
        },
        "oldest_unknown": await ledger.oldest(State.UNKNOWN),
        "oldest_review": await ledger.oldest(State.NEEDS_REVIEW),
        "day": week[-24:],
        "week": week,
        "accepted_day": accepted,
        "outcomes": delivery,
        "connected": proxy.upstream.connected,
        "sign_in_problem": proxy.upstream.sign_in_problem,
        "changed_tools": [pin.name for pin in pins if pin.changed],
        "tools": len(pins),
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


async def timeline(ledger: Ledger, operation: Operation) -> list[dict[str, Any]]:
    """Everything that happened to an operation, oldest first: state moves, decisions, delivery."""
    moves = [
        {"at": e.at, "kind": "decision" if _decided(e) else "state", "what": _move(e), "who": e.actor,
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


async def tool_changes(ledger: Ledger) -> list[ToolChange]:
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
