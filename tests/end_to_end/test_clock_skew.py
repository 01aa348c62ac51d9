"""A worker whose clock is hours off neither steals nor loses leases (issue 9, part 6).

Leases are written and compared by the database's clock (SQLite `julianday('now')`, PostgreSQL
`statement_timestamp()`), never by the Python clock of the process that claims. To prove it, the Python
clock of one worker is moved hours ahead or behind with `time_machine` (it shifts `time.time()` and
`datetime.now()`; SQLite's C clock and the PostgreSQL server are untouched), against a ledger it shares
with a worker on the true time. Each check fails if lease logic used the Python clock anywhere:

- a worker hours AHEAD would see another's live lease as expired and take the operation over;
- a worker hours BEHIND would not see a lapsed lease as expired;
- either would write its own leases hours early or late, which the other worker would then expire at
  once or never (and the lease itself would not be "now + lease_seconds" by the database's clock).
"""

from __future__ import annotations

import json
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import time_machine
from anyio.abc import Process

from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import Intent, Operation, Outcome, State
from hail_guard.sandbox import Sandbox, parse_fault, serve_http
from tests.conftest import email
from tests.end_to_end.test_workers import HG
from tests.ledger.test_ledger_contract import accepted_outcome
from tests.ledger.test_ledger_contract import intent as contract_intent

SKEW_HOURS = 6
SKEWED_WORKER = """\
import datetime, sys, time_machine
time_machine.travel(datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=float(sys.argv[1]))).start()
from hail_guard.cli import main
sys.exit(main(sys.argv[2:]))
"""
"""`hail-guard ARGS...` with its Python clock moved `argv[1]` hours (and ticking)."""
LEASE_SECONDS = 600.0
ACCEPTED = Outcome(state=State.ACCEPTED, reason="Hail accepted it", provider_id="provider-1")


@contextmanager
def python_clock_off_by(hours: float) -> Iterator[None]:
    """This process's Python clock, `hours` off the true time (and ticking) until the block ends."""
    with time_machine.travel(datetime.now(UTC) + timedelta(hours=hours), tick=True):
        yield


def intent(name: str, batch_id: str | None = None) -> Intent:
    """A send of its own to a recipient of its own (one recipient's unresolved send would hold the next)."""
    return contract_intent(f"clock:{name}", body=f"Hello {name}", to=f"{name}@example.com").model_copy(
        update={"batch_id": batch_id}
    )


async def claimed_by_the_database_clock(ledger: Ledger, claim: Any) -> Operation:
    """Run `claim` (a coroutine giving one operation) and check its lease is `now + LEASE_SECONDS` by the
    database's clock, read just before and just after."""
    before = await ledger.now()
    operation: Operation = await claim
    after = await ledger.now()
    assert operation.lease_expires_at is not None
    lease = timedelta(seconds=LEASE_SECONDS)
    assert before + lease <= operation.lease_expires_at <= after + lease, (before, operation.lease_expires_at)
    return operation


async def begun(ledger: Ledger, name: str, owner: str, lease_seconds: float = LEASE_SECONDS) -> Operation:
    begin = await ledger.begin_send(intent(name), owner=owner, lease_seconds=lease_seconds)
    assert begin.claimed
    return begin.operation


@pytest.mark.parametrize("skew_hours", [SKEW_HOURS, -SKEW_HOURS], ids=["ahead", "behind"])
async def test_a_worker_whose_clock_is_hours_off_neither_steals_nor_loses_leases(
    ledger_url: str, skew_hours: int
) -> None:
    async with open_ledger(ledger_url) as honest, open_ledger(ledger_url) as skewed:
        await begun(honest, "reconciling", "honest", lease_seconds=0)
        reconciling = await claimed_by_the_database_clock(
            honest, _one(honest.claim_unknown(owner="honest", lease_seconds=LEASE_SECONDS))
        )  # `unknown`, under the honest worker's reconcile lease
        live = await claimed_by_the_database_clock(honest, begun(honest, "live", "honest"))
        lapsed = await begun(honest, "lapsed", "honest", lease_seconds=0)  # its lease ran out as it was written
        await honest.plan_batch(
            batch_id="clock", name=None, intents=[intent("batched", "clock")], state=State.READY, actor="test"
        )

        with python_clock_off_by(skew_hours):
            assert abs(datetime.now(UTC) - await skewed.now()) > timedelta(hours=SKEW_HOURS - 1)  # the skew is real
            assert await skewed.expire_leases() == 1  # the lapsed lease, and only that one
            for name in ("live", "reconciling"):
                again = await skewed.begin_send(intent(name), owner="skewed", lease_seconds=LEASE_SECONDS)
                assert not again.claimed
                assert again.operation.lease_owner == "honest"
            recovered = await claimed_by_the_database_clock(
                skewed, _one(skewed.claim_unknown(owner="skewed", lease_seconds=LEASE_SECONDS))
            )
            assert recovered.id == lapsed.id  # not the one the honest worker is reconciling
            mine = await claimed_by_the_database_clock(skewed, begun(skewed, "mine", "skewed"))
            batched = await claimed_by_the_database_clock(
                skewed, _one(skewed.claim_ready(owner="skewed", lease_seconds=LEASE_SECONDS, batch_id="clock"))
            )

        assert await honest.expire_leases() == 0  # the skewed worker's leases are not over early
        assert await honest.claim_unknown(owner="honest", lease_seconds=LEASE_SECONDS) == []
        assert not (await honest.begin_send(intent("mine"), owner="honest", lease_seconds=LEASE_SECONDS)).claimed
        for operation in (live, reconciling):  # the honest worker kept its leases: its completions are not fenced off
            recorded = await honest.record_outcome(
                operation.id, owner="honest", outcome=accepted_outcome(operation.id), actor="honest"
            )
            assert recorded.state is State.ACCEPTED
        with python_clock_off_by(skew_hours):
            for operation in (recovered, mine, batched):
                recorded = await skewed.record_outcome(
                    operation.id, owner="skewed", outcome=accepted_outcome(operation.id), actor="skewed"
                )
                assert recorded.state is State.ACCEPTED


async def _one(claim: Any) -> Operation:
    operations: list[Operation] = await claim
    assert len(operations) == 1, operations
    return operations[0]


def worker_config(tmp_path: Path, ledger_url: str, upstream_url: str) -> Path:
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "{ledger_url}"\nbusy_timeout_seconds = 30\n'
        f'[upstream]\nurl = "{upstream_url}"\ntimeout_seconds = 10.0\n'
        f"[guard]\nlease_seconds = 60\n[worker]\npoll_seconds = 0.05\nshutdown_seconds = 10\n"
        '[delivery]\npoll = false\n[log]\nlevel = "info"\n'
    )
    return config


async def start_skewed_worker(config: Path, batch_id: str, hours: float, log: Path) -> Process:
    args = [sys.executable, "-c", SKEWED_WORKER, str(hours), "--config", str(config), "worker", "--batch", batch_id]
    with log.open("wb") as stderr:
        return await anyio.open_process([*args, "--concurrency", "2"], stdout=None, stderr=stderr)


def logged_times(log: Path) -> list[datetime]:
    times = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"timestamp"' in line:
            times.append(datetime.fromisoformat(json.loads(line)["timestamp"]))
    return times


@pytest.mark.timeout(120)
async def test_worker_processes_hours_ahead_and_behind_send_each_once_and_leave_a_live_lease_alone(
    tmp_path: Path, ledger_url: str
) -> None:
    sends = 16
    sandbox = Sandbox(faults=[parse_fault("send_email:*:delay:100")])  # sends overlap the other worker's passes
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_http, sandbox, "127.0.0.1", 0, None)
        config = worker_config(tmp_path, ledger_url, url)
        batch_id = await plan_batch(tmp_path, config, sends)
        async with open_ledger(ledger_url) as honest:
            [held] = await honest.claim_ready(owner="honest", lease_seconds=LEASE_SECONDS, batch_id=batch_id)
            logs = {hours: tmp_path / f"worker{hours:+d}.log" for hours in (SKEW_HOURS, -SKEW_HOURS)}
            workers = [await start_skewed_worker(config, batch_id, hours, log) for hours, log in logs.items()]
            try:
                with anyio.fail_after(60):
                    while not await _settled(honest, batch_id, held, sends - 1):  # noqa: ASYNC110  (processes)
                        await anyio.sleep(0.1)
            finally:
                codes = [await stop(worker) for worker in workers]
            counts = (await honest.batch_status(batch_id)).counts
            still = await honest.get(held.id)
            histories = [
                [event.to_state for event in await honest.events(op.id)]
                for op in await honest.list_operations(batch_id=batch_id, state=State.ACCEPTED, limit=sends)
            ]
            recorded = await honest.record_outcome(
                held.id, owner="honest", outcome=accepted_outcome(held.id), actor="honest"
            )
        tg.cancel_scope.cancel()

    assert codes == [0, 0]
    assert counts == {State.ACCEPTED: sends - 1, State.SENDING: 1}
    assert (still.state, still.lease_owner, still.lease_expires_at) == (State.SENDING, "honest", held.lease_expires_at)
    assert histories == [[State.READY, State.SENDING, State.ACCEPTED]] * (
        sends - 1
    )  # no lease ran out, none taken over
    assert recorded.state is State.ACCEPTED
    keys = Counter(entry["idempotency_key"] for entry in sandbox.outbox)
    assert len(keys) == sends - 1
    assert set(keys.values()) == {1}
    assert held.idempotency_key not in keys
    now = datetime.now(UTC)
    for hours, log in logs.items():  # each worker really ran hours off
        times = logged_times(log)
        assert times
        assert all(abs(at - now - timedelta(hours=hours)) < timedelta(hours=1) for at in times), (hours, times[:3])


async def plan_batch(tmp_path: Path, config: Path, sends: int) -> str:
    """`hail-guard batch plan` of `sends` emails, one per lead; returns the batch id."""
    batch = tmp_path / "batch.jsonl"
    lines = [
        json.dumps(
            {
                "tool": "send_email",
                "arguments": email(
                    to=[f"lead{n}@example.com"],
                    metadata={"campaign_id": "clock", "lead_id": f"lead{n}", "message_id": "intro"},
                    body_text=f"Hello lead {n}",
                ),
            }
        )
        for n in range(sends)
    ]
    batch.write_text("\n".join(lines) + "\n")
    planned = await anyio.run_process([*HG, "--config", str(config), "batch", "plan", str(batch)], check=False)
    assert planned.returncode == 0, planned.stderr.decode()
    batch_id: str = json.loads(planned.stdout)["batch_id"]
    return batch_id


async def _settled(ledger: Ledger, batch_id: str, held: Operation, accepted: int) -> bool:
    """The workers have sent all they may, or something already went wrong (stop waiting, and say so)."""
    counts = (await ledger.batch_status(batch_id)).counts
    if State.UNKNOWN in counts or (await ledger.get(held.id)).lease_owner != held.lease_owner:
        return True  # a lease ran out early, or the held operation was taken over
    return counts.get(State.ACCEPTED, 0) >= accepted and not counts.get(State.READY)


async def stop(process: Process) -> int:
    process.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        return await process.wait()
