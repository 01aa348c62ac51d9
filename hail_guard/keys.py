"""Canonical JSON, fingerprints and idempotency keys.

`canonical_json` is the one function that turns arguments into bytes: the same text is hashed
for fingerprints, stored in the ledger and forwarded upstream, so a replay is byte-identical. What a
tool's message is, who it is from and where its key goes come from its profile (`ToolSpec`).

Key derivation (DESIGN.md, keys), in order:
1. the caller's own key, validated: in the upstream's key argument (the profile's `key`, Hail's
   `idempotency_key`), or in hail-guard's own `idempotency_key` for an upstream that takes none;
2. the configured template, when one is set (a template that cannot be filled is refused);
3. `campaign_id:lead_id:channel:message_id` when `metadata` carries all three;
4. a content key `hg:<channel>:<hash>` over the canonical request, so a plain repeat is the same
   operation.

The one other key ever minted is an operator's deliberate resend (`resend_key`): a new action,
`<original key>:resend:<n>`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import string
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from hail_guard import pointers, profiles
from hail_guard.errors import BadInput, ConfigError
from hail_guard.profiles import ToolSpec
from hail_guard.recipients import BadRecipient, normalise_recipient

KEY_FIELD = profiles.KEY_FIELD
"""hail-guard's own key argument (and Hail's): where a caller gives its key when the profile names no other."""
MAX_KEY_LENGTH = 255
METADATA_KEY_FIELDS = ("campaign_id", "lead_id", "message_id")
_WHITESPACE = re.compile(r"\s+")
_RESEND_SUFFIX = re.compile(r"^(?P<original>.+):resend:(?P<n>[0-9]+)$")
_PLACEHOLDER = re.compile(r"^(channel|tool|metadata\.[A-Za-z0-9_]+|[A-Za-z_][A-Za-z0-9_]*)$")


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant whitespace, UTF-8 kept; NaN and infinities refused."""
    _refuse_non_finite(value)
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an integer of more than 4,300 digits
        raise BadInput(f"the arguments are not a JSON value hail-guard can record: {exc}") from None


def _refuse_non_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise BadInput(f"{value!r} is not a JSON number; send a finite number or a string")
    if isinstance(value, Mapping):
        for item in value.values():
            _refuse_non_finite(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _refuse_non_finite(item)


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def content_fingerprint(spec: ToolSpec, arguments: Mapping[str, Any]) -> str:
    """What a message says, by meaning: the same for every form an agent's regenerated retry takes.

    Only the message counts (`ToolSpec.message`: the profile's `content`, else every argument but the
    recipients, sender, key and `not_content`; recipients are matched one by one, the sender only when both
    sends name one). Text is NFC with its whitespace collapsed; null, empty text, empty lists and empty
    objects count as absent; 2.0 is 2. Used to recognise a retry, never to derive a key (keys never change
    between versions: `derive_key`).
    """
    message = meaning_of(spec.message(arguments))
    return fingerprint(canonical_json({"tool": spec.name, "message": message or {}}))


def sender_of(spec: ToolSpec, arguments: Mapping[str, Any]) -> dict[str, str]:
    """The sender fields a send gives, in their compared form (an address or number normalised, a name
    case-folded), by name."""
    sender: dict[str, str] = {}
    for pointer in (*spec.sender, *spec.sender_names):
        value = meaning_of(pointers.resolve(arguments, pointer))
        if value is None:
            continue
        text, name = str(value), pointers.shown(pointer)
        try:
            sender[name] = normalise_recipient(text, spec.channel) if pointer in spec.sender else text.casefold()
        except BadRecipient:
            sender[name] = text.casefold()
    return sender


def meaning_of(value: Any) -> Any:
    """`value` with the differences of form removed (see `content_fingerprint`); None when it is empty."""
    if isinstance(value, str):
        text = _WHITESPACE.sub(" ", unicodedata.normalize("NFC", value)).strip()
        return text or None
    if isinstance(value, Mapping):
        kept = {str(name): meaning_of(item) for name, item in value.items()}
        return {name: item for name, item in kept.items() if item is not None} or None
    if isinstance(value, list | tuple):
        items = [item for item in (meaning_of(item) for item in value) if item is not None]
        return items or None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def validate_key(key: object, field: str = KEY_FIELD) -> str:
    if not isinstance(key, str) or not key.strip():
        raise BadInput(f"{field} must be a non-empty string; omit it to let hail-guard derive one")
    if len(key) > MAX_KEY_LENGTH:
        raise BadInput(f"{field} is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}")
    if not key.isprintable() or any(ch.isspace() for ch in key):
        raise BadInput(f"{field} must be printable with no whitespace: {key!r}")
    return key


def resend_key(key: str) -> str:
    """The key of an operator's resend of the operation under `key`: `<original key>:resend:<n>`.

    `n` counts the resends of the original, so resending a resend gives `...:resend:2`, not a
    growing chain of suffixes.
    """
    match = _RESEND_SUFFIX.match(key)
    original, count = (match["original"], int(match["n"])) if match else (key, 0)
    return validate_key(f"{original}:resend:{count + 1}")


def template_fields(template: str) -> list[str]:
    """The placeholders of a key template, refusing ones we cannot fill."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"key_template {template!r} is not a valid template: {exc}") from exc
    if not names:
        raise ConfigError(f"key_template {template!r} has no placeholders: every send would share one key")
    for name in names:
        if not _PLACEHOLDER.match(name):
            raise ConfigError(
                f"key_template placeholder {{{name}}} is not supported; use {{channel}}, {{tool}}, "
                "{metadata.NAME} or a top-level argument name"
            )
    return names


def derive_key(spec: ToolSpec, arguments: Mapping[str, Any], template: str | None = None) -> str:
    """The idempotency key for these arguments (see the module docstring for the order); the caller's own
    key is in `spec.key_field` (the upstream's key argument, else hail-guard's `idempotency_key`)."""
    if spec.key_field in arguments:
        return validate_key(arguments[spec.key_field], spec.key_field)
    tool, channel = spec.name, spec.channel
    if template is not None:
        return validate_key(_fill(template, tool, channel, arguments))
    metadata = arguments.get("metadata")
    if isinstance(metadata, Mapping) and all(_usable(metadata.get(f)) for f in METADATA_KEY_FIELDS):
        campaign, lead, message = (str(metadata[f]) for f in METADATA_KEY_FIELDS)
        return validate_key(f"{campaign}:{lead}:{channel}:{message}")
    return f"hg:{channel}:{fingerprint(canonical_json(dict(arguments)))[:32]}"


def _usable(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool) and str(value).strip() != ""


def _fill(template: str, tool: str, channel: str, arguments: Mapping[str, Any]) -> str:
    values: dict[str, str] = {}
    missing: list[str] = []
    for name in template_fields(template):
        value = _lookup(name, tool, channel, arguments)
        if value is None:
            missing.append(name)
        else:
            values[name] = value
    if missing:
        raise BadInput(
            f"the key template {template!r} cannot be filled: missing {_names(missing)}; "
            f"add them to the arguments or pass {KEY_FIELD} yourself"
        )
    return _substitute(template, values)


def _lookup(name: str, tool: str, channel: str, arguments: Mapping[str, Any]) -> str | None:
    if name == "channel":
        return channel
    if name == "tool":
        return tool
    if name.startswith("metadata."):
        metadata = arguments.get("metadata")
        value = metadata.get(name.removeprefix("metadata.")) if isinstance(metadata, Mapping) else None
    else:
        value = arguments.get(name)
    return str(value) if _usable(value) else None


def _substitute(template: str, values: Mapping[str, str]) -> str:
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            parts.append(values[name])
    return "".join(parts)


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))
