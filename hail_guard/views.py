"""How results look, the same to an agent, an operator and the console: an operation, its stored request
(secrets redacted), its deliveries, a batch; and the MCP results built from them.

The server answers tools with `data_result` / `error_result` over these views; the command line
(`ops show`, `ops export`, `batch status`...) and the console print the same views, so a field means
the same wherever it is read. Texts for agents come from `policy` (`next_step`, headlines, failures).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mcp import types

from hail_guard import policy
from hail_guard.models import BatchStatus, DeliveryEvent, Operation, State

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet reads as the start of a formula (OWASP's list): a CSV cell beginning so is shown as text."""
SECRET_ARGUMENTS = frozenset({"api_key", "apikey", "access_token", "token", "secret", "client_secret", "password"})
"""Argument names (at any depth) whose values are shown `[redacted]`: `place_call`'s `llm.api_key`, for one."""
REDACTED = "[redacted]"


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
        "next_step": policy.next_step(operation),
    }
    if operation.not_before is not None:
        view["not_before"] = operation.not_before.isoformat()
    for link in ("resend_of", "resent_as"):
        if getattr(operation, link) is not None:
            view[link] = getattr(operation, link)
    if replayed is not None:
        view["replayed"] = replayed
    return view


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
    held = [
        {
            "operation_id": held.operation.id,
            "recipients": held.operation.recipients,
            "held_by": held.held_by.id,
            "held_by_state": held.held_by.state.value,
        }
        for held in status.held
    ]
    return {
        "batch_id": status.batch_id,
        "name": status.name,
        "total": status.total,
        "counts": {state.value: count for state, count in status.counts.items()},
        "unresolved": unresolved,
        "held": held,
        "next_step": _batch_step(status),
    }


def _batch_step(status: BatchStatus) -> str:
    if status.held:
        return (
            f"{len(status.held)} ready send(s) wait while another send to the same recipient (or lead) is unresolved "
            "(`held`): settle those (reconcile, or a human), and run_batch sends them; the rest goes meanwhile"
        )
    if status.counts.get(State.READY) or status.unresolved:
        return "run_batch sends what is ready; unresolved sends are settled by reconcile or a human"
    return "nothing left to send"


def csv_cell(value: Any) -> str:
    """A value as a CSV cell that a spreadsheet shows as text, never runs (`ops export`, the console's export):
    a list joined by `;`, None empty, and a cell that begins like a formula prefixed with `'` (OWASP's way), so
    a key, metadata or recipient such as `=HYPERLINK(...)` or `+15550100` opens as the text it is."""
    if value is None:
        return ""
    text = ";".join(str(item) for item in value) if isinstance(value, list | tuple) else str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def data_result(data: Mapping[str, Any]) -> types.CallToolResult:
    """A tool's answer: `data` as structured content and as its JSON text."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(data, default=str))],
        structured_content=dict(data),
    )


def error_result(message: str, extra: Mapping[str, Any] | None = None) -> types.CallToolResult:
    """A tool's refusal or failure: `message` as its text, and as `error` beside `extra`."""
    data = {"error": message, **(extra or {})}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], structured_content=data, is_error=True
    )
