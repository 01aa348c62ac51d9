"""Which of an upstream's tools message people: the one rule `profile init`, `profile check` and `serve` share.

A tool **writes to the world** when its annotations say so (`readOnlyHint` false, `openWorldHint` not false;
MCP's defaults when it has none). It **sends** when, besides, it takes an idempotency key, names people
(a property called `to`, `cc`, `email`, `phone`, `recipients`... or of format `email`, at the top or in the
items of an array of objects: `/emails/*/to`), or its name begins with a verb that sends (`send_`,
`reply_`, `forward_`, `post_`, `notify_`). A profile guards each tool that sends, or lists it in
`[profile] pass_through`; `serve` refuses any other (fail closed), and `profile check` names it.
Everything read here is an upstream's hostile text: it is only compared, never run or printed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mcp import types

from hail_guard import pointers

KEY_NAMES = frozenset({"idempotencykey", "idempotencytoken", "dedupekey", "dedupkey", "deduplicationkey"})
"""Argument names (lower case, without `_` and `-`) that say they are an idempotency key."""
RECIPIENT_NAMES = frozenset(
    {
        "to",
        "cc",
        "bcc",
        "recipient",
        "recipients",
        "channel",
        "channelid",
        "chatid",
        "conversationid",
        "roomid",
        "phone",
        "phonenumber",
        "number",
        "email",
        "emails",
        "emailaddress",
        "userid",
        "target",
        "destination",
    }
)
"""Argument names that name who receives something."""
ADDRESSEES = RECIPIENT_NAMES - {"email", "emails", "emailaddress", "userid"}
"""The names that say whom a message goes to (`to`, `phone`, `channel`), not only whom it is about (a
contact's `email`, a suppression's `emails`)."""
SEND_VERBS = frozenset({"send", "reply", "forward", "post", "notify"})
"""The first word of a tool name that sends (`send-email`, `reply_to_message`, `postMessage`)."""


def words(name: str) -> str:
    """A name compared without case, `_` or `-`: `idempotency_key` and `idempotencyKey` alike."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def writes_to_world(tool: types.Tool) -> bool:
    """What MCP's annotations say: not read-only, and not limited to a closed world (defaults when unsaid)."""
    notes = tool.annotations
    read_only = bool(notes.read_only_hint) if notes is not None and notes.read_only_hint is not None else False
    open_world = notes.open_world_hint if notes is not None and notes.open_world_hint is not None else True
    return not read_only and open_world is not False


def is_key_like(name: str) -> bool:
    return words(name) in KEY_NAMES


def properties(schema: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """A schema's declared properties, by name (each one's schema; `{}` where it is not an object)."""
    found = (schema or {}).get("properties")
    if not isinstance(found, Mapping):
        return {}
    return {str(name): spec if isinstance(spec, Mapping) else {} for name, spec in found.items()}


def key_arguments(tool: types.Tool) -> list[str]:
    """The top-level arguments whose names say they are an idempotency key."""
    return [name for name in properties(tool.input_schema) if is_key_like(name)]


def recipient_pointers(schema: Mapping[str, Any] | None) -> list[str]:
    """Pointers to the arguments that name people: top-level ones, and those of each item of an array of
    objects (`/emails/*/to`)."""
    found: list[str] = []
    for name, spec in properties(schema).items():
        if names_people(name, spec):
            found.append(pointers.pointer_to(name))
            continue
        items = spec.get("items")
        inner = properties(items) if isinstance(items, Mapping) else {}
        found += [
            pointers.pointer_to(name, pointers.EVERY, part) for part, sub in inner.items() if names_people(part, sub)
        ]
    return found


def names_people(name: str, spec: Mapping[str, Any]) -> bool:
    """Whether an argument names who receives something: by its name, or by its (items') `email` format. An
    array of objects (`emails` of a batch) names none itself: its items' arguments may."""
    items = spec.get("items")
    if isinstance(items, Mapping) and properties(items):
        return False
    formats = {spec.get("format"), items.get("format") if isinstance(items, Mapping) else None}
    return words(name) in RECIPIENT_NAMES or "email" in formats


def addresses_someone(tool: types.Tool) -> bool:
    """Whether an argument says whom a message goes to (`ADDRESSEES`), not only whom it is about."""
    found = recipient_pointers(tool.input_schema)
    return any(words(pointers.parse(pointer)[-1]) in ADDRESSEES for pointer in found)


def says_it_sends(tool: types.Tool) -> bool:
    """Whether the tool's name begins with a verb that sends."""
    first = re.split(r"[^a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", tool.name).lower())
    return next((part for part in first if part), "") in SEND_VERBS


def sends(tool: types.Tool) -> bool:
    """The rule (module docstring): it writes to the world and takes a key, names people or says it sends."""
    if not writes_to_world(tool):
        return False
    return bool(key_arguments(tool) or recipient_pointers(tool.input_schema) or says_it_sends(tool))


def why_it_sends(tool: types.Tool) -> str:
    """The rule's reasons for one tool, in words (for a refusal or a finding)."""
    said = []
    if keys := key_arguments(tool):
        said.append(f"takes a key ({keys[0]})")
    if people := recipient_pointers(tool.input_schema):
        said.append(f"names recipients ({', '.join(pointers.shown(p) for p in people[:3])})")
    if says_it_sends(tool):
        said.append("is named like a send")
    notes = (
        "its annotations say it writes to the world" if tool.annotations else "it has no annotations (MCP: it writes)"
    )
    return f"{notes}, and it " + " and ".join(said)
