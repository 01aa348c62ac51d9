"""The command line, run in process the way a user types it (stdout and exit codes checked)."""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from hail_guard.cli import main
from hail_guard.cli import parser as cli_parser
from hail_guard.cli.clients import TOKEN_PLACEHOLDER
from tests.end_to_end.test_upstream import ECHO_SERVER
from tests.unit.test_docs import doc_block

CONSENTED: dict[str, Any] = {
    "to": ["lead@example.com"],
    "subject": "Hi",
    "body_text": "Hello",
    "recipient_consent": True,
    "metadata": {"campaign_id": "c", "lead_id": "l1", "message_id": "intro"},
}


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in sandbox upstream, a ledger in tmp_path, approval required."""
    path = tmp_path / "hail-guard.toml"
    path.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        f'[upstream]\nsandbox_outbox = "{tmp_path / "outbox.jsonl"}"\n'
        '[guard]\nrequire_approval = true\n[log]\nlevel = "warning"\n'
    )
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_planned_batch_waits_for_approval_then_runs(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    code, out, _ = run(capsys, "batch", "plan", str(batch), "--name", "spring")
    assert code == 0
    batch_id = json.loads(out)["batch_id"]
    assert json.loads(out)["counts"] == {"planned": 1}

    code, out, _ = run(capsys, "batch", "run", batch_id)
    assert code == 0
    assert not (tmp_path / "outbox.jsonl").exists()

    assert run(capsys, "batch", "approve", batch_id, "--by", "alice")[0] == 0
    code, out, _ = run(capsys, "batch", "run", batch_id)
    assert code == 0
    assert "accepted 1" in out
    assert len((tmp_path / "outbox.jsonl").read_text().splitlines()) == 1

    code, out, _ = run(capsys, "batch", "status", batch_id, "--json")
    assert json.loads(out)["counts"] == {"accepted": 1}

    code, out, _ = run(capsys, "ops", "list", "--state", "accepted", "--json")
    [view] = [json.loads(line) for line in out.splitlines()]
    assert view["idempotency_key"] == "c:l1:email:intro"

    code, out, _ = run(capsys, "ops", "show", "c:l1:email:intro", "--json")
    shown = json.loads(out)
    assert [e["actor"] for e in shown["history"]][:2] == [shown["history"][0]["actor"], "alice"]
    assert [e["to_state"] for e in shown["history"]] == ["planned", "ready", "sending", "accepted"]
    assert shown["request"]["idempotency_key"] == "c:l1:email:intro"


def test_opt_outs_from_the_command_line(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "suppress", "add", "Lead@Example.com", "--reason", "asked by phone")
    assert (code, out.strip()) == (0, "suppressed lead@example.com on all; cancelled 0 send(s)")
    code, out, _ = run(capsys, "suppress", "list", "--json")
    assert json.loads(out)["reason"] == "asked by phone"
    with pytest.raises(SystemExit) as usage:  # as in the console, taking one back needs a reason
        main(["suppress", "remove", "lead@example.com"])
    assert (usage.value.code, "--reason" in capsys.readouterr().err) == (2, True)
    code, out, _ = run(capsys, "suppress", "remove", "lead@example.com", "--reason", "asked to hear again")
    assert (code, out.strip()) == (0, "removed the opt-out of lead@example.com on all (asked to hear again)")
    code, _, err = run(capsys, "suppress", "remove", "lead@example.com", "--reason", "again")
    assert code == 1
    assert "has no opt-out" in err


def test_reconcile_with_nothing_unknown_reports_nothing(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "reconcile", "--json")
    assert (code, json.loads(out)) == (0, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ops", "show", "nope"], "no operation has the id or key 'nope'"),
        (["batch", "status", "batch-nope"], "no batch batch-nope"),
        (["batch", "approve", "batch-nope"], "no batch batch-nope"),
        (["batch", "plan", "/no/such/file.jsonl"], "cannot read the batch file"),
    ],
)
def test_errors_are_one_clear_line_and_exit_1(
    config: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert message in err


@pytest.fixture
def logging_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ledger in tmp_path, the built-in sandbox, the default log level (info)."""
    path = tmp_path / "hail-guard.toml"
    path.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[delivery]\npoll = false\n')
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    return path


def test_a_command_prints_its_result_and_warnings_only_as_text_and_the_log_with_verbose(
    logging_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They once printed 3-4 JSON log lines before their one-line result."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    code, out, err = run(capsys, "batch", "plan", str(batch))
    assert (code, json.loads(out)["counts"]) == (0, {"ready": 1})
    [created, sandbox] = err.splitlines()  # each warning a line of text, and nothing else
    assert created.startswith("hail-guard: warning: no ledger was there: a new, empty one was made")
    assert sandbox == "hail-guard: warning: no upstream configured: using the built-in sandbox; nothing real is sent"
    code, _, err = run(capsys, "batch", "list", "--verbose")
    assert code == 0
    assert "upstream_connected" not in err  # it reads the ledger only
    code, _, err = run(capsys, "batch", "run", json.loads(out)["batch_id"], "--verbose")
    assert {json.loads(line)["event"] for line in err.splitlines()} >= {"sandbox_upstream", "upstream_connected"}


def test_batch_plan_on_a_missing_file_says_so_before_connecting_to_the_upstream(
    logging_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "batch", "plan", str(tmp_path / "nosuch.jsonl"), "--verbose")
    assert code == 1
    assert err.splitlines()[-1] == f"hail-guard: cannot read the batch file {tmp_path / 'nosuch.jsonl'}: no such file"
    assert "upstream_connected" not in err  # logged when it connects (--verbose shows info)


def test_a_broken_config_is_reported_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[upstream]\ntimeout_seconds = 'soon'\n")
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(broken))
    code, _, err = run(capsys, "ops", "list")
    assert code == 1
    assert "[upstream.timeout_seconds]" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ops", "list", "--state", "sent"])
    assert exited.value.code == 2


def test_a_worker_on_a_ledger_it_cannot_write_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", f"sqlite:///{blocker / 'ledger.db'}")
    code, _, err = run(capsys, "worker")
    assert code == 1
    assert "cannot be used" in err


def test_migrate_reports_the_schema_version(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hail_guard.ledger.sqlite import migrations

    code, out, _ = run(capsys, "migrate")
    assert (code, out.strip()) == (0, f"the ledger is at schema version {migrations()[-1][0]}")


def test_status_shows_counts_and_the_review_queue(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "status", "--json")
    report = json.loads(out)
    assert (code, report["operations"], report["review_queue"], report["oldest_unknown"]) == (0, {}, 0, None)


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sandbox_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in sandbox upstream, a ledger in tmp_path, no approval: what a new user has."""
    path = tmp_path / "hail-guard.toml"
    path.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        f'[upstream]\nsandbox_outbox = "{tmp_path / "outbox.jsonl"}"\n[delivery]\npoll = false\n'
        '[log]\nlevel = "warning"\n'
    )
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    for name in ("HAIL_GUARD_UPSTREAM_URL", "HAIL_GUARD_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.mark.parametrize(
    ("page", "after"), [("docs/how-to/campaigns.md", "**Batch files.**"), ("docs/tutorial/first-hour.md", "leads.csv")]
)
def test_the_docs_csv_example_plans_and_every_row_is_accepted(
    sandbox_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], page: str, after: str
) -> None:
    leads = tmp_path / "leads.csv"
    leads.write_text(doc_block(page, "csv", after))
    code, out, err = run(capsys, "batch", "plan", str(leads), "--name", "spring")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["next_step"] == f"hail-guard batch run {planned['batch_id']}"
    assert run(capsys, "batch", "run", planned["batch_id"])[0] == 0
    code, out, _ = run(capsys, "batch", "status", planned["batch_id"], "--json")
    rows = len(leads.read_text().splitlines()) - 1
    assert json.loads(out)["counts"] == {"accepted": rows}
    sent = [json.loads(line) for line in (tmp_path / "outbox.jsonl").read_text().splitlines()]
    assert sorted(entry["tool"] for entry in sent) == ["send_email", "send_sms"]


def test_a_batch_file_refused_by_the_ledger_names_the_send_by_its_line(
    sandbox_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ledger checks the sends by their position in the batch; the operator reads a file by its lines (a CSV's
    header is line 1), so the refusal names the line to leave out."""
    header = "tool,to,subject,body_text,recipient_consent,metadata.campaign_id,metadata.lead_id,metadata.message_id\n"
    first = tmp_path / "first.csv"
    first.write_text(header + "send_email,ada@example.com,Spring,Our spring offer.,true,spring,ada,offer\n")
    planned = json.loads(run(capsys, "batch", "plan", str(first))[1])
    assert run(capsys, "batch", "run", planned["batch_id"])[0] == 0
    again = tmp_path / "again.csv"
    again.write_text(
        header
        + "send_email,bob@example.com,Spring,Our spring offer.,true,spring,bob,offer\n"
        + "send_email,ada@example.com,Spring,Our spring offer.,true,spring,ada,offer-again\n"
    )
    code, _, err = run(capsys, "batch", "plan", str(again))
    assert code != 0
    assert "line 3: ada@example.com already has this message" in err
    assert "Leave line 3 out of the batch." in err
    assert "send 2" not in err


def test_batch_plan_names_the_next_command_for_a_batch_waiting_for_approval(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    planned = json.loads(run(capsys, "batch", "plan", str(batch))[1])
    assert planned["next_step"] == f"hail-guard batch approve {planned['batch_id']}"


def leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command line's words (`ops list`) with its parser, walking the subcommands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += leaf_commands(child, (*path, name))
    return found or [(path, parser)]


def every_command() -> list[tuple[tuple[str, ...], Any]]:
    words = ["drill", "sandbox", "fake"]  # their options load only when named
    return leaf_commands(cli_parser(words))


def minimal_argv(parser: argparse.ArgumentParser) -> list[str]:
    """The fewest arguments this command accepts: its positionals and required options."""
    argv: list[str] = []
    for action in parser._actions:
        value = str(next(iter(action.choices))) if action.choices else "1"
        if not action.option_strings and action.nargs in (None, 1):
            argv.append(value)
        elif action.option_strings and action.required:
            argv += [action.option_strings[0], value]
    return argv


def test_global_options_go_before_or_after_every_command(tmp_path: Path) -> None:
    config = str(tmp_path / "c.toml")
    for path, command in every_command():
        rest = minimal_argv(command)
        parser = cli_parser(path)
        assert parser.parse_args([*path, *rest, "--config", config]).config == config, path
        assert parser.parse_args(["--config", config, *path, *rest]).config == config, path
        assert not hasattr(parser.parse_args([*path, *rest]), "config"), path
        assert "--config FILE" in command.format_help(), path


def option_help(command: argparse.ArgumentParser, option: str) -> str:
    """The help of one option as `--help` prints it (its lines up to the next option)."""
    lines = command.format_help().splitlines()
    after_usage = lines.index("")  # a usage that wraps can start a line with the option too
    start = next(n for n, line in enumerate(lines) if n > after_usage and line.strip().startswith(option))
    rest = [lines[start]]
    for line in lines[start + 1 :]:
        if line.strip().startswith("-") or not line.startswith(" "):
            break
        rest.append(line)
    return " ".join(" ".join(rest).split())


def test_every_option_says_its_default_in_help() -> None:
    quiet = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction)
    for path, command in every_command():
        for action in command._actions:
            if action.option_strings and not isinstance(action, quiet):
                text = option_help(command, action.option_strings[-1])
                assert "default" in text or "(required)" in text, (path, text)


def test_sandbox_help_lists_every_fault_kind(capsys: pytest.CaptureFixture[str]) -> None:
    from hail_guard.sandbox import FAULT_KINDS

    with pytest.raises(SystemExit) as done:
        main(["sandbox", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert [kind for kind in FAULT_KINDS if f"  {kind}" not in out] == []


def test_reconcile_help_describes_its_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["reconcile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "ID_OR_KEY an operation id or an idempotency key (default: every unknown send that is due)" in out


def test_reconcile_review_and_ops_take_an_id_or_a_key(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.end_to_end.test_operator_commands import REVIEW_WHY, in_review

    key = "spring:lead9:email:intro"
    operation_id = in_review(f"sqlite:///{tmp_path / 'ledger.db'}", key)
    for reference in (operation_id, key):
        shown = json.loads(run(capsys, "ops", "show", reference, "--json")[1])
        assert (shown["operation_id"], shown["review_reason"]) == (operation_id, REVIEW_WHY)
    code, out, err = run(capsys, "reconcile", key, "--json")
    assert (code, [view["operation_id"] for view in json.loads(out)]) == (0, [operation_id]), err
    code, out, _ = run(capsys, "review", "resolve", key, "--as", "failed", "--reason", "Hail shows none", "--by", "me")
    assert (code, out.strip()) == (0, f"{operation_id} resolved as failed by me")


def test_tables_never_cut_an_id_or_a_key(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.end_to_end.test_operator_commands import in_review

    key = "a-very-long-campaign-name:" + "lead-" * 20 + "1:email:intro"
    operation_id = in_review(f"sqlite:///{tmp_path / 'ledger.db'}", key)
    for argv in (["ops", "list"], ["review", "list"], ["ops", "list", "--wide"]):
        code, out, _ = run(capsys, *argv)
        lines = out.splitlines()
        assert code == 0
        assert any(key in line and operation_id in line for line in lines), argv
        assert "…" not in out


def test_a_table_wraps_other_columns_before_it_folds_an_id() -> None:
    from io import StringIO

    from rich.console import Console

    from hail_guard.cli.terminal import Column, print_table

    out = StringIO()
    ids = ("6f1c2a3e-0000-4000-8000-000000000001", "campaign_042:lead_018:email:intro")
    rows = [(*ids, "a long reason that has to wrap over several lines to fit", "accepted")]
    terminal = Console(file=out, width=100, force_terminal=True, color_system=None)
    print_table(
        (Column("operation", whole=True), Column("key", whole=True), "why", "state"), rows, title="t", out=terminal
    )
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    assert any(ids[0] in line and ids[1] in line for line in lines)
    assert sum("│" in line for line in lines) > 1  # the reason wrapped


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_progress_bar_off_a_terminal_with_no_progress_or_before_an_argument_error(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    batch_id = json.loads(run(capsys, "batch", "plan", str(batch))[1])["batch_id"]
    run(capsys, "batch", "approve", batch_id)

    def stderr_of(*argv: str) -> str:
        terminal = Terminal()
        with monkeypatch.context() as patched:
            patched.setattr(sys, "stderr", terminal)
            main(list(argv))
        capsys.readouterr()
        return terminal.getvalue()

    assert "sending batch-nope" not in stderr_of("batch", "run", "batch-nope")
    assert "no batch batch-nope" in stderr_of("batch", "run", "batch-nope")
    assert "sending" not in stderr_of("batch", "run", batch_id, "--no-progress")
    code, _, err = run(capsys, "batch", "run", batch_id)  # stderr is not a terminal here
    assert (code, "sending" in err, "━" in err) == (0, False, False)


def test_the_bar_is_drawn_on_a_terminal(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    batch_id = json.loads(run(capsys, "batch", "plan", str(batch))[1])["batch_id"]
    run(capsys, "batch", "approve", batch_id)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["batch", "run", batch_id]) == 0
    assert f"sending {batch_id}" in terminal.getvalue()


def test_batch_list_shows_each_batch_with_its_name_and_counts(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    first = json.loads(run(capsys, "batch", "plan", str(batch), "--name", "spring")[1])["batch_id"]
    other = {**CONSENTED, "to": ["b@example.com"], "metadata": {**CONSENTED["metadata"], "lead_id": "l2"}}
    batch.write_text(json.dumps({"tool": "send_email", "arguments": other}) + "\n")
    second = json.loads(run(capsys, "batch", "plan", str(batch))[1])["batch_id"]
    code, out, _ = run(capsys, "batch", "list", "--json")
    listed = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [(b["batch_id"], b["name"], b["counts"], b["total"]) for b in listed] == [
        (second, None, {"planned": 1}, 1),
        (first, "spring", {"planned": 1}, 1),
    ]
    code, out, _ = run(capsys, "batch", "list")
    assert (code, first in out, second in out, "spring" in out, "planned 1" in out) == (0, True, True, True, True)


def test_status_names_the_ledger_and_the_upstream(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads(run(capsys, "status", "--json")[1])
    assert report["ledger"] == f"sqlite:///{tmp_path / 'ledger.db'}"
    assert report["upstream"] == "the built-in sandbox (nothing real is sent)"
    assert report["warnings"] == []
    code, out, _ = run(capsys, "status")
    assert (code, f"ledger: sqlite:///{tmp_path / 'ledger.db'}" in out) == (0, True)


def test_status_warns_when_an_upstream_is_set_and_its_token_is_not(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAIL_GUARD_UPSTREAM_URL", "https://user:pw@hail.example/?k=v")
    monkeypatch.setenv("HAIL_API_KEY", "")
    report = json.loads(run(capsys, "status", "--json")[1])
    assert report["upstream"] == "https://hail.example/ (http)"
    [warning] = report["warnings"]
    assert warning.startswith("HAIL_API_KEY is not set")
    assert "warning: HAIL_API_KEY is not set" in run(capsys, "status")[1]
    monkeypatch.setenv("HAIL_API_KEY", "a-token")
    assert json.loads(run(capsys, "status", "--json")[1])["warnings"] == []


def test_a_postgresql_ledger_is_named_without_its_user_or_password() -> None:
    from hail_guard.cli.admin import ledger_shown

    assert ledger_shown("postgresql://hg:s3cret@db:5432/hg?password=s3cret") == "postgresql://db:5432/hg"


def test_a_url_without_a_token_or_a_sign_in_is_warned_of_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `serve` logs at start-up, `status` and `/readyz` show (spawned: tests/end_to_end/test_stdio.py)."""
    from datetime import UTC, datetime

    from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

    from hail_guard.app import credentials_warning
    from hail_guard.config import load_settings
    from hail_guard.oauth import SignInRecord, TokenStore

    url, folder = "https://mcp.hail.so", str(tmp_path / "signin")
    settings = load_settings(None, environ={"HAIL_GUARD_UPSTREAM_URL": url, "HAIL_GUARD_UPSTREAM_SIGNIN_DIR": folder})
    monkeypatch.delenv("HAIL_API_KEY", raising=False)
    warning = credentials_warning(settings)
    assert warning is not None
    assert warning.startswith("HAIL_API_KEY is not set")
    assert "hail-guard login" in warning
    client = OAuthClientInformationFull(client_id="hg", redirect_uris=["http://127.0.0.1/callback"])
    signed_in = SignInRecord(
        upstream=url, tokens=OAuthToken(access_token="a"), client=client, signed_in_at=datetime.now(UTC)
    )
    TokenStore(url, folder).save(signed_in)
    assert credentials_warning(settings) is None
    TokenStore(url, folder).forget()
    monkeypatch.setenv("HAIL_API_KEY", "a-key")
    assert credentials_warning(settings) is None


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_status_notices_the_placeholder_client_config_writes(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAIL_GUARD_UPSTREAM_URL", f"http://127.0.0.1:{closed_port()}/mcp")
    monkeypatch.setenv("HAIL_API_KEY", TOKEN_PLACEHOLDER)
    code, out, _ = run(capsys, "status", "--json")
    [warning] = json.loads(out)["warnings"]
    assert code == 0
    assert warning.startswith(f"HAIL_API_KEY holds {TOKEN_PLACEHOLDER}, the placeholder")
    assert "put your Hail key there" in warning


def test_status_says_whether_the_upstream_answers_and_never_fails_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "hail-guard.toml"
    echo = json.dumps([sys.executable, str(ECHO_SERVER)])
    path.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[upstream]\ncommand = {echo}\n')
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    code, out, _ = run(capsys, "status")
    assert (code, "upstream answers: yes: it lists 3 tool(s)" in out) == (0, True)
    path.write_text(  # a url and a command both set is refused at start: the url alone
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[upstream]\nurl = "http://127.0.0.1:{closed_port()}/mcp"\n'
    )
    code, out, _ = run(capsys, "status", "--json")
    answered = json.loads(out)["upstream_answers"]
    assert (code, answered["answers"]) == (0, False)
    assert "is not reachable" in answered["detail"]
    assert json.loads(run(capsys, "status", "--json")[1])["operations"] == {}  # the rest is reported all the same


def test_a_folder_given_as_the_ledger_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It once printed a good error, then a traceback from the SQLite driver's thread."""
    monkeypatch.delenv("HAIL_GUARD_CONFIG", raising=False)
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", str(tmp_path))
    for argv in (("status",), ("ops", "list"), ("migrate",)):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (1, "")
        assert err.splitlines() == [
            f"hail-guard: the ledger {tmp_path} is a folder: name a file in it, such as {tmp_path / 'ledger.db'}"
        ]


def test_upstream_accept_of_a_tool_never_listed_fails_naming_it_and_the_known_ones(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    assert run(capsys, "batch", "plan", str(batch))[0] == 0  # the proxy records the tools it sees
    code, out, err = run(capsys, "upstream", "accept", "send_email", "nosuchtool")
    assert (code, out) == (1, "")
    assert "no upstream tool named 'nosuchtool'; nothing was accepted" in err
    assert "send_email" in err.split("as last seen:")[1]
    assert run(capsys, "upstream", "accept", "send_email")[0:2] == (0, "accepted 0 changed tool(s): none\n")


def test_batch_cancel_cancels_what_was_not_sent_with_the_reason(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tool": "send_email", "arguments": CONSENTED}) + "\n")
    batch_id = json.loads(run(capsys, "batch", "plan", str(batch))[1])["batch_id"]
    code, out, _ = run(capsys, "batch", "cancel", batch_id, "--reason", "the wrong list")
    assert (code, out.splitlines()[0]) == (
        0,
        f"cancelled 1 unsent send(s) of {batch_id}; see `hail-guard batch status {batch_id}`",
    )
    shown = json.loads(run(capsys, "ops", "show", "c:l1:email:intro", "--json")[1])
    assert shown["state"] == "cancelled"
    assert shown["cancel_reason"].endswith(": the wrong list")
    assert run(capsys, "batch", "cancel", "batch-nosuch", "--reason", "x")[0] == 1
    assert not (tmp_path / "outbox.jsonl").exists()
