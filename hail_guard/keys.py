"""Idempotency keys: the caller's, a template's, the campaign's, or one derived from the send's meaning.

What a tool's message is, who it is from and where its key goes come from its profile (`ToolSpec`);
canonical JSON and fingerprints are `hail_guard.canonical`'s (re-exported here).

Key derivation (docs/explanation/keys.md, "How a key is made"), in order:
1. the caller's own key, validated: in the upstream's key argument (the profile's `key`, Hail's
   `idempotency_key`), or in hail-guard's own `idempotency_key` for an upstream that takes none;
2. the configured template, when one is set (a template that cannot be filled is refused);
3. `campaign_id:lead_id:channel:message_id` when `metadata` carries all three;
4. a meaning key `hgm:<channel>:<hash>` over what the send means (the tool, its recipients in their
   normal form, its message by meaning and its sender: `same_send.meaning_digest`), so every form of a
   regenerated retry gets the same key, in this ledger and in any other: a second proxy, or a ledger
   restored from an old backup, sends it under the key the upstream already holds.

Keys already in ledgers never change. Before meaning keys, step 4 gave a content key `hg:<channel>:<hash>`
over the canonical request (`legacy_key`); the guard still looks that form up, so a retry after an
upgrade finds its operation. Golden vectors (tests/unit/test_golden_keys.py) pin both forms.

The one other key ever minted is an operator's deliberate resend (`resend_key`): a new action,
`<original key>:resend:<n>`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from typing import Any

from hail_guard import profiles, same_send
from hail_guard.canonical import canonical_json, fingerprint
from hail_guard.errors import BadInput, ConfigError
from hail_guard.profiles import ToolSpec
from hail_guard.recipients import recipients_of

__all__ = [  # canonical JSON and fingerprints are hail_guard.canonical's; callers that derive keys find them here
    "KEY_FIELD",
    "MEANING_PREFIX",
    "canonical_json",
    "derive_key",
    "fingerprint",
    "legacy_key",
    "resend_key",
    "template_fields",
    "validate_key",
]

KEY_FIELD = profiles.KEY_FIELD
"""hail-guard's own key argument (and Hail's): where a caller gives its key when the profile names no other."""
MAX_KEY_LENGTH = 255
METADATA_KEY_FIELDS = ("campaign_id", "lead_id", "message_id")
MEANING_PREFIX = "hgm:"
"""Keys derived from a send's meaning (step 4)."""
LEGACY_PREFIX = "hg:"
"""Keys derived from a request's bytes, before meaning keys (`legacy_key`)."""
_RESEND_SUFFIX = re.compile(r"^(?P<original>.+):resend:(?P<n>[0-9]+)$")
_PLACEHOLDER = re.compile(r"^(channel|tool|metadata\.[A-Za-z0-9_]+|[A-Za-z_][A-Za-z0-9_]*)$")


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


def derive_key(
    spec: ToolSpec, arguments: Mapping[str, Any], template: str | None = None, *, region: str | None = None
) -> str:
    """The idempotency key for these arguments (see the module docstring for the order); the caller's own
    key is in `spec.key_field` (the upstream's key argument, else hail-guard's `idempotency_key`). `region`
    reads national phone numbers, as for the send's recipients."""
    if spec.key_field in arguments:
        return validate_key(arguments[spec.key_field], spec.key_field)
    tool, channel = spec.name, spec.channel
    if template is not None:
        return validate_key(_fill(template, tool, channel, arguments))
    metadata = arguments.get("metadata")
    if isinstance(metadata, Mapping) and all(_usable(metadata.get(f)) for f in METADATA_KEY_FIELDS):
        campaign, lead, message = (str(metadata[f]) for f in METADATA_KEY_FIELDS)
        return validate_key(f"{campaign}:{lead}:{channel}:{message}")
    reached = recipients_of(channel, arguments, spec.recipients, region=region)
    content = same_send.content_fingerprint(spec, arguments)
    sender = same_send.sender_of(spec, arguments, region=region)
    return f"{MEANING_PREFIX}{channel}:{same_send.meaning_digest(spec, reached, content, sender)[:32]}"


def legacy_key(spec: ToolSpec, arguments: Mapping[str, Any]) -> str:
    """The content key earlier versions derived in step 4 (over the request's canonical bytes): still looked
    up, never derived for a new send."""
    return f"{LEGACY_PREFIX}{spec.channel}:{fingerprint(canonical_json(dict(arguments)))[:32]}"


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
