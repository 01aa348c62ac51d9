"""What a send's arguments must be before anything is recorded: the tool's schema, and the argument rules
of its profile (Hail's own pre-send rules and its strict consent live in the `hail` profile).

A refusal here records nothing and keeps the key free for the corrected request: `BadInput` for a
value that cannot be used, `RefusedByPolicy` for a send without the consent it needs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema

from hail_guard import nesting, pointers
from hail_guard.errors import (
    BadInput,
    RefusedByPolicy,
)
from hail_guard.profiles import Rule, ToolSpec


def validate_arguments(tool: str, arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
    """Check arguments against the tool's own input schema, naming the first bad field."""
    nesting.check_arguments(tool, arguments)  # first: the schema check recurses once per level
    try:
        validator = _validator(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(dict(arguments)))
    except (jsonschema.exceptions.SchemaError, RecursionError, ValueError, TypeError) as exc:
        raise BadInput(f"the arguments for {tool} cannot be checked: {exc}") from exc
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(arguments)"
        raise BadInput(
            f"invalid arguments for {tool}: {where}: {error.message}; fix it and call again (nothing was recorded)"
        )


VALIDATORS_KEPT = 256
"""Compiled validators kept, one per distinct tool schema (an upstream has a few)."""
_validators: dict[str, jsonschema.Draft202012Validator] = {}


def _validator(schema: Mapping[str, Any]) -> jsonschema.Draft202012Validator:
    """The schema's validator, compiled once per schema and kept by its fingerprint (its JSON, sorted)."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=repr)
    digest = hashlib.sha256(text.encode()).hexdigest()
    validator = _validators.get(digest)
    if validator is None:
        if len(_validators) >= VALIDATORS_KEPT:
            _validators.clear()
        validator = _validators[digest] = jsonschema.Draft202012Validator(json.loads(text))
    return validator


def check_rules(spec: ToolSpec, arguments: Mapping[str, Any], tool_schema: Mapping[str, Any]) -> None:
    """The profile's argument rules for this tool, in order (its own, then the profile's): the first one
    broken is refused, before anything is recorded, so the key stays free for the corrected request.

    The upstream's tool layer refuses these before its API sees them (Hail's), or hail-guard is stricter than
    the upstream is (Hail's consent): checking first keeps our key free, and nothing reaches the upstream.
    """
    for rule in spec.rules:
        problem = _broken(rule, arguments, tool_schema)
        if problem is None:
            continue
        if rule.refusal == "policy":
            raise RefusedByPolicy(problem)
        raise BadInput(f"invalid arguments for {spec.name}: {problem}; fix it and call again (nothing was recorded)")


def _broken(rule: Rule, arguments: Mapping[str, Any], tool_schema: Mapping[str, Any]) -> str | None:
    """The rule's message when `arguments` break it, else None."""
    if any(_canonical(pointers.resolve(arguments, name)) != _canonical(value) for name, value in rule.when.items()):
        return None
    if rule.one_of is not None:
        given = [pointers.resolve(arguments, pointer) for pointer in rule.one_of]
        return None if any(_given(value, text=rule.text) for value in given) else rule.message
    field = rule.field or ""
    value = pointers.resolve(arguments, field)
    if rule.when_declared and not (pointers.present(arguments, field) or _declares(tool_schema, field)):
        return None
    if rule.equals is not None:
        broken = _canonical(value) != _canonical(rule.equals)
    elif rule.length is not None:
        broken = isinstance(value, str) and not rule.length[0] <= len(value) <= rule.length[1]
    elif rule.pattern is not None:
        broken = isinstance(value, str) and re.match(rule.pattern, value) is None
    else:
        broken = not _given(value, text=rule.text)
    if not broken:
        return None
    length = len(value) if isinstance(value, str | list | dict) else 0
    return rule.message.format(field=pointers.shown(field), got=json.dumps(value), shown=repr(value), length=length)


def _given(value: object, *, text: bool) -> bool:
    """Something is given: any truthy value, or (`text`) a text with something besides whitespace."""
    return isinstance(value, str) and bool(value.strip()) if text else bool(value)


def _declares(schema: Mapping[str, Any], pointer: str) -> bool:
    found = pointers.schema_at(schema, pointer)
    return bool(found) and found != [schema]


def _canonical(value: object) -> str:
    """JSON equality with types kept apart (`true` is not `1`)."""
    return json.dumps(value, sort_keys=True, default=str)


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
