"""The console's two pictures, drawn on the server as SVG shapes (no script, no inline style).

`bars` is the sends-per-hour chart; `stacked` is a batch's progress bar, one segment per state.
Both return plain numbers for the template to place; colours come from CSS classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from hail_guard.lifecycle import STATES
from hail_guard.models import State

PROGRESS_ORDER = tuple(STATES)
"""Settled first, then what is in flight, then what waits (`lifecycle.STATES`' order): the bar fills from the left."""
STATE_CSS = "".join(
    f".s-{state.value} {{ fill: {row.colour}; background: {row.colour}; }}\n" for state, row in STATES.items()
)
"""Each state's colour (`lifecycle.STATES`), served as the console's `static/states.css`."""


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    """What a pointer over it shows (an SVG `<title>`)."""


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    peak: int
    first: str
    last: str


def bars(hours: Sequence[tuple[datetime, int]], *, width: int = 720, height: int = 120) -> Chart:
    """One bar per hour, scaled to the busiest hour (at least 1, so an empty chart stays flat)."""
    peak = max((count for _, count in hours), default=0)
    step = width / max(len(hours), 1)
    shapes = []
    for position, (start, count) in enumerate(hours):
        tall = height * count / max(peak, 1)
        label = f"{start:%Y-%m-%d %H}:00 UTC: {count} sent"
        shapes.append(Bar(x=position * step, y=height - tall, width=max(step - 1, 1), height=tall, label=label))
    first = f"{hours[0][0]:%a %H}:00" if hours else ""
    last = f"{hours[-1][0]:%a %H}:00" if hours else ""
    return Chart(width=width, height=height, bars=shapes, peak=peak, first=first, last=last)


@dataclass(frozen=True)
class Segment:
    state: str
    x: float
    width: float
    count: int


def stacked(counts: Mapping[State, int], *, width: int = 600) -> list[Segment]:
    """A bar `width` wide split by state, in `PROGRESS_ORDER`; states with nothing are left out."""
    total = sum(counts.values())
    segments, x = [], 0.0
    for state in PROGRESS_ORDER:
        count = counts.get(state, 0)
        if count and total:
            share = width * count / total
            segments.append(Segment(state=state.value, x=x, width=share, count=count))
            x += share
    return segments
