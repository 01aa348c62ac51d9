"""The sandbox's tool surface: names, hand-written JSON Schemas, annotations, schema checks.

Parameter names follow Hail's (`from_` with an underscore, `recipient_consent` a strict boolean).
The low-level MCP server does not validate arguments, so `schema_refusal` does, and words its
refusal like Hail's pydantic layer does (`1 validation error for send_emailArguments ...`).
Unknown arguments are ignored, as Hail's tool layer ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import mcp.types as types
from jsonschema import Draft202012Validator, ValidationError

SEND_TOOLS: Final = frozenset({"send_email", "send_sms", "place_call"})
"""The tools that send, each under an organisation-wide idempotency key."""

OUTPUT_SCHEMA: Final[dict[str, Any]] = {"type": "object", "additionalProperties": True}


def _text(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": ["string", "null"], "description": description, **extra}


def _strings(description: str) -> dict[str, Any]:
    return {"type": ["array", "null"], "items": {"type": "string"}, "description": description}


def _object(description: str) -> dict[str, Any]:
    return {"type": ["object", "null"], "description": description}


_CONSENT: Final = {
    "recipient_consent": {
        "type": "boolean",
        "description": "You attest that the recipient consented to be contacted. Must be true.",
    },
    "message_type": {
        "type": "string",
        "enum": ["informational", "marketing"],
        "default": "informational",
        "description": "marketing also needs consent_source.",
    },
    "consent_source": _text("How and where consent was obtained (required for marketing)."),
    "consent_obtained_at": _text("When consent was obtained (ISO 8601)."),
    "metadata": _object("Free-form JSON attached to the record."),
    "idempotency_key": _text("Organisation-wide key; a same-key retry returns the first answer."),
}

_LIST_PARAMS: Final = {
    "cursor": _text("next_cursor from the previous page."),
    "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 50},
    "status": _text("Only records in this status."),
    "to": _text("Only records sent to this address or number."),
}


def _schema(properties: Mapping[str, Any], *required: str) -> dict[str, Any]:
    return {"type": "object", "properties": dict(properties), "required": list(required)}


_SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "send_email": _schema(
        {
            "to": {"type": "array", "items": {"type": "string"}, "description": "Recipient addresses."},
            "subject": {"type": "string", "description": "1 to 998 characters."},
            "body_text": _text("Plain-text body (this or body_html)."),
            "body_html": _text("HTML body (this or body_text)."),
            "from_": _text("Sender address; defaults to the organisation's sender."),
            "from_name": _text("Sender display name."),
            "cc": _strings("Cc addresses."),
            "bcc": _strings("Bcc addresses."),
            "reply_to": _text("Reply-To address."),
            "attachment_ids": _strings("Previously uploaded attachment ids."),
            **_CONSENT,
        },
        "to",
        "subject",
        "recipient_consent",
    ),
    "send_sms": _schema(
        {
            "to": {"type": "string", "description": "E.164 number, e.g. +14155551234."},
            "body": {"type": "string", "description": "1 to 1600 characters."},
            "from_": _text("Sender number; defaults to the organisation's number."),
            **_CONSENT,
        },
        "to",
        "body",
        "recipient_consent",
    ),
    "place_call": _schema(
        {
            "to": {"type": "string", "description": "E.164 number, e.g. +14155551234."},
            "system_prompt": _text("Prompt for Hail's bundled voice agent (or llm, or agent_id)."),
            "llm": _object("Your own OpenAI-compatible endpoint: base_url, api_key, model."),
            "agent_id": _text("A saved agent."),
            "from_": _text("Caller number; defaults to a free shared number."),
            "first_message": _text("Spoken on pickup."),
            "language": _text("BCP 47 language tag."),
            "ai_disclosure": {"type": ["boolean", "null"], "description": "Announce that an AI is calling."},
            "tools": {"type": ["array", "null"], "items": {"type": "object"}, "description": "Agent tools."},
            **_CONSENT,
        },
        "to",
        "recipient_consent",
    ),
    "get_email": _schema({"email_id": {"type": "string"}}, "email_id"),
    "get_sms": _schema({"sms_id": {"type": "string"}}, "sms_id"),
    "get_call": _schema({"call_id": {"type": "string"}}, "call_id"),
    "list_emails": _schema(_LIST_PARAMS),
    "list_sms": _schema(_LIST_PARAMS),
    "list_calls": _schema(_LIST_PARAMS),
    "get_email_events": _schema({"email_id": {"type": "string"}}, "email_id"),
    "get_events": _schema(
        {
            "id": _text("email:<uuid>, sms:<uuid> or call:<uuid>; omit for the whole organisation."),
            "kind": {"type": ["string", "null"], "enum": ["email", "sms", "call", None]},
            "cursor": _text("next_cursor from the previous page."),
            "limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 100},
        }
    ),
    "whoami": _schema({}),
    "create_contact": _schema(
        {
            "name": _text("Display name."),
            "email": _text("Email address (this or phone)."),
            "phone": _text("E.164 number (this or email)."),
            "metadata": _object("Free-form JSON attached to the contact."),
        }
    ),
}

_DESCRIPTIONS: Final = {
    "send_email": "Send an email. Returns the email record (status sent) plus idempotency_key.",
    "send_sms": "Send an SMS. Returns the SMS record (sent, or failed with error_code) plus idempotency_key.",
    "place_call": "Place an outbound AI call. Returns the call record (status dialing) plus idempotency_key.",
    "get_email": "Fetch one email by id.",
    "get_sms": "Fetch one SMS by id.",
    "get_call": "Fetch one call by id.",
    "list_emails": "Page through emails, newest first.",
    "list_sms": "Page through SMS, newest first.",
    "list_calls": "Page through calls, newest first.",
    "get_email_events": "Delivery and engagement events of one email.",
    "get_events": "Events of one email, SMS or call (id=email:<uuid>), or of the whole organisation.",
    "whoami": "The organisation and user behind the token.",
    "create_contact": "Create a contact (no idempotency key: every call creates one).",
}

TOOL_NAMES: Final = tuple(_SCHEMAS)

_READ_ONLY = types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=True)
_SENDS = types.ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=True
)
_WRITES = types.ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)


def _annotations(name: str) -> types.ToolAnnotations:
    if name in SEND_TOOLS:
        return _SENDS
    return _WRITES if name == "create_contact" else _READ_ONLY


def tool_list() -> list[types.Tool]:
    """Every tool, as `tools/list` answers."""
    return [
        types.Tool(
            name=name,
            description=_DESCRIPTIONS[name],
            input_schema=schema,
            output_schema=OUTPUT_SCHEMA,
            annotations=_annotations(name),
        )
        for name, schema in _SCHEMAS.items()
    ]


def input_schema(name: str) -> dict[str, Any] | None:
    """The input schema of `name`, or None for an unknown tool."""
    return _SCHEMAS.get(name)


_VALIDATORS: Final = {name: Draft202012Validator(schema) for name, schema in _SCHEMAS.items()}

_TYPE_WORDS: Final = {
    "boolean": ("a valid boolean", "bool_type"),
    "string": ("a valid string", "string_type"),
    "array": ("a valid list", "list_type"),
    "object": ("a valid dictionary", "dict_type"),
    "integer": ("a valid integer", "int_type"),
}


def _describe(error: ValidationError) -> list[tuple[str, str]]:
    """(location, message) pairs for one jsonschema error, in pydantic's words where they differ."""
    location = ".".join(str(part) for part in error.absolute_path)
    rule: Any = error.validator_value
    if error.validator == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        missing = [field for field in rule if field not in present]
        return [(".".join(filter(None, (location, field))), "Field required [type=missing]") for field in missing]
    if error.validator == "type":
        first = str(rule[0] if isinstance(rule, list) else rule)
        words, kind = _TYPE_WORDS.get(first, (f"of type {first}", f"{first}_type"))
        detail = f"input_value={error.instance!r}, input_type={type(error.instance).__name__}"
        return [(location, f"Input should be {words} [type={kind}, {detail}]")]
    return [(location, error.message)]


def schema_refusal(name: str, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit `name`'s schema, worded like pydantic, or None when they fit."""
    errors = sorted(_VALIDATORS[name].iter_errors(dict(arguments)), key=lambda e: list(map(str, e.path)))
    pairs = sorted({pair for error in errors for pair in _describe(error)})
    if not pairs:
        return None
    plural = "" if len(pairs) == 1 else "s"
    lines = [f"{len(pairs)} validation error{plural} for {name}Arguments"]
    for location, message in pairs:
        lines += [location or name, f"  {message}"]
    return "\n".join(lines)
