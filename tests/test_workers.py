"""Worker processes sharing one SQLite ledger, against `hail-guard sandbox` over HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from hail_guard.ledger import open_ledger
from hail_guard.models import State
from tests.test_stdio import outbox_lines, running_sandbox

HG = [sys.executable, "-m", "hail_guard"]


def write_config(tmp_path: Path, url: str, *, lease_seconds: float = 60.0) -> Path:
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\nbusy_timeout_seconds = 30\n'
        f'[upstream]\nurl = "{url}"\ntimeout_seconds = 5.0\n'
        f"[guard]\nlease_seconds = {lease_seconds}\n[worker]\npoll_seconds = 0.2\nshutdown_seconds = 10\n"
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


async def wait_for_batch(tmp_path: Path, batch_id: str, expected: dict[State, int], seconds: float) -> None:
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        with anyio.fail_after(seconds):
            while (await ledger.batch_status(batch_id)).counts != expected:  # noqa: ASYNC110  (other processes)
                await anyio.sleep(0.2)


async def stop(process: Process) -> int:
    process.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        return await process.wait()


async def test_four_worker_processes_drain_a_batch_sending_each_operation_once(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path) as (url, outbox):
        config = write_config(tmp_path, url)
        batch_id = plan_batch(tmp_path, config, 2000)
        workers = [await start_worker(config, batch_id, 4) for _ in range(4)]
        try:
            await wait_for_batch(tmp_path, batch_id, {State.ACCEPTED: 2000}, seconds=240)
        finally:
            codes = [await stop(worker) for worker in workers]
        assert codes == [0, 0, 0, 0]
        keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
        assert len(keys) == len(set(keys)) == 2000


async def test_a_killed_worker_is_recovered_after_its_lease_with_no_duplicate(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path, "send_email:5:hang_after_accept") as (url, outbox):
        config = write_config(tmp_path, url, lease_seconds=1.0)
        batch_id = plan_batch(tmp_path, config, 20)
        doomed = await start_worker(config, batch_id, 1)
        with anyio.fail_after(30):
            while len(outbox_lines(outbox)) < 5:  # noqa: ASYNC110  (the 5th send hangs after acceptance)
                await anyio.sleep(0.05)
        doomed.kill()
        await doomed.wait()
        survivor = await start_worker(config, batch_id, 2)
        try:
            await wait_for_batch(tmp_path, batch_id, {State.ACCEPTED: 20}, seconds=60)
        finally:
            assert await stop(survivor) == 0
        keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
        assert len(keys) == len(set(keys)) == 20


async def test_sigterm_lets_in_flight_sends_finish_then_exits_cleanly(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path, "send_email:*:delay:400") as (url, outbox):
        config = write_config(tmp_path, url)
        batch_id = plan_batch(tmp_path, config, 30)
        worker = await start_worker(config, batch_id, 3)
        with anyio.fail_after(30):
            while not outbox_lines(outbox):  # noqa: ASYNC110  (another process's file)
                await anyio.sleep(0.05)
        assert await stop(worker) == 0
        async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
            counts = (await ledger.batch_status(batch_id)).counts
        assert State.SENDING not in counts
        assert State.UNKNOWN not in counts
        assert counts[State.ACCEPTED] == len(outbox_lines(outbox))
        assert counts[State.READY] > 0
