"""`python -m bench [--quick] [--json | --markdown] [--only CASE] [--ledger sqlite|postgres|both] [--save FILE]`.

Prints the figures as a table on stdout (JSON with `--json`, Markdown with `--markdown`); what it
is doing goes to stderr. Targets are printed beside each figure, never enforced: the exit code is
0 whenever every case ran.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.figures import Report, markdown, print_report
from bench.ledgers import KINDS
from bench.suite import CASES, FULL, QUICK, Options, run_suite


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="hail-guard benchmarks (issue 8).")
    parser.add_argument("--quick", action="store_true", help="small sizes: well under a minute (CI)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of the table")
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown (for docs/benchmarks.md)")
    parser.add_argument("--only", action="append", choices=CASES, help="run only this case (repeatable)")
    parser.add_argument("--ledger", choices=[*KINDS, "both"], default="both", help="ledgers for the ledger cases")
    parser.add_argument("--save", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--load", metavar="FILE", help="print a report saved with --save instead of running")
    args = parser.parse_args(argv)
    if args.load:
        _print(args, Report.from_json(Path(args.load).read_text(encoding="utf-8")))
        return 0
    options = Options(
        sizes=QUICK if args.quick else FULL,
        cases=[case for case in CASES if case in args.only] if args.only else CASES,
        ledgers=KINDS if args.ledger == "both" else (args.ledger,),
    )
    report = run_suite(options)
    if args.save:
        Path(args.save).write_text(report.to_json() + "\n", encoding="utf-8")
    _print(args, report)
    return 0


def _print(args: argparse.Namespace, report: Report) -> None:
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    elif args.markdown:
        sys.stdout.write(markdown(report) + "\n")
    else:
        print_report(report, Console(width=200))
