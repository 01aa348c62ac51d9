"""Recorded means on stable storage: the syscalls of real hail-guard processes, traced with strace.

One traced run (a module fixture) chains each process to `hail-guard sandbox` over HTTP, on one SQLite ledger:
`hail-guard serve` over stdio, through which an MCP client sends one email, records an opt-out, plans a batch and
runs it, meets a send Hail puts in review and resolves it, and plans a batch for a worker; `hail-guard worker`,
which sends that batch; and `hail-guard serve --transport http`, which takes a signed delivery webhook. In the
traces:

- an intent (a direct send, a batch send or a worker's claim) is written to the ledger's WAL and the WAL is
  fsync'd before the request to Hail is written to the upstream socket (a power cut after Hail accepted cannot
  forget the send);
- every answer that says something was recorded (an outcome, an opt-out, a planned batch, a batch run, a review
  decision, a webhook) is written to stdout or the socket only after the WAL holding it is fsync'd.

With `synchronous = NORMAL` (which this hail-guard never sets) these tests fail: the WAL is not synced before
the socket writes, nor before the answers. `.ci/run` installs strace; without it (outside CI) the tests are
skipped, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx2
import pytest
from mcp import Client, StdioServerParameters

from hail_guard.upstream import UpstreamTarget, connect_upstream
from tests.conftest import data, email, missing, text
from tests.end_to_end.test_stdio import free_port, running_sandbox
from tests.end_to_end.test_webhooks import hail_signature

WEBHOOK_SECRET = "whsec-traced-0123456789"

STRACE = shutil.which("strace")
if STRACE is None:
    missing("the syscall-order tests: strace is not installed (apt-get install strace)", module=True)

_CALL = re.compile(r"^(?P<pid>\d+)\s+(?P<name>\w+)\((?P<fd>\d+)<(?P<target>.*?)>(?=[,)]| <unfinished)(?P<rest>.*)$")
"""A syscall on a descriptor; one whose only argument is the descriptor (`fdatasync(7<...> <unfinished ...>`)
may be cut off right after it, when another thread's call is printed before it returns."""
_RESUMED = re.compile(r"^(?P<pid>\d+)\s+<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)$")
WRITES = frozenset({"write", "writev", "pwrite64", "sendto", "sendmsg"})
READS = frozenset({"read", "recvfrom", "recvmsg"})
SYNCS = frozenset({"fsync", "fdatasync"})


@dataclass(frozen=True)
class Call:
    """One traced syscall on a file descriptor: `started` and `done` are its line numbers in the trace."""

    name: str
    target: str
    """What strace -yy names the descriptor: a path, or `TCP:[...]`, `pipe:[...]`."""
    text: str
    started: int
    done: int


def read_trace(path: Path) -> list[Call]:
    """The syscalls on descriptors, with when each started and when it returned (strace -f interleaves threads)."""
    calls: list[Call] = []
    pending: dict[tuple[str, str], int] = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines()):
        resumed = _RESUMED.match(line)
        if resumed is not None:
            index = pending.pop((resumed["pid"], resumed["name"]), None)
            if index is not None:
                call = calls[index]  # a read's data shows where it returns
                calls[index] = Call(call.name, call.target, call.text + resumed["rest"], call.started, number)
            continue
        found = _CALL.match(line)
        if found is None or found["name"] not in WRITES | READS | SYNCS:
            continue
        unfinished = line.endswith("<unfinished ...>")
        if unfinished:
            pending[(found["pid"], found["name"])] = len(calls)
        done = -1 if unfinished else number
        calls.append(Call(found["name"], found["target"], found["rest"], number, done))
    return calls


def first(calls: list[Call], *, name: frozenset[str], target: str, text: str = "", after: int = -1) -> Call:
    for call in calls:
        if call.started > after and call.name in name and target in call.target and text in call.text:
            return call
    raise AssertionError(f"no {sorted(name)} on {target!r} with {text!r} after line {after}")


def request_start(calls: list[Call], body: Call) -> int:
    """Where an HTTP request to Hail begins: its headers' write, if they went in a write of their own."""
    heads = [c.started for c in calls if c.name in WRITES and c.target == body.target and c.started <= body.started]
    posts = [line for line in heads if "POST " in next(c.text for c in calls if c.started == line)]
    return max(posts) if posts else body.started


def between(calls: list[Call], *, wal: str, after: int, before: int) -> bool:
    """Whether something was written to `wal` after line `after`, and fsync'd, before line `before`."""
    written = [c for c in calls if c.name in WRITES and wal in c.target and after < c.started < before]
    return (
        any(c.name in SYNCS and wal in c.target and c.started > written[0].started and c.done < before for c in calls)
        if written
        else False
    )


def strace(trace: Path, *command: str) -> list[str]:
    return [str(STRACE), "-f", "-yy", "-s", "65536", "-o", str(trace), "-e", "trace=%desc,%network", *command]


def hail_guard(config: Path, *command: str) -> list[str]:
    return [sys.executable, "-m", "hail_guard", "--config", str(config), *command]


def tracee(process: anyio.abc.Process) -> int:
    """The process strace started (its child): signals go to it; strace ends when it does."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 10
    while not (found := children.read_text().split()):  # an external process: /proc is the only signal
        assert time.monotonic() < deadline, "strace started nothing"
        time.sleep(0.01)
    return int(found[0])


async def stop(process: anyio.abc.Process) -> None:
    os.kill(tracee(process), signal.SIGTERM)
    with anyio.fail_after(20):
        await process.wait()


@dataclass(frozen=True)
class Traces:
    stdio: list[Call]
    worker: list[Call]
    http: list[Call]
    provider_id: str


def sends(text: str, *recipients: str) -> list[dict[str, Any]]:
    """One text to each recipient (a campaign), each with its own lead id."""
    return [
        {
            "tool": "send_email",
            "arguments": email(
                to=[to],
                subject=text,
                metadata={"campaign_id": "traced", "lead_id": to, "message_id": text.replace(" ", "-")},
            ),
        }
        for to in recipients
    ]


async def traced_run(folder: Path) -> Traces:
    """The agent's calls through a traced `serve` over stdio, then a traced worker, then a traced HTTP serve."""
    async with running_sandbox(folder) as (url, outbox):
        async with connect_upstream(UpstreamTarget(kind="http", url=url), heartbeat_seconds=None) as hail:
            # Hail already holds this key for another message: the guarded send under it goes to review.
            seeded = email(to=["review@example.com"], idempotency_key="traced-review", subject="Seeded", metadata={})
            assert not (await hail.call_tool("send_email", seeded)).is_error
        config = folder / "hail-guard.toml"
        ledger = folder / "ledger.db"
        config.write_text(
            f'[ledger]\nurl = "sqlite:///{ledger}"\n[upstream]\nurl = "{url}"\n[delivery]\npoll = false\n'
            "[review]\nexpose_to_agent = true\n"
        )
        serve = StdioServerParameters(
            command=str(STRACE), args=strace(folder / "stdio.trace", *hail_guard(config, "serve"))[1:], cwd=str(folder)
        )
        async with Client(serve, mode="legacy") as agent:
            await agent.list_tools()
            sent = await agent.call_tool("send_email", email(subject="Traced send"))
            assert not sent.is_error
            opted = await agent.call_tool(
                "record_opt_out", {"recipient": "traced.optout@example.com", "reason": "STOP"}
            )
            assert not opted.is_error
            planned = await agent.call_tool(
                "plan_batch", {"sends": sends("Traced batch", "b1@example.com", "b2@example.com")}
            )
            ran = await agent.call_tool("run_batch", {"batch_id": data(planned)["batch_id"], "concurrency": 1})
            assert data(ran)["counts"] == {"accepted": 2}
            review = await agent.call_tool(
                "send_email",
                email(to=["review@example.com"], idempotency_key="traced-review", subject="Traced review", metadata={}),
            )
            assert data(review).get("hail_guard", {}).get("state") == "needs_review", text(review)
            decided = await agent.call_tool(
                "review_resolve",
                {
                    "operation_id": data(review)["hail_guard"]["operation_id"],
                    "state": "failed",
                    "reason": "Traced decision",
                },
            )
            assert not decided.is_error, text(decided)
            for_worker = await agent.call_tool(
                "plan_batch", {"sends": sends("Traced worker", "w1@example.com", "w2@example.com")}
            )
            batch_id = data(for_worker)["batch_id"]
            provider_id = data(sent)["id"]

        worker = strace(
            folder / "worker.trace", *hail_guard(config, "worker", "--batch", batch_id, "--concurrency", "1")
        )
        async with await anyio.open_process(worker, stdout=None, stderr=None) as process:
            with anyio.fail_after(30):
                while True:  # an external process: its outbox is the only signal
                    if outbox.read_text().count("Traced worker") == 2:
                        break
                    await anyio.sleep(0.05)
            await stop(process)

        port = free_port()
        http = strace(folder / "http.trace", *hail_guard(config, "serve", "--transport", "http", "--port", str(port)))
        env = {**os.environ, "HAIL_WEBHOOK_SECRET": WEBHOOK_SECRET, "HAIL_GUARD_TOKEN": "traced-agent-token"}
        async with (
            await anyio.open_process(http, stdout=None, stderr=None, env=env) as process,
            httpx2.AsyncClient() as client,
        ):
            base = f"http://127.0.0.1:{port}"
            with anyio.fail_after(30):
                while True:  # an external process: its health endpoint is the only readiness signal
                    try:
                        if (await client.get(f"{base}/healthz")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        await anyio.sleep(0.05)
            for n, event in enumerate(("email.delivered", "email.opened"), start=1):  # the second meets a WAL in use
                hook = {"type": event, "data": {"id": provider_id, "note": f"Traced hook {n}"}}
                body = json.dumps(hook).encode()
                signature = hail_signature(WEBHOOK_SECRET, body, int(time.time()))
                headers = {"X-Hail-Signature": signature, "X-Hail-Delivery": f"traced-{n}"}
                hooked = await client.post(f"{base}/webhooks/hail", content=body, headers=headers)
                assert (hooked.status_code, hooked.json()["status"]) == (200, "applied")
            await stop(process)
    return Traces(
        read_trace(folder / "stdio.trace"),
        read_trace(folder / "worker.trace"),
        read_trace(folder / "http.trace"),
        provider_id,
    )


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Traces:
    return anyio.run(traced_run, tmp_path_factory.mktemp("traced"))


WAL = "ledger.db-wal"


def test_the_intent_is_on_disk_before_the_request_leaves_and_the_outcome_before_the_answer(traces: Traces) -> None:
    calls = traces.stdio
    asked = first(calls, name=READS, target="pipe", text="Traced send")  # the agent's call arrives on stdin
    intent = first(calls, name=WRITES, target=WAL, after=asked.started)
    forward = first(calls, name=WRITES, target="TCP", text="tools/call", after=asked.started)
    synced = first(calls, name=SYNCS, target=WAL, after=intent.started)
    assert synced.done < request_start(calls, forward), "the intent was not fsync'd before the request left"
    answered = first(calls, name=WRITES, target="pipe", text="jsonrpc", after=forward.started)
    outcome = first(calls, name=WRITES, target=WAL, after=forward.started)
    outcome_synced = first(calls, name=SYNCS, target=WAL, after=outcome.started)
    assert outcome_synced.done < answered.started, "the outcome was not fsync'd before the agent was answered"


def test_an_opt_out_is_on_disk_before_it_is_acknowledged(traces: Traces) -> None:
    calls = traces.stdio
    asked = first(calls, name=READS, target="pipe", text="traced.optout@example.com")
    recorded = first(calls, name=WRITES, target=WAL, after=asked.started)
    acknowledged = first(calls, name=WRITES, target="pipe", text="traced.optout@example.com", after=asked.started)
    assert recorded.started < acknowledged.started, "the opt-out was not written to the ledger before its answer"
    synced = first(calls, name=SYNCS, target=WAL, after=recorded.started)
    assert synced.done < acknowledged.started, "the opt-out was not fsync'd before it was acknowledged"


def test_a_planned_batch_is_on_disk_before_it_is_acknowledged(traces: Traces) -> None:
    calls = traces.stdio
    asked = first(calls, name=READS, target="pipe", text="Traced batch")
    acknowledged = first(calls, name=WRITES, target="pipe", text="batch_id", after=asked.started)
    assert between(calls, wal=WAL, after=asked.started, before=acknowledged.started), "the plan was not fsync'd first"


def test_each_batch_send_is_on_disk_before_it_leaves_and_its_outcome_before_the_run_is_answered(traces: Traces) -> None:
    calls = traces.stdio
    asked = first(calls, name=READS, target="pipe", text="run_batch")
    answered = first(calls, name=WRITES, target="pipe", text="counts", after=asked.started)
    forwards = [
        c
        for c in calls
        if c.name in WRITES
        and "TCP" in c.target
        and "Traced batch" in c.text
        and asked.started < c.started < answered.started
    ]
    assert len(forwards) == 2
    since = asked.started
    for forward in forwards:
        assert between(calls, wal=WAL, after=since, before=request_start(calls, forward)), "a batch send left unsynced"
        since = forward.started
    assert between(calls, wal=WAL, after=since, before=answered.started), "the last outcome was not fsync'd first"


def test_a_review_decision_is_on_disk_before_it_is_acknowledged(traces: Traces) -> None:
    calls = traces.stdio
    asked = first(calls, name=READS, target="pipe", text="Traced decision")
    acknowledged = first(calls, name=WRITES, target="pipe", text="jsonrpc", after=asked.started)
    assert between(calls, wal=WAL, after=asked.started, before=acknowledged.started), "the decision was not fsync'd"


def test_a_worker_claims_each_send_on_disk_before_it_leaves(traces: Traces) -> None:
    calls = traces.worker
    forwards = [c for c in calls if c.name in WRITES and "TCP" in c.target and "Traced worker" in c.text]
    assert len(forwards) == 2
    since = -1
    for forward in forwards:
        assert between(calls, wal=WAL, after=since, before=request_start(calls, forward)), "a claim was not fsync'd"
        since = forward.started
    assert between(calls, wal=WAL, after=since, before=sys.maxsize), "the last outcome never synced"


@pytest.mark.parametrize("n", [1, 2])
def test_a_webhook_is_on_disk_before_it_is_acknowledged(traces: Traces, n: int) -> None:
    calls = traces.http
    arrived = first(calls, name=READS, target="TCP", text=f"Traced hook {n}")
    acknowledged = first(calls, name=WRITES, target="TCP", text="applied", after=arrived.started)
    assert between(calls, wal=WAL, after=arrived.started, before=acknowledged.started), "the webhook was not fsync'd"
