"""The operator's first hour, run as typed: where the ledger is, a ledger that is empty or damaged, who is
sending (the heartbeats workers and batch runs leave), and what to do after a `batch run` that left sends
unresolved."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters, stdio_client

from hail_guard.batch import run_worker
from hail_guard.cli import main
from hail_guard.guard import PROCESS_ID
from hail_guard.ledger import Heartbeat, open_ledger
from hail_guard.models import Outcome, State
from tests.conftest import data, open_harness
from tests.ledger.test_ledger_contract import batch_intents
from tests.ledger.test_ledger_sqlite import damage


def consented(n: int) -> dict[str, object]:
    return {
        "to": [f"lead{n}@example.com"],
        "subject": "Hi",
        "body_text": f"Hello {n}",
        "recipient_consent": True,
        "metadata": {"campaign_id": "spring", "lead_id": f"lead{n}", "message_id": "intro"},
    }


@pytest.fixture
def ledger_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in sandbox upstream, a ledger in tmp_path, approval required, no delivery polling."""
    path = tmp_path / "hail-guard.toml"
    path.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[guard]\nrequire_approval = true\n'
        '[delivery]\npoll = false\n[log]\nlevel = "warning"\n'
    )
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(path))
    return tmp_path / "ledger.db"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_status_refuses_an_empty_ledger_file_and_leaves_it_as_it_is(
    ledger_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger_path.write_bytes(b"")
    for command in (["status"], ["ops", "list"], ["migrate"]):
        code, out, err = run(capsys, *command)
        assert (code, out) == (1, ""), command
        assert "is an empty file (0 bytes)" in err
    assert ledger_path.stat().st_size == 0


def test_status_refuses_a_damaged_ledger_as_ops_list_does(
    ledger_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def fill() -> None:
        async with open_ledger(str(ledger_path)) as ledger:
            await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(300), state=State.READY, actor="a")

    anyio.run(fill)
    damage(ledger_path)
    for command in (["status"], ["status", "--json"], ["ops", "list", "--limit", "1000"]):
        code, out, err = run(capsys, *command)
        assert (code, out) == (1, ""), command
        assert "is damaged" in err
        assert ".recover" in err


def test_status_says_who_is_sending_and_plainly_when_nobody_is(
    ledger_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "status")
    assert code == 0
    assert "sending: nobody: no worker, `batch run` or serve is sending from this ledger" in out

    async def beat() -> None:
        async with open_ledger(str(ledger_path)) as ledger:
            await ledger.record_heartbeat(Heartbeat("b-1", "host-a:4242", "batch run", batch_id="batch-1"))

    anyio.run(beat)
    code, out, _ = run(capsys, "status", "--json")
    [sender] = json.loads(out)["sending"]
    assert (sender["who"], sender["role"], sender["batch_id"], sender["stale"]) == (
        "host-a, process 4242",
        "batch run",
        "batch-1",
        False,
    )
    code, out, _ = run(capsys, "status")
    assert "sending: host-a, process 4242 (batch run, batch batch-1) since " in out


def test_a_batch_run_that_leaves_sends_unresolved_exits_3_and_names_the_next_step(
    ledger_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sends = tmp_path / "batch.jsonl"
    sends.write_text("".join(json.dumps({"tool": "send_email", "arguments": consented(n)}) + "\n" for n in range(3)))
    code, out, _ = run(capsys, "batch", "plan", str(sends))
    batch_id = json.loads(out)["batch_id"]
    assert run(capsys, "batch", "approve", batch_id)[0] == 0

    async def leave_two_unresolved() -> None:
        async with open_ledger(str(ledger_path)) as ledger:
            [lost, unclear] = await ledger.claim_ready(owner="w", lease_seconds=60, batch_id=batch_id, limit=2)
            later = Outcome(state=State.UNKNOWN, reason="timeout", error="no answer", check_after_seconds=3600)
            await ledger.record_outcome(lost.id, owner="w", outcome=later, actor="w")
            review = Outcome(state=State.NEEDS_REVIEW, reason="unclear", review_reason="unclear")
            await ledger.record_outcome(unclear.id, owner="w", outcome=review, actor="w")

    anyio.run(leave_two_unresolved)
    code, out, _ = run(capsys, "batch", "run", batch_id, "--no-progress")
    assert code == 3
    assert (
        "next step: 1 send(s) have no known outcome (Hail may have sent them): `hail-guard reconcile` settles them, "
        f"or run `hail-guard batch run {batch_id}` again later (it reconciles first)"
    ) in out
    assert "next step: 1 send(s) need a person to decide: `hail-guard review list`" in out


async def test_serve_started_elsewhere_makes_its_relative_ledger_beside_its_config_and_says_where(
    tmp_path: Path,
) -> None:
    """As a desktop client starts it: an absolute config path, a working folder of the client's choosing."""
    folder, elsewhere = tmp_path / "config", tmp_path / "client"
    folder.mkdir()
    elsewhere.mkdir()
    config = folder / "hail-guard.toml"
    config.write_text('[ledger]\nurl = "ledger.db"\n[delivery]\npoll = false\n')
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "hail_guard", "serve", "--config", str(config)], cwd=str(elsewhere)
    )
    with (tmp_path / "serve.log").open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode="legacy") as agent:
            assert "send_email" in {tool.name for tool in (await agent.list_tools()).tools}
    logged = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    events = {entry["event"]: entry for entry in logged}
    assert events["proxy_ready"]["ledger"] == str(folder / "ledger.db")
    assert events["ledger_created"]["ledger"] == str(folder / "ledger.db")
    assert (folder / "ledger.db").stat().st_size > 0
    assert list(elsewhere.iterdir()) == []


async def test_a_batch_run_and_a_worker_beat_while_they_send_and_take_their_beat_away_after(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        sends = [{"tool": "send_email", "arguments": consented(n)} for n in range(2)]
        batch_id = data(await harness.call("plan_batch", {"sends": sends}))["batch_id"]
        seen: list[list[tuple[str, str, str | None]]] = []

        async def progress(done: int, total: int | None) -> None:
            seen.append([(beat.who, beat.role, beat.batch_id) for beat in await harness.ledger.heartbeats()])

        await harness.proxy.batches.run(batch_id, concurrency=1, progress=progress)
        assert seen == [[(PROCESS_ID, "batch run", batch_id)]] * 2
        assert await harness.ledger.heartbeats() == []
        more = [{"tool": "send_email", "arguments": consented(n)} for n in range(2, 4)]
        await harness.call("plan_batch", {"sends": more})
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_worker, harness.proxy.guard, harness.ledger, concurrency=1, stop=stop))
            with anyio.fail_after(10):
                await harness.sandbox.wait_for_outbox(4)
            [beat] = await harness.ledger.heartbeats()
            assert (beat.who, beat.role, beat.batch_id) == (PROCESS_ID, "worker", None)
            stop.set()
        assert await harness.ledger.heartbeats() == []
