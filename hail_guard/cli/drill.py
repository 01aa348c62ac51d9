"""`hail-guard drill` on the command line: its options, a progress bar on stderr, and the report on stdout."""

from __future__ import annotations

import argparse
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from hail_guard.cli.parsing import Commands, whole_number
from hail_guard.cli.terminal import console, json_text, print_table, progress, say, shown, terminal_text
from hail_guard.config import Settings
from hail_guard.logs import configure_logging

if TYPE_CHECKING:
    from hail_guard.drill import DrillReport, Scenario, ScenarioResult

EXIT_OK = 0
EXIT_FAILED = 1
"""`hail-guard drill`: a scenario did not hold."""


def add_commands(commands: Commands, argv: Sequence[str]) -> None:
    rehearsal = commands.add(
        "drill", help="rehearse the failures against the sandbox: nothing is sent twice", run=drill_command
    )
    if "drill" in argv:  # its package (the rehearsals) loads only for it: `serve` starts sooner
        add_arguments(rehearsal)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hail_guard import drill

    parser.add_argument(
        "--leads",
        type=whole_number("--leads", 1, drill.MAX_LEADS),
        default=drill.DEFAULT_LEADS,
        help="leads in the batch scenarios",
    )
    parser.add_argument(
        "--workers",
        type=whole_number("--workers", 1, drill.MAX_WORKERS),
        default=drill.DEFAULT_WORKERS,
        help="workers in scenario 5",
    )
    parser.add_argument("--seed", type=int, help="replay a run's random choices (default: a new seed, printed)")
    parser.add_argument(
        "--ledger",
        metavar="URL",
        help="rehearse on this ledger (e.g. a staging PostgreSQL) instead of throwaway SQLite files; "
        "the drill's records stay in it, under campaigns named drill-<run> (default: throwaway files)",
    )
    parser.add_argument(
        "--scenario",
        type=whole_number("--scenario", 1, len(drill.SCENARIOS)),
        action="append",
        metavar="N",
        help="run only scenario N, repeatable (default: all)",
    )
    parser.add_argument(
        "--transport",
        choices=drill.TRANSPORTS,
        default="inprocess",
        help="how the agent reaches hail-guard: in this process, or a spawned `hail-guard serve` over stdio",
    )
    parser.add_argument(
        "--keep",
        metavar="DIR",
        type=Path,
        help="keep the ledgers and outboxes (and serve's logs) in DIR, a new or empty folder (default: thrown away)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--no-progress", action="store_true", help="draw no progress bar (none is drawn off a terminal)"
    )


async def drill_command(args: argparse.Namespace, settings: Settings) -> int:
    """The drill's report on stdout; 0 only when every scenario holds."""
    report = await run_from_args(args, settings)
    if args.json:
        print(json_text(report.to_json(), indent=2))
    else:
        print_report(report)
    return EXIT_OK if report.passed else EXIT_FAILED


async def run_from_args(ns: argparse.Namespace, settings: Settings) -> DrillReport:
    """Run the drill as `hail-guard drill` was asked to; the bar is drawn once the first scenario starts."""
    from hail_guard.drill import SCENARIOS, DrillOptions, run_drill

    options = DrillOptions(
        seed=ns.seed if ns.seed is not None else secrets.randbelow(1_000_000),
        leads=ns.leads,
        workers=ns.workers,
        ledger_url=ns.ledger,
        scenarios=tuple(sorted(set(ns.scenario or ()))),
        duplicate_window_hours=settings.guard.duplicate_window_hours,
        busy_timeout_seconds=settings.ledger.busy_timeout_seconds,
        transport=ns.transport,
        keep=ns.keep,
    )
    with ExitStack() as stack:
        if settings.log.level != "debug":  # the faults are deliberate: their warnings would only be noise
            configure_logging("error", text=not getattr(ns, "verbose", False))
            stack.enter_context(_quiet(*_THEIR_LOGGERS))
        bar = _Bar(stack, total=len(options.scenarios) or len(SCENARIOS), enabled=not ns.no_progress)
        return await run_drill(options, started=bar.started, finished=bar.finished)


class _Bar:
    """The drill's progress on stderr, drawn once the first scenario starts (never before an error)."""

    def __init__(self, stack: ExitStack, *, total: int, enabled: bool) -> None:
        self._stack, self._total, self._enabled = stack, total, enabled
        self._advance: Callable[..., None] | None = None
        self._done = 0

    def started(self, scenario: Scenario) -> None:
        if self._advance is None:
            self._advance = self._stack.enter_context(progress("drill", total=self._total, enabled=self._enabled))
        self._advance(self._done, description=f"{scenario.number}. {scenario.name}")

    def finished(self, result: ScenarioResult) -> None:
        self._done += 1
        if self._advance is not None:
            self._advance(self._done)


_THEIR_LOGGERS = ("mcp", "uvicorn", "httpx2")
"""The libraries' own loggers: over stdio the sandbox serves HTTP, and a dropped connection is logged."""


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Only critical records from these loggers while the drill runs."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def print_report(report: DrillReport) -> None:
    """A table that fits 80 columns (sent, and the most any one lead got, without hail-guard then with it),
    then what each scenario did and what the agent saw, then the one-line summary."""
    rows = [
        (
            result.number,
            result.name,
            result.sent_shown(),
            result.most_to_one_shown(),
            Text("holds", style="green") if result.holds else Text("FAILS", style="red"),
        )
        for result in report.scenarios
    ]
    print_table(
        ("#", "scenario", "sent", "most to one lead", "verdict"),
        rows,
        title="hail-guard drill",
        caption=(
            "without hail-guard -> with it. sent: messages the sandbox accepted; most to one lead: the most "
            "any one lead got (1: nobody twice). Without hail-guard: the same agent behaviour, no key of its "
            "own, one retry on an error"
        ),
    )
    console().print(_details(report))
    style = "green" if report.passed else "bold red"
    console().print(Text(terminal_text(report.summary()), style=style), soft_wrap=True)  # one line, for grep
    if report.options.keep is not None:
        say("kept in ", terminal_text(report.options.keep), ": ", _kept(report))


def _details(report: DrillReport) -> Table:
    """Each scenario's faults, what its agent saw and, when it fails, why: wrapped beside its number."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right")
    grid.add_column(ratio=1)
    for result in report.scenarios:
        lines = [
            Text.assemble(("faults: ", "bold"), shown(result.faults)),
            Text.assemble(("the agent saw: ", "bold"), shown(" -> ".join(result.agent_saw) or None)),
        ]
        if not result.holds:
            lines.append(Text.assemble(("FAILS: ", "bold red"), shown(result.failed_check)))
        grid.add_row(f"{result.number}.", Text("\n").join(lines))
    return grid


def _kept(report: DrillReport) -> str:
    """What `--keep` left in its folder."""
    options = report.options
    files = [] if options.ledger_url is not None else ["scenario-NN.db (the ledgers)"]
    files += [
        "scenario-NN-outbox.jsonl (what the sandbox accepted)",
        "scenario-NN-unguarded-outbox.jsonl (the same agent without hail-guard)",
    ]
    if options.transport == "stdio":
        files.append("scenario-NN-serve.log (serve's stderr)")
    return ", ".join(files)
