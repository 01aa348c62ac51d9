"""The suite: which cases run, at what sizes, on which ledgers, and the machine it ran on.

`run_suite(options)` returns a `Report`; `bench.cli` prints it. Each asynchronous case gets its
own event loop (`anyio.run`), so one case's leftovers never slow the next.
"""

from __future__ import annotations

import os
import platform
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from rich.console import Console

from bench import console, drain, growth, limits, memory, overhead, peer, startup
from bench.figures import Figure, Report, skipped
from bench.ledgers import KINDS, SQLITE_SETTINGS, Ledgers, scratch_folder
from bench.workload import quiet_logs

CASES = ("limits", "overhead", "peer", "drain", "growth", "startup", "memory", "console")


@dataclass(frozen=True)
class Sizes:
    overhead_iterations: dict[int, int]
    """Upstream latency (ms) -> timed calls per path."""
    overhead_warmup: int
    peer_iterations: int
    """Timed calls per path beside FastMCP's proxy (upstream 0 ms)."""
    drain_sends: int
    drain_concurrency: int
    drain_latency_ms: int
    growth_small: int
    growth_large: int
    growth_work: int
    startup_runs: int
    memory_sends: int
    memory_concurrency: int
    limits_sends: int
    console_operations: int
    console_views: int


FULL = Sizes(
    overhead_iterations={0: 1000, 20: 300},
    overhead_warmup=30,
    peer_iterations=500,
    drain_sends=10_000,
    drain_concurrency=32,
    drain_latency_ms=50,
    growth_small=10_000,
    growth_large=1_000_000,
    growth_work=300,
    startup_runs=7,
    memory_sends=100_000,
    memory_concurrency=32,
    limits_sends=5_000,
    console_operations=1_000_000,
    console_views=20,
)
QUICK = Sizes(
    overhead_iterations={0: 60, 20: 20},
    overhead_warmup=5,
    peer_iterations=20,
    drain_sends=300,
    drain_concurrency=32,
    drain_latency_ms=50,
    growth_small=10_000,
    growth_large=50_000,
    growth_work=100,
    startup_runs=1,
    memory_sends=200,
    memory_concurrency=32,
    limits_sends=500,
    console_operations=10_000,
    console_views=3,
)


@dataclass
class Options:
    sizes: Sizes = QUICK
    cases: Sequence[str] = CASES
    ledgers: Sequence[str] = KINDS
    progress: Console = field(default_factory=lambda: Console(file=sys.__stderr__))


@dataclass
class _Run:
    options: Options
    ledgers: Ledgers
    folder: Path
    report: Report

    def step(self, what: str, action: Callable[[], Any]) -> Any:
        self.options.progress.print(f"[dim]bench: {what}...[/dim]", highlight=False)
        started = time.perf_counter()
        result = action()
        self.options.progress.print(f"[dim]bench: {what}: {time.perf_counter() - started:.1f} s[/dim]")
        return result

    def usable(self, case: str, name: str) -> list[str]:
        """The ledgers this case runs on; the others are reported as skipped, with why."""
        kinds = []
        for kind in self.options.ledgers:
            if why := self.ledgers.missing(kind):
                self.report.figures.append(skipped(case, name, kind, why))
            else:
                kinds.append(kind)
        return kinds


def run_suite(options: Options) -> Report:
    with scratch_folder() as folder, quiet_logs():
        ledgers = Ledgers(options.ledgers, folder)
        run = _Run(options, ledgers, folder, Report(machine={}))
        run.step("starting the ledgers", ledgers.start)
        try:
            run.report.machine = machine(ledgers)
            for case in options.cases:
                _RUNNERS[case](run)
        finally:
            ledgers.stop()
    return run.report


def _overhead(run: _Run) -> None:
    sizes = run.options.sizes
    for kind in run.usable("overhead", "send_email and get_email"):
        for latency_ms, iterations in sizes.overhead_iterations.items():

            async def case(kind: str = kind, latency_ms: int = latency_ms, iterations: int = iterations) -> None:
                async with run.ledgers.fresh(kind) as url:
                    commits = await _commits_per_second(run, kind, url, OVERHEAD_DISK_SECONDS)
                    found = await overhead.measure(
                        kind, url, latency_ms, iterations, sizes.overhead_warmup, commit_ms=1000 / commits
                    )
                run.report.figures.extend(found)

            run.step(f"overhead, {kind}, upstream {latency_ms} ms", partial(anyio.run, case))


def _peer(run: _Run) -> None:
    sizes = run.options.sizes
    found = run.step(
        "peer: FastMCP's proxy beside hail-guard",
        lambda: anyio.run(peer.measure, run.folder, 0, sizes.peer_iterations, sizes.overhead_warmup),
    )
    run.report.figures.extend(found)


def _drain(run: _Run) -> None:
    sizes = run.options.sizes
    sends, concurrency, latency = sizes.drain_sends, sizes.drain_concurrency, sizes.drain_latency_ms
    forward_slow = run.step(
        f"drain: forwarding {sends:,} at {latency} ms",
        lambda: anyio.run(drain.forward_only, sends, concurrency, latency),
    )
    forward_fast = run.step(
        f"drain: forwarding {sends:,} at 0 ms", lambda: anyio.run(drain.forward_only, sends, concurrency, 0)
    )
    run.report.figures.append(drain.latency_figure("-", forward_slow, concurrency, latency, guarded=False))
    for kind in run.usable("drain", f"{sends:,} sends"):
        for latency_ms in (latency, 0):

            async def case(kind: str = kind, latency_ms: int = latency_ms) -> drain.Drained:
                async with run.ledgers.fresh(kind) as url:
                    return await drain.drain_guarded(url, sends, concurrency, latency_ms)

            done = run.step(f"drain, {kind}, {sends:,} at {latency_ms} ms", partial(anyio.run, case))
            if latency_ms:
                run.report.figures.append(drain.plan_figure(kind, done))
                run.report.figures.append(drain.latency_figure(kind, done, concurrency, latency_ms, guarded=True))
            else:
                run.report.figures.append(drain.throughput_figure(kind, done, forward_fast, concurrency))


def _growth(run: _Run) -> None:
    sizes = run.options.sizes
    for kind in run.usable("growth", "ledger operations"):
        timings = []
        for rows in (sizes.growth_small, sizes.growth_large):
            shape = growth.Shape(history=rows, work=sizes.growth_work)

            async def case(kind: str = kind, shape: growth.Shape = shape) -> growth.Timings:
                async with run.ledgers.fresh(kind) as url:
                    filled = await growth.fill(url, shape)
                    samples = await growth.time_operations(url, shape)
                    if shape.history == sizes.growth_large:
                        plans = growth.sqlite_plans(url) if kind == "sqlite" else await growth.postgres_plans(url)
                        total = shape.history + 2 * shape.work
                        run.report.plans.extend({"ledger": kind, "rows": total, **plan} for plan in plans)
                return growth.Timings(shape.history, samples, filled)

            timings.append(run.step(f"growth, {kind}, {rows:,} operations", partial(anyio.run, case)))
        run.report.figures.extend(growth.figures(kind, timings[0], timings[1]))


def _limits(run: _Run) -> None:
    sends, concurrency = run.options.sizes.limits_sends, run.options.sizes.drain_concurrency
    for kind in run.usable("limits", "disk and ledger"):

        async def case(kind: str = kind) -> list[Figure]:
            async with run.ledgers.fresh(kind) as url:
                commits = await _commits_per_second(run, kind, url, limits.DISK_SECONDS)
                settings = SQLITE_SETTINGS if kind == "sqlite" else run.ledgers.postgres_settings or "-"
                rate = await limits.ledger_only(url, sends, concurrency)
            return [
                limits.disk_figure(kind, commits, settings),
                limits.ledger_figure(kind, rate, commits, sends, concurrency),
            ]

        run.report.figures.extend(run.step(f"limits, {kind}", partial(anyio.run, case)))


OVERHEAD_DISK_SECONDS = 0.5
"""How long the overhead case probes the disk's commit time, right before it measures (for the floor it names)."""


async def _commits_per_second(run: _Run, kind: str, url: str, seconds: float) -> float:
    """fsync'd one-row commits a second on the disk of this kind of ledger, now (`limits`)."""
    if kind == "sqlite":
        return await anyio.to_thread.run_sync(limits.sqlite_commits_per_second, run.folder, seconds)
    return await limits.postgres_commits_per_second(url, seconds)


def _startup(run: _Run) -> None:
    runs = run.options.sizes.startup_runs
    figure: Figure = run.step("start-up", lambda: anyio.run(startup.measure, run.folder, runs))
    run.report.figures.append(figure)


def _memory(run: _Run) -> None:
    sizes = run.options.sizes
    found = run.step(
        f"memory, {sizes.memory_sends:,} sends",
        lambda: memory.measure(run.folder, sizes.memory_sends, sizes.memory_concurrency),
    )
    run.report.figures.extend(found)


def _console(run: _Run) -> None:
    sizes = run.options.sizes
    for kind in run.usable("console", "pages"):

        async def case(kind: str = kind) -> console.Rendered:
            async with run.ledgers.fresh(kind) as url:
                return await console.measure(url, sizes.console_operations, sizes.console_views)

        rows = sizes.console_operations
        rendered = run.step(f"console, {kind}, {rows:,} operations", partial(anyio.run, case))
        run.report.figures.extend(console.figures(kind, rendered))


_RUNNERS: dict[str, Callable[[_Run], None]] = {
    "limits": _limits,
    "overhead": _overhead,
    "peer": _peer,
    "drain": _drain,
    "growth": _growth,
    "startup": _startup,
    "memory": _memory,
    "console": _console,
}


def machine(ledgers: Ledgers) -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram": f"{_ram_gib():.0f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "sqlite": f"{sqlite3.sqlite_version}; {SQLITE_SETTINGS}",
        "postgresql": f"{ledgers.postgres_version}; {ledgers.postgres_settings}" if ledgers.postgres_version else "-",
        "mcp": version("mcp"),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return 0.0
