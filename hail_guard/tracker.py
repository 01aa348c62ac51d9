"""Delivery tracking by polling: accepted messages are read back from Hail until their delivery settles.

A `Tracker` runs beside `serve` and `worker` (`app.tracking`, `[delivery] poll`). Each round it
claims the operations that are due (held, so another process's tracker skips them), reads each one
back with its profile's lookup (Hail's `get_email` / `get_sms` / `get_call`, whose lookups say
`delivery`) through the upstream (never the guard: nothing is sent), and records what the record says
(`delivery.observations_of_record`). An operation is checked
again after a wait that starts at the poll interval and grows by `backoff_factor` up to
`max_backoff_seconds`, until its delivery settles or it is older than `max_age_hours`.

Webhooks (`hail_guard.webhooks`) report the same facts sooner; the ledger takes both, in any
order. A round is bounded (`batch_size` operations, each lookup under the upstream timeout) and
a failure never stops the server it runs in: it is logged and the next round tries again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import structlog

from hail_guard import delivery, pointers, profiles
from hail_guard.errors import HailGuardError, UpstreamError, UpstreamUnavailable
from hail_guard.guard import UpstreamCaller, text_of
from hail_guard.ledger import Tracking
from hail_guard.models import Operation
from hail_guard.profiles import Profile

log = structlog.get_logger(__name__)

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class TrackerSettings:
    interval_seconds: float = 30.0
    """How long the tracker waits between rounds."""
    first_backoff_seconds: float | None = None
    """The wait after an operation's first check (default: `interval_seconds`)."""
    backoff_factor: float = 2.0
    max_backoff_seconds: float = 3600.0
    max_age_hours: float = 72.0
    batch_size: int = 50
    timeout_seconds: float = 45.0
    """Per lookup."""
    profile: Profile = field(default_factory=profiles.hail)
    """Which tools' sends are polled, and with which lookup (those that say `delivery`)."""

    @property
    def hold_seconds(self) -> float:
        """How long claimed checks are held from other trackers. A round that runs longer (a slow Hail)
        may see another tracker check the same message too: harmless, as delivery only moves forward."""
        return self.interval_seconds + 2 * self.timeout_seconds

    def wait_after(self, checks: int) -> float:
        first = self.interval_seconds if self.first_backoff_seconds is None else self.first_backoff_seconds
        return delivery.next_check_seconds(
            checks, first_seconds=first, factor=self.backoff_factor, most_seconds=self.max_backoff_seconds
        )


class Tracker:
    def __init__(
        self, ledger: Tracking, upstream: UpstreamCaller, settings: TrackerSettings, *, sleep: Sleep = anyio.sleep
    ) -> None:
        self.ledger = ledger
        self.upstream = upstream
        self.settings = settings
        self._sleep = sleep
        self.rounds = 0
        """Rounds completed."""
        self._round_done = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll until cancelled; `tg.start` returns at once (the first round runs after)."""
        log.info("delivery_tracker_started", interval_seconds=self.settings.interval_seconds)
        task_status.started()
        while True:
            await self.poll_once()
            await self._sleep(self.settings.interval_seconds)

    async def poll_once(self) -> int:
        """One round: check every operation that is due (up to `batch_size`); returns how many were checked."""
        checked = 0
        channels = self.settings.profile.delivery_channels()
        try:
            due: list[Operation] = []
            if channels:  # a profile that polls nothing (the chat example's) asks the ledger nothing
                due = await self.ledger.claim_delivery_checks(
                    channels=channels,
                    max_age_seconds=self.settings.max_age_hours * 3600.0,
                    hold_seconds=self.settings.hold_seconds,
                    limit=self.settings.batch_size,
                )
            for operation in due:
                if not await self._check(operation):
                    break
                checked += 1
        except HailGuardError as exc:
            log.warning("delivery_round_failed", error=str(exc))
        except Exception:  # the round's boundary: a bug here must not stop the server it runs in
            log.exception("delivery_round_crashed")
        self._finish_round()
        return checked

    async def wait_for_rounds(self, count: int) -> None:
        """Return once `count` rounds have completed (bound it with `anyio.fail_after`)."""
        while self.rounds < count:
            await self._round_done.wait()

    async def _check(self, operation: Operation) -> bool:
        """Read one message back and record it; False when the upstream cannot be reached (the round ends)."""
        lookup = self.settings.profile.spec(operation.tool).lookup
        if lookup is None or not lookup.delivery:  # another tool on a polled channel: look again much later
            await self.ledger.record_delivery(operation.id, [], next_check_seconds=self.settings.max_backoff_seconds)
            return True
        try:
            record = await self._read_back(operation, lookup)
        except UpstreamUnavailable as exc:
            log.warning("delivery_check_unavailable", error=str(exc))
            return False  # the held checks come due again when the hold runs out
        except UpstreamError as exc:
            log.warning("delivery_check_failed", operation_id=operation.id, tool=lookup.tool, error=str(exc))
            return True
        observations = delivery.observations_of_record(operation.channel, record, detail=lookup.tool)
        wait = self.settings.wait_after(operation.delivery_checks)
        updated = await self.ledger.record_delivery(operation.id, observations, next_check_seconds=wait)
        if updated.delivery_state != operation.delivery_state:
            log.info(
                "delivery_recorded",
                operation_id=operation.id,
                provider_id=operation.provider_id,
                delivery=updated.delivery_state,
                source="poll",
            )
        return True

    async def _read_back(self, operation: Operation, lookup: profiles.Lookup) -> dict[str, Any]:
        """The upstream's record of one send, by its lookup; {} when the answer says nothing usable."""
        arguments = profiles.read_arguments(
            lookup.arguments, operation.arguments(), provider_id=operation.provider_id, since=operation.created_at
        ).arguments
        result = await self.upstream.call_tool(lookup.tool, arguments, timeout_seconds=self.settings.timeout_seconds)
        record = profiles.read_answer(result.structured_content, text_of(result), lookup.answer_text)
        error = self.settings.profile.data.answers.error
        if record is None or result.is_error or (error is not None and pointers.present(record, error)):
            log.warning(
                "delivery_check_unanswered", operation_id=operation.id, tool=lookup.tool, answer=str(record)[:200]
            )
            return {}
        return record

    def _finish_round(self) -> None:
        self.rounds += 1
        self._round_done.set()
        self._round_done = anyio.Event()
