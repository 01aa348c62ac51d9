"""Worker processes sharing one ledger (SQLite, or PostgreSQL), against `hail-guard sandbox` over HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from hail_guard.ledger import open_ledger
from hail_guard.models import State
from tests.end_to_end.test_stdio import outbox_lines, running_sandbox

HG = [sys.executable, "-m", "hail_guard"]


def write_config(
    tmp_path: Path,
    ledger_url: str,
    upstream_url: str,
    *,
    lease_seconds: float = 60.0,
    timeout_seconds: float = 5.0,
    shutdown_seconds: float = 10.0,
) -> Path:
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "{ledger_url}"\nbusy_timeout_seconds = 30\n'
        f'[upstream]\nurl = "{upstream_url}"\ntimeout_seconds = {timeout_seconds}\n'
        f"[guard]\nlease_seconds = {lease_seconds}\n[worker]\npoll_seconds = 0.2\n"
        f"shutdown_seconds = {shutdown_seconds}\n"
        '[log]\nlevel = "warning"\n'
    )
    return config


def plan_batch(tmp_path: Path, config: Path, leads: int) -> str:
    batch = tmp_path / "batch.jsonl"
    with batch.open("w") as file:
        for n in range(leads):
            arguments: dict[str, Any] = {
                "to": [f"lead{n}@example.com"],
                "subject": "Hello",
                "body_text": f"Hello lead {n}",
                "recipient_consent": True,
                "metadata": {"campaign_id": "c", "lead_id": f"lead{n}", "message_id": "intro"},
            }
            file.write(json.dumps({"tool": "send_email", "arguments": arguments}) + "\n")
    planned = subprocess.run(
        [*HG, "--config", str(config), "batch", "plan", str(batch)], capture_output=True, text=True, check=False
    )
    assert planned.returncode == 0, planned.stderr
    batch_id: str = json.loads(planned.stdout)["batch_id"]
    return batch_id


async def start_worker(config: Path, batch_id: str, concurrency: int) -> Process:
    args = [*HG, "--config", str(config), "worker", "--concurrency", str(concurrency), "--batch", batch_id]
    return await anyio.open_process(args, stdout=None, stderr=None)


async def wait_for_batch(ledger_url: str, batch_id: str, expected: dict[State, int], seconds: float) -> None:
    async with open_ledger(ledger_url) as ledger:
        with anyio.fail_after(seconds):
            while (await ledger.batch_status(batch_id)).counts != expected:  # noqa: ASYNC110  (other processes)
                await anyio.sleep(0.2)


async def stop(process: Process) -> int:
    process.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        return await process.wait()


@pytest.mark.timeout(300)  # 35 s to over 2 min on 2 shared cores: past the 60 s default
@pytest.mark.parametrize(
    ("ledger_url", "sends"),
    [("sqlite", 1000), pytest.param("postgres", 2000, marks=pytest.mark.slow)],
    indirect=["ledger_url"],
)
async def test_four_worker_processes_drain_a_batch_sending_each_operation_once(
    tmp_path: Path, ledger_url: str, sends: int
) -> None:
    async with running_sandbox(tmp_path) as (url, outbox):
        config = write_config(tmp_path, ledger_url, url)
        batch_id = plan_batch(tmp_path, config, sends)
        workers = [await start_worker(config, batch_id, 4) for _ in range(4)]
        try:
            await wait_for_batch(ledger_url, batch_id, {State.ACCEPTED: sends}, seconds=240)
        finally:
            codes = [await stop(worker) for worker in workers]
        assert codes == [0, 0, 0, 0]
        keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
        assert len(keys) == len(set(keys)) == sends


async def test_a_killed_worker_is_recovered_after_its_lease_with_no_duplicate(tmp_path: Path, ledger_url: str) -> None:
    async with running_sandbox(tmp_path, "send_email:5:hang_after_accept") as (url, outbox):
        config = write_config(tmp_path, ledger_url, url, lease_seconds=1.0)
        batch_id = plan_batch(tmp_path, config, 20)
        doomed = await start_worker(config, batch_id, 1)
        with anyio.fail_after(30):
            while len(outbox_lines(outbox)) < 5:  # noqa: ASYNC110  (the 5th send hangs after acceptance)
                await anyio.sleep(0.05)
        doomed.kill()
        await doomed.wait()
        survivor = await start_worker(config, batch_id, 2)
        try:
            await wait_for_batch(ledger_url, batch_id, {State.ACCEPTED: 20}, seconds=60)
        finally:
            assert await stop(survivor) == 0
        keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
        assert len(keys) == len(set(keys)) == 20


async def test_sigterm_lets_in_flight_sends_finish_then_exits_cleanly(tmp_path: Path, ledger_url: str) -> None:
    async with running_sandbox(tmp_path, "send_email:*:delay:400") as (url, outbox):
        config = write_config(tmp_path, ledger_url, url)
        batch_id = plan_batch(tmp_path, config, 30)
        worker = await start_worker(config, batch_id, 3)
        with anyio.fail_after(30):
            while not outbox_lines(outbox):  # noqa: ASYNC110  (another process's file)
                await anyio.sleep(0.05)
        assert await stop(worker) == 0
        async with open_ledger(ledger_url) as ledger:
            counts = (await ledger.batch_status(batch_id)).counts
        assert State.SENDING not in counts
        assert State.UNKNOWN not in counts
        assert counts[State.ACCEPTED] == len(outbox_lines(outbox))
        assert counts[State.READY] > 0


async def test_a_send_sigterm_cuts_off_at_the_shutdown_bound_is_recorded_unknown(
    tmp_path: Path, ledger_url: str
) -> None:
    async with running_sandbox(tmp_path, "send_email:1:hang_after_accept") as (url, outbox):
        config = write_config(tmp_path, ledger_url, url, timeout_seconds=60.0, shutdown_seconds=0.5)
        batch_id = plan_batch(tmp_path, config, 1)
        worker = await start_worker(config, batch_id, 1)
        with anyio.fail_after(30):
            while not outbox_lines(outbox):  # noqa: ASYNC110  (another process's file: Hail has the send)
                await anyio.sleep(0.05)
        assert await stop(worker) == 0  # long before the upstream's 60 s timeout
        async with open_ledger(ledger_url) as ledger:
            [operation] = await ledger.list_operations(batch_id=batch_id)
            events = await ledger.events(operation.id)
        assert operation.state is State.UNKNOWN  # never `sending` with nobody holding it, never `ready`
        assert (events[-1].from_state, events[-1].to_state) == (State.SENDING, State.UNKNOWN)
        assert "interrupted" in (operation.last_error or ""), operation.last_error
        assert len(outbox_lines(outbox)) == 1
