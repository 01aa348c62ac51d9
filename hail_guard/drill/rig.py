"""The drill's rig: per scenario, the agent's MCP client -> hail-guard -> a sandbox, on the scenario's ledger.

`Drill` holds what every scenario of one run shares (its options, the run's id, its folder) and
opens a `Rig` for a scenario: a sandbox, the scenario's ledger, and hail-guard between the agent
and the sandbox. With the `inprocess` transport hail-guard is a `Proxy` in this process, reached
over in-memory streams. With `stdio` it is a spawned `hail-guard serve`, configured the way a user
deploys it, reached over its stdin and stdout, and the sandbox listens on a loopback port.

Either way the rig also holds a hail-guard of the drill's own (ledger, upstream connection, guard):
the scenarios use it for what is not the agent's (an operator's approval, a worker that crashes,
the key another caller holds). Its proxy records no tool pins (`record_tools=False`): the sandbox's
tools carry Hail's names, and recording them in a shared ledger (`--ledger`) would mark the real
Hail's tools as changed. `Run` collects what a scenario did and what the agent saw.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import sys
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TextIO

import anyio
from mcp import Client, StdioServerParameters, stdio_client, types

from hail_guard.guard import Guard, GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.sandbox import Sandbox, parse_fault, serve_http
from hail_guard.server import Proxy, build_server
from hail_guard.upstream import Upstream, UpstreamTarget, connect_upstream

Transport = Literal["inprocess", "stdio"]
TRANSPORTS: Final[tuple[Transport, ...]] = ("inprocess", "stdio")
DEFAULT_LEADS: Final = 100
DEFAULT_WORKERS: Final = 2
MAX_LEADS: Final = 10_000
MAX_WORKERS: Final = 32
CALL_TIMEOUT_SECONDS: Final = 10.0
"""hail-guard's upstream timeout, except where a scenario scripts Hail never to answer."""
_SANDBOX_TOKEN_ENV: Final = "HAIL_API_KEY"  # noqa: S105  (the name of a variable, not a secret)


@dataclass(frozen=True)
class DrillOptions:
    seed: int
    leads: int = DEFAULT_LEADS
    workers: int = DEFAULT_WORKERS
    ledger_url: str | None = None
    """None: a fresh SQLite file per scenario in the run's folder."""
    scenarios: tuple[int, ...] = ()
    """Only these scenario numbers (empty: all)."""
    duplicate_window_hours: float = 24.0
    busy_timeout_seconds: float = 5.0
    transport: Transport = "inprocess"
    """How the agent reaches hail-guard: in this process, or a spawned `hail-guard serve` over stdio."""
    keep: Path | None = None
    """Keep the ledgers, outboxes (and, over stdio, serve's logs) in this folder; None: a throwaway one."""


class CheckFailed(Exception):
    """A check of a scenario did not hold; the text names it."""


def check(holds: bool, what: str) -> None:
    """`what` is the claim the scenario makes; when it does not hold, the scenario fails naming it."""
    if not holds:
        raise CheckFailed(what)


@dataclass
class Run:
    """One scenario as it runs: what the faults did, what it expects, what the agent saw, the ground truth."""

    faults: str = ""
    expected: int = 0
    sandbox: Sandbox | None = None
    agent_saw: list[str] = field(default_factory=list)

    @property
    def outbox(self) -> list[dict[str, Any]]:
        return self.sandbox.outbox if self.sandbox is not None else []

    def saw(self, step: str) -> None:
        self.agent_saw.append(step)


@dataclass
class Rig:
    """What a scenario drives: the agent's client, and the drill's own hail-guard on the same ledger."""

    run: Run
    sandbox: Sandbox
    ledger: Ledger
    upstream: Upstream
    proxy: Proxy
    client: Client

    async def call(self, tool: str, arguments: Mapping[str, Any]) -> types.CallToolResult:
        """One call of the agent's, as it is made; its answer is noted in what the agent saw."""
        result = await self.client.call_tool(tool, dict(arguments))
        self.run.saw(brief(tool, result))
        return result

    async def send(self, arguments: Mapping[str, Any], what: str) -> dict[str, Any]:
        """The agent sends an email; returns hail-guard's view of the operation."""
        return view(await self.call("send_email", arguments), what)

    async def reconcile(self, operation_id: str) -> dict[str, Any]:
        answer = data(await self.client.call_tool("reconcile", {"operation_id": operation_id}))
        reconciled = answer.get("reconciled")
        if not isinstance(reconciled, list) or len(reconciled) != 1 or not isinstance(reconciled[0], dict):
            raise CheckFailed(f"reconcile answers with the operation (got: {str(answer)[:200]})")
        settled: dict[str, Any] = reconciled[0]
        self.run.saw(f"reconcile -> {settled.get('state')}")
        return settled

    async def plan(self, sends: list[dict[str, Any]]) -> str:
        result = await self.call("plan_batch", {"sends": sends})
        answer = data(result)
        check(not result.is_error, f"the batch is planned ({answer.get('error')})")
        return str(answer["batch_id"])

    async def batch(self, tool: str, batch_id: str, **extra: Any) -> dict[str, Any]:
        result = await self.call(tool, {"batch_id": batch_id, **extra})
        answer = data(result)
        check(not result.is_error, f"{tool} answers ({answer.get('error')})")
        return answer


@dataclass
class Drill:
    """What every scenario of one run shares: the options, this run's id and its folder."""

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

    def sandbox(self, number: int, *faults: str, unguarded: bool = False, **options: Any) -> Sandbox:
        """A sandbox with `faults`; its outbox is kept with `--keep` (the unguarded one's apart)."""
        outbox = None
        if self.options.keep is not None:
            outbox = self.folder / f"scenario-{number:02d}{'-unguarded' if unguarded else ''}-outbox.jsonl"
        return Sandbox(faults=[parse_fault(fault) for fault in faults], outbox_path=outbox, **options)

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

    def batch_dies_at(self) -> int:
        """Where scenario 3's run dies: at 35 to 45 % of the leads."""
        leads = self.options.leads
        return self.rng(3).randint(max(1, round(leads * 0.35)), max(1, round(leads * 0.45)))

    def changed_field(self) -> str:
        """What the agent edits in scenario 4."""
        return self.rng(4).choice(["subject", "body_text"])

    def opted_out_lead(self) -> int:
        """Who opts out in scenario 6."""
        return self.rng(6).randrange(self.options.leads)

    def sends(self, number: int, order: Sequence[int]) -> list[dict[str, Any]]:
        return [{"tool": "send_email", "arguments": self.lead(number, index)} for index in order]

    def template_sends(self, number: int, order: Sequence[int]) -> list[dict[str, Any]]:
        """A campaign of one text: every lead's send with the same subject and body (its own recipient and ids)."""
        tag = f"{self.run_id}-s{number:02d}"
        text = f"Hello, this is our spring offer ({tag}); a rehearsal: nothing real is sent."
        return [
            {
                "tool": "send_email",
                "arguments": {**self.lead(number, index), "subject": "Our spring offer", "body_text": text},
            }
            for index in order
        ]

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
        self, number: int, target: UpstreamTarget, upstream_timeout_seconds: float
    ) -> AsyncIterator[tuple[Ledger, Upstream]]:
        """What one hail-guard process holds: its own ledger connection and its own connection to the sandbox."""
        async with (
            open_ledger(self.ledger_url(number), busy_timeout_seconds=self.options.busy_timeout_seconds) as ledger,
            connect_upstream(target, timeout_seconds=upstream_timeout_seconds, heartbeat_seconds=None) as upstream,
        ):
            yield ledger, upstream

    @asynccontextmanager
    async def worker(self, number: int, sandbox: Sandbox) -> AsyncIterator[Guard]:
        """A worker of the drill's own (in this process, whatever the transport) on the scenario's ledger."""
        target = UpstreamTarget(kind="inprocess", server=sandbox.server())
        async with self.connect(number, target, CALL_TIMEOUT_SECONDS) as (ledger, upstream):
            yield Guard(ledger, upstream, self.guard_settings(CALL_TIMEOUT_SECONDS))

    @asynccontextmanager
    async def rig(
        self,
        number: int,
        run: Run,
        sandbox: Sandbox,
        *,
        timeout_seconds: float = CALL_TIMEOUT_SECONDS,
        require_approval: bool = False,
        **guard: Any,
    ) -> AsyncIterator[Rig]:
        run.sandbox = sandbox
        async with AsyncExitStack() as stack:
            target = await self._upstream_target(stack, sandbox)
            ledger, upstream = await stack.enter_async_context(self.connect(number, target, timeout_seconds))
            settings = self.guard_settings(timeout_seconds, **guard)
            proxy = Proxy(ledger, upstream, settings, require_approval=require_approval, record_tools=False)
            await proxy.refresh_tools()
            if self.options.transport == "stdio":
                served = _Served(self, number, target, timeout_seconds, require_approval, guard)
                client = await stack.enter_async_context(served.client(stack))
            else:
                client = await stack.enter_async_context(Client(build_server(proxy), mode="legacy"))
            yield Rig(run, sandbox, ledger, upstream, proxy, client)

    async def _upstream_target(self, stack: AsyncExitStack, sandbox: Sandbox) -> UpstreamTarget:
        if self.options.transport == "inprocess":
            return UpstreamTarget(kind="inprocess", server=sandbox.server())
        token = secrets.token_urlsafe(16)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)  # runs first on the way out: the sandbox stops after the rig
        url: str = await tg.start(serve_http, sandbox, "127.0.0.1", 0, token)
        return UpstreamTarget(kind="http", url=url, token=token)


@dataclass
class _Served:
    """`hail-guard serve` as a user deploys it, spawned for one rig and configured by its environment."""

    drill: Drill
    number: int
    target: UpstreamTarget
    timeout_seconds: float
    require_approval: bool
    guard: Mapping[str, Any]

    def environment(self) -> dict[str, str]:
        options = self.drill.options
        env = {
            "HAIL_GUARD_LEDGER_URL": self.drill.ledger_url(self.number),
            "HAIL_GUARD_LEDGER_BUSY_TIMEOUT_SECONDS": str(options.busy_timeout_seconds),
            "HAIL_GUARD_UPSTREAM_URL": self.target.url or "",
            _SANDBOX_TOKEN_ENV: self.target.token or "",
            "HAIL_GUARD_UPSTREAM_TIMEOUT_SECONDS": str(self.timeout_seconds),
            "HAIL_GUARD_UPSTREAM_RECORD_TOOLS": "false",
            "HAIL_GUARD_GUARD_REQUIRE_APPROVAL": str(self.require_approval).lower(),
            "HAIL_GUARD_GUARD_DUPLICATE_WINDOW_HOURS": str(options.duplicate_window_hours),
            "HAIL_GUARD_DELIVERY_POLL": "false",
            "HAIL_GUARD_LOG_LEVEL": "info" if options.keep is not None else "error",
        }
        if "key_retention_hours" in self.guard:
            env["HAIL_GUARD_UPSTREAM_KEY_RETENTION_HOURS"] = str(self.guard["key_retention_hours"])
        unknown = set(self.guard) - {"key_retention_hours"}
        if unknown:
            raise ValueError(f"no serve setting for the guard options {sorted(unknown)}")
        return env

    def client(self, stack: AsyncExitStack) -> Client:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "hail_guard", "serve"],
            env=self.environment(),
            cwd=str(self.drill.folder),
        )
        return Client(stdio_client(params, errlog=self._log(stack)), mode="legacy")

    def _log(self, stack: AsyncExitStack) -> TextIO:
        """Where serve's stderr goes: a file kept with `--keep`, else nowhere."""
        if self.drill.options.keep is None:
            return stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
        path = self.drill.folder / f"scenario-{self.number:02d}-serve.log"
        return stack.enter_context(path.open("a", encoding="utf-8"))


def paraphrased(email: dict[str, Any]) -> dict[str, Any]:
    """The same email as an LLM rewords it when it writes the call again: near the same, not the same bytes."""
    body = email["body_text"].replace("this is", "this is just")
    return {**email, "subject": f"Re: {email['subject']}", "body_text": body}


def data(result: types.CallToolResult) -> dict[str, Any]:
    """An answer's JSON object (an error text that is not JSON comes back as `{"error": text}`)."""
    if isinstance(result.structured_content, dict):
        return result.structured_content
    value_text = text(result)
    try:
        value = json.loads(value_text)
    except ValueError:
        return {"error": value_text}
    return value if isinstance(value, dict) else {"error": value_text}


def text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


def view(result: types.CallToolResult, what: str) -> dict[str, Any]:
    """hail-guard's view of the operation a guarded call answered about."""
    found = data(result).get("hail_guard")
    if not isinstance(found, dict):
        raise CheckFailed(f"{what} answers with a hail-guard operation (got: {text(result)[:200]})")
    return found


def brief(tool: str, result: types.CallToolResult) -> str:
    """What an answer amounts to, in a few words: the operation's state, a batch's counts, or the refusal."""
    answer = data(result)
    found = answer.get("hail_guard")
    if isinstance(found, dict):
        return f"{found.get('state')}{' (from the ledger)' if found.get('replayed') else ''}"
    if result.is_error:
        fields = answer.get("differing_fields")
        reason = f"changed {', '.join(map(str, fields))}" if isinstance(fields, list) else _clause(answer)
        return f"{tool}: refused ({reason})"
    counts = answer.get("counts")
    if isinstance(counts, dict):
        return f"{tool}: " + ", ".join(f"{state} {count}" for state, count in sorted(counts.items()))
    cancelled = answer.get("cancelled_operations")
    return f"{tool}: cancelled {len(cancelled)}" if isinstance(cancelled, list) else tool


def _clause(answer: Mapping[str, Any]) -> str:
    """The first clause of an error text: enough to tell refusals apart in a report."""
    error = str(answer.get("error", "an error"))
    return error.split(";")[0].split(": ")[0].strip().rstrip(".")[:80]
