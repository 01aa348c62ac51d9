"""`hail-guard drill`: every scenario holds, the report reads and parses, and no scenario can pass by accident.

The sabotage tests switch off, one at a time, the protection a scenario checks (a minimal, named
change to our own code, made with monkeypatch) and show that THAT scenario's verdict becomes
`fails` on one of its checks: a mutation test of the drill, the one place tests patch our code.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from hail_guard import batch, drill, policy, same_send
from hail_guard.cli import drill as command_line
from hail_guard.config import Settings
from hail_guard.drill import DrillOptions, DrillReport, Scenario, run_drill
from hail_guard.drill.report import ScenarioResult, Tally
from hail_guard.errors import BadInput, ConfigError, RefusedByPolicy
from hail_guard.guard import Guard, SendReport
from hail_guard.ledger import sql
from hail_guard.ledger.sqlite import SqliteLedger
from hail_guard.logs import configure_logging
from hail_guard.models import Answer, AnswerKind, Intent, Operation, Outcome, State, Suppression
from hail_guard.policy import ReconcilePlan, outcomes
from tests.postgres import PostgresServer

SMALL = 12
"""Leads in the batch scenarios of most tests: enough for ~40%, a few workers and an opt-out."""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """The command quiets logging for the drill; later tests expect the suite's own level."""
    yield
    configure_logging("debug")


def verdicts(report: DrillReport) -> dict[int, str | None]:
    return {result.number: result.failed_check for result in report.scenarios}


def command(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command_line.add_arguments(parser)
    return parser.parse_args(argv)


async def test_the_command_with_the_default_leads_prints_a_table_and_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # a row per line
    code = await command_line.drill_command(command("--seed", "42"), Settings())
    out = capsys.readouterr().out
    assert code == command_line.EXIT_OK
    assert re.search(r"│ 2 +│ Hail hangs after acceptance \(timeout\) +│ 2 -> 1 +│ 2 -> 1 +│ holds", out)
    assert re.search(r"│ 3 +│ a batch dies .* +│ 101 -> 100 +│ 2 -> 1 +│ holds", out)  # dies, and is resumed
    assert re.search(
        r" 2\. faults: Hail accepts, then never answers .*\n +the agent saw: unknown -> reconcile -> accepted", out
    )
    assert "All 15 scenarios hold: nobody got a message twice and nothing was lost" in out
    assert "seed 42, 100 leads, 2 workers" in out
    assert "workers claim" in out
    assert "FAILS" not in out


@pytest.mark.parametrize("width", [80, 60])
def test_the_report_fits_the_terminal_and_shows_the_most_any_one_lead_got(
    width: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its table had no per-recipient column and, with long texts, went past the terminal's edge."""
    monkeypatch.setenv("COLUMNS", str(width))
    failed = ScenarioResult(
        number=3,
        name="a batch dies at ~40% and is resumed",
        faults="Hail drops the connection after accepting send 37 of 100; the run dies (37 sent) and a new one resumes",
        expected=100,
        sent=101,
        most_to_one=2,
        failed_check="drill-4f2a9c1e:lead-00092@drill-run-4f2a9c1e.example.com got 2 messages",
        seconds=1.0,
        without_guard=Tally(sent=101, most_to_one=2),
        agent_saw=("plan_batch: ready 100", "run_batch: cut off", "batch_status: accepted 36, ready 58, unknown 6"),
    )
    command_line.print_report(DrillReport(DrillOptions(seed=1, leads=100, workers=2), [failed], seconds=1.0))
    *lines, summary = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= width
    assert re.search(r"│ 3 +│ a batch .*│ 101 -> 101 +│ 2 -> 2 +│ FAILS", "\n".join(lines))
    words = " ".join(" ".join(lines).split())  # the details wrap between words
    assert "FAILS: drill-4f2a9c1e:lead-00092@drill-run-4f2a9c1e.example.com got 2 messages" in words
    assert summary.startswith("1 of 1 scenarios FAIL (3;")  # one line, for grep


async def test_every_scenario_holds_on_a_small_batch_and_the_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--json", "--leads", str(SMALL), "--workers", "3", "--seed", "5")
    code = await command_line.drill_command(command(*argv), Settings())
    report = json.loads(capsys.readouterr().out)
    assert code == command_line.EXIT_OK
    assert report["passed"] is True
    assert (report["seed"], report["leads"], report["workers"], report["ledger"]) == (5, SMALL, 3, None)
    assert [(s["number"], s["verdict"], s["failed_check"]) for s in report["scenarios"]] == [
        (number, "holds", None) for number in range(1, 16)
    ]
    assert all(s["sent"] == s["expected"] for s in report["scenarios"])
    assert [s["expected"] for s in report["scenarios"] if s["number"] in (3, 5, 6, 15)] == [
        SMALL,
        SMALL,
        SMALL - 1,
        SMALL,
    ]
    assert set(report["scenarios"][0]) == {
        "number",
        "name",
        "faults",
        "expected",
        "sent",
        "most_to_one",
        "without_guard",
        "agent_saw",
        "verdict",
        "failed_check",
        "seconds",
    }
    assert {s["number"]: s["most_to_one"] for s in report["scenarios"]} == {n: 0 if n == 7 else 1 for n in range(1, 16)}
    assert report["scenarios"][4]["without_guard"]["most_to_one"] == 3  # 3 workers without a shared ledger
    unguarded = {s["number"]: s["without_guard"]["sent"] for s in report["scenarios"]}
    assert unguarded == {
        **{1: 2, 2: 2, 3: SMALL + 1, 4: 2, 5: 3 * SMALL, 6: SMALL, 7: 1, 8: 2, 9: 2, 10: 2, 11: 2, 12: 2},
        **{13: 2, 14: 2, 15: SMALL + 1},
    }
    saw = {s["number"]: " -> ".join(s["agent_saw"]) for s in report["scenarios"]}
    assert saw[2] == "unknown -> reconcile -> accepted"
    assert saw[1] == "unknown -> unknown (from the ledger) -> reconcile -> accepted"
    assert saw[11] == "unknown -> unknown (from the ledger) -> reconcile -> accepted"
    assert saw[13] == "unknown -> unknown (from the ledger) -> reconcile -> accepted"
    assert saw[14].startswith("unknown -> send_email: refused")
    assert saw[14].endswith("-> reconcile -> accepted -> send_email: refused (probably a duplicate)")
    assert saw[15].startswith(f"plan_batch: ready {SMALL} -> run_batch: ")
    assert report["replay"] == f"hail-guard drill --seed 5 --leads {SMALL} --workers 3"


async def test_without_a_seed_one_is_chosen_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code = await command_line.drill_command(command("--json", "--scenario", "4"), Settings())
    report = json.loads(capsys.readouterr().out)
    assert code == command_line.EXIT_OK
    assert isinstance(report["seed"], int)
    assert f"--seed {report['seed']}" in report["replay"]
    assert [s["number"] for s in report["scenarios"]] == [4]


async def test_a_failing_scenario_exits_1_and_says_how_to_replay_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_same_send_rules(monkeypatch)
    code = await command_line.drill_command(command("--json", "--seed", "9", "--scenario", "11"), Settings())
    report = json.loads(capsys.readouterr().out)
    assert code == command_line.EXIT_FAILED
    assert report["passed"] is False
    [scenario] = report["scenarios"]
    assert scenario["verdict"] == "fails"
    assert "the new key is answered from the first send" in scenario["failed_check"]
    assert report["replay"] == "hail-guard drill --seed 9 --leads 100 --workers 2 --scenario 11"
    assert "1 of 1 scenarios FAIL (11" in report["summary"]


async def test_the_table_names_the_failed_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_same_send_rules(monkeypatch)
    code = await command_line.drill_command(command("--scenario", "11", "--seed", "3"), Settings())
    out = capsys.readouterr().out
    assert code == command_line.EXIT_FAILED
    assert "FAILS" in out
    assert "Replay: hail-guard drill --seed 3" in " ".join(out.split())


async def test_a_duplicate_window_of_0_still_answers_a_new_key_for_an_unresolved_send_from_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The window bounds only what has settled: an `unknown` send is compared at any age (it released it once)."""
    settings = Settings.model_validate({"guard": {"duplicate_window_hours": 0}})
    code = await command_line.drill_command(command("--json", "--scenario", "11", "--seed", "1"), settings)
    assert code == command_line.EXIT_OK
    assert json.loads(capsys.readouterr().out)["scenarios"][0]["sent"] == 1


async def test_the_same_seed_makes_the_same_choices() -> None:
    options = DrillOptions(seed=77, leads=20, scenarios=(3, 6))
    first, second = await run_drill(options), await run_drill(options)
    assert [r.faults for r in first.scenarios] == [r.faults for r in second.scenarios]
    other = await run_drill(DrillOptions(seed=78, leads=20, scenarios=(3, 6)))
    assert [r.faults for r in other.scenarios] != [r.faults for r in first.scenarios]


async def test_a_scenario_that_raises_fails_with_its_error_and_the_drill_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def explode(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(drill, "SCENARIOS", (Scenario(1, "explodes", explode), drill.SCENARIOS[3]))
    report = await run_drill(DrillOptions(seed=1, leads=SMALL))
    assert verdicts(report) == {1: "error: RuntimeError: boom", 4: None}
    assert not report.passed


async def test_repeated_runs_share_one_ledger_without_colliding(tmp_path: Path) -> None:
    colliding = (1, 3, 4, 5, 6, 7, 8, 11, 12)  # what would meet an earlier run's keys, content or opt-outs
    options = DrillOptions(seed=2, leads=SMALL, ledger_url=f"sqlite:///{tmp_path / 'shared.db'}", scenarios=colliding)
    assert (await run_drill(options)).passed
    again = await run_drill(options)  # the same seed again: keys, recipients and content are new
    assert verdicts(again) == dict.fromkeys(colliding)


async def test_the_drill_runs_on_postgresql(postgres_server: PostgresServer) -> None:
    async with postgres_server.database() as url:
        report = await run_drill(DrillOptions(seed=4, leads=SMALL, ledger_url=url))
    assert report.passed, report.summary()


async def test_a_batch_that_dies_resumes_at_once_on_postgresql(postgres_server: PostgresServer) -> None:
    async with postgres_server.database() as url:
        for seed in range(4):  # the cancellation lands in the window about every other time
            [result] = (await run_drill(DrillOptions(seed=seed, leads=30, ledger_url=url, scenarios=(3,)))).scenarios
            assert result.failed_check is None


async def test_the_drill_command_passes_on_a_fresh_postgresql_database(postgres_url: str) -> None:
    """`hail-guard drill --ledger postgresql://...` as an operator types it, on an empty database."""
    argv = [sys.executable, "-m", "hail_guard", "drill", "--ledger", postgres_url, "--json", "--seed", "7"]
    with anyio.fail_after(50):
        done = await anyio.run_process(argv, check=False)
    assert done.returncode == command_line.EXIT_OK, done.stderr.decode()
    report = json.loads(done.stdout)
    assert report["passed"] is True
    assert [scenario["failed_check"] for scenario in report["scenarios"]] == [None] * len(drill.SCENARIOS)


async def test_a_ledger_that_cannot_be_opened_is_an_error_not_a_verdict() -> None:
    with pytest.raises(ConfigError, match="unsupported ledger URL"):
        await run_drill(DrillOptions(seed=1, ledger_url="mysql://nowhere/ledger"))


def test_a_printed_ledger_url_hides_its_password() -> None:
    report = DrillReport(DrillOptions(seed=1, ledger_url="postgresql://app:s3cret@db:5432/hg"), [], 0.0)
    assert "s3cret" not in json.dumps(report.to_json())
    assert "--ledger postgresql://db:5432/hg" in report.replay_command()


@pytest.mark.parametrize(("flag", "value"), [("--leads", "0"), ("--workers", "x"), ("--scenario", "16")])
def test_bad_numbers_are_usage_errors(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        command(flag, value)


# Sabotage: each switches off one protection, minimally, and names it.


def _replace_sql(monkeypatch: pytest.MonkeyPatch, name: str, old: str, new: str) -> None:
    """Edit the SQLite ledger's named statement `name` for this test (the drill runs on SQLite)."""
    statements = sql.statements("sqlite")
    assert old in statements[name].text, f"the sabotage of {name} no longer applies"
    monkeypatch.setitem(statements, name, replace(statements[name], text=statements[name].text.replace(old, new)))


def retry_forwarded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """1: begin_send claims an existing key whatever its state, so a retry is forwarded again."""
    _replace_sql(monkeypatch, "claim_ready_by_id", "AND state IN ('ready') ", "")


def timeout_taken_as_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """2: classification records a lost answer (timeout, drop) as accepted."""
    monkeypatch.setitem(outcomes._FIRST_ATTEMPT, AnswerKind.LOST, State.ACCEPTED)


def resume_skips_unknowns(monkeypatch: pytest.MonkeyPatch) -> None:
    """3: a batch run does not settle the batch's unknown sends first."""
    reconcile = Guard.reconcile

    async def reconcile_except_batches(
        self: Guard, operation_id: str | None = None, *, batch_id: str | None = None
    ) -> list[Operation]:
        return [] if batch_id is not None else await reconcile(self, operation_id, batch_id=batch_id)

    monkeypatch.setattr(Guard, "reconcile", reconcile_except_batches)  # the first step of Batches.run


def changed_request_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """4: an existing key is answered from the ledger without comparing the request."""

    def answer_anyway(self: Guard, existing: Operation, intent: Intent, request: dict[str, Any]) -> SendReport:
        return SendReport(existing, replayed=True)

    monkeypatch.setattr(Guard, "_answer_from_ledger", answer_anyway)


def claims_held_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """5: claim_ready also takes operations another worker holds (`sending`; once each, or the workers
    could take each send from one another for ever)."""
    statements = sql.statements("sqlite")
    for name in ("claim_ready_any", "claim_ready_in_batch"):
        _replace_sql(
            monkeypatch,
            name,
            "WHERE state = 'ready' AND",
            "WHERE (state = 'ready' OR state = 'sending' AND attempts < 2) AND",
        )
        unindexed = re.sub(r" INDEXED BY \w+", "", statements[name].text)  # an index of ready rows cannot serve it
        monkeypatch.setitem(statements, name, replace(statements[name], text=unindexed))


def opt_out_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """6: an opt-out is acknowledged but not recorded."""

    async def forget(self: SqliteLedger, suppression: Suppression, *, actor: str) -> list[str]:
        return []

    monkeypatch.setattr(SqliteLedger, "add_suppression", forget)


def repeated_answer_not_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """7: reconcile does not see that Hail repeated its saved answer."""
    outcome_of_replay = policy.outcome_of_replay

    def forgetful(answer: Answer, *, previous_error: str | None, attempts: int, max_attempts: int) -> Outcome:
        return outcome_of_replay(answer, previous_error=None, attempts=attempts, max_attempts=max_attempts)

    monkeypatch.setattr(policy, "outcome_of_replay", forgetful)


def reconcile_mints_a_new_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """8: reconcile replays the stored request under a new key."""
    replay = Guard._replay

    async def replay_under_a_new_key(self: Guard, operation: Operation) -> Outcome:
        request = {**operation.arguments(), "idempotency_key": f"{operation.idempotency_key}:again"}
        return await replay(self, operation.model_copy(update={"request": json.dumps(request)}))

    monkeypatch.setattr(Guard, "_replay", replay_under_a_new_key)


def expired_lease_made_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """9: a `sending` operation whose lease ran out goes back to `ready`, not `unknown`."""
    _replace_sql(monkeypatch, "expire_leases", "SET state = 'unknown'", "SET state = 'ready'")


def key_retention_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """10: reconcile replays whatever the age of the first attempt."""
    plan_reconcile = policy.plan_reconcile

    def ageless(operation: Operation, *, now: Any, key_retention_hours: float, recipient_suppressed: bool) -> Any:
        plan: ReconcilePlan = plan_reconcile(
            operation, now=now, key_retention_hours=1e9, recipient_suppressed=recipient_suppressed
        )
        return plan

    monkeypatch.setattr(policy, "plan_reconcile", ageless)


def no_same_send_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """11: a new key for the same content is recorded whatever the ledger holds (no rule about the same send)."""
    monkeypatch.setattr(policy, "decide", lambda intent, found, rules, position=None: None)


def gateway_error_taken_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """12: classification records a gateway 5xx as a definitive failure."""
    monkeypatch.setitem(outcomes._FIRST_ATTEMPT, AnswerKind.GATEWAY_ERROR, State.FAILED)


def retries_compared_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """13: a message's meaning is its exact form (as before retries were recognised by meaning): its fingerprint and
    its key differ with every regenerated form."""
    monkeypatch.setattr(same_send, "meaning_of", lambda value: value)


def paraphrases_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """14: only the same message is compared: no hold while a send to the recipient is unresolved, no similarity."""
    judge = same_send.judge

    def exact_only(intent: Intent, text: str, found: same_send.Candidates, rules: same_send.Rules) -> Any:
        return judge(intent, text, same_send.Candidates(matches=found.matches), rules)

    monkeypatch.setattr(same_send, "judge", exact_only)


def campaigns_compared_without_recipients(monkeypatch: pytest.MonkeyPatch) -> None:
    """15: the planner's repeat check compares the message alone (the bug that refused every campaign whole)."""

    def by_content(self: Any, send: Any, intent: Intent) -> None:
        seen = self.__dict__.setdefault("contents", {})
        if intent.content_fingerprint in seen:
            raise RefusedByPolicy(f"{seen[intent.content_fingerprint]} and {send.where} have the same content")
        seen[intent.content_fingerprint] = send.where

    monkeypatch.setattr(batch._Repeats, "check", by_content)


SABOTAGE: dict[int, Callable[[pytest.MonkeyPatch], None]] = {
    1: retry_forwarded_again,
    2: timeout_taken_as_accepted,
    3: resume_skips_unknowns,
    4: changed_request_not_compared,
    5: claims_held_operations,
    6: opt_out_forgotten,
    7: repeated_answer_not_recognised,
    8: reconcile_mints_a_new_key,
    9: expired_lease_made_ready,
    10: key_retention_ignored,
    11: no_same_send_rules,
    12: gateway_error_taken_as_failed,
    13: retries_compared_byte_for_byte,
    14: paraphrases_not_held,
    15: campaigns_compared_without_recipients,
}


def test_every_scenario_has_a_sabotage() -> None:
    assert sorted(SABOTAGE) == [scenario.number for scenario in drill.SCENARIOS]


@pytest.mark.parametrize("number", sorted(SABOTAGE), ids=[f.__name__ for _, f in sorted(SABOTAGE.items())])
async def test_a_scenario_fails_when_its_protection_is_switched_off(
    number: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    SABOTAGE[number](monkeypatch)
    [result] = (await run_drill(DrillOptions(seed=number, leads=SMALL, scenarios=(number,)))).scenarios
    assert result.verdict == "fails"
    assert result.failed_check is not None
    assert not result.failed_check.startswith("error:"), result.failed_check  # a check failed, not the drill
    assert "did not finish" not in result.failed_check


@pytest.mark.timeout(240)  # fifteen `hail-guard serve` processes start, one after another
async def test_the_drill_runs_through_a_spawned_serve_over_stdio_and_keeps_what_it_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # a row per line
    keep = tmp_path / "kept"
    argv = ("--transport", "stdio", "--leads", str(SMALL), "--seed", "6", "--keep", str(keep))
    code = await command_line.drill_command(command(*argv), Settings())
    out = " ".join(capsys.readouterr().out.split())
    assert code == command_line.EXIT_OK, out
    assert "All 15 scenarios hold" in out
    assert "over stdio" in out
    assert f"kept in {keep}" in out
    assert re.search(r"│ 2 +│ Hail hangs after acceptance \(timeout\) +│ 2 -> 1 +│ 2 -> 1 +│ holds", out)
    outbox = [json.loads(line) for line in (keep / "scenario-01-outbox.jsonl").read_text().splitlines()]
    unguarded = (keep / "scenario-01-unguarded-outbox.jsonl").read_text().splitlines()
    assert (len(outbox), len(unguarded)) == (1, 2)
    assert (keep / "scenario-01.db").is_file()
    assert "proxy_ready" in (keep / "scenario-01-serve.log").read_text()  # the spawned serve's own log


async def test_the_drill_over_stdio_holds_on_postgresql(postgres_server: PostgresServer) -> None:
    async with postgres_server.database() as url:
        options = DrillOptions(seed=3, leads=SMALL, ledger_url=url, transport="stdio", scenarios=(1, 3, 6, 9))
        report = await run_drill(options)
    assert report.passed, report.summary()


async def test_keep_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("mine")
    with pytest.raises(BadInput, match="give a new or empty folder"):
        await run_drill(DrillOptions(seed=1, scenarios=(4,), keep=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["something"]
