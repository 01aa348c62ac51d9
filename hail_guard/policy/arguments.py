"""What a send's arguments must be before anything is recorded: the tool's schema, Hail's own
pre-send rules, consent; and which tools are guarded at all.

A refusal here records nothing and keeps the key free for the corrected request: `BadInput` for a
value that cannot be used, `RefusedByPolicy` for a send without the consent it needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

from hail_guard import nesting
from hail_guard.errors import (
    BadInput,
    RefusedByPolicy,
)


def validate_arguments(tool: str, arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
    """Check arguments against the tool's own input schema, naming the first bad field."""
    nesting.check_arguments(tool, arguments)  # first: the schema check recurses once per level
    try:
        validator = jsonschema.Draft202012Validator(dict(schema))
        error = jsonschema.exceptions.best_match(validator.iter_errors(dict(arguments)))
    except (jsonschema.exceptions.SchemaError, RecursionError, ValueError) as exc:
        raise BadInput(f"the arguments for {tool} cannot be checked: {exc}") from exc
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(arguments)"
        raise BadInput(
            f"invalid arguments for {tool}: {where}: {error.message}; fix it and call again (nothing was recorded)"
        )


_E164 = re.compile(r"^\+[1-9]\d{1,14}$")
_TEXT_LIMITS = {("send_email", "subject"): 998, ("send_sms", "body"): 1600}


def check_hail_rules(tool: str, arguments: Mapping[str, Any]) -> None:
    """Hail's own pre-send checks (HAIL_CONTRACT.md, sends), made here so a refusal records nothing.

    Hail's tool layer refuses these before its API sees them, so no key is consumed upstream;
    checking first keeps our key free too, for the corrected request.
    """
    problem = _hail_rule_problem(tool, arguments)
    if problem is not None:
        raise BadInput(f"invalid arguments for {tool}: {problem}; fix it and call again (nothing was recorded)")


def _hail_rule_problem(tool: str, arguments: Mapping[str, Any]) -> str | None:
    for (limited_tool, name), most in _TEXT_LIMITS.items():
        value = arguments.get(name)
        if tool == limited_tool and isinstance(value, str) and not 1 <= len(value) <= most:
            return f"{name}: must be 1 to {most} characters (got {len(value)})"
    if tool == "send_email":
        if not arguments.get("to"):
            return "to: give at least one recipient address"
        if not any(isinstance(arguments.get(f), str) and arguments[f].strip() for f in ("body_text", "body_html")):
            return "body_text or body_html: give at least one non-empty body"
    if tool in ("send_sms", "place_call"):
        to = arguments.get("to")
        if isinstance(to, str) and not _E164.match(to):
            return f"to: {to!r} is not an E.164 number such as +14155551234"
    if tool == "place_call" and not any(arguments.get(f) for f in ("system_prompt", "llm", "agent_id")):
        return "give one of system_prompt, llm or agent_id"
    return None


def check_consent(tool_schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """`recipient_consent` must be the JSON boolean true; marketing needs a consent source."""
    properties = tool_schema.get("properties")
    declares_consent = isinstance(properties, Mapping) and "recipient_consent" in properties
    if declares_consent or "recipient_consent" in arguments:
        consent = arguments.get("recipient_consent")
        if consent is not True:
            raise RefusedByPolicy(
                f"recipient_consent must be the JSON boolean true (got {json.dumps(consent)}); "
                "send only to recipients who consented, and pass recipient_consent: true"
            )
    if arguments.get("message_type") == "marketing":
        source = arguments.get("consent_source")
        if not isinstance(source, str) or not source.strip():
            raise RefusedByPolicy(
                "marketing sends need a non-empty consent_source saying where the recipient's consent "
                "came from (e.g. 'signup form 2026-03-01')"
            )


def differing_fields(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ (lists compared whole)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        fields: list[str] = []
        for name in sorted(set(old) | set(new)):
            where = f"{path}.{name}" if path else str(name)
            if name not in old or name not in new:
                fields.append(where)
            else:
                fields.extend(differing_fields(old[name], new[name], where))
        return fields
    return [] if old == new else [path or "(whole request)"]


def guarded_tool_names(schemas: Mapping[str, Mapping[str, Any]], configured: Sequence[str] | None) -> set[str]:
    """Tools that go through the guard: those configured, else those that take an idempotency key."""
    if configured is not None:
        return set(configured)
    guarded = set()
    for name, schema in schemas.items():
        properties = schema.get("properties")
        if isinstance(properties, Mapping) and "idempotency_key" in properties:
            guarded.add(name)
    return guarded
