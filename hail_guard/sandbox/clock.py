"""Time for the sandbox: a reading (`Clock`) and a wait (`Sleep`), both replaceable.

Delivery progression reads the clock; latency, `delay` and `processing` wait with the sleep.
`ManualClock` provides both for tests: time moves only when `advance` is called, and sleepers wake
when it passes their deadline, so nothing waits on the wall clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Final

import anyio
import anyio.lowlevel

Clock = Callable[[], datetime]
"""Returns the current time, timezone-aware UTC."""

Sleep = Callable[[float], Awaitable[None]]
"""Waits that many seconds; must be cancellable."""

MANUAL_CLOCK_START: Final = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


def system_clock() -> datetime:
    return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to; its `sleep` wakes when `advance` passes the deadline."""

    def __init__(self, start: datetime = MANUAL_CLOCK_START) -> None:
        if start.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start time")
        self._now = start
        self._sleepers: list[tuple[datetime, anyio.Event]] = []
        self._changed: anyio.Event | None = None

    def __call__(self) -> datetime:
        return self._now

    @property
    def sleepers(self) -> int:
        """How many `sleep` calls are waiting."""
        return len(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has come."""
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._now += timedelta(seconds=seconds)
        for deadline, event in self._sleepers:
            if deadline <= self._now:
                event.set()

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by `seconds` (cancellable)."""
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        entry = (self._now + timedelta(seconds=seconds), anyio.Event())
        self._sleepers.append(entry)
        self._notify()
        try:
            await entry[1].wait()
        finally:
            self._sleepers.remove(entry)
            self._notify()

    async def wait_for_sleepers(self, count: int = 1) -> None:
        """Return once at least `count` sleepers are waiting (bound it with `anyio.fail_after`)."""
        while len(self._sleepers) < count:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
