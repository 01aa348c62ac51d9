"""The downstream MCP server: Hail's tools re-exposed, guarded ones routed through the guard.

Upstream tools pass through verbatim (names, descriptions, schemas, annotations, results). Tools
that take an idempotency key go through `Guard.send`; hail-guard adds its own tools (`reconcile`,
`get_operation`, `list_operations`, batches, opt-outs; the review queue only when the config exposes
it). This is the only module that turns our errors into MCP results.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from mcp import types
from mcp.server import Server, ServerRequestContext

from hail_guard import __version__, keys, policy, recipients, review
from hail_guard.batch import Batches, Progress, sends_from_tool
from hail_guard.errors import (
    BadInput,
    RefusedByPolicy,
    UpstreamError,
)
from hail_guard.guard import ALLOW_DUPLICATE, Guard, SendReport
from hail_guard.ledger import find_operation
from hail_guard.models import (
    SUPPRESSION_CHANNELS,
    BatchStatus,
    DeliveryEvent,
    Operation,
    State,
    Suppression,
)

log = structlog.get_logger(__name__)

_ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
_BATCH_TOOLS = frozenset({"plan_batch", "run_batch", "batch_status", "record_opt_out"})
_STATE_NAMES = [state.value for state in State]
OWN_TOOLS: tuple[types.Tool, ...] = (
    types.Tool(
        name="reconcile",
        description=(
            "Settle sends whose outcome is unknown (a timeout or a dropped connection after Hail may have "
            "accepted them). Replays the SAME idempotency key with the SAME request, so Hail answers with "
            "what it saved and nothing is sent twice. Give operation_id for one, or nothing for all that are due."
        ),
        input_schema={
            "type": "object",
            "properties": {"operation_id": {"type": "string", "minLength": 1}},
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True),
    ),
    types.Tool(
        name="get_operation",
        description=(
            "Show one guarded send (state, Hail's id, attempts, history, and delivery: what happened after Hail "
            "accepted it, with times) by operation_id or idempotency_key."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "operation_id": {"type": "string", "minLength": 1},
                "idempotency_key": {"type": "string", "minLength": 1},
            },
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    ),
    types.Tool(
        name="list_operations",
        description="List guarded sends, newest first, optionally by state or campaign.",
        input_schema={
            "type": "object",
            "properties": {
                "state": {"type": "string", "enum": _STATE_NAMES},
                "campaign_id": {"type": "string", "minLength": 1},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50},
            },
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    ),
)
_RECIPIENT = {"type": "string", "minLength": 1, "maxLength": 320}
OWN_TOOLS += (
    types.Tool(
        name="plan_batch",
        description=(
            "Record many sends at once as a batch; nothing is sent yet. Each send is {tool, arguments} "
            "exactly as for the tool itself and gets its own idempotency key. Returns the batch_id for "
            "run_batch. With approval required, an operator approves it first (`hail-guard batch approve`)."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "sends": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {"tool": {"type": "string"}, "arguments": {"type": "object"}},
                        "required": ["tool", "arguments"],
                    },
                },
                "name": {"type": "string", "maxLength": 200},
            },
            "required": ["sends"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False),
    ),
    types.Tool(
        name="run_batch",
        description=(
            "Send a planned batch: first settles its unknown sends, then sends what is ready with bounded "
            "concurrency. Safe to call again at any time: it continues where it stopped and never resends."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "batch_id": {"type": "string", "minLength": 1},
                "concurrency": {"type": "integer", "minimum": 1, "maximum": 64, "default": 4},
            },
            "required": ["batch_id"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True),
    ),
    types.Tool(
        name="batch_status",
        description="Counts by state for a batch, and the sends still unresolved.",
        input_schema={
            "type": "object",
            "properties": {"batch_id": {"type": "string", "minLength": 1}},
            "required": ["batch_id"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    ),
    types.Tool(
        name="record_opt_out",
        description=(
            "Record that a recipient opted out (email address or phone number). Every send to them that "
            "has not been forwarded is cancelled, and no later send reaches them."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "recipient": _RECIPIENT,
                "channel": {"type": "string", "enum": list(SUPPRESSION_CHANNELS), "default": "all"},
                "reason": {"type": "string", "minLength": 1, "maxLength": 500},
                "source": {"type": "string", "minLength": 1, "maxLength": 200, "default": "agent"},
            },
            "required": ["recipient", "reason"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True),
    ),
)
_OWN = {tool.name: tool for tool in OWN_TOOLS}
_OPERATION_ID = {"type": "string", "minLength": 1}
_REASON = {"type": "string", "minLength": 1, "maxLength": 500}
REVIEW_TOOLS: tuple[types.Tool, ...] = (
    types.Tool(
        name="review_list",
        description="List the sends waiting for a human decision (needs_review), with the reason each one waits.",
        input_schema={
            "type": "object",
            "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}},
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    ),
    types.Tool(
        name="review_resolve",
        description=(
            "Record what became of a send in review, as established outside hail-guard (e.g. in Hail's "
            "console): accepted (give provider_id when known), failed, or cancelled. Sends nothing."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "operation_id": _OPERATION_ID,
                "state": {"type": "string", "enum": [state.value for state in policy.REVIEW_RESOLUTIONS]},
                "reason": _REASON,
                "provider_id": {"type": "string", "minLength": 1},
            },
            "required": ["operation_id", "state", "reason"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False),
    ),
    types.Tool(
        name="review_resend",
        description=(
            "Send a message in review AGAIN as a new operation under a new key (<key>:resend:<n>), and close "
            "the old one as superseded. The earlier attempt may have reached the recipient: only when sure."
        ),
        input_schema={
            "type": "object",
            "properties": {"operation_id": _OPERATION_ID, "reason": _REASON},
            "required": ["operation_id", "reason"],
            "additionalProperties": False,
        },
        output_schema=_ANY_OBJECT,
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False),
    ),
)
_REVIEW = {tool.name: tool for tool in REVIEW_TOOLS}
_ALLOW_DUPLICATE_SCHEMA = {
    "type": "boolean",
    "description": (
        "hail-guard: only when the user explicitly asked for a second copy of a message that was already "
        "delivered (default false). Never to retry: a retry is recognised and answered from the ledger."
    ),
}


class UpstreamTools(Protocol):
    @property
    def connected(self) -> bool:
        """True while a connection to Hail is up (readiness probes read it)."""

    @property
    def sign_in_problem(self) -> str | None:
        """Why an operator must run `hail-guard login` before anything is sent; None: no need."""

    async def list_tools(self) -> list[types.Tool]: ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, timeout_seconds: float | None = None
    ) -> types.CallToolResult: ...


class CallObserver(Protocol):
    """Told about every tool call the proxy serves (metrics); must not raise or block."""

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None: ...


@dataclass
class Proxy:
    """Everything one hail-guard server needs; shared by all its sessions."""

    guard: Guard
    upstream: UpstreamTools
    guarded_tools: Sequence[str] | None = None
    """Tools to guard; None: every tool whose schema takes an idempotency key."""
    require_approval: bool = False
    observer: CallObserver | None = None
    pin_tools: bool = False
    """Refuse a guarded tool whose name, description or schemas changed since it was accepted."""
    expose_review: bool = False
    """Offer the review queue to the agent (`[review] expose_to_agent`)."""
    record_tools: bool = True
    """Record the upstream's tools in the ledger, for pinning; off for the drill, whose sandbox is not Hail."""
    tools: dict[str, types.Tool] = field(default_factory=dict)
    """The upstream's tools, verbatim."""
    guarded: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)
    """Upstream tools that differ from what was accepted (`hail-guard upstream accept`)."""
    _fingerprints: dict[str, str] = field(default_factory=dict)
    batches: Batches = field(init=False)

    def __post_init__(self) -> None:
        self.batches = Batches(self.guard, self.guarded_schema, require_approval=self.require_approval)

    def guarded_schema(self, name: str) -> dict[str, Any] | None:
        tool = self.tools.get(name) if name in self.guarded else None
        return dict(tool.input_schema) if tool is not None else None

    def listed_tools(self) -> list[types.Tool]:
        """What the agent sees: upstream tools verbatim (guarded ones also take allow_duplicate), then ours."""
        return [self._as_listed(tool) for tool in self.tools.values()] + list(self.own_tools().values())

    def own_tools(self) -> dict[str, types.Tool]:
        """hail-guard's own tools, the review queue included when it is exposed."""
        return {**_OWN, **_REVIEW} if self.expose_review else _OWN

    def _as_listed(self, tool: types.Tool) -> types.Tool:
        properties = tool.input_schema.get("properties")
        if tool.name not in self.guarded or not isinstance(properties, dict) or ALLOW_DUPLICATE in properties:
            return tool
        schema = {**tool.input_schema, "properties": {**properties, ALLOW_DUPLICATE: _ALLOW_DUPLICATE_SCHEMA}}
        return tool.model_copy(update={"input_schema": schema})

    async def refresh_tools(self) -> None:
        try:
            listed = await self.upstream.list_tools()
        except UpstreamError as exc:
            log.warning("upstream_tools_unavailable", error=str(exc))
            return
        own = self.own_tools()
        shadowed = [tool.name for tool in listed if tool.name in own]
        if shadowed:
            log.warning("upstream_tools_shadowed", tools=shadowed)
        self.tools = {tool.name: tool for tool in listed if tool.name not in own}
        schemas = {name: tool.input_schema for name, tool in self.tools.items()}
        self.guarded = policy.guarded_tool_names(schemas, self.guarded_tools) & set(self.tools)
        self.guard.tool_schemas = {name: schemas[name] for name in self.guarded}
        await self._observe(self.tools)

    async def _observe(self, tools: Mapping[str, types.Tool]) -> None:
        """Compare each tool with what was accepted; the ledger is written only when something moved."""
        if not self.record_tools:
            return
        fingerprints = {name: tool_fingerprint(tool) for name, tool in tools.items()}
        if fingerprints == self._fingerprints:
            return
        pins = await self.guard.ledger.observe_tools(fingerprints)
        self._fingerprints = fingerprints
        self.changed = {pin.name for pin in pins if pin.changed and pin.name in fingerprints}
        if self.changed:
            log.warning("upstream_tools_changed", tools=sorted(self.changed), refused=self.pin_tools)

    def input_schema(self, name: str) -> dict[str, Any] | None:
        tool = self.own_tools().get(name) or self.tools.get(name)
        return dict(self._as_listed(tool).input_schema) if tool is not None else None

    async def call(
        self, name: str, arguments: dict[str, Any], progress: Progress | None = None
    ) -> types.CallToolResult:
        """One tool call, with every error of ours turned into a clear MCP result; observed."""
        started, outcome = time.monotonic(), "cancelled"
        try:
            with structlog.contextvars.bound_contextvars(tool=name):
                result = await self._call(name, arguments, progress)
            outcome = call_outcome(result)
            return result
        finally:
            if self.observer is not None:
                known = name in self.own_tools() or name in self.tools
                self.observer.tool_called(name if known else "unknown", outcome, time.monotonic() - started)

    async def _call(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
        try:
            if name in self.own_tools():
                return await self._own(name, arguments, progress)
            if not self.tools:
                await self.refresh_tools()
            if name in self.guarded:
                await self._refuse_if_changed(name)
                report = await self.guard.send(name, arguments, self.tools[name].input_schema)
                return _send_result(report)
            if name in self.tools:
                return await self.upstream.call_tool(
                    name, arguments, timeout_seconds=self.guard.settings.timeout_seconds
                )
            return _error(f"unknown tool {name!r}; list the tools to see what hail-guard offers")
        except Exception as exc:  # the per-call boundary: every error becomes an answer; cancellation passes
            failure = policy.failure_of(exc)
            if failure.crashed:
                log.exception("call_crashed", tool=name)
            elif failure.logged:
                log.error("call_failed", tool=name, error=str(exc))  # the operator's detail; the agent's may be generic
            return _error(failure.message, failure.details)

    async def _refuse_if_changed(self, name: str) -> None:
        if not (self.pin_tools and name in self.changed):
            return
        pins = await self.guard.ledger.tool_pins()  # an operator may have accepted it since
        self.changed = {pin.name for pin in pins if pin.changed and pin.name in self._fingerprints}
        if name in self.changed:
            raise RefusedByPolicy(
                f"the upstream changed {name} (its description or schema) since it was accepted; nothing was "
                f"sent. An operator reviews the change and runs `hail-guard upstream accept {name}`"
            )

    async def _own(self, name: str, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
        policy.validate_arguments(name, arguments, self.own_tools()[name].input_schema)
        await self.guard.ledger.expire_leases()  # what the agent sees is what is true now
        if name in _BATCH_TOOLS:
            return await self._batch_tool(name, arguments, progress)
        if name in _REVIEW:
            return await self._review_tool(name, arguments)
        if name == "reconcile":
            target = await self._find(arguments) if "operation_id" in arguments else None
            settled = await self.guard.reconcile(target.id if target is not None else None)
            return _data({"reconciled": [operation_view(op) for op in settled], "count": len(settled)})
        if name == "get_operation":
            operation = await self._find(arguments)
            events = await self.guard.ledger.events(operation.id)
            history = [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]
            deliveries = await self.guard.ledger.delivery_events(operation.id)
            return _data(
                {**operation_view(operation), "history": history, "delivery_events": delivery_view(deliveries)}
            )
        state = State(arguments["state"]) if "state" in arguments else None
        operations = await self.guard.ledger.list_operations(
            state=state, campaign_id=arguments.get("campaign_id"), limit=arguments.get("limit", 50)
        )
        return _data({"operations": [operation_view(op) for op in operations], "count": len(operations)})

    async def _batch_tool(
        self, name: str, arguments: dict[str, Any], progress: Progress | None
    ) -> types.CallToolResult:
        if name == "plan_batch":
            if not self.tools:
                await self.refresh_tools()
            sends = sends_from_tool(arguments["sends"])
            batch_id = await self.batches.plan(sends, name=arguments.get("name"), actor="agent")
            return _data(batch_view(await self.guard.ledger.batch_status(batch_id)))
        if name == "run_batch":
            await self.guard.upstream.wait_connected()
            status = await self.batches.run(
                arguments["batch_id"], concurrency=arguments.get("concurrency", 4), progress=progress
            )
            return _data(batch_view(status))
        if name == "batch_status":
            return _data(batch_view(await self.guard.ledger.batch_status(arguments["batch_id"])))
        channel = arguments.get("channel", "all")
        opt_out = Suppression(
            recipient=recipients.normalise_recipient(arguments["recipient"], channel),  # refuses an unreadable one
            channel=channel,
            reason=arguments["reason"],
            source=arguments.get("source", "agent"),
        )
        cancelled = await self.guard.ledger.add_suppression(opt_out, actor="agent")
        return _data(
            {
                "recipient": opt_out.recipient,
                "channel": opt_out.channel,
                "cancelled_operations": cancelled,
            }
        )

    async def _review_tool(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """The review queue, offered to the agent only with `[review] expose_to_agent = true`."""
        if name == "review_list":
            waiting = await self.guard.ledger.list_operations(
                state=State.NEEDS_REVIEW, limit=arguments.get("limit", 50)
            )
            return _data({"operations": [operation_view(op) for op in waiting], "count": len(waiting)})
        if name == "review_resolve":
            resolved = await self.guard.ledger.resolve_review(
                arguments["operation_id"],
                state=State(arguments["state"]),
                reason=arguments["reason"],
                actor="agent",
                provider_id=arguments.get("provider_id"),
            )
            return _data(operation_view(resolved))
        resent = await review.resend(self.guard, arguments["operation_id"], reason=arguments["reason"], actor="agent")
        return _data(operation_view(resent))

    async def _find(self, arguments: Mapping[str, Any]) -> Operation:
        """The operation named by `operation_id` or `idempotency_key` (either takes an id or a key)."""
        reference = arguments.get("operation_id", arguments.get("idempotency_key"))
        if reference is None:
            raise BadInput("give operation_id or idempotency_key")
        return await find_operation(self.guard.ledger, reference)


def tool_fingerprint(tool: types.Tool) -> str:
    """What pinning compares: name, description and schemas."""
    shape = {
        "name": tool.name,
        "description": tool.description,
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema,
    }
    return keys.fingerprint(keys.canonical_json(shape))


def build_server(proxy: Proxy) -> Server[Any]:
    """A low-level MCP server over `proxy` (one per session on stdio; the proxy may be shared)."""

    async def on_list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        await proxy.refresh_tools()
        return types.ListToolsResult(tools=proxy.listed_tools())

    async def on_call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        async def progress(done: int, total: int | None) -> None:
            await ctx.session.report_progress(done, total, f"{done} sent")

        return await proxy.call(params.name, dict(params.arguments or {}), progress)

    return Server(
        "hail-guard",
        version=__version__,
        instructions=(
            "hail-guard stands in front of Hail: sends are recorded before they are forwarded and never "
            "sent twice. When a send's outcome is unknown, do NOT resend it: call `reconcile`."
        ),
        get_tool_input_schema=proxy.input_schema,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )


def call_outcome(result: types.CallToolResult) -> str:
    """A guarded send's state (or `replayed`), else `ok` / `error`: a small, fixed set of labels."""
    data = result.structured_content if isinstance(result.structured_content, dict) else {}
    view = data.get("hail_guard")
    if isinstance(view, dict) and isinstance(view.get("state"), str):
        return "replayed" if view.get("replayed") else str(view["state"])
    return "error" if result.is_error else "ok"


next_step = policy.next_step


def operation_view(operation: Operation, *, replayed: bool | None = None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "operation_id": operation.id,
        "idempotency_key": operation.idempotency_key,
        "state": operation.state.value,
        "tool": operation.tool,
        "recipients": operation.recipients,
        "provider_id": operation.provider_id,
        "attempts": operation.attempts,
        "last_error": operation.last_error,
        "review_reason": operation.review_reason,
        "cancel_reason": operation.cancel_reason,
        "may_have_left": operation.may_have_left,
        "delivery_state": operation.delivery_state.value if operation.delivery_state else None,
        "delivery_at": operation.delivery_at.isoformat() if operation.delivery_at else None,
        "created_at": operation.created_at.isoformat(),
        "updated_at": operation.updated_at.isoformat(),
        "next_step": next_step(operation),
    }
    if operation.not_before is not None:
        view["not_before"] = operation.not_before.isoformat()
    for link in ("resend_of", "resent_as"):
        if getattr(operation, link) is not None:
            view[link] = getattr(operation, link)
    if replayed is not None:
        view["replayed"] = replayed
    return view


SECRET_ARGUMENTS = frozenset({"api_key", "apikey", "access_token", "token", "secret", "client_secret", "password"})
"""Argument names (at any depth) whose values are shown `[redacted]`: `place_call`'s `llm.api_key`, for one."""
REDACTED = "[redacted]"


def request_view(operation: Operation) -> dict[str, Any]:
    """The stored request as every view shows it (`ops show`, `ops export`): secrets the upstream needs in
    clear, such as `llm.api_key`, are stored so that a replay sends the same request, and shown redacted."""
    return {name: _redacted(name, value) for name, value in operation.arguments().items()}


def _redacted(name: str | None, value: Any) -> Any:
    if name is not None and name.lower() in SECRET_ARGUMENTS:
        return REDACTED
    if isinstance(value, Mapping):
        return {key: _redacted(key, item) for key, item in value.items()}
    return [_redacted(None, item) for item in value] if isinstance(value, list) else value


def delivery_view(events: Sequence[DeliveryEvent]) -> list[dict[str, Any]]:
    """Delivery events as the agent and the operator see them: state, when it happened, where it was learnt."""
    return [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]


def batch_view(status: BatchStatus) -> dict[str, Any]:
    unresolved = [operation_view(op) for op in status.unresolved]
    return {
        "batch_id": status.batch_id,
        "name": status.name,
        "total": status.total,
        "counts": {state.value: count for state, count in status.counts.items()},
        "unresolved": unresolved,
        "next_step": (
            "run_batch sends what is ready; unresolved sends are settled by reconcile or a human"
            if status.counts.get(State.READY) or unresolved
            else "nothing left to send"
        ),
    }


def _send_result(report: SendReport) -> types.CallToolResult:
    operation = report.operation
    guard_view = {
        key: value
        for key, value in operation_view(operation, replayed=report.replayed).items()
        if key in {"operation_id", "idempotency_key", "state", "replayed", "next_step", "not_before"}
    }
    if operation.state is State.ACCEPTED:
        return _data({**(operation.result or {}), "hail_guard": guard_view})
    if operation.state is State.FAILED:
        payload = operation.result if operation.result is not None else {"error": operation.last_error}
        return _data({**payload, "hail_guard": guard_view})
    return _error(
        f"{policy.headline(operation)} {policy.sentence(guard_view['next_step'])}.", {"hail_guard": guard_view}
    )


def _data(data: Mapping[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(data, default=str))],
        structured_content=dict(data),
    )


def _error(message: str, extra: Mapping[str, Any] | None = None) -> types.CallToolResult:
    data = {"error": message, **(extra or {})}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], structured_content=data, is_error=True
    )
