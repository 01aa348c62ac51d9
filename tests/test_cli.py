"""The command line, run in process the way a user types it (stdout and exit codes checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hail_guard.cli import main

CONSENTED = {
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
    assert run(capsys, "suppress", "remove", "lead@example.com")[0] == 0
    code, _, err = run(capsys, "suppress", "remove", "lead@example.com")
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
