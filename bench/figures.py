"""What a benchmark reports: one `Figure` per measured thing, its statistics, and how it is shown.

A figure holds the measured median (or the single value of a throughput run), its p99 when there
is a distribution, the baseline measured in the same run, their ratio, and the target it is held
against. Nothing here asserts: a missed target is printed as such, and explained in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Figure:
    case: str
    """overhead, drain, growth, startup or memory."""
    name: str
    """What was measured, e.g. `send_email, upstream 20 ms`."""
    ledger: str = "-"
    """sqlite, postgres, or `-` when no ledger is involved or it does not matter."""
    unit: str = "ms"
    median: float | None = None
    p99: float | None = None
    baseline: float | None = None
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    """None: no target, or not measured."""
    note: str = ""
    skipped: str | None = None
    """Why it was not measured (the table prints `skipped: <why>`)."""


def skipped(case: str, name: str, ledger: str, why: str) -> Figure:
    return Figure(case=case, name=name, ledger=ledger, skipped=why)


@dataclass
class Report:
    """A whole run: the machine it ran on, the figures, and the query plans read on the way."""

    machine: dict[str, Any]
    figures: list[Figure] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        return cls(data["machine"], [Figure(**figure) for figure in data["figures"]], data["plans"])

    def to_json(self) -> str:
        return json.dumps(
            {"machine": self.machine, "figures": [asdict(f) for f in self.figures], "plans": self.plans}, indent=2
        )


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (`fraction` 0.99 for p99) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def median(samples: Iterable[float]) -> float:
    return statistics.median(samples)


def ms(seconds: Sequence[float]) -> list[float]:
    return [s * 1000.0 for s in seconds]


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ops/s":
        return f"{value:,.0f} ops/s"
    if unit == "MB":
        return f"{value:,.1f} MB"
    if unit == "s":
        return f"{value:,.2f} s"
    return f"{value:,.3f} ms" if value < 10 else f"{value:,.1f} ms"


def _met(figure: Figure) -> str:
    if figure.skipped is not None:
        return "-"
    if figure.met is None:
        return ""
    return "[green]yes[/green]" if figure.met else "[red]NO[/red]"


def table(report: Report) -> Table:
    grid = Table(title="hail-guard benchmarks", show_lines=False, expand=False)
    for column in ("case", "ledger", "median", "p99", "baseline", "ratio", "target", "met?", "note"):
        grid.add_column(column, overflow="fold", justify="right" if column in ("median", "p99", "ratio") else "left")
    for f in report.figures:
        if f.skipped is not None:
            grid.add_row(f"{f.case}: {f.name}", f.ledger, "", "", "", "", f.target, "-", f"skipped: {f.skipped}")
            continue
        ratio = f"{f.ratio:.2f}x" if f.ratio is not None else "-"
        grid.add_row(
            f"{f.case}: {f.name}",
            f.ledger,
            _number(f.median, f.unit),
            _number(f.p99, f.unit),
            _number(f.baseline, f.unit),
            ratio,
            f.target,
            _met(f),
            f.note,
        )
    return grid


def print_report(report: Report, console: Console) -> None:
    machine = ", ".join(f"{key} {value}" for key, value in report.machine.items())
    console.print(f"machine: {machine}", soft_wrap=True)
    console.print(table(report))
    for plan in report.plans:
        verdict = "index" if plan["uses_index"] else "FULL SCAN"
        console.print(f"[bold]query plan[/bold] {plan['ledger']} {plan['query']} ({plan['rows']:,} rows): {verdict}")
        for line in plan["plan"]:
            console.print(f"    {line}", soft_wrap=True, highlight=False, markup=False)


def markdown(report: Report) -> str:
    """The table as GitHub Markdown (for docs/benchmarks.md)."""
    lines = [
        "| case | ledger | median | p99 | baseline | ratio | target | met? | note |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for f in report.figures:
        if f.skipped is not None:
            lines.append(f"| {f.case}: {f.name} | {f.ledger} | | | | | {f.target} | - | skipped: {f.skipped} |")
            continue
        met = "" if f.met is None else ("yes" if f.met else "**no**")
        ratio = f"{f.ratio:.2f}x" if f.ratio is not None else "-"
        cells = (
            f"{f.case}: {f.name}",
            f.ledger,
            _number(f.median, f.unit),
            _number(f.p99, f.unit),
            _number(f.baseline, f.unit),
            ratio,
            f.target.replace("|", "/"),
            met,
            f.note.replace("|", "/"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
