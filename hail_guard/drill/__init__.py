"""`hail-guard drill`: rehearse the failures against the sandbox, scenario by scenario.

Each scenario gets its own sandbox with scripted faults, its own ledger (a fresh SQLite file in the
run's folder, or the ledger `--ledger` names, with run-unique campaigns, keys and recipients so
that scenarios and repeated runs never collide) and a real MCP client, the agent, talking to
hail-guard in front of that sandbox: in process, or a spawned `hail-guard serve` over stdio. A
verdict is computed from the sandbox's outbox (what was really "sent") and from the ledger's
states; a scenario that raises fails with the error and never stops the drill. Then the same agent
behaviour runs straight against a second sandbox, to show what would have been sent without
hail-guard. Every random choice (lead order, where the batch dies, who opts out) comes from the
seed, so a failing run can be replayed with `--seed`.

Modules: `rig` (the agent, hail-guard and the sandbox of one scenario), `scenarios` (the fifteen),
`unguarded` (the counterfactual), `report` (verdicts). The command's options and its table are the
command line's (`hail_guard.cli.drill`).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import anyio
import structlog

from hail_guard.drill.report import DrillReport, ScenarioResult, Tally, display_url
from hail_guard.drill.rig import (
    DEFAULT_LEADS,
    DEFAULT_WORKERS,
    MAX_LEADS,
    MAX_WORKERS,
    TRANSPORTS,
    CheckFailed,
    Drill,
    DrillOptions,
    Run,
    Transport,
)
from hail_guard.drill.scenarios import SCENARIOS, Scenario
from hail_guard.errors import BadInput
from hail_guard.ledger import open_ledger

__all__ = [
    "DEFAULT_LEADS",
    "DEFAULT_WORKERS",
    "MAX_LEADS",
    "MAX_WORKERS",
    "SCENARIOS",
    "TRANSPORTS",
    "DrillOptions",
    "DrillReport",
    "Scenario",
    "ScenarioResult",
    "Transport",
    "display_url",
    "run_drill",
]

log = structlog.get_logger(__name__)

SCENARIO_SECONDS: Final = {"inprocess": 20.0, "stdio": 60.0}
"""A scenario still running after this long fails: a hang is a verdict, never a stuck drill.
Over stdio each rig spawns a `hail-guard serve`, which takes about a second to start."""


async def run_drill(
    options: DrillOptions,
    *,
    started: Callable[[Scenario], None] | None = None,
    finished: Callable[[ScenarioResult], None] | None = None,
) -> DrillReport:
    """Run the scenarios (all, or those `options.scenarios` names), one after another."""
    chosen = [s for s in SCENARIOS if not options.scenarios or s.number in options.scenarios]
    began = time.monotonic()
    if options.ledger_url is not None:  # a ledger that cannot be opened is the user's error, not a verdict
        async with open_ledger(options.ledger_url, busy_timeout_seconds=options.busy_timeout_seconds):
            pass
    results = []
    with _folder(options.keep) as folder:
        drill = Drill(options, folder)
        for scenario in chosen:
            if started is not None:
                started(scenario)
            result = await _run_scenario(drill, scenario)
            results.append(result)
            if finished is not None:
                finished(result)
    return DrillReport(options, results, time.monotonic() - began)


@contextmanager
def _folder(keep: Path | None) -> Iterator[Path]:
    """`--keep DIR` (a new or empty folder), else a throwaway one."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="hail-guard-drill-") as folder:
            yield Path(folder)
        return
    if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise BadInput(f"--keep {keep}: give a new or empty folder (the drill writes its ledgers and outboxes there)")
    try:
        keep.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--keep {keep}: cannot create the folder: {exc.strerror}") from exc
    yield keep


async def _run_scenario(drill: Drill, scenario: Scenario) -> ScenarioResult:
    run = Run()
    began = time.monotonic()
    failed: str | None = None
    bound = SCENARIO_SECONDS[drill.options.transport]
    with anyio.move_on_after(bound) as deadline:
        try:
            await scenario.body(drill, run)
        except Exception as exc:  # the per-scenario boundary: a crash is a failed verdict, never a stopped drill
            failed = _failure(exc, scenario)
    if deadline.cancelled_caught:
        failed = f"did not finish within {bound:g} s"
    return ScenarioResult(
        number=scenario.number,
        name=scenario.name,
        faults=run.faults,
        expected=run.expected,
        sent=len(run.outbox),
        most_to_one=Tally.of(run.outbox).most_to_one,
        failed_check=failed or _ground_truth(run),
        seconds=time.monotonic() - began,
        without_guard=await _unguarded(drill, scenario),
        agent_saw=tuple(run.agent_saw),
    )


async def _unguarded(drill: Drill, scenario: Scenario) -> Tally | None:
    """What the same agent behaviour sends without hail-guard; None when it could not be run."""
    if scenario.unguarded is None:
        return None
    with anyio.move_on_after(SCENARIO_SECONDS["inprocess"]):
        try:
            return await scenario.unguarded(drill)
        except Exception as exc:  # the counterfactual is shown, never judged: a crash leaves it out
            log.error("drill_unguarded_crashed", scenario=scenario.number, exc_info=exc)
    return None


def _failure(exc: BaseException, scenario: Scenario) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, CheckFailed):
        return str(exc)
    log.error("drill_scenario_crashed", scenario=scenario.number, exc_info=exc)
    return f"error: {type(exc).__name__}: {exc}"


def _ground_truth(run: Run) -> str | None:
    """What the outbox says, whatever the scenario's own checks said: nobody twice, nothing lost."""
    recipients = Counter(recipient for entry in run.outbox for recipient in entry["to"])
    twice = [(recipient, count) for recipient, count in recipients.items() if count > 1]
    if twice:
        return f"{twice[0][0]} got {twice[0][1]} messages"
    if len(run.outbox) != run.expected:
        return f"Hail accepted {len(run.outbox)} message(s); {run.expected} expected"
    return None
