"""`hail-guard drill`: rehearse the failures against the in-process sandbox, scenario by scenario.

    hail-guard drill [--leads N] [--workers N] [--seed S] [--ledger URL] [--scenario N]... [--json]

Each scenario gets its own sandbox with scripted faults, its own ledger (a fresh SQLite file in a
throwaway folder, or the ledger `--ledger` names, with run-unique campaigns, keys and recipients so
that scenarios and repeated runs never collide) and a real MCP client, the agent, talking to
hail-guard in front of that sandbox. A verdict is computed from the sandbox's outbox (what was
really "sent") and from the ledger's states; a scenario that raises fails with the error and never
stops the drill. Every random choice (lead order, where the batch dies, who opts out) comes from the
seed, so a failing run can be replayed with `--seed`.

`run_drill` is the drill itself; `add_arguments` and `run_from_args` are the command's edge (the
progress bar goes to stderr; `hail-guard drill` in cli.py prints the report with `print_report`).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import structlog
from mcp import Client, types
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hail_guard.batch import drain
from hail_guard.guard import Guard, GuardSettings, claim_token
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.logs import configure_logging
from hail_guard.models import State, ToolPin
from hail_guard.sandbox import KEY_RETENTION_SECONDS, ManualClock, Sandbox, parse_fault
from hail_guard.server import Proxy, build_server
from hail_guard.upstream import Upstream, UpstreamTarget, connect_upstream
from hail_guard.urls import display_url

if TYPE_CHECKING:
    from hail_guard.config import Settings

log = structlog.get_logger(__name__)

DEFAULT_LEADS: Final = 100
DEFAULT_WORKERS: Final = 2
MAX_LEADS: Final = 10_000
MAX_WORKERS: Final = 32
SCENARIO_SECONDS: Final = 20.0
"""A scenario still running after this long fails: a hang is a verdict, never a stuck drill."""
HANG_TIMEOUT_SECONDS: Final = 0.5
"""hail-guard's upstream timeout in the scenarios where Hail is scripted never to answer."""
CALL_TIMEOUT_SECONDS: Final = 10.0
"""hail-guard's upstream timeout everywhere else."""
CRASH_LEASE_SECONDS: Final = 0.5
"""The lease of the worker that crashes in scenario 9 (the drill waits for it to run out)."""
WORKER_LOOPS: Final = 4
"""Concurrent claim loops in each worker of scenario 5."""
HELD_KEY_MS: Final = 60_000
"""How long another caller holds the key upstream in scenario 8 (released early by the drill)."""
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
"""`hail-guard drill`: a scenario did not hold."""


@dataclass(frozen=True)
class DrillOptions:
    seed: int
    leads: int = DEFAULT_LEADS
    workers: int = DEFAULT_WORKERS
    ledger_url: str | None = None
    """None: a fresh SQLite file per scenario in a throwaway folder."""
    scenarios: tuple[int, ...] = ()
    """Only these scenario numbers (empty: all)."""
    duplicate_window_hours: float | None = 24.0
    busy_timeout_seconds: float = 5.0


@dataclass(frozen=True)
class ScenarioResult:
    number: int
    name: str
    faults: str
    """What the faults did (and what the agent did), in one line."""
    expected: int
    """Messages the sandbox should have accepted."""
    sent: int
    """Messages the sandbox really accepted (its outbox)."""
    failed_check: str | None
    """The first check that did not hold, or the error the scenario raised; None: it holds."""
    seconds: float

    @property
    def holds(self) -> bool:
        return self.failed_check is None

    @property
    def verdict(self) -> str:
        return "holds" if self.holds else "fails"

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "name": self.name,
            "faults": self.faults,
            "expected": self.expected,
            "sent": self.sent,
            "verdict": self.verdict,
            "failed_check": self.failed_check,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class DrillReport:
    options: DrillOptions
    scenarios: list[ScenarioResult]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(result.holds for result in self.scenarios)

    def replay_command(self) -> str:
        options = self.options
        words = ["hail-guard drill", f"--seed {options.seed}", f"--leads {options.leads}"]
        words.append(f"--workers {options.workers}")
        if options.ledger_url is not None:
            words.append(f"--ledger {_display_url(options.ledger_url)}")
        words += [f"--scenario {result.number}" for result in self.scenarios if not result.holds]
        return " ".join(words)

    def summary(self) -> str:
        options = self.options
        setting = f"seed {options.seed}, {options.leads} leads, {options.workers} workers, {self.seconds:.1f} s"
        if self.passed:
            held = f"All {len(self.scenarios)} scenarios hold" if len(self.scenarios) > 1 else "The scenario holds"
            return f"{held}: nobody got a message twice and nothing was lost ({setting})."
        failed = [str(result.number) for result in self.scenarios if not result.holds]
        return (
            f"{len(failed)} of {len(self.scenarios)} scenarios FAIL ({', '.join(failed)}; {setting}). "
            f"Replay: {self.replay_command()}"
        )

    def to_json(self) -> dict[str, Any]:
        options = self.options
        return {
            "seed": options.seed,
            "leads": options.leads,
            "workers": options.workers,
            "ledger": _display_url(options.ledger_url) if options.ledger_url else None,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "summary": self.summary(),
            "replay": self.replay_command(),
            "scenarios": [result.to_json() for result in self.scenarios],
        }


class _CheckFailed(Exception):
    """A check of a scenario did not hold; the text names it."""


def _check(holds: bool, what: str) -> None:
    """`what` is the claim the scenario makes; when it does not hold, the scenario fails naming it."""
    if not holds:
        raise _CheckFailed(what)


@dataclass
class _Run:
    """One scenario as it runs: what the faults did, what it expects, the sandbox that is ground truth."""

    faults: str = ""
    expected: int = 0
    sandbox: Sandbox | None = None

    @property
    def outbox(self) -> list[dict[str, Any]]:
        return self.sandbox.outbox if self.sandbox is not None else []


@dataclass
class _Rig:
    """The agent's MCP client -> hail-guard -> the sandbox, in process, on the scenario's ledger."""

    sandbox: Sandbox
    ledger: Ledger
    upstream: Upstream
    proxy: Proxy
    client: Client

    async def call(self, tool: str, arguments: Mapping[str, Any]) -> types.CallToolResult:
        return await self.client.call_tool(tool, dict(arguments))

    async def send(self, arguments: Mapping[str, Any], what: str) -> dict[str, Any]:
        """The agent sends an email; returns hail-guard's view of the operation."""
        return _view(await self.call("send_email", arguments), what)

    async def reconcile(self, operation_id: str) -> dict[str, Any]:
        answer = _data(await self.call("reconcile", {"operation_id": operation_id}))
        reconciled = answer.get("reconciled")
        if not isinstance(reconciled, list) or len(reconciled) != 1 or not isinstance(reconciled[0], dict):
            raise _CheckFailed(f"reconcile answers with the operation (got: {str(answer)[:200]})")
        view: dict[str, Any] = reconciled[0]
        return view

    async def plan(self, sends: list[dict[str, Any]]) -> str:
        result = await self.call("plan_batch", {"sends": sends})
        answer = _data(result)
        _check(not result.is_error, f"the batch is planned ({answer.get('error')})")
        return str(answer["batch_id"])

    async def batch(self, tool: str, batch_id: str, **extra: Any) -> dict[str, Any]:
        result = await self.call(tool, {"batch_id": batch_id, **extra})
        answer = _data(result)
        _check(not result.is_error, f"{tool} answers ({answer.get('error')})")
        return answer


class _UnpinnedLedger:
    """The scenario's ledger, except that the sandbox's tools are not recorded as the upstream's look.

    The sandbox's tools carry Hail's names; recording them in a shared ledger (`--ledger`) would mark
    the real Hail's tools as changed and, with pinning on, stop real sends until an operator accepted.
    """

    def __init__(self, inner: Ledger) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def observe_tools(self, fingerprints: Mapping[str, str]) -> list[ToolPin]:
        return []


@dataclass
class _Drill:
    """What every scenario shares: the options, this run's id and its throwaway folder."""

    options: DrillOptions
    folder: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def rng(self, number: int) -> random.Random:
        """The scenario's own random choices, the same for a seed whichever scenarios run."""
        return random.Random(f"{self.options.seed}:{number}")  # noqa: S311  (rehearsal choices, not secrets)

    def ledger_url(self, number: int) -> str:
        if self.options.ledger_url is not None:
            return self.options.ledger_url
        return f"sqlite:///{self.folder / f'scenario-{number:02d}.db'}"

    def lead(self, number: int, index: int, **changes: Any) -> dict[str, Any]:
        """Lead `index`'s email in scenario `number`: its own key, recipient and content in this run."""
        tag = f"{self.run_id}-s{number:02d}"
        arguments = {
            "to": [f"lead{index:04d}.{tag}@drill.example.com"],
            "subject": "A quick hello",
            "body_text": f"Hello lead {index}, this is a rehearsal ({tag}); nothing real is sent.",
            "recipient_consent": True,
            "metadata": {"campaign_id": f"drill-{tag}", "lead_id": f"lead{index:04d}", "message_id": "intro"},
        }
        return {**arguments, **changes}

    def sends(self, number: int, order: Sequence[int]) -> list[dict[str, Any]]:
        return [{"tool": "send_email", "arguments": self.lead(number, index)} for index in order]

    def shuffled_leads(self, number: int) -> list[int]:
        order = list(range(self.options.leads))
        self.rng(number).shuffle(order)
        return order

    def guard_settings(self, timeout_seconds: float, **guard: Any) -> GuardSettings:
        return GuardSettings(
            timeout_seconds=timeout_seconds, duplicate_window_hours=self.options.duplicate_window_hours, **guard
        )

    @asynccontextmanager
    async def connect(
        self, number: int, sandbox: Sandbox, timeout_seconds: float
    ) -> AsyncIterator[tuple[Ledger, Upstream]]:
        """What one hail-guard process holds: its own ledger connection and its own connection to the sandbox."""
        target = UpstreamTarget(kind="inprocess", server=sandbox.server())
        async with (
            open_ledger(self.ledger_url(number), busy_timeout_seconds=self.options.busy_timeout_seconds) as ledger,
            connect_upstream(target, timeout_seconds=timeout_seconds, heartbeat_seconds=None) as upstream,
        ):
            yield cast(Ledger, _UnpinnedLedger(ledger)), upstream

    @asynccontextmanager
    async def worker(self, number: int, sandbox: Sandbox) -> AsyncIterator[Guard]:
        async with self.connect(number, sandbox, CALL_TIMEOUT_SECONDS) as (ledger, upstream):
            yield Guard(ledger, upstream, self.guard_settings(CALL_TIMEOUT_SECONDS))

    @asynccontextmanager
    async def rig(
        self,
        number: int,
        run: _Run,
        sandbox: Sandbox,
        *,
        timeout_seconds: float = CALL_TIMEOUT_SECONDS,
        require_approval: bool = False,
        **guard: Any,
    ) -> AsyncIterator[_Rig]:
        run.sandbox = sandbox
        async with self.connect(number, sandbox, timeout_seconds) as (ledger, upstream):
            hail_guard = Guard(ledger, upstream, self.guard_settings(timeout_seconds, **guard))
            proxy = Proxy(hail_guard, upstream, require_approval=require_approval)
            await proxy.refresh_tools()
            async with Client(build_server(proxy), mode="legacy") as client:
                yield _Rig(sandbox, ledger, upstream, proxy, client)


def _data(result: types.CallToolResult) -> dict[str, Any]:
    if isinstance(result.structured_content, dict):
        return result.structured_content
    text = _text(result)
    try:
        value = json.loads(text)
    except ValueError:
        return {"error": text}
    return value if isinstance(value, dict) else {"error": text}


def _text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


def _view(result: types.CallToolResult, what: str) -> dict[str, Any]:
    view = _data(result).get("hail_guard")
    if not isinstance(view, dict):
        raise _CheckFailed(f"{what} answers with a hail-guard operation (got: {_text(result)[:200]})")
    return view


def _brief(result: types.CallToolResult) -> str:
    """What an answer amounts to, in a few words: the operation's state, or the error."""
    answer = _data(result)
    view = answer.get("hail_guard")
    if isinstance(view, dict):
        return f"{view.get('state')}{', from the ledger' if view.get('replayed') else ''}"
    return str(answer.get("error", _text(result)))[:160]


def _only_id(run: _Run) -> str | None:
    return str(run.outbox[0]["id"]) if len(run.outbox) == 1 else None


async def _settles_accepted(rig: _Rig, run: _Run, operation_id: str, claim: str) -> None:
    """Reconcile one operation and check it found the one message Hail really accepted."""
    settled = await rig.reconcile(operation_id)
    _check(
        settled["state"] == "accepted" and settled["provider_id"] == _only_id(run),
        f"{claim} (got {settled['state']}, {settled['provider_id']})",
    )


# The scenarios. Each one names its faults, sets what it expects, and checks as it goes.


async def _drop_then_retry(drill: _Drill, run: _Run) -> None:
    run.faults = "Hail accepts, then drops the connection; the agent retries the same call"
    run.expected = 1
    email = drill.lead(1, 0)
    async with drill.rig(1, run, Sandbox(faults=[parse_fault("send_email:1:drop_after_accept")])) as rig:
        first = await rig.send(email, "the dropped send")
        _check(first["state"] == "unknown", f"the lost answer is recorded unknown (got {first['state']})")
        retry = await rig.send(email, "the retry")
        _check(
            retry.get("replayed") is True and rig.sandbox.calls("send_email") == 1,
            f"the retry is answered from the ledger, not forwarded (Hail got {rig.sandbox.calls('send_email')} calls)",
        )
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the one accepted message")


async def _hang_then_reconcile(drill: _Drill, run: _Run) -> None:
    run.faults = f"Hail accepts, then never answers (hail-guard times out after {HANG_TIMEOUT_SECONDS:g} s)"
    run.expected = 1
    sandbox = Sandbox(faults=[parse_fault("send_email:1:hang_after_accept")])
    async with drill.rig(2, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS) as rig:
        first = await rig.send(drill.lead(2, 0), "the send that timed out")
        _check(first["state"] == "unknown", f"the timeout is recorded unknown (got {first['state']})")
        _check("reconcile" in first["next_step"], "the agent is told to reconcile, not to resend")
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the accepted message")


async def _batch_dies_and_resumes(drill: _Drill, run: _Run) -> None:
    leads = drill.options.leads
    dies_at = drill.rng(3).randint(max(1, round(leads * 0.35)), max(1, round(leads * 0.45)))
    run.faults = f"Hail drops the connection after accepting send {dies_at} of {leads}; the run dies"
    run.expected = leads
    sandbox = Sandbox(faults=[parse_fault(f"send_email:{dies_at}:drop_after_accept")])
    async with drill.rig(3, run, sandbox) as first:
        batch_id = await first.plan(drill.sends(3, drill.shuffled_leads(3)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.call, "run_batch", {"batch_id": batch_id, "concurrency": 4})
            await sandbox.wait_for_outbox(dies_at)
            tg.cancel_scope.cancel()  # the process running the batch dies
    run.faults += f" ({len(sandbox.outbox)} sent) and a new one resumes"
    async with drill.rig(3, run, sandbox) as second:
        left = (await second.batch("batch_status", batch_id))["counts"]
        _check(left.get("unknown", 0) >= 1, f"the dead run left its lost answers unknown (counts {left})")
        resumed_at = await second.ledger.now()
        counts = (await second.batch("run_batch", batch_id, concurrency=8))["counts"]
        _check(counts == {"accepted": leads}, f"after the resume every lead is accepted (counts {counts})")
        keys = [entry["idempotency_key"] for entry in sandbox.outbox]
        _check(len(set(keys)) == len(keys) == leads, f"one message per lead ({len(set(keys))} keys)")
        settled, sending = await _events_since(second.ledger, batch_id, resumed_at)
        _check(
            bool(settled) and (not sending or max(settled) <= min(sending)),
            "the resume checks the unknown sends before it sends anything new",
        )


async def _events_since(ledger: Ledger, batch_id: str, since: datetime) -> tuple[list[datetime], list[datetime]]:
    """When unknown operations were settled, and when operations were claimed to send, since `since`."""
    settled: list[datetime] = []
    sending: list[datetime] = []
    for operation in await ledger.list_operations(batch_id=batch_id, limit=MAX_LEADS):
        for event in await ledger.events(operation.id):
            if event.at >= since and event.from_state is State.UNKNOWN:
                settled.append(event.at)
            elif event.at >= since and event.to_state is State.SENDING:
                sending.append(event.at)
    return settled, sending


async def _changed_message_same_key(drill: _Drill, run: _Run) -> None:
    changed_field = drill.rng(4).choice(["subject", "body_text"])
    run.faults = f"none; the agent reuses the key with a changed {changed_field}"
    run.expected = 1
    original = drill.lead(4, 0)
    async with drill.rig(4, run, Sandbox()) as rig:
        first = await rig.send(original, "the first send")
        _check(first["state"] == "accepted", f"the first send is accepted (got {first['state']})")
        result = await rig.call("send_email", {**original, changed_field: f"{original[changed_field]} (edited)"})
        answer = _data(result)
        _check(
            result.is_error and answer.get("differing_fields") == [changed_field],
            f"the changed message is refused, naming {changed_field} (got: {_brief(result)})",
        )
        _check(rig.sandbox.calls("send_email") == 1, "the changed message never reaches Hail")
        sent = run.outbox[0]["request"][changed_field] if run.outbox else None
        _check(sent == original[changed_field], "Hail holds the original message")


async def _workers_race(drill: _Drill, run: _Run) -> None:
    leads, workers = drill.options.leads, drill.options.workers
    run.faults = f"none; {workers} workers x {WORKER_LOOPS} loops claim one batch on one ledger at once"
    run.expected = leads
    sandbox = Sandbox(latency_seconds=0.001)
    async with drill.rig(5, run, sandbox) as rig, AsyncExitStack() as stack:
        batch_id = await rig.plan(drill.sends(5, drill.shuffled_leads(5)))
        guards = [await stack.enter_async_context(drill.worker(5, sandbox)) for _ in range(workers)]
        dispatched = [0] * workers

        async def work(index: int) -> None:
            dispatched[index] = await drain(guards[index], concurrency=WORKER_LOOPS, batch_id=batch_id)

        async with anyio.create_task_group() as tg:
            for index in range(workers):
                tg.start_soon(work, index)
        run.faults += f" (they sent {' + '.join(str(count) for count in dispatched)})"
        _check(sum(dispatched) == leads, f"each operation is dispatched once ({sum(dispatched)} dispatches)")
        calls = sandbox.calls("send_email")
        _check(calls == leads, f"Hail is asked once per operation ({calls} calls for {leads})")
        counts = (await rig.batch("batch_status", batch_id))["counts"]
        _check(counts == {"accepted": leads}, f"every lead is accepted (counts {counts})")


async def _opt_out_after_approval(drill: _Drill, run: _Run) -> None:
    leads = drill.options.leads
    opted_out = drill.rng(6).randrange(leads)
    run.faults = f"none; lead {opted_out} opts out after the batch is approved, before it runs"
    run.expected = leads - 1
    recipient = drill.lead(6, opted_out)["to"][0]
    async with drill.rig(6, run, Sandbox(), require_approval=True) as rig:
        batch_id = await rig.plan(drill.sends(6, drill.shuffled_leads(6)))
        approved = await rig.ledger.approve_batch(batch_id, actor="drill operator")
        _check(approved == leads, f"the operator approves the batch ({approved} approved)")
        opt_out = _data(
            await rig.call("record_opt_out", {"recipient": recipient.upper(), "channel": "email", "reason": "STOP"})
        )
        counts = (await rig.batch("run_batch", batch_id))["counts"]
        _check(all(recipient not in entry["to"] for entry in run.outbox), "nothing reaches the opted-out lead")
        cancelled = opt_out.get("cancelled_operations")
        _check(
            isinstance(cancelled, list) and len(cancelled) == 1,
            f"the opt-out cancels the approved send (it cancelled {cancelled})",
        )
        expected = {"accepted": leads - 1, "cancelled": 1} if leads > 1 else {"cancelled": 1}
        _check(counts == expected, f"the batch ends {expected} (got {counts})")


async def _saved_failure_replayed(drill: _Drill, run: _Run) -> None:
    run.faults = "Hail refuses (409, unfamiliar words), saves the refusal and replays it"
    run.expected = 0
    email = drill.lead(7, 0)
    async with drill.rig(7, run, Sandbox(faults=[parse_fault("send_email:1:fail_before_accept:409")])) as rig:
        first = await rig.send(email, "the refused send")
        _check(first["state"] == "unknown", f"an error it does not know is unknown at first (got {first['state']})")
        settled = await rig.reconcile(first["operation_id"])
        _check(settled["state"] == "failed", f"the repeated answer is taken as final: failed (got {settled['state']})")
        calls = rig.sandbox.calls("send_email")
        retry = await rig.send(email, "the retry")
        again = await rig.reconcile(first["operation_id"])
        _check(
            retry.get("replayed") is True and again["state"] == "failed" and rig.sandbox.calls("send_email") == calls,
            "once failed, neither a retry nor reconcile makes a new attempt",
        )


async def _key_still_processing(drill: _Drill, run: _Run) -> None:
    run.faults = "another caller holds the key at Hail (still processing) while the agent sends"
    run.expected = 1
    held, release = anyio.Event(), anyio.Event()

    async def sleep(seconds: float) -> None:
        if seconds == HELD_KEY_MS / 1000:  # the `processing` fault: hold the key until the drill lets go
            held.set()
            await release.wait()
        else:
            await anyio.sleep(seconds)

    sandbox = Sandbox(faults=[parse_fault(f"send_email:1:processing:{HELD_KEY_MS}")], sleep=sleep)
    email = drill.lead(8, 0)
    async with drill.rig(8, run, sandbox) as rig:
        schema = rig.proxy.guarded_schema("send_email") or {}
        _, forwarded = rig.proxy.guard.prepare("send_email", email, schema)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sandbox.invoke, "send_email", forwarded)
            try:
                await held.wait()
                first = await rig.send(email, "the send while Hail holds the key")
                _check(first["state"] == "unknown", f"'still processing' is unknown (got {first['state']})")
                waiting = await rig.reconcile(first["operation_id"])
                _check(
                    waiting["state"] == "unknown" and not sandbox.outbox,
                    f"reconcile waits: no replacement is sent (got {waiting['state']}, {len(sandbox.outbox)} sent)",
                )
            finally:
                release.set()  # Hail finishes the held send even if a check failed (it runs shielded, like Hail)
        await _settles_accepted(rig, run, first["operation_id"], "once Hail finishes, reconcile finds its one message")


async def _crash_after_acceptance(drill: _Drill, run: _Run) -> None:
    run.faults = f"Hail accepts a worker's send; the worker dies before recording it (lease {CRASH_LEASE_SECONDS:g} s)"
    run.expected = 1
    async with drill.rig(9, run, Sandbox()) as rig:
        batch_id = await rig.plan(drill.sends(9, [0]))
        claimed = await rig.ledger.claim_ready(
            owner=claim_token(), lease_seconds=CRASH_LEASE_SECONDS, batch_id=batch_id, limit=1
        )
        _check(len(claimed) == 1, "the worker claims the send")
        operation = claimed[0]
        await rig.upstream.call_tool(operation.tool, operation.arguments(), timeout_seconds=CALL_TIMEOUT_SECONDS)
        _check(len(run.outbox) == 1, "Hail accepts the crashed worker's send")  # and nothing is recorded
        await rig.batch("run_batch", batch_id)
        _check(len(run.outbox) == 1, "a run while the lease holds does not send it again")
        await _until_lease_ends(rig.ledger, operation.lease_expires_at)
        await _settles_accepted(
            rig, run, operation.id, "after the lease, reconcile replays the same key and recovers it accepted"
        )
        counts = (await rig.batch("run_batch", batch_id))["counts"]
        _check(counts == {"accepted": 1}, f"a later run sends nothing more (counts {counts})")


async def _until_lease_ends(ledger: Ledger, expires_at: datetime | None) -> None:
    """Wait, on the database's clock, until a lease has run out (the scenario's deadline bounds it)."""
    for _ in range(10):  # the database's clock may run a little behind this process's
        now = await ledger.now()
        if expires_at is None or now >= expires_at:
            return
        await anyio.sleep((expires_at - now).total_seconds() + 0.01)


async def _unknown_past_retention(drill: _Drill, run: _Run) -> None:
    run.faults = "Hail accepts, never answers, and forgets the key (25 h pass; retention set to 30 min)"
    run.expected = 1
    clock = ManualClock()
    sandbox = Sandbox(faults=[parse_fault("send_email:1:hang_after_accept")], clock=clock)
    email = drill.lead(10, 0)
    async with drill.rig(10, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS, key_retention_hours=0.5) as rig:
        first = await rig.send(email, "the send that timed out")
        _check(first["state"] == "unknown", f"the timeout is recorded unknown (got {first['state']})")
        clock.advance(KEY_RETENTION_SECONDS + 3600)
        settled = await rig.reconcile(first["operation_id"])
        _check(
            settled["state"] == "needs_review" and "retention" in (settled["review_reason"] or ""),
            f"past the key retention it goes to a human: needs_review (got {settled['state']})",
        )
        retry = await rig.send(email, "the retry")
        _check(
            retry.get("replayed") is True and sandbox.calls("send_email") == 1,
            f"no blind resend reaches Hail (it got {sandbox.calls('send_email')} calls)",
        )


async def _new_key_same_content(drill: _Drill, run: _Run) -> None:
    run.faults = "Hail accepts, then never answers; the agent resends under a key it made up"
    run.expected = 1
    email = drill.lead(11, 0)
    sandbox = Sandbox(faults=[parse_fault("send_email:1:hang_after_accept")])
    async with drill.rig(11, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS) as rig:
        first = await rig.send(email, "the send that timed out")
        minted = await rig.call("send_email", {**email, "idempotency_key": f"agent-{drill.run_id}-retry"})
        view = _view(minted, "the retry under a new key")
        _check(
            view["operation_id"] == first["operation_id"] and view.get("replayed") is True,
            f"the new key is answered from the first send, {first['operation_id']} (got: {_brief(minted)})",
        )
        settled = await rig.reconcile(first["operation_id"])
        _check(settled["state"] == "accepted", f"reconcile settles the first send (got {settled['state']})")


async def _gateway_error_hid_success(drill: _Drill, run: _Run) -> None:
    run.faults = "Hail accepts, but its gateway answers 502; the agent follows the answer"
    run.expected = 1
    email = drill.lead(12, 0)
    async with drill.rig(12, run, Sandbox(faults=[parse_fault("send_email:1:error_after_accept:502")])) as rig:
        first = await rig.send(email, "the send answered 502")
        if first["state"] == "failed":  # told it failed for good, an agent sends a new message (a new key)
            await rig.send({**email, "idempotency_key": f"agent-{drill.run_id}-again"}, "the agent's new message")
        _check(first["state"] == "unknown", f"the 5xx is recorded unknown, not failed (got {first['state']})")
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the accepted message behind the 5xx")


@dataclass(frozen=True)
class Scenario:
    number: int
    name: str
    body: Callable[[_Drill, _Run], Awaitable[None]]


SCENARIOS: Final[tuple[Scenario, ...]] = (
    Scenario(1, "the connection drops after acceptance; the agent retries", _drop_then_retry),
    Scenario(2, "Hail hangs after acceptance (timeout)", _hang_then_reconcile),
    Scenario(3, "a batch dies at ~40% and is resumed", _batch_dies_and_resumes),
    Scenario(4, "the same key with a changed message", _changed_message_same_key),
    Scenario(5, "workers claim from the same batch at once", _workers_race),
    Scenario(6, "an opt-out after approval", _opt_out_after_approval),
    Scenario(7, "a saved failure replayed by Hail", _saved_failure_replayed),
    Scenario(8, "the key is still processing upstream", _key_still_processing),
    Scenario(9, "a worker crashes after acceptance, before recording", _crash_after_acceptance),
    Scenario(10, "an unknown older than Hail's key retention", _unknown_past_retention),
    Scenario(11, "the agent mints a new key for the same content", _new_key_same_content),
    Scenario(12, "a gateway 5xx that hid a success", _gateway_error_hid_success),
)


async def run_drill(
    options: DrillOptions,
    *,
    started: Callable[[Scenario], None] | None = None,
    finished: Callable[[ScenarioResult], None] | None = None,
) -> DrillReport:
    """Run the scenarios (all, or those `options.scenarios` names), one after another."""
    chosen = [s for s in SCENARIOS if not options.scenarios or s.number in options.scenarios]
    began = time.monotonic()
    if options.ledger_url is not None:  # a ledger that cannot be opened is the user's error, not a verdict
        async with open_ledger(options.ledger_url, busy_timeout_seconds=options.busy_timeout_seconds):
            pass
    results = []
    with tempfile.TemporaryDirectory(prefix="hail-guard-drill-") as folder:
        drill = _Drill(options, Path(folder))
        for scenario in chosen:
            if started is not None:
                started(scenario)
            result = await _run_scenario(drill, scenario)
            results.append(result)
            if finished is not None:
                finished(result)
    return DrillReport(options, results, time.monotonic() - began)


async def _run_scenario(drill: _Drill, scenario: Scenario) -> ScenarioResult:
    run = _Run()
    began = time.monotonic()
    failed: str | None = None
    with anyio.move_on_after(SCENARIO_SECONDS) as deadline:
        try:
            await scenario.body(drill, run)
        except Exception as exc:  # the per-scenario boundary: a crash is a failed verdict, never a stopped drill
            failed = _failure(exc, scenario)
    if deadline.cancelled_caught:
        failed = f"did not finish within {SCENARIO_SECONDS:g} s"
    return ScenarioResult(
        number=scenario.number,
        name=scenario.name,
        faults=run.faults,
        expected=run.expected,
        sent=len(run.outbox),
        failed_check=failed or _ground_truth(run),
        seconds=time.monotonic() - began,
    )


def _failure(exc: BaseException, scenario: Scenario) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, _CheckFailed):
        return str(exc)
    log.error("drill_scenario_crashed", scenario=scenario.number, exc_info=exc)
    return f"error: {type(exc).__name__}: {exc}"


def _ground_truth(run: _Run) -> str | None:
    """What the outbox says, whatever the scenario's own checks said: nobody twice, nothing lost."""
    recipients = Counter(recipient for entry in run.outbox for recipient in entry["to"])
    twice = [(recipient, count) for recipient, count in recipients.items() if count > 1]
    if twice:
        return f"{twice[0][0]} got {twice[0][1]} messages"
    if len(run.outbox) != run.expected:
        return f"Hail accepted {len(run.outbox)} message(s); {run.expected} expected"
    return None


def _display_url(url: str) -> str:
    """A ledger URL safe to print: scheme, host, port and database only (`urls.display_url`)."""
    return display_url(url)


# The command's edge.


def _bounded(what: str, most: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, not {text!r}") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{what} must be from 1 to {most}, not {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `drill` command's options to `parser`."""
    parser.add_argument(
        "--leads", type=_bounded("--leads", MAX_LEADS), default=DEFAULT_LEADS, help="leads in the batch scenarios"
    )
    parser.add_argument(
        "--workers", type=_bounded("--workers", MAX_WORKERS), default=DEFAULT_WORKERS, help="workers in scenario 5"
    )
    parser.add_argument("--seed", type=int, help="replay a run's random choices (default: a new seed, printed)")
    parser.add_argument(
        "--ledger",
        metavar="URL",
        help="rehearse on this ledger (e.g. a staging PostgreSQL) instead of throwaway SQLite files; "
        "the drill's records stay in it, under campaigns named drill-<run>",
    )
    parser.add_argument(
        "--scenario",
        type=_bounded("--scenario", len(SCENARIOS)),
        action="append",
        metavar="N",
        help="run only scenario N (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


async def run_from_args(ns: argparse.Namespace, settings: Settings) -> DrillReport:
    """Run the drill as `hail-guard drill` was asked to, with a progress bar on stderr."""
    if settings.log.level != "debug":
        configure_logging("error")  # the faults are deliberate: their warnings would only be noise
    options = DrillOptions(
        seed=ns.seed if ns.seed is not None else secrets.randbelow(1_000_000),
        leads=ns.leads,
        workers=ns.workers,
        ledger_url=ns.ledger,
        scenarios=tuple(sorted(set(ns.scenario or ()))),
        duplicate_window_hours=settings.guard.duplicate_window_hours or None,
        busy_timeout_seconds=settings.ledger.busy_timeout_seconds,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        total = len(options.scenarios) or len(SCENARIOS)
        task = bar.add_task("drill", total=total)
        return await run_drill(
            options,
            started=lambda scenario: bar.update(task, description=f"{scenario.number}. {scenario.name}"),
            finished=lambda _: bar.advance(task),
        )


def print_report(report: DrillReport, console: Console) -> None:
    table = Table(
        "#",
        "scenario",
        "what the faults did",
        "expected",
        "sent",
        "verdict",
        title="hail-guard drill",
        caption="expected / sent: messages the sandbox should have accepted / really accepted (its outbox)",
    )
    for result in report.scenarios:
        verdict = "[green]holds[/green]" if result.holds else f"[red]FAILS[/red]: {escape(result.failed_check or '')}"
        table.add_row(
            str(result.number),
            escape(result.name),
            escape(result.faults),
            str(result.expected),
            str(result.sent),
            verdict,
        )
    console.print(table)
    style = "green" if report.passed else "bold red"
    console.print(f"[{style}]{escape(report.summary())}[/{style}]", soft_wrap=True)  # one line, for grep
