"""hail-guard's own tools, each declared once: its name, description, schema and annotations, and its handler.

`OWN` is the registry: the server lists these tools and answers a call to one by its entry, after
checking the arguments against the entry's schema. Every schema has one shape (`_tool`): an object of
the named properties and nothing else, answered by any object. The review queue's entries are offered
only with `[review] expose_to_agent = true` (`offered`). A guarded upstream tool is listed as the
upstream declares it, plus `allow_duplicate` and, for an upstream that takes no key, hail-guard's own
`idempotency_key` (`listed_as_guarded`).

A handler works with the `Context` the proxy that serves it gives: the ledger's roles it uses
(`AgentLedger`), the guard and the batches. It returns the MCP result (`views`); an error it raises is
answered by the server.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mcp import types

from hail_guard import recipients, review, views
from hail_guard.batch import Batches, Progress, sends_from_tool
from hail_guard.errors import BadInput
from hail_guard.guard import ALLOW_DUPLICATE, Guard
from hail_guard.ledger import OptOuts, Reviewing, Tracking, find_operation
from hail_guard.models import SUPPRESSION_CHANNELS, Operation, State, Suppression
from hail_guard.policy import REVIEW_RESOLUTIONS
from hail_guard.profiles import KEY_FIELD, ToolSpec

READS = types.ToolAnnotations(read_only_hint=True, idempotent_hint=True)
SETTLES = types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True)
"""Writes that are safe to repeat: calling again changes nothing more."""
RECORDS = types.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False)
SENDS_AGAIN = types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False)
_ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
_ID = {"type": "string", "minLength": 1}
_REASON = {"type": "string", "minLength": 1, "maxLength": 500}
_LIMIT = {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}
_ALLOW_DUPLICATE_SCHEMA = {
    "type": "boolean",
    "description": (
        "hail-guard: only when the user explicitly asked for a second copy of a message that was already "
        "delivered (default false). Never to retry: a retry is recognised and answered from the ledger."
    ),
}
_OWN_KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 255,
    "description": (
        "hail-guard: your own idempotency key for this send (optional; hail-guard derives one). The upstream "
        "takes no key: hail-guard records it and never forwards it."
    ),
}


class AgentLedger(Tracking, OptOuts, Reviewing, Protocol):
    """What hail-guard's own tools use of the ledger: operations and their delivery, opt-outs, the review queue."""


@dataclass(frozen=True)
class Context:
    """What a handler works with, given by the proxy that serves the call (`server.Proxy`)."""

    ledger: AgentLedger
    guard: Guard
    batches: Batches
    know_tools: Callable[[], Awaitable[None]]
    """List the upstream's tools if that was never done (a batch's sends are checked against them)."""
    region: str | None = None
    """Where a phone number without its country code is read (`[guard] default_region`)."""


Handler = Callable[[Context, dict[str, Any], Progress | None], Awaitable[types.CallToolResult]]


@dataclass(frozen=True)
class OwnTool:
    """One of hail-guard's own tools: what the agent is shown, and what answers a call."""

    tool: types.Tool
    run: Handler
    review: bool = False
    """Part of the review queue: offered only when the config exposes it to the agent."""


def _tool(
    name: str,
    description: str,
    properties: Mapping[str, Any],
    annotations: types.ToolAnnotations,
    *,
    required: Sequence[str] = (),
) -> types.Tool:
    """The one shape of our tools: an object of exactly `properties` in, any object out."""
    schema: dict[str, Any] = {"type": "object", "properties": dict(properties)}
    if required:
        schema["required"] = list(required)
    schema["additionalProperties"] = False
    return types.Tool(
        name=name, description=description, input_schema=schema, output_schema=_ANY_OBJECT, annotations=annotations
    )


def listed_as_guarded(tool: types.Tool, spec: ToolSpec) -> types.Tool:
    """A guarded upstream tool as the agent sees it: as declared, taking `allow_duplicate` and (where the
    upstream takes no key) hail-guard's own `idempotency_key`; its output schema, if it declares one, also
    admits what hail-guard answers besides the upstream's record (`hail_guard`, a failure's `error`)."""
    update: dict[str, Any] = {}
    properties = tool.input_schema.get("properties")
    if isinstance(properties, dict):
        added: dict[str, object] = {ALLOW_DUPLICATE: _ALLOW_DUPLICATE_SCHEMA}
        if not spec.forwards_key:
            added[KEY_FIELD] = _OWN_KEY_SCHEMA
        added = {name: schema for name, schema in added.items() if name not in properties}
        if added:
            update["input_schema"] = {**tool.input_schema, "properties": {**properties, **added}}
    output = tool.output_schema
    if output is not None and (output.get("required") or output.get("additionalProperties", True) is not True):
        update["output_schema"] = {
            **{name: value for name, value in output.items() if name != "required"},
            "additionalProperties": True,
        }
    return tool.model_copy(update=update) if update else tool


# --- the handlers --------------------------------------------------------------------------------------


async def _reconcile(context: Context, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
    target = await _find(context, arguments) if "operation_id" in arguments else None
    settled = await context.guard.reconcile(target.id if target is not None else None)
    return views.data_result({"reconciled": [views.operation_view(op) for op in settled], "count": len(settled)})


async def _get_operation(
    context: Context, arguments: dict[str, Any], progress: Progress | None
) -> types.CallToolResult:
    operation = await _find(context, arguments)
    events = await context.ledger.events(operation.id)
    history = [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]
    deliveries = views.delivery_view(await context.ledger.delivery_events(operation.id))
    return views.data_result({**views.operation_view(operation), "history": history, "delivery_events": deliveries})


async def _list_operations(
    context: Context, arguments: dict[str, Any], progress: Progress | None
) -> types.CallToolResult:
    state = State(arguments["state"]) if "state" in arguments else None
    operations = await context.ledger.list_operations(
        state=state, campaign_id=arguments.get("campaign_id"), limit=arguments.get("limit", 50)
    )
    return views.data_result({"operations": [views.operation_view(op) for op in operations], "count": len(operations)})


async def _plan_batch(context: Context, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
    await context.know_tools()
    sends = sends_from_tool(arguments["sends"])
    batch_id = await context.batches.plan(sends, name=arguments.get("name"), actor="agent")
    return views.data_result(views.batch_view(await context.batches.status(batch_id)))


async def _run_batch(context: Context, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
    await context.guard.wait_connected()
    concurrency = arguments.get("concurrency", 4)
    status = await context.batches.run(arguments["batch_id"], concurrency=concurrency, progress=progress)
    return views.data_result(views.batch_view(status))


async def _batch_status(context: Context, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
    return views.data_result(views.batch_view(await context.batches.status(arguments["batch_id"])))


async def _record_opt_out(
    context: Context, arguments: dict[str, Any], progress: Progress | None
) -> types.CallToolResult:
    channel = arguments.get("channel", "all")
    opt_out = Suppression(
        recipient=recipients.normalise_recipient(  # refuses an unreadable one
            arguments["recipient"], channel, region=context.region
        ),
        channel=channel,
        reason=arguments["reason"],
        source=arguments.get("source", "agent"),
    )
    cancelled = await context.ledger.add_suppression(opt_out, actor="agent")
    return views.data_result(
        {"recipient": opt_out.recipient, "channel": opt_out.channel, "cancelled_operations": cancelled}
    )


async def _review_list(context: Context, arguments: dict[str, Any], progress: Progress | None) -> types.CallToolResult:
    waiting = await context.ledger.list_operations(state=State.NEEDS_REVIEW, limit=arguments.get("limit", 50))
    return views.data_result({"operations": [views.operation_view(op) for op in waiting], "count": len(waiting)})


async def _review_resolve(
    context: Context, arguments: dict[str, Any], progress: Progress | None
) -> types.CallToolResult:
    resolved = await context.ledger.resolve_review(
        arguments["operation_id"],
        state=State(arguments["state"]),
        reason=arguments["reason"],
        actor="agent",
        provider_id=arguments.get("provider_id"),
    )
    return views.data_result(views.operation_view(resolved))


async def _review_resend(
    context: Context, arguments: dict[str, Any], progress: Progress | None
) -> types.CallToolResult:
    resent = await review.resend(
        context.ledger, context.guard, arguments["operation_id"], reason=arguments["reason"], actor="agent"
    )
    return views.data_result(views.operation_view(resent))


async def _find(context: Context, arguments: Mapping[str, Any]) -> Operation:
    """The operation named by `operation_id` or `idempotency_key` (either takes an id or a key)."""
    reference = arguments.get("operation_id", arguments.get("idempotency_key"))
    if reference is None:
        raise BadInput("give operation_id or idempotency_key")
    return await find_operation(context.ledger, reference)


# --- the registry ----------------------------------------------------------------------------------------

_SEND = {
    "type": "object",
    "properties": {"tool": {"type": "string"}, "arguments": {"type": "object"}},
    "required": ["tool", "arguments"],
}
_ENTRIES = (
    OwnTool(
        _tool(
            "reconcile",
            "Settle sends whose outcome is unknown (a timeout or a dropped connection after {upstream} may have "
            "accepted them). Replays the SAME idempotency key with the SAME request, so {upstream} answers with "
            "what it saved and nothing is sent twice. Give operation_id for one, or nothing for all that are due.",
            {"operation_id": _ID},
            SETTLES,
        ),
        _reconcile,
    ),
    OwnTool(
        _tool(
            "get_operation",
            "Show one guarded send (state, {upstream}'s id, attempts, history, and delivery: what happened after "
            "{upstream} accepted it, with times) by operation_id or idempotency_key.",
            {"operation_id": _ID, "idempotency_key": _ID},
            READS,
        ),
        _get_operation,
    ),
    OwnTool(
        _tool(
            "list_operations",
            "List guarded sends, newest first, optionally by state or campaign.",
            {
                "state": {"type": "string", "enum": [state.value for state in State]},
                "campaign_id": _ID,
                "limit": _LIMIT,
            },
            READS,
        ),
        _list_operations,
    ),
    OwnTool(
        _tool(
            "plan_batch",
            "Record many sends at once as a batch; nothing is sent yet. Each send is {tool, arguments} "
            "exactly as for the tool itself and gets its own idempotency key. Returns the batch_id for "
            "run_batch. With approval required, an operator approves it first (`hail-guard batch approve`).",
            {"sends": {"type": "array", "minItems": 1, "items": _SEND}, "name": {"type": "string", "maxLength": 200}},
            RECORDS,
            required=["sends"],
        ),
        _plan_batch,
    ),
    OwnTool(
        _tool(
            "run_batch",
            "Send a planned batch: first settles its unknown sends, then sends what is ready with bounded "
            "concurrency. Safe to call again at any time: it continues where it stopped and never resends.",
            {"batch_id": _ID, "concurrency": {"type": "integer", "minimum": 1, "maximum": 64, "default": 4}},
            SETTLES,
            required=["batch_id"],
        ),
        _run_batch,
    ),
    OwnTool(
        _tool(
            "batch_status",
            "Counts by state for a batch, and the sends still unresolved.",
            {"batch_id": _ID},
            READS,
            required=["batch_id"],
        ),
        _batch_status,
    ),
    OwnTool(
        _tool(
            "record_opt_out",
            "Record that a recipient opted out (email address or phone number). Every send to them that "
            "has not been forwarded is cancelled, and no later send reaches them.",
            {
                "recipient": {"type": "string", "minLength": 1, "maxLength": 320},
                "channel": {"type": "string", "enum": list(SUPPRESSION_CHANNELS), "default": "all"},
                "reason": _REASON,
                "source": {"type": "string", "minLength": 1, "maxLength": 200, "default": "agent"},
            },
            SETTLES,
            required=["recipient", "reason"],
        ),
        _record_opt_out,
    ),
    OwnTool(
        _tool(
            "review_list",
            "List the sends waiting for a human decision (needs_review), with the reason each one waits.",
            {"limit": _LIMIT},
            READS,
        ),
        _review_list,
        review=True,
    ),
    OwnTool(
        _tool(
            "review_resolve",
            "Record what became of a send in review, as established outside hail-guard (e.g. in {upstream}'s "
            "console): accepted (give provider_id when known), failed, or cancelled. Sends nothing.",
            {
                "operation_id": _ID,
                "state": {"type": "string", "enum": [state.value for state in REVIEW_RESOLUTIONS]},
                "reason": _REASON,
                "provider_id": _ID,
            },
            RECORDS,
            required=["operation_id", "state", "reason"],
        ),
        _review_resolve,
        review=True,
    ),
    OwnTool(
        _tool(
            "review_resend",
            "Send a message in review AGAIN as a new operation under a new key (<key>:resend:<n>), and close "
            "the old one as superseded. The earlier attempt may have reached the recipient: only when sure.",
            {"operation_id": _ID, "reason": _REASON},
            SENDS_AGAIN,
            required=["operation_id", "reason"],
        ),
        _review_resend,
        review=True,
    ),
)
OWN: Mapping[str, OwnTool] = {entry.tool.name: entry for entry in _ENTRIES}
"""hail-guard's own tools by name, in the order they are listed."""


def offered(*, review: bool, upstream: str = "Hail") -> dict[str, OwnTool]:
    """The own tools an agent is offered, their descriptions naming the upstream `upstream` (the profile's
    display name): the review queue's only when `review` (it is exposed)."""
    return dict(_offered(review, upstream))


@functools.cache
def _offered(review: bool, upstream: str) -> tuple[tuple[str, OwnTool], ...]:
    """`offered`, made once per upstream name (every call routes through it)."""
    return tuple((name, _named(entry, upstream)) for name, entry in OWN.items() if review or not entry.review)


def _named(entry: OwnTool, upstream: str) -> OwnTool:
    description = (entry.tool.description or "").replace("{upstream}", upstream)
    return dataclasses.replace(entry, tool=entry.tool.model_copy(update={"description": description}))
