"""The drill's report: each scenario's verdict, its counts with and without hail-guard, and how to replay it.

Plain data, printed by the command line (`hail-guard drill`: a table, or `--json`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hail_guard import urls
from hail_guard.drill.rig import DrillOptions


@dataclass(frozen=True)
class Tally:
    """What a sandbox accepted: how many messages, and the most that any one recipient got."""

    sent: int
    most_to_one: int

    @classmethod
    def of(cls, outbox: Iterable[Mapping[str, Any]]) -> Tally:
        entries = list(outbox)
        per_recipient = Counter(recipient for entry in entries for recipient in entry["to"])
        return cls(len(entries), max(per_recipient.values(), default=0))

    def to_json(self) -> dict[str, int]:
        return {"sent": self.sent, "most_to_one": self.most_to_one}


@dataclass(frozen=True)
class ScenarioResult:
    number: int
    name: str
    faults: str
    """What the faults did (and what the agent did), in one line."""
    expected: int
    """Messages the sandbox should have accepted."""
    sent: int
    """Messages the sandbox really accepted (its outbox)."""
    failed_check: str | None
    """The first check that did not hold, or the error the scenario raised; None: it holds."""
    seconds: float
    most_to_one: int = 0
    """The most messages any one recipient got from the sandbox behind hail-guard (1: nobody twice)."""
    without_guard: Tally | None = None
    """What a second sandbox accepted from the same agent behaviour without hail-guard (None: not run)."""
    agent_saw: tuple[str, ...] = ()
    """What the agent was answered, step by step (`unknown`, `reconcile -> accepted`, ...)."""

    @property
    def holds(self) -> bool:
        return self.failed_check is None

    @property
    def verdict(self) -> str:
        return "holds" if self.holds else "fails"

    def sent_shown(self) -> str:
        """Messages sent, without hail-guard then with it: `2 -> 1` (`-`: the unguarded run was not made)."""
        return f"{'-' if self.without_guard is None else self.without_guard.sent} -> {self.sent}"

    def most_to_one_shown(self) -> str:
        """The most any one recipient got, without hail-guard then with it: `2 -> 1`."""
        return f"{'-' if self.without_guard is None else self.without_guard.most_to_one} -> {self.most_to_one}"

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "name": self.name,
            "faults": self.faults,
            "expected": self.expected,
            "sent": self.sent,
            "most_to_one": self.most_to_one,
            "without_guard": None if self.without_guard is None else self.without_guard.to_json(),
            "agent_saw": list(self.agent_saw),
            "verdict": self.verdict,
            "failed_check": self.failed_check,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class DrillReport:
    options: DrillOptions
    scenarios: list[ScenarioResult]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(result.holds for result in self.scenarios)

    def replay_command(self) -> str:
        options = self.options
        words = ["hail-guard drill", f"--seed {options.seed}", f"--leads {options.leads}"]
        words.append(f"--workers {options.workers}")
        if options.transport != "inprocess":
            words.append(f"--transport {options.transport}")
        if options.ledger_url is not None:
            words.append(f"--ledger {display_url(options.ledger_url)}")
        words += [f"--scenario {result.number}" for result in self.scenarios if not result.holds]
        return " ".join(words)

    def summary(self) -> str:
        options = self.options
        setting = f"seed {options.seed}, {options.leads} leads, {options.workers} workers, {self.seconds:.1f} s"
        if options.transport != "inprocess":
            setting += f", over {options.transport}"
        if self.passed:
            held = f"All {len(self.scenarios)} scenarios hold" if len(self.scenarios) > 1 else "The scenario holds"
            return f"{held}: nobody got a message twice and nothing was lost ({setting})."
        failed = [str(result.number) for result in self.scenarios if not result.holds]
        return (
            f"{len(failed)} of {len(self.scenarios)} scenarios FAIL ({', '.join(failed)}; {setting}). "
            f"Replay: {self.replay_command()}"
        )

    def to_json(self) -> dict[str, Any]:
        options = self.options
        return {
            "seed": options.seed,
            "leads": options.leads,
            "workers": options.workers,
            "transport": options.transport,
            "ledger": display_url(options.ledger_url) if options.ledger_url else None,
            "kept": str(options.keep) if options.keep is not None else None,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "summary": self.summary(),
            "replay": self.replay_command(),
            "scenarios": [result.to_json() for result in self.scenarios],
        }


def display_url(url: str) -> str:
    """A ledger URL safe to print: scheme, host, port and database only (`urls.display_url`)."""
    return urls.display_url(url)
