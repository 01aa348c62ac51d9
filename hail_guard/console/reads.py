"""What each console page shows, read from the ledger (and, for the upstream, from the proxy).

The only module of the console that reaches the shared views of operations (`operation_view`): the
pages and exports show what `hail-guard ops` and the agent's `get_operation` show. Every list is one
page read through an index (`Ledger.search_operations`...).
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
from hail_guard.views import operation_view

__all__ = ["operation_view"]

KEEP_HOURS_SECONDS = 600.0
"""How long the count of an hour that ended is kept before it is read again (delivery moves on)."""
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
    """Sends per hour, an hour at a time from the ledger; ended hours kept a while (see the module docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._kept: dict[datetime, tuple[HourOfSends, float]] = {}

    async def hours(self, now: datetime, count: int) -> list[HourOfSends]:
        """The last `count` hours up to `now`'s, oldest first."""
        current = now.replace(minute=0, second=0, microsecond=0)
        found = []
        for back in range(count - 1, -1, -1):
            start = current - timedelta(hours=back)
            kept = self._kept.get(start)
            if kept is None or start == current or kept[1] < time.monotonic() - KEEP_HOURS_SECONDS:
                kept = (await self._ledger.hour_of_sends(start), time.monotonic())
                self._kept[start] = kept
            found.append(kept[0])
        oldest = current - timedelta(hours=count)
        self._kept = {start: value for start, value in self._kept.items() if start > oldest}
        return found


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
    week = await history.hours(now, 7 * 24)
    accepted, delivery = outcomes(week[-24:])
    pins = await ledger.tool_pins()
    return {
        "now": now,
        "counts": await ledger.count_by_state(),
        "oldest_unknown": await ledger.oldest(State.UNKNOWN),
        "oldest_review": await ledger.oldest(State.NEEDS_REVIEW),
        "day": [(hour.start, hour.sent) for hour in week[-24:]],
        "week": [(hour.start, hour.sent) for hour in week],
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
