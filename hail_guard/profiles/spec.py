"""What the guard reads of a profile for one tool (`ToolSpec`), and how it reads an upstream's answers.

`spec_of` merges a tool entry over `[defaults]` over the built-in defaults; `read_answer` turns a result
into the JSON object it stands for (structured content, JSON text, or the named groups of the tool's
`answer_text` pattern); `read_items` finds a search's listed items; `read_arguments` fills a lookup's or
a search's arguments from a stored send.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hail_guard import pointers
from hail_guard.profiles.model import (
    PROVIDER_ID,
    SINCE,
    Answers,
    Literal_,
    Lookup,
    ProfileData,
    Rule,
    Search,
    ToolEntry,
    ToolFields,
)
from hail_guard.recipients import RECIPIENT_POINTERS

KEY_FIELD = "idempotency_key"
"""hail-guard's own key argument: the caller's key for an upstream that takes none (never forwarded)."""
ALLOW_DUPLICATE = "allow_duplicate"
DEFAULT_RECIPIENTS = RECIPIENT_POINTERS
"""Where a tool's recipients are when its profile does not say: every one is checked against opt-outs."""
DEFAULT_LEAD = ("/metadata/campaign_id", "/metadata/lead_id")
"""Who a send is for when a profile does not say (`lead`): the caller's campaign and lead ids."""
DEFAULT_TIMES = ("/created_at", "/createdAt", "/timestamp", "/sent_at", "/requested_at")


@dataclass(frozen=True)
class ToolSpec:
    """One guarded tool as the guard sees it (every field resolved)."""

    name: str
    channel: str
    recipients: tuple[str, ...]
    content: tuple[str, ...] | None
    """Pointers to the message; None: every argument not in `not_content`."""
    not_content: frozenset[str]
    sender: tuple[str, ...]
    sender_names: tuple[str, ...]
    lead: tuple[str, ...]
    """Who a send is for in the caller's own records (`same_send.lead_of`); empty: nobody."""
    key: str | None
    """The upstream's key argument (a top-level name); None: the upstream takes no key."""
    key_checked: bool
    """Its name need not say it is a key (`profile check`)."""
    provider_id: str
    required: tuple[str, ...]
    answer_text: re.Pattern[str] | None
    lookup: Lookup | None
    search: Search | None
    rules: tuple[Rule, ...]
    answers: Answers
    retention_hours: float

    @property
    def key_field(self) -> str:
        """The argument a caller names its own key in: the upstream's, else hail-guard's `idempotency_key`."""
        return self.key or KEY_FIELD

    @property
    def forwards_key(self) -> bool:
        """True when the upstream takes the key: a replay under it is safe inside its retention."""
        return self.key is not None

    def message(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments that make up the message (what a recipient reads), by name."""
        if self.content is not None:
            return {pointers.shown(pointer): pointers.resolve(arguments, pointer) for pointer in self.content}
        return {name: value for name, value in arguments.items() if name not in self.not_content}


def spec_of(entry: ToolEntry, defaults: ToolFields, answers: Answers, rules: Sequence[Rule], hours: float) -> ToolSpec:
    """A tool entry over the profile's defaults over the built-in ones."""

    def pick(name: str, fallback: Any) -> Any:
        """The entry's value, else the defaults', else the built-in one."""
        for given in (getattr(entry, name), getattr(defaults, name)):
            if given is not None:
                return given
        return fallback

    recipients = tuple(pick("recipients", DEFAULT_RECIPIENTS))
    sender, sender_names = tuple(pick("sender", ())), tuple(pick("sender_names", ()))
    key = pointers.top_level(key_pointer) if (key_pointer := pick("key", None)) is not None else None
    text = pick("answer_text", None)
    return ToolSpec(
        name=entry.name,
        channel=pick("channel", entry.name),
        recipients=recipients,
        content=_tuple(pick("content", None)),
        not_content=_not_content([*pick("not_content", ()), *recipients, *sender, *sender_names], key),
        sender=sender,
        sender_names=sender_names,
        lead=tuple(pick("lead", DEFAULT_LEAD)),
        key=key,
        key_checked=bool(pick("key_checked", False)),
        provider_id=pick("provider_id", "/id"),
        required=tuple(pick("required", ())),
        answer_text=re.compile(text, re.DOTALL) if text is not None else None,
        lookup=entry.lookup,
        search=entry.search,
        rules=(*entry.rules, *(rule for rule in rules if rule.tools is None or entry.name in rule.tools)),
        answers=answers,
        retention_hours=hours,
    )


def _not_content(named: Sequence[str], key: str | None) -> frozenset[str]:
    """The top-level arguments that are not the message: those named, hail-guard's own, the key."""
    names = {name for name in map(pointers.top_level, named) if name}
    return frozenset({*names, KEY_FIELD, ALLOW_DUPLICATE, key or KEY_FIELD})


def _tuple(values: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values is not None else None


def read_answer(structured: object, text: str, pattern: re.Pattern[str] | str | None = None) -> dict[str, Any] | None:
    """The JSON object an answer stands for: its structured content, else its text read by `pattern` (named
    groups; `json` a JSON object merged in), else its text as JSON; None when it stands for none."""
    if isinstance(structured, dict):
        return structured
    if pattern is None:
        return _json_object(text)
    found = re.search(pattern, text, re.DOTALL) if isinstance(pattern, str) else pattern.search(text)
    if found is None:
        return None
    fields = {name: value for name, value in found.groupdict().items() if name != "json" and value is not None}
    if "json" in found.groupdict():
        inner = _json_object(found["json"] or "")
        if inner is None:
            return None
        fields = {**inner, **fields}
    return fields


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_items(search: Search, structured: object, text: str) -> list[dict[str, Any]] | None:
    """The items a search's answer lists (each a JSON object), or None when it lists none readably."""
    if search.item_text is not None and not isinstance(structured, dict):
        pattern = re.compile(search.item_text, re.MULTILINE)
        return [{k: v for k, v in found.groupdict().items() if v is not None} for found in pattern.finditer(text)]
    payload = read_answer(structured, text)
    if payload is None:
        return None
    if search.items is not None:
        listed = pointers.resolve(payload, search.items)
    else:
        listed = next((value for value in payload.values() if isinstance(value, list)), None)
    if not isinstance(listed, list):
        return None
    return [item for item in listed if isinstance(item, dict)]


@dataclass(frozen=True)
class FilledArguments:
    arguments: dict[str, Any]
    described: str
    """The arguments taken from the send, in words (`to ada@example.com`)."""
    missing: tuple[str, ...]
    """Pointers the send does not fill: the read cannot be made without them."""


def read_arguments(
    mapping: Mapping[str, Any], request: Mapping[str, Any], *, provider_id: str | None, since: datetime
) -> FilledArguments:
    """A lookup's or a search's arguments for one stored send (see `model` for the values it maps)."""
    filled: dict[str, Any] = {}
    said: list[str] = []
    missing: list[str] = []
    for name, source in mapping.items():
        if isinstance(source, dict):
            filled[name] = Literal_.model_validate(source).literal
        elif source == PROVIDER_ID:
            if provider_id is None:
                missing.append(PROVIDER_ID)
            filled[name] = provider_id
        elif source == SINCE:
            filled[name] = since.isoformat()
        elif isinstance(source, str) and source.startswith("/"):
            value = pointers.resolve(request, source)
            if value is None:
                missing.append(source)
            filled[name] = value
            said.append(f"{name} {', '.join(map(str, value)) if isinstance(value, list) else value}")
        else:
            filled[name] = source
    return FilledArguments(filled, " ".join(said), tuple(missing))


class Profile:
    """The profile in use: which upstream tools are guarded, and each one's `ToolSpec`."""

    def __init__(self, data: ProfileData, source: str) -> None:
        self.data = data
        self.source = source
        """Where it came from (a built-in name or a file), for messages."""
        meta = data.profile
        self._specs = {
            entry.name: spec_of(entry, data.defaults, data.answers, data.rules, meta.key_retention_hours)
            for entry in data.tools
        }
        self._others: dict[str, ToolSpec] = {}
        self._default_key = pointers.top_level(data.defaults.key) if data.defaults.key is not None else None

    @property
    def name(self) -> str:
        return self.data.profile.name

    @property
    def display_name(self) -> str:
        """How texts name the upstream: `Hail`, `Resend`, `AgentMail`, or the profile's own."""
        meta = self.data.profile
        return meta.display_name or meta.name

    @property
    def key_env(self) -> str | None:
        """The variable that holds the upstream's API key, as the profile says."""
        return self.data.profile.key_env

    @property
    def pass_through(self) -> frozenset[str]:
        """Tools forwarded unguarded although they write to the world and name people."""
        return frozenset(self.data.profile.pass_through)

    @property
    def key_retention_hours(self) -> float:
        return self.data.profile.key_retention_hours

    @property
    def tools(self) -> Mapping[str, ToolSpec]:
        """The tools the profile names, in its order."""
        return self._specs

    def spec(self, tool: str) -> ToolSpec:
        """How to guard `tool`: its entry, else the defaults (a tool that takes the key, an operation recorded
        under another profile, a tool `[guard] guarded_tools` names)."""
        found = self._specs.get(tool) or self._others.get(tool)
        if found is None:
            data = self.data
            found = spec_of(ToolEntry(name=tool), data.defaults, data.answers, data.rules, self.key_retention_hours)
            self._others[tool] = found
        return found

    def guarded(self, schemas: Mapping[str, Mapping[str, Any]], configured: Sequence[str] | None) -> set[str]:
        """The upstream tools to guard: those configured, else those the profile names (and, with
        `guard_tools_taking_key`, every tool whose schema takes the key argument)."""
        if configured is not None:
            return set(configured) & set(schemas)
        guarded = set(self._specs) & set(schemas)
        if self.data.profile.guard_tools_taking_key and self._default_key is not None:
            for name, schema in schemas.items():
                properties = schema.get("properties")
                if isinstance(properties, Mapping) and self._default_key in properties:
                    guarded.add(name)
        return guarded

    def delivery_channels(self) -> list[str]:
        """The channels of the tools whose sends are polled for delivery (their lookup says `delivery`)."""
        polled = (spec.channel for spec in self._specs.values() if spec.lookup is not None and spec.lookup.delivery)
        return list(dict.fromkeys(polled))
