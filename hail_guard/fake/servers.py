"""Hand-written fakes of real MCP servers, from their public tool schemas (written anew; no code copied).

- Resend's MCP (`resend/resend-mcp` 2.22.0): `send-email` and `send-batch-emails` with an optional
  `idempotencyKey` (1 to 256 characters; the same key and body answer the first send's id again, another body
  is a 409 `invalid_idempotent_request`), `send-broadcast` and `send-event` (no key), no annotations on them;
  answers in words: `Email sent successfully! {"id":"..."}`; `get-email` (by `id`), `get-broadcast` and
  `list-emails` (no filters: `limit`, newest first, one line a message) read back; failures are isError
  `Email failed to send: {"statusCode":...,"message":...,"name":...}`. (The real package itself runs in the
  tests too, in front of a fake of Resend's REST API: `tests/end_to_end/test_resend_mcp.py`.)
- AgentMail's hosted MCP (`agentmail-to/agentmail-mcp`, tools from the Node `agentmail-toolkit`):
  `send_message` (`inboxId`, `to`, `cc`, `bcc`, `subject`, `text`, `html`, ...; no key), `reply_to_message`,
  `forward_message` and `send_draft` answer `{messageId, threadId}`; `get_message` (`inboxId`, `messageId`)
  and `list_messages` (`inboxId`, `to`, `labels`, `after`, ... all of them must match) read back; failures
  are isError `<message> (HTTP <status>)`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from mcp import types

from hail_guard.fake.surfaces import Get, Lister, Record, Send, Surface, isError, structured
from hail_guard.sandbox.answers import Answer, Reply

_STRINGS = {"type": "array", "items": {"type": "string"}}
_EMAILS = {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 50}
_RESEND_NAMES = {
    400: "invalid_idempotency_key",
    401: "missing_api_key",
    403: "invalid_api_key",
    409: "invalid_idempotent_request",
    422: "validation_error",
    429: "rate_limit_exceeded",
}

_RESEND_SEND = {
    "to": _EMAILS,
    "subject": {"type": "string", "description": "Email subject line"},
    "text": {"type": "string", "description": "Plain text email content"},
    "html": {"type": "string"},
    "cc": _STRINGS,
    "bcc": _STRINGS,
    "from": {"type": "string", "minLength": 1, "description": "Sender, e.g. Acme <onboarding@resend.com>"},
    "replyTo": _STRINGS,
    "scheduledAt": {"type": "string"},
    "attachments": {"type": "array", "items": {"type": "object"}},
    "tags": {"type": "array", "items": {"type": "object"}},
    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
    "idempotencyKey": {"type": "string", "minLength": 1, "maxLength": 256, "description": "Idempotency key"},
}


_RESEND_BATCH = {
    "emails": {
        "type": "array",
        "minItems": 1,
        "maxItems": 100,
        "items": {
            "type": "object",
            "properties": {
                name: _RESEND_SEND[name] for name in ("to", "subject", "text", "html", "from", "replyTo", "cc", "bcc")
            },
            "required": ["to", "subject", "text"],
        },
    },
    "idempotencyKey": _RESEND_SEND["idempotencyKey"],
}
_RESEND_BROADCAST = {"broadcastId": {"type": "string"}, "scheduledAt": {"type": "string"}}
_RESEND_EVENT = {
    "event": {"type": "string"},
    "contactId": {"type": "string"},
    "email": {"type": "string", "format": "email"},
    "payload": {"type": "object"},
}


def resend() -> Surface:
    reads = types.ToolAnnotations(read_only_hint=True)
    tools = (
        _tool("send-email", "Send Email", _RESEND_SEND, ["to", "subject", "text", "from"], None),
        _tool("send-batch-emails", "Send Batch Emails", _RESEND_BATCH, ["emails"], None),
        _tool("send-broadcast", "Send Broadcast", _RESEND_BROADCAST, ["broadcastId"], None),
        _tool("send-event", "Send Event", _RESEND_EVENT, ["event"], None),
        _tool("get-broadcast", "Get Broadcast", {"broadcastId": {"type": "string"}}, ["broadcastId"], reads),
        _tool("get-email", "Get Email", {"id": {"type": "string"}}, ["id"], types.ToolAnnotations(read_only_hint=True)),
        _tool(
            "list-emails",
            "List Emails",
            {
                "limit": {"type": "number", "minimum": 1, "maximum": 100},
                "after": {"type": "string"},
                "before": {"type": "string"},
            },
            [],
            types.ToolAnnotations(read_only_hint=True),
        ),
    )
    return Surface(
        "resend",
        tools,
        _resend_error,
        sends={
            "send-email": Send(_resend_sent, key="idempotencyKey", recipients=("to", "cc", "bcc")),
            "send-batch-emails": Send(_resend_batch, key="idempotencyKey", recipients=("emails",)),
            "send-broadcast": Send(_resend_broadcast, recipients=("broadcastId",), id_field="broadcastId"),
            "send-event": Send(_resend_event, recipients=("email", "contactId")),
        },
        gets={
            "get-email": Get("id", _resend_details),
            "get-broadcast": Get("broadcastId", _resend_broadcast_details, "broadcastId"),
        },
        lists={"list-emails": Lister(_resend_list)},
    )


def _resend_sent(record: Record) -> Answer:
    return Reply({}, text="Email sent successfully! " + json.dumps({"id": record["id"]}, separators=(",", ":")))


def _resend_batch(record: Record) -> Answer:
    return Reply({}, text=f"Batch sent successfully! {len(record['emails'])} email(s) queued.\nIDs: {record['id']}")


def _resend_broadcast(record: Record) -> Answer:
    return Reply({}, text=f"Broadcast sent successfully.\nID: {record['broadcastId']}")


def _resend_broadcast_details(record: Record | None, wanted: str) -> Answer:
    if record is None:
        return isError(f'Failed to get broadcast: {{"statusCode":404,"name":"not_found","message":"{wanted}"}}')
    return Reply({}, text=f"ID: {record['broadcastId']}\nName: broadcast\nStatus: sent")


def _resend_event(record: Record) -> Answer:
    contact = record.get("contactId") or record.get("email")
    return Reply({}, text=f'Event "{record["event"]}" sent successfully.\nContact: {contact}')


def _resend_time(record: Record) -> str:
    return str(record["created_at"]).replace("T", " ").removesuffix(":00")  # Resend's: 2026-07-10 12:34:56.7+00


def _resend_details(record: Record | None, wanted: str) -> Answer:
    if record is None:
        return isError(f"Email with ID {wanted} not found.")
    lines = [
        "Email Details:",
        f"- ID: {record['id']}",
        f"- Message ID: <{record['id']}@resend.dev>",
        f"- From: {record.get('from', '')}",
        f"- To: {', '.join(record['to'])}",
        f"- Subject: {record['subject']}",
        "- Status: delivered",
        f"- Created: {_resend_time(record)}",
        "",
        "--- Plain Text Content ---",
        str(record.get("text") or "(none)"),
    ]
    return Reply({}, text="\n".join(lines))


def _resend_list(records: list[Record], arguments: Mapping[str, Any]) -> Answer:
    shown = records[: int(arguments.get("limit") or 20)]
    if not shown:
        return Reply({}, text="No emails found.")
    lines = [
        f'- To: {", ".join(r["to"])} | Subject: "{r["subject"]}" | Status: delivered | Sent: {_resend_time(r)} '
        f"| Message ID: <{r['id']}@resend.dev> | ID: {r['id']}"
        for r in shown
    ]
    more = " (more available)" if len(records) > len(shown) else ""
    return Reply({}, text=f"Found {len(shown)} email(s){more}:\n\n" + "\n".join(lines))


def _resend_error(status: int, message: str = "the request failed") -> Answer:
    name = _RESEND_NAMES.get(status, "application_error" if status >= 500 else "validation_error")
    if status == 409 and message != "conflict":
        name = "concurrent_idempotent_requests"
    error = {"statusCode": status, "message": message, "name": name}
    return isError("Email failed to send: " + json.dumps(error, separators=(",", ":")))


_AGENTMAIL_SEND = {
    "inboxId": {"type": "string", "description": "ID of inbox"},
    "to": _STRINGS,
    "cc": _STRINGS,
    "bcc": _STRINGS,
    "subject": {"type": "string"},
    "text": {"type": "string"},
    "html": {"type": "string"},
    "labels": _STRINGS,
    "attachments": {"type": "array", "items": {"type": "object"}},
    "replyTo": _STRINGS,
}

_WRITES = types.ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=True
)

_READS = types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=True)

_AGENTMAIL_REPLY = {
    **{name: _AGENTMAIL_SEND[name] for name in ("inboxId", "text", "html", "labels", "attachments", "to", "cc", "bcc")},
    "messageId": {"type": "string", "description": "ID of message"},
    "replyAll": {"type": "boolean"},
    "replyTo": _STRINGS,
}
_AGENTMAIL_FORWARD = {**_AGENTMAIL_SEND, "messageId": {"type": "string", "description": "ID of message"}}
_AGENTMAIL_DRAFT = {"inboxId": {"type": "string"}, "draftId": {"type": "string", "description": "ID of draft"}}

_AGENTMAIL_LISTING = {
    "inboxId": {"type": "string"},
    "limit": {"type": "number"},
    "pageToken": {"type": "string"},
    "labels": _STRINGS,
    "before": {"type": "string"},
    "after": {"type": "string"},
    "ascending": {"type": "boolean"},
    "from": _STRINGS,
    "to": _STRINGS,
    "subject": _STRINGS,
}

_AGENTMAIL_SENT = {
    "type": "object",
    "properties": {"messageId": {"type": "string"}, "threadId": {"type": "string"}},
    "required": ["messageId", "threadId"],
    "additionalProperties": False,
}


def agentmail() -> Surface:
    tools = (
        _tool(
            "send_message",
            "Send an email from an inbox to one or more recipients.",
            _AGENTMAIL_SEND,
            ["inboxId", "to"],
            _WRITES,
            _AGENTMAIL_SENT,
        ),
        _tool(
            "reply_to_message",
            "Reply to a message in its thread.",
            _AGENTMAIL_REPLY,
            ["inboxId", "messageId"],
            _WRITES,
            _AGENTMAIL_SENT,
        ),
        _tool(
            "forward_message",
            "Forward a message to new recipients.",
            _AGENTMAIL_FORWARD,
            ["inboxId", "messageId", "to"],
            _WRITES,
            _AGENTMAIL_SENT,
        ),
        _tool(
            "send_draft",
            "Send a draft immediately.",
            _AGENTMAIL_DRAFT,
            ["inboxId", "draftId"],
            _WRITES,
            _AGENTMAIL_SENT,
        ),
        _tool(
            "get_message",
            "Get one message by ID with its full body.",
            {"inboxId": {"type": "string"}, "messageId": {"type": "string"}},
            ["inboxId", "messageId"],
            _READS,
        ),
        _tool("list_messages", "List messages in an inbox.", _AGENTMAIL_LISTING, ["inboxId"], _READS),
    )
    return Surface(
        "agentmail",
        tools,
        lambda status, message="request failed": isError(f"{message} (HTTP {status})"),
        sends={
            name: Send(_agentmail_sent, recipients=recipients, id_field="messageId", adds=_agentmail_fields)
            for name, recipients in (
                ("send_message", ("to", "cc", "bcc")),
                ("reply_to_message", ("to", "cc", "bcc")),
                ("forward_message", ("to", "cc", "bcc")),
                ("send_draft", ("draftId",)),
            )
        },
        gets={"get_message": Get("messageId", _agentmail_message, id_field="messageId")},
        lists={"list_messages": Lister(_agentmail_list, _agentmail_filters())},
    )


def _agentmail_fields(record: Record) -> Record:
    return {
        "threadId": str(uuid.uuid4()),
        "timestamp": record["created_at"],
        "labels": ["sent"],
        "from": record["inboxId"],
        "preview": str(record.get("text") or "")[:100],
    }


def _agentmail_sent(record: Record) -> Answer:
    return structured({"messageId": record["messageId"], "threadId": record["threadId"]})


def _agentmail_item(record: Record) -> Record:
    kept = ("inboxId", "threadId", "messageId", "labels", "timestamp", "from", "to", "cc", "bcc", "subject", "preview")
    return {name: record[name] for name in kept if name in record}


def _agentmail_message(record: Record | None, wanted: str) -> Answer:
    if record is None:
        return isError("message not found (HTTP 404)")
    return structured({**_agentmail_item(record), "text": record.get("text"), "html": record.get("html")})


def _agentmail_list(records: list[Record], arguments: Mapping[str, Any]) -> Answer:
    shown = records[: int(arguments.get("limit") or 10)]
    return structured({"count": len(shown), "messages": [_agentmail_item(record) for record in shown]})


def _agentmail_filters() -> dict[str, Callable[[Record, Any], bool]]:
    def each_in(field: str) -> Callable[[Record, Any], bool]:  # every value given is a part of one of the field's
        def keep(record: Record, wanted: Any) -> bool:
            have = record.get(field)
            texts = [str(item) for item in (have if isinstance(have, list) else [have]) if item is not None]
            return all(any(str(value) in text for text in texts) for value in wanted or ())

        return keep

    return {
        "inboxId": lambda record, value: record.get("inboxId") == value,
        "labels": lambda record, value: set(value or ()) <= set(record.get("labels") or ()),
        "after": lambda record, value: str(record.get("timestamp", "")) >= str(value),
        "to": each_in("to"),
        "subject": each_in("subject"),
        "from": each_in("from"),
    }


def _tool(
    name: str,
    description: str,
    properties: dict[str, Any],
    required: list[str],
    annotations: types.ToolAnnotations | None,
    output: dict[str, Any] | None = None,
) -> types.Tool:
    schema = {"type": "object", "properties": properties, "required": required}
    return types.Tool(
        name=name, description=description, input_schema=schema, annotations=annotations, output_schema=output
    )


HAND_WRITTEN: dict[str, Callable[[], Surface]] = {"resend": resend, "agentmail": agentmail}
"""The servers with a hand-written fake, by the name of their built-in profile."""
