"""Recorded means on stable storage: the syscalls of a real `hail-guard serve`, traced with strace.

`hail-guard serve` runs over stdio under `strace -f -yy`, chained to `hail-guard sandbox` over HTTP,
and an MCP client sends one email and records one opt-out through it. In the trace:

- the intent is written to the ledger's WAL and the WAL is fsync'd before the request to Hail is
  written to the upstream socket (a power cut after Hail accepted cannot forget the send);
- the outcome is fsync'd before the agent's answer is written to stdout;
- the opt-out is fsync'd before its answer is written to stdout.

With `synchronous = NORMAL` (which this hail-guard never sets) both tests fail: the WAL is not
synced before the socket write, nor before the answers. `.ci/run` installs strace; without it
(outside CI) the tests are skipped, saying why.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from mcp import Client, StdioServerParameters

from tests.conftest import email, missing
from tests.test_stdio import running_sandbox

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


async def traced_session(tmp_path: Path) -> list[Call]:
    """One email and one opt-out through `hail-guard serve` under strace; the trace's calls."""
    trace = tmp_path / "serve.trace"
    async with running_sandbox(tmp_path) as (url, _):
        config = tmp_path / "hail-guard.toml"
        ledger = tmp_path / "ledger.db"
        config.write_text(
            f'[ledger]\nurl = "sqlite:///{ledger}"\n[upstream]\nurl = "{url}"\n[delivery]\npoll = false\n'
        )
        strace = [str(STRACE), "-f", "-yy", "-s", "65536", "-o", str(trace), "-e", "trace=%desc,%network"]
        serve = StdioServerParameters(
            command=strace[0],
            args=[*strace[1:], sys.executable, "-m", "hail_guard", "--config", str(config), "serve"],
            cwd=str(tmp_path),
        )
        async with Client(serve, mode="legacy") as agent:
            await agent.list_tools()
            sent = await agent.call_tool("send_email", email(subject="Traced send"))
            assert not sent.is_error
            opted = await agent.call_tool(
                "record_opt_out", {"recipient": "traced.optout@example.com", "reason": "STOP"}
            )
            assert not opted.is_error
    return read_trace(trace)


async def test_the_intent_is_on_disk_before_the_request_leaves_and_the_outcome_before_the_answer(
    tmp_path: Path,
) -> None:
    calls = await traced_session(tmp_path)
    wal = "ledger.db-wal"
    asked = first(calls, name=READS, target="pipe", text="Traced send")  # the agent's call arrives on stdin
    intent = first(calls, name=WRITES, target=wal, after=asked.started)
    forward = first(calls, name=WRITES, target="TCP", text="tools/call", after=asked.started)
    synced = first(calls, name=SYNCS, target=wal, after=intent.started)
    assert synced.done < request_start(calls, forward), "the intent was not fsync'd before the request left"
    answered = first(calls, name=WRITES, target="pipe", text="jsonrpc", after=forward.started)
    outcome = first(calls, name=WRITES, target=wal, after=forward.started)
    outcome_synced = first(calls, name=SYNCS, target=wal, after=outcome.started)
    assert outcome_synced.done < answered.started, "the outcome was not fsync'd before the agent was answered"


async def test_an_opt_out_is_on_disk_before_it_is_acknowledged(tmp_path: Path) -> None:
    calls = await traced_session(tmp_path)
    wal = "ledger.db-wal"
    asked = first(calls, name=READS, target="pipe", text="traced.optout@example.com")
    recorded = first(calls, name=WRITES, target=wal, after=asked.started)
    acknowledged = first(calls, name=WRITES, target="pipe", text="traced.optout@example.com", after=asked.started)
    assert recorded.started < acknowledged.started, "the opt-out was not written to the ledger before its answer"
    synced = first(calls, name=SYNCS, target=wal, after=recorded.started)
    assert synced.done < acknowledged.started, "the opt-out was not fsync'd before it was acknowledged"
