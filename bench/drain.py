"""Case 2, campaign drain: plan N sends as a batch, then `Batches.run` with bounded concurrency.

The sandbox runs as real Hail does, in a process of its own over Streamable HTTP, with a fixed
latency per call, so hail-guard and the fake Hail do not share one event loop. With latency, the wall time is held
against the ideal `N x latency / concurrency` (efficiency = ideal / wall). Without latency, the
throughput is held against forwarding the very same requests (the keys and canonical JSON the
guard would forward) over the same upstream connection with the same concurrency, but without
the ledger. Forwarding with latency is measured too: it shows what this machine allows at all.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio

from bench.figures import Figure, median, ms, percentile
from bench.workload import lead_email, open_guarded, sandbox_process, upstream_of
from hail_guard.batch import PlannedSend
from hail_guard.guard import Guard, GuardSettings
from hail_guard.models import Operation, State
from hail_guard.upstream import connect_upstream

EFFICIENCY_TARGET = 0.90
THROUGHPUT_TARGET = 0.5
SQLITE_RATE_TARGET = 1000.0
"""Durable sends a second a SQLite drain at 0 ms must reach (issue 15): more than one fsync per commit allows."""


class Drained:
    """One drain: how long planning and sending took, and each send's dispatch time."""

    def __init__(
        self, sends: int, plan_seconds: float, wall_seconds: float, dispatch: list[float], unsettled: str = ""
    ) -> None:
        self.sends, self.plan_seconds, self.wall_seconds, self.dispatch = sends, plan_seconds, wall_seconds, dispatch
        self.unsettled = unsettled
        """The sends that did not end accepted, by state ("26 unknown"), or "" when every one did."""

    @property
    def rate(self) -> float:
        return self.sends / self.wall_seconds


def planned_sends(count: int, tag: str) -> list[PlannedSend]:
    return [PlannedSend("send_email", lead_email(n, tag), f"send {n + 1}") for n in range(count)]


async def drain_guarded(ledger_url: str, sends: int, concurrency: int, latency_ms: int) -> Drained:
    async with sandbox_process(latency_ms) as hail, open_guarded(ledger_url, hail) as proxy:
        started = time.perf_counter()
        batch_id = await proxy.batches.plan(planned_sends(sends, f"drain{latency_ms}"), name="bench")
        plan_seconds = time.perf_counter() - started
        dispatch: list[float] = []
        proxy.guard.dispatch = _timing(proxy.guard.dispatch, dispatch)  # type: ignore[method-assign,assignment]
        started = time.perf_counter()
        status = await proxy.batches.run(batch_id, concurrency=concurrency)
        wall = time.perf_counter() - started
    unsettled = ", ".join(f"{count} {state}" for state, count in status.counts.items() if state != State.ACCEPTED)
    return Drained(sends, plan_seconds, wall, dispatch, unsettled)


def _timing(
    dispatch: Callable[[Operation, str], Awaitable[Operation]], into: list[float]
) -> Callable[[Operation, str], Coroutine[Any, Any, Operation]]:
    async def timed(operation: Operation, owner: str) -> Operation:
        started = time.perf_counter()
        try:
            return await dispatch(operation, owner)
        finally:
            into.append(time.perf_counter() - started)

    return timed


async def forward_only(sends: int, concurrency: int, latency_ms: int) -> Drained:
    """The same requests the guard would forward, over one upstream connection, with no ledger."""
    settings = GuardSettings()
    schema = _send_email_schema()
    guard = Guard(ledger=None, upstream=None, settings=settings)  # type: ignore[arg-type]  # prepare needs neither
    requests = iter([guard.prepare("send_email", lead_email(n, f"fwd{latency_ms}"), schema)[1] for n in range(sends)])
    dispatch: list[float] = []
    async with (
        sandbox_process(latency_ms) as hail,
        connect_upstream(
            upstream_of(hail), timeout_seconds=settings.timeout_seconds, heartbeat_seconds=None
        ) as upstream,
    ):

        async def loop() -> None:
            for request in requests:
                started = time.perf_counter()
                result = await upstream.call_tool("send_email", request, timeout_seconds=settings.timeout_seconds)
                dispatch.append(time.perf_counter() - started)
                if result.is_error:
                    raise RuntimeError(f"forwarding failed: {result.content}")

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(loop)
        wall = time.perf_counter() - started
    return Drained(sends, 0.0, wall, dispatch)


def _send_email_schema() -> dict[str, Any]:
    from hail_guard.sandbox.tools import input_schema

    schema = input_schema("send_email")
    if schema is None:
        raise RuntimeError("the sandbox has no send_email")
    return dict(schema)


def ideal_seconds(sends: int, concurrency: int, latency_ms: int) -> float:
    return sends * latency_ms / 1000 / concurrency


def latency_figure(ledger: str, run: Drained, concurrency: int, latency_ms: int, *, guarded: bool) -> Figure:
    ideal = ideal_seconds(run.sends, concurrency, latency_ms)
    efficiency = ideal / run.wall_seconds
    per_send = ms(run.dispatch)
    what = "drain" if guarded else "forward, no ledger"
    return Figure(
        case="drain",
        name=f"{what} {run.sends:,} sends, upstream {latency_ms} ms, concurrency {concurrency}: wall vs ideal",
        ledger=ledger,
        unit="s",
        median=run.wall_seconds,
        baseline=ideal,
        ratio=run.wall_seconds / ideal,
        target=f"efficiency >= {EFFICIENCY_TARGET:.0%}" if guarded else "",
        met=efficiency >= EFFICIENCY_TARGET and not run.unsettled if guarded else None,
        note=_unsettled(run)
        + (
            f"efficiency {efficiency:.1%}; {run.rate:,.0f} sends/s; per send p50 {median(per_send):.1f} ms, "
            f"p99 {percentile(per_send, 0.99):.1f} ms"
        ),
    )


def throughput_figure(ledger: str, run: Drained, forward: Drained, concurrency: int) -> Figure:
    ratio = run.rate / forward.rate
    per_send = ms(run.dispatch)
    sqlite = ledger == "sqlite"
    return Figure(
        case="drain",
        name=f"drain {run.sends:,} sends, upstream 0 ms, concurrency {concurrency}: throughput vs forwarding",
        ledger=ledger,
        unit="ops/s",
        median=run.rate,
        baseline=forward.rate,
        ratio=ratio,
        target=f">= {THROUGHPUT_TARGET:g}x forwarding" + (f"; >= {SQLITE_RATE_TARGET:,.0f} sends/s" if sqlite else ""),
        met=ratio >= THROUGHPUT_TARGET and (run.rate >= SQLITE_RATE_TARGET or not sqlite) and not run.unsettled,
        note=_unsettled(run)
        + (
            f"per send p50 {median(per_send):.2f} ms, p99 {percentile(per_send, 0.99):.2f} ms; "
            f"forwarding {forward.wall_seconds:.1f} s"
        ),
    )


def plan_figure(ledger: str, run: Drained) -> Figure:
    return Figure(
        case="drain",
        name=f"plan {run.sends:,} sends (one batch)",
        ledger=ledger,
        unit="s",
        median=run.plan_seconds,
        note=f"{run.sends / run.plan_seconds:,.0f} sends/s planned",
    )


def _unsettled(run: Drained) -> str:
    """The note's warning when a drain left sends that did not end accepted (the figures then count them too)."""
    return f"NOT ALL ACCEPTED: {run.unsettled}; " if run.unsettled else ""
