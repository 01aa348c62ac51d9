"""Delivery after acceptance: which states exist, what may follow what, and how Hail reports them.

Pure decisions, no I/O: both ledger backends, the tracker (polling) and the webhook receiver use
these, so the order of delivery states lives here and nowhere else (never in SQL).

    rank 1  delivery_delayed                                   email; more is to come
    rank 2  delivered                                          email, SMS; settled (polling stops)
    rank 3  opened                                             email; settled
    rank 4  bounced, complained                                email; final
            undelivered, failed                                SMS (failed: also calls); final
            completed, busy, no_answer, canceled               calls; final

A state replaces the current one only when its rank is higher, so a late, repeated or
out-of-order event never moves delivery back, and a final state never changes. Each state is still
recorded once as an event, with its time. Delivery never changes an operation's `state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from hail_guard.models import DeliveryObservation, DeliveryState

D = DeliveryState

FINAL: Final = frozenset(
    {D.BOUNCED, D.COMPLAINED, D.UNDELIVERED, D.FAILED, D.COMPLETED, D.BUSY, D.NO_ANSWER, D.CANCELED}
)
"""Nothing changes after these."""
RANK: Final[Mapping[DeliveryState, int]] = {
    D.DELIVERY_DELAYED: 1,
    D.DELIVERED: 2,
    D.OPENED: 3,
    **dict.fromkeys(FINAL, 4),
}
SETTLED: Final = FINAL | {D.DELIVERED, D.OPENED}
"""Polling stops at these; a later open or complaint can still arrive by webhook."""

CHANNEL_STATES: Final[Mapping[str, tuple[DeliveryState, ...]]] = {
    "email": (D.DELIVERY_DELAYED, D.DELIVERED, D.OPENED, D.COMPLAINED, D.BOUNCED),
    "sms": (D.DELIVERED, D.UNDELIVERED, D.FAILED),
    "call": (D.COMPLETED, D.FAILED, D.BUSY, D.NO_ANSWER, D.CANCELED),
}
"""The delivery states each channel reports (docs/explanation/hail.md, "What happens after acceptance")."""

EVENT_TYPES: Final[Mapping[str, DeliveryState]] = {
    f"{channel}.{state.value}": state for channel, states in CHANNEL_STATES.items() for state in states
}
"""Hail webhook event types that carry a delivery state (`email.bounced`, `call.no_answer`, ...)."""
SMS_RECEIVED: Final = "sms.received"

OPT_OUT_WORDS: Final = frozenset({"STOP", "STOPALL", "UNSUBSCRIBE", "CANCEL", "END", "QUIT"})
"""An inbound SMS whose whole body is one of these (any case, trimmed) is an opt-out."""


def settle(current: DeliveryState | None, observations: Iterable[DeliveryObservation]) -> DeliveryObservation | None:
    """The observation that becomes the current delivery state, or None when nothing moves forward.

    Only a higher rank wins; among several of the same rank, the first given wins.
    """
    best: DeliveryObservation | None = None
    floor = RANK[current] if current is not None else 0
    for observation in observations:
        if RANK[observation.state] > (RANK[best.state] if best is not None else floor):
            best = observation
    return best


def observations_of_record(
    channel: str, record: Mapping[str, Any], *, source: str = "poll", detail: str | None = None
) -> list[DeliveryObservation]:
    """What a record read back (Hail's `get_email` / `get_sms` / `get_call`) says about delivery, in rank order.

    The record's `status`, plus any `<state>_at` time it carries (e.g. `opened_at`, which does not
    change the status). Unknown statuses (`sent`, `ringing`, ...) say nothing.
    """
    states = CHANNEL_STATES.get(channel, ())
    status = record.get("status")
    found: dict[DeliveryState, datetime | None] = {}
    for state in states:
        at = parse_time(record.get(f"{state.value}_at"))
        if at is not None or status == state.value:
            found[state] = at or (parse_time(record.get("updated_at")) if status == state.value else None)
    return [
        DeliveryObservation(state=state, occurred_at=at, source=source, detail=detail)
        for state, at in sorted(found.items(), key=lambda item: RANK[item[0]])
    ]


def next_check_seconds(checks: int, *, first_seconds: float, factor: float, most_seconds: float) -> float:
    """How long to wait before polling an operation again, after `checks` checks (exponential, capped)."""
    return min(most_seconds, first_seconds * factor ** max(0, checks))


def opt_out_word(body: object) -> str | None:
    """The opt-out word an inbound SMS body is, or None."""
    if not isinstance(body, str):
        return None
    word = body.strip().upper()
    return word if word in OPT_OUT_WORDS else None


def parse_time(value: object) -> datetime | None:
    """An ISO 8601 time (`Z` allowed) or Unix seconds, as UTC; None for anything else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, tz=UTC)
        except (OverflowError, OSError, ValueError):
            return None
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
