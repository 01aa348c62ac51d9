"""The crash campaign: SIGKILL a real `hail-guard serve` or `worker` at every crash point, restart, reconcile.

Each scenario runs a `hail-guard sandbox` process (its outbox file is the ground truth of what was
sent) and a SQLite ledger, then RUNS times: start a `serve` (an agent's MCP client on its stdio) or a
`worker` armed with `HAIL_GUARD_CRASH_AT=POINT:N`, let it work until it kills itself at the Nth hit
of POINT, and start the next one on the same ledger. `in_flight` is the one point not in the code:
the sandbox holds every new send's answer (`hang_after_accept`) and the harness kills `serve` once
the send is in the outbox. After the last run an unarmed process finishes the work (the agent retries
every call that got no answer, as MCP tells it to; reconcile settles the rest), then the invariant is
checked: each logical send reached the outbox at most once, each ended `accepted`, `failed`,
`cancelled` or `needs_review` (the sandbox always answers, so `unknown` is not allowed), each holds one
key that the agent meant, every outbox message is known to the ledger, and none is lost.

Seeded: the seed picks each run's sends (channel, how the key is made), the hit N and the worker's
concurrency; a failure names it: rerun with HAIL_GUARD_CAMPAIGN_SEED=<seed>. The default suite runs
QUICK_RUNS per scenario; the campaign (`slow`) runs HAIL_GUARD_CAMPAIGN_RUNS (20 when unset, 8 in .ci/run).
Processes are forked from a preloaded interpreter (tests/forked.py) to keep hundreds of starts cheap.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx2
import pytest
from mcp import Client, types

from hail_guard import crashpoints, keys
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import Event, Operation, State
from hail_guard.profiles import hail
from hail_guard.sandbox import SMS_CARRIER_REFUSED
from tests import forked
from tests.postgres import PostgresServer

RUNS = int(os.environ.get("HAIL_GUARD_CAMPAIGN_RUNS", "20"))
QUICK_RUNS = 1
SEED = os.environ.get("HAIL_GUARD_CAMPAIGN_SEED")
FINAL = frozenset({State.ACCEPTED, State.FAILED, State.CANCELLED, State.NEEDS_REVIEW})
TERMINAL = frozenset({State.ACCEPTED, State.FAILED, State.CANCELLED})
LEASE_SECONDS = 1.0
RUN_SECONDS = 60.0
"""Bound on one run (start, work, die); generous for two loaded cores."""
SETTLE_SECONDS = 120.0
UNKNOWN_AFTER_ACCEPT = ("send_email:*:error_after_accept:{status}", "send_sms:*:error_after_accept:{status}")
HANG_AFTER_ACCEPT = ("send_email:*:hang_after_accept", "send_sms:*:hang_after_accept")


@dataclass(frozen=True)
class Scenario:
    point: str
    process: Literal["serve", "worker"]
    faults: tuple[str, ...] = ()
    """Sandbox faults (`{status}`: a 5xx the seed picks)."""
    backend: Literal["sqlite", "postgres"] = "sqlite"

    @property
    def id(self) -> str:
        return f"{self.process}-{self.point}" + ("-postgres" if self.backend == "postgres" else "")


SCENARIOS = [
    Scenario("before_intent", "serve"),
    Scenario("after_intent", "serve"),
    Scenario("after_forward", "serve"),
    Scenario("in_flight", "serve", HANG_AFTER_ACCEPT),
    Scenario("after_answer", "serve"),
    Scenario("reconcile_claimed", "serve", UNKNOWN_AFTER_ACCEPT),
    Scenario("reconcile_answered", "serve", UNKNOWN_AFTER_ACCEPT),
    Scenario("after_claim", "worker"),
    Scenario("after_forward", "worker"),
    Scenario("after_answer", "worker"),
    Scenario("reconcile_claimed", "worker", UNKNOWN_AFTER_ACCEPT),
    Scenario("reconcile_answered", "worker", UNKNOWN_AFTER_ACCEPT),
    Scenario("after_answer", "worker", backend="postgres"),
    Scenario("reconcile_answered", "serve", UNKNOWN_AFTER_ACCEPT, backend="postgres"),
]


@dataclass
class LogicalSend:
    """One message the agent means to send once, whatever happens."""

    label: str
    tool: str
    arguments: dict[str, Any]

    @property
    def key(self) -> str:
        return keys.derive_key(hail().spec(self.tool), dict(self.arguments), None)


@dataclass
class Report:
    runs: int = 0
    kills: int = 0
    sends: int = 0
    duplicates: int = 0
    lost: int = 0
    states: Counter[str] = field(default_factory=Counter)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Campaign:
    """One scenario: a sandbox, a ledger, and a chain of processes killed at one crash point."""

    def __init__(self, scenario: Scenario, tmp_path: Path, runs: int, ledger_url: str | None = None) -> None:
        self.scenario, self.runs, self.tmp_path = scenario, runs, tmp_path
        self.seed = int(SEED) if SEED else random.SystemRandom().randrange(2**32)
        self.rng = random.Random(self.seed)  # noqa: S311  (a replayable plan, not a secret)
        self.logs = tmp_path / "logs"
        self.outbox = tmp_path / "outbox.jsonl"
        self.ledger_url = ledger_url or f"sqlite:///{tmp_path / 'ledger.db'}"
        self.config = tmp_path / "hail-guard.toml"
        self.sends: list[LogicalSend] = []
        self.pending: list[LogicalSend] = []
        """Calls the agent made without getting an answer: it makes them again."""
        self.run = 0
        self.report = Report()
        self.lease_seconds = LEASE_SECONDS

    def where(self) -> str:
        return (
            f"[{self.scenario.id}, run {self.run} of {self.runs}, seed {self.seed}: "
            f"rerun with HAIL_GUARD_CAMPAIGN_SEED={self.seed} HAIL_GUARD_CAMPAIGN_RUNS={self.runs} "
            f'pytest tests/campaigns/test_crash_points.py -m "slow or not slow" -k {self.scenario.id}]'
        )

    # -- the sends ------------------------------------------------------------------------------------

    def new_send(self) -> LogicalSend:
        """A new logical send: an email keyed by its metadata or by its content, an SMS with the caller's key,
        or an SMS the carrier refuses (Hail answers `failed`), keyed by its content."""
        label = f"m{len(self.sends):04d}"
        kind = self.rng.choice(["email_metadata", "email_content", "sms_caller_key", "sms_refused"])
        if kind == "sms_refused" and any(send.arguments.get("to") == SMS_CARRIER_REFUSED for send in self.sends):
            kind = "sms_caller_key"  # one message to the refused number: a second, different one would be held
        if kind.startswith("sms"):
            number = SMS_CARRIER_REFUSED if kind == "sms_refused" else f"+1415555{len(self.sends):04d}"
            arguments: dict[str, Any] = {"to": number, "body": f"Hello {label}", "recipient_consent": True}
            if kind == "sms_caller_key":
                arguments["idempotency_key"] = f"crash-{label}"
            send = LogicalSend(label, "send_sms", arguments)
        else:
            arguments = {
                "to": [f"{label}@example.com"],
                "subject": f"Hello {label}",
                "body_text": f"Nice to meet you, {label}.",
                "recipient_consent": True,
            }
            if kind == "email_metadata":
                arguments["metadata"] = {"campaign_id": "crash", "lead_id": label, "message_id": "intro"}
            send = LogicalSend(label, "send_email", arguments)
        self.sends.append(send)
        return send

    # -- processes ------------------------------------------------------------------------------------

    def write_config(self, upstream_url: str) -> None:
        timeout = 30.0 if self.scenario.point == "in_flight" else 10.0
        self.config.write_text(
            f'[ledger]\nurl = "{self.ledger_url}"\nbusy_timeout_seconds = 30\n'
            f'[upstream]\nurl = "{upstream_url}"\ntimeout_seconds = {timeout}\n'
            f"[guard]\nlease_seconds = {self.lease_seconds}\n"
            "[worker]\npoll_seconds = 0.1\nshutdown_seconds = 10\n"
            '[log]\nlevel = "info"\n'
        )

    async def start_sandbox(self) -> forked.Command:
        port = free_port()
        status = self.rng.choice([500, 502, 503, 504])
        args = ["sandbox", "--port", str(port), "--outbox", str(self.outbox)]
        for fault in self.scenario.faults:
            args += ["--fault", fault.format(status=status)]
        sandbox = forked.start(args, logs=self.logs, name="sandbox")
        url = f"http://127.0.0.1:{port}/"
        async with httpx2.AsyncClient() as http:
            with anyio.fail_after(30):
                while True:  # another process: its health endpoint is the only readiness signal
                    assert sandbox.exitcode is None, f"the sandbox exited: {sandbox.log()}"
                    try:
                        if (await http.get(f"{url}healthz")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        await anyio.sleep(0.05)
        self.write_config(url)
        return sandbox

    def armed(self, hit: int) -> dict[str, str]:
        return {} if self.scenario.point == "in_flight" else {forked.CRASH_VARIABLE: f"{self.scenario.point}:{hit}"}

    def hg(self, *args: str) -> list[str]:
        return ["--config", str(self.config), *args]

    async def expect_crash(self, process: forked.Command, *, error: BaseException | None = None) -> None:
        """The process must have died of SIGKILL, at the armed point."""
        try:
            code = await process.wait(RUN_SECONDS)
        except TimeoutError:
            process.kill()
            await process.wait(10)
            pytest.fail(f"{self.where()} crash point never fired; the process was still running:\n{process.log()}")
        assert code == -9, f"{self.where()} expected death by SIGKILL, got exit {code} ({error!r}):\n{process.log()}"
        if self.scenario.point != "in_flight":
            lines = process.log(last=None).splitlines()
            fired = [json.loads(line) for line in lines if '"crash_point_fired"' in line]
            assert fired, f"{self.where()} killed, but not by a crash point:\n{process.log()}"
            assert [event["point"] for event in fired] == [self.scenario.point], fired
        self.report.kills += 1

    # -- serve ----------------------------------------------------------------------------------------

    async def agent(self, client: Client, *, reconcile_after: bool, parallel: int = 1) -> None:
        """What an agent does on (re)connecting: settle what is due, then repeat unanswered calls and make new
        ones, `parallel` at a time."""
        await client.call_tool("reconcile", {})
        queue = list(self.pending)

        async def calls() -> None:
            while queue:
                send = queue.pop(0)
                result = await client.call_tool(send.tool, send.arguments)
                assert _view(result) is not None, f"{self.where()} no operation in the answer: {result}"
                self.pending.remove(send)

        async with anyio.create_task_group() as tg:
            for _ in range(parallel):
                tg.start_soon(calls)
        if reconcile_after:
            await client.call_tool("reconcile", {})

    async def serve_run(self) -> None:
        reconcile_point = self.scenario.point.startswith("reconcile")
        new = 1 if self.scenario.point == "in_flight" else self.rng.randint(1, 3)
        self.pending += [self.new_send() for _ in range(new)]
        hit, parallel = self.rng.randint(1, new), self.rng.randint(1, 3)
        process = forked.start(self.hg("serve"), logs=self.logs, env=self.armed(hit), stdio=True, name="serve")
        try:
            async with anyio.create_task_group() as tg:
                if self.scenario.point == "in_flight":
                    tg.start_soon(self.kill_when_sent, process, len(_outbox(self.outbox)))
                error = await self.talk(process, reconcile_after=reconcile_point, parallel=parallel)
                tg.cancel_scope.cancel()
            await self.expect_crash(process, error=error)
        finally:
            process.kill()
            process.close()

    async def talk(self, process: forked.Command, *, reconcile_after: bool, parallel: int) -> Exception | None:
        """The agent's session; the error it ended with when the process died under it."""
        with anyio.fail_after(RUN_SECONDS):
            try:
                async with process.mcp_client() as client:
                    await self.agent(client, reconcile_after=reconcile_after, parallel=parallel)
            except Exception as exc:  # the process died under the client; the caller checks how
                return exc
        return None

    async def kill_when_sent(self, process: forked.Command, before: int) -> None:
        """`in_flight`: kill serve once its new send is in the outbox (the sandbox holds the answer)."""
        with anyio.fail_after(RUN_SECONDS):
            while len(_outbox(self.outbox)) == before:  # noqa: ASYNC110  (another process's file: no event)
                await anyio.sleep(0.02)
        process.kill()

    async def serve_settle(self) -> None:
        """An unarmed serve: the agent repeats unanswered calls and reconciles until nothing is open."""
        process = forked.start(self.hg("serve"), logs=self.logs, stdio=True, name="serve-final")
        try:
            with anyio.fail_after(SETTLE_SECONDS):
                async with process.mcp_client() as client:
                    await self.agent(client, reconcile_after=True)
                    await self.until_settled(lambda: client.call_tool("reconcile", {}))
            assert await process.wait(30) == 0, process.log()
        finally:
            process.kill()
            process.close()

    # -- worker ---------------------------------------------------------------------------------------

    async def plan(self, count: int) -> None:
        batch = self.tmp_path / "batch.jsonl"
        sends = [self.new_send() for _ in range(count)]
        batch.write_text("".join(json.dumps({"tool": s.tool, "arguments": s.arguments}) + "\n" for s in sends))
        process = forked.start(self.hg("batch", "plan", str(batch)), logs=self.logs, name="plan")
        try:
            assert await process.wait(RUN_SECONDS) == 0, process.log()
            assert json.loads(process.stdout())["batch_id"]
        finally:
            process.close()

    async def worker_run(self) -> None:
        hit, concurrency = self.rng.randint(1, 3), self.rng.randint(1, 3)
        args = self.hg("worker", "--concurrency", str(concurrency))
        process = forked.start(args, logs=self.logs, env=self.armed(hit), name="worker")
        try:
            await self.expect_crash(process)
        finally:
            process.kill()
            process.close()

    async def worker_settle(self) -> None:
        process = forked.start(self.hg("worker", "--concurrency", "2"), logs=self.logs, name="worker-final")
        try:
            with anyio.fail_after(SETTLE_SECONDS):
                await self.until_settled(None)
            assert await process.stop() == 0, process.log()
        finally:
            process.kill()
            process.close()

    # -- the invariant --------------------------------------------------------------------------------

    async def until_settled(self, nudge: Callable[[], Awaitable[object]] | None) -> None:
        """Wait until every operation is final (leases of the dead run out on the database clock)."""
        async with open_ledger(self.ledger_url, busy_timeout_seconds=30) as ledger:
            while True:
                open_states = set(await ledger.count_by_state()) - FINAL
                if not open_states and len(await _operations(ledger)) >= len(self.sends):
                    return
                if nudge is not None:
                    await nudge()
                await anyio.sleep(0.1)

    async def check(self) -> None:
        async with open_ledger(self.ledger_url) as ledger:
            operations = {op.idempotency_key: op for op in await _operations(ledger)}
            broken = [_broken_history(op, await ledger.events(op.id)) for op in operations.values()]
        outbox = _outbox(self.outbox)
        sent = Counter(line["idempotency_key"] for line in outbox)
        provider = {line["idempotency_key"]: (line["id"], line["status"]) for line in outbox}
        meant = {send.key for send in self.sends}
        duplicates = {key: n for key, n in sent.items() if n > 1}
        lost = sorted(key for key in meant if key not in operations or operations[key].state not in FINAL)
        strangers = sorted(set(operations) - meant)
        unrecorded = sorted(set(sent) - set(operations))
        mismatched = sorted(key for key, op in operations.items() if not _agrees(op, provider.get(key)))
        self.report.sends = len(self.sends)
        self.report.duplicates, self.report.lost = len(duplicates), len(lost)
        self.report.states = Counter(op.state.value for op in operations.values())
        where = self.where()
        assert not duplicates, f"{where} sent more than once: {duplicates}"
        assert not lost, f"{where} lost (no operation, or not final): {[_state(operations, k) for k in lost]}"
        assert not strangers, f"{where} operations under keys nobody meant: {strangers}"
        assert not unrecorded, f"{where} in the outbox without a ledger record: {unrecorded}"
        assert not mismatched, f"{where} ledger and outbox disagree: {[_state(operations, k) for k in mismatched]}"
        assert not [b for b in broken if b], f"{where} histories that do not add up: {[b for b in broken if b]}"

    async def __call__(self) -> Report:
        sandbox = await self.start_sandbox()
        try:
            if self.scenario.process == "worker":
                await self.plan(3 * self.runs + 10)  # every run finds at least 3 ready (or unknown) sends
            for run in range(1, self.runs + 1):
                self.run = run
                await (self.serve_run() if self.scenario.process == "serve" else self.worker_run())
                self.report.runs += 1
            self.run = 0
            await (self.serve_settle() if self.scenario.process == "serve" else self.worker_settle())
            await self.check()
        finally:
            sandbox.kill()  # its outbox is written line by line; nothing to wait for
            await sandbox.wait(10)
            sandbox.close()
        return self.report


def _data(result: types.CallToolResult) -> dict[str, Any]:
    data = result.structured_content
    if not isinstance(data, dict):
        try:
            data = json.loads("".join(b.text for b in result.content if isinstance(b, types.TextContent)))
        except ValueError:
            return {}
    return data if isinstance(data, dict) else {}


def _view(result: types.CallToolResult) -> dict[str, Any] | None:
    view = _data(result).get("hail_guard")
    return view if isinstance(view, dict) else None


def _outbox(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _operations(ledger: Ledger) -> list[Operation]:
    return await ledger.list_operations(limit=100_000)


def _broken_history(operation: Operation, events: list[Event]) -> str | None:
    """What is wrong with an operation's history: a gap, a way out of a terminal state, an end not its state."""
    previous: State | None = None
    for event in events:
        if event.from_state != previous or previous in TERMINAL:
            return f"{operation.idempotency_key}: {previous} then {event.from_state} -> {event.to_state}"
        previous = event.to_state
    if previous is not operation.state:
        return f"{operation.idempotency_key}: history ends {previous}, the operation is {operation.state}"
    return None


def _agrees(operation: Operation, sent: tuple[str, str] | None) -> bool:
    """Ledger against outbox: accepted means sent (that message); failed means refused, in the send or before
    it; a message Hail took is never recorded as not sent; needs_review may be either."""
    if operation.state is State.NEEDS_REVIEW:
        return True
    if operation.state is State.ACCEPTED:
        return sent is not None and sent[0] == operation.provider_id
    if operation.state is State.FAILED:
        return sent is None or sent == (operation.provider_id, "failed")
    return sent is None


def _state(operations: dict[str, Operation], key: str) -> str:
    op = operations.get(key)
    return f"{key}: {op.state.value if op else 'no operation'} ({op.last_error if op else ''})"


# -- the tests ----------------------------------------------------------------------------------------


def test_every_documented_crash_point_is_in_the_send_path_exactly_once() -> None:
    package = Path(crashpoints.__file__).parent
    source = "".join((package / name).read_text() for name in ("guard.py", "batch.py"))
    used = re.findall(r'crash_point\("([a-z_]+)"\)', source)
    assert sorted(used) == sorted(crashpoints.POINTS)
    assert {s.point for s in SCENARIOS} == {*crashpoints.POINTS, "in_flight"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, (None, 0)), ("", (None, 0)), ("after_intent", ("after_intent", 1)), ("after_claim:3", ("after_claim", 3))],
)
def test_the_crash_setting_names_a_point_and_which_hit(value: str | None, expected: tuple[str | None, int]) -> None:
    assert crashpoints.parse(value) == expected


@pytest.mark.parametrize("value", ["after_intnet", "after_intent:0", "after_intent:x", "after_intent:-1"])
def test_a_misspelt_crash_setting_is_refused_not_ignored(value: str) -> None:
    with pytest.raises(ValueError, match=crashpoints.ENV_VAR):
        crashpoints.parse(value)


async def test_serve_with_an_unknown_crash_point_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "hail-guard.toml"
    config.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[upstream]\ntransport = "sandbox"\n')
    env = {forked.CRASH_VARIABLE: "after_intnet"}
    process = forked.start(["--config", str(config), "serve"], logs=tmp_path / "logs", env=env, stdio=True)
    try:
        assert await process.wait(RUN_SECONDS) == 1
        assert "names no crash point; the points are before_intent, after_intent" in process.log()
    finally:
        process.close()


@asynccontextmanager
async def ledger_for(scenario: Scenario, request: pytest.FixtureRequest) -> AsyncIterator[str | None]:
    """None (a SQLite file in the campaign's directory), or a new PostgreSQL database."""
    if scenario.backend == "sqlite":
        yield None
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    async with server.database() as url:
        yield url


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
async def test_a_quick_crash_at_each_point_loses_and_repeats_nothing(
    tmp_path: Path, scenario: Scenario, request: pytest.FixtureRequest
) -> None:
    async with ledger_for(scenario, request) as url:
        report = await Campaign(scenario, tmp_path, QUICK_RUNS, url)()
    assert report.kills == QUICK_RUNS
    assert report.duplicates == report.lost == 0


@pytest.mark.slow
@pytest.mark.timeout(max(600, RUNS * 30))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
async def test_the_crash_campaign_loses_and_repeats_nothing(
    tmp_path: Path, scenario: Scenario, request: pytest.FixtureRequest
) -> None:
    async with ledger_for(scenario, request) as url:
        report = await Campaign(scenario, tmp_path, RUNS, url)()
    print(f"crash campaign {scenario.id}: {report}")  # shown with -rP or -s
    assert report.kills == RUNS
    assert report.duplicates == report.lost == 0


async def test_a_reconcile_killed_on_one_operation_leaves_the_others_free(tmp_path: Path) -> None:
    """Found by the campaign: reconcile claimed every due operation at once, so dying on the first one left
    all of them held for a whole lease, each with a reconcile attempt counted that never happened."""
    campaign = Campaign(Scenario("reconcile_claimed", "serve", UNKNOWN_AFTER_ACCEPT), tmp_path, runs=1)
    campaign.lease_seconds = 600.0
    sandbox = await campaign.start_sandbox()
    try:
        campaign.pending = [campaign.new_send() for _ in range(3)]
        process = forked.start(campaign.hg("serve"), logs=campaign.logs, env=campaign.armed(1), stdio=True)
        error = await campaign.talk(process, reconcile_after=True, parallel=1)
        await campaign.expect_crash(process, error=error)
        process.close()
        async with open_ledger(campaign.ledger_url) as ledger:
            operations, now = await _operations(ledger), await ledger.now()
        assert [op.state for op in operations] == [State.UNKNOWN] * 3
        held = [op for op in operations if op.lease_expires_at is not None and op.lease_expires_at > now]
        assert len(held) == 1, [(op.idempotency_key, op.lease_expires_at, op.attempts) for op in operations]
        assert sorted(op.attempts for op in operations) == [1, 1, 2]

        process = forked.start(campaign.hg("serve"), logs=campaign.logs, stdio=True)
        async with process.mcp_client() as client:
            answer = _data(await client.call_tool("reconcile", {}))
        # Both settled at once, not left held: accepted, or failed for an SMS the carrier refuses (the seed's pick).
        assert len(answer["reconciled"]) == 2
        assert {view["state"] for view in answer["reconciled"]} <= {"accepted", "failed"}
        assert await process.wait(RUN_SECONDS) == 0
        process.close()
    finally:
        sandbox.kill()
        await sandbox.wait(10)
        sandbox.close()
