"""The benchmark suite runs and reports in shape (its figures are printed, never asserted here)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from bench.figures import Figure, Report, markdown, percentile, print_report
from bench.growth import sqlite_plans
from bench.suite import QUICK, Options, run_suite
from hail_guard.ledger import open_ledger
from tests import postgres


def test_the_smallest_quick_case_reports_each_figure_beside_its_baseline_and_target() -> None:
    tiny = replace(QUICK, overhead_iterations={0: 4}, overhead_warmup=1)
    report = run_suite(
        Options(sizes=tiny, cases=["overhead"], ledgers=["sqlite"], progress=Console(file=io.StringIO()))
    )

    assert [(f.case, f.ledger) for f in report.figures] == [("overhead", "sqlite"), ("overhead", "sqlite")]
    send, read = report.figures
    assert send.name == "send_email (guarded), upstream 0 ms"
    assert read.name == "get_email (pass-through), upstream 0 ms"
    for figure in report.figures:
        assert figure.skipped is None
        assert figure.unit == "ms"
        assert figure.median is not None
        assert figure.p99 is not None
        assert figure.baseline is not None
        assert 0 < figure.median <= figure.p99
        assert figure.baseline > 0
        assert figure.ratio == figure.median / figure.baseline
        assert "added p50" in figure.note
    assert send.target == "added p50 <= 2 ms; added p99 <= 5 ms"
    assert isinstance(send.met, bool)
    assert read.met is None
    assert {"cores", "python", "sqlite", "postgresql"} <= set(report.machine)


def test_the_peer_rows_say_why_when_fastmcp_cannot_be_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder would be\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    report = run_suite(Options(cases=["peer"], ledgers=["sqlite"], progress=Console(file=io.StringIO())))

    assert [(f.case, f.name) for f in report.figures] == [
        ("peer", "send_email, upstream 0 ms"),
        ("peer", "get_email, upstream 0 ms"),
    ]
    for figure in report.figures:
        assert figure.skipped is not None
        assert figure.skipped.startswith("FastMCP's proxy cannot be had here: `-m venv ")
        assert "Not a directory" in figure.skipped


def test_a_machine_without_postgresql_reports_its_cases_as_skipped_with_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "missing_reason", lambda: "PostgreSQL is not installed here")
    report = run_suite(Options(cases=["growth"], ledgers=["postgres"], progress=Console(file=io.StringIO())))

    assert [(f.case, f.ledger, f.skipped) for f in report.figures] == [
        ("growth", "postgres", "PostgreSQL is not installed here")
    ]
    assert report.machine["postgresql"] == "-"


def test_a_report_prints_as_a_table_as_json_and_as_markdown() -> None:
    report = Report(
        machine={"cores": 2},
        figures=[
            Figure(case="startup", name="serve", unit="s", median=0.9, baseline=0.7, ratio=0.9 / 0.7, met=True),
            Figure(case="drain", name="10 sends", ledger="postgres", skipped="PostgreSQL is not installed"),
        ],
        plans=[{"ledger": "sqlite", "query": "find_by_key", "rows": 10, "uses_index": True, "plan": ["SEARCH"]}],
    )
    screen = io.StringIO()
    print_report(report, Console(file=screen, width=200))

    assert "startup: serve" in screen.getvalue()
    assert "skipped: PostgreSQL is not installed" in screen.getvalue()
    assert "find_by_key" in screen.getvalue()
    parsed = json.loads(report.to_json())
    assert parsed["figures"][1]["skipped"] == "PostgreSQL is not installed"
    assert parsed["plans"][0]["uses_index"] is True
    assert markdown(report).count("\n") == 3  # header, rule, two rows


def test_p99_is_the_nearest_rank() -> None:
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.99) == 5.0


async def test_every_sqlite_statement_the_growth_case_explains_is_planned_on_an_index(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with open_ledger(url):
        pass  # created and migrated
    plans = sqlite_plans(url)
    assert {plan["query"] for plan in plans} >= {"claim_ready (one batch)", "claim_ready (any batch)", "find_by_key"}
    assert all(plan["uses_index"] for plan in plans), plans
