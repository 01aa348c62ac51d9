"""A profile: an upstream's contract as data, as read from its TOML file (pydantic, strict).

    [profile]   name, display_name, description, key_env, key_retention_hours, guard_tools_taking_key,
                pass_through
    [defaults]  what every tool entry leaves out (recipients, sender, key, provider_id, ...)
    [[tools]]   one guarded tool each: channel, recipients, content, key, provider_id, lookup, search, rules
    [answers]   how an answer is read and sorted: the error field, isError, the table of patterns
    [[rules]]   argument rules for every guarded tool (Hail's strict consent, say)

Fields are JSON pointers (`hail_guard.pointers`). A lookup's and a search's `arguments` map each argument
of the read tool to a value: a pointer into the send's arguments (`"/channel"`), `"$provider_id"`,
`"$since"` (when the send was recorded, less a margin, ISO 8601), or a literal (`{ literal = "/x" }` for
a text that starts with `/` or `$`). `hail_guard.profiles.spec` turns it into the `Profile` the guard reads.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from hail_guard import pointers

PROVIDER_ID = "$provider_id"
SINCE = "$since"


def _pointer(value: str) -> str:
    pointers.parse(value)  # PointerError (a ValueError): pydantic names the key
    return value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
    return value


def _top_level(value: str) -> str:
    if pointers.top_level(_pointer(value)) is None:
        raise ValueError(f"{value!r} must name one top-level argument, such as '/idempotency_key'")
    return value


Pointer = Annotated[str, AfterValidator(_pointer)]
Regex = Annotated[str, AfterValidator(_regex)]
ArgumentPointer = Annotated[str, AfterValidator(_top_level)]
Kind = Literal["refused", "still_processing", "key_conflict", "retry_later", "gateway_error", "lost", "unrecognised"]
"""What a pattern may say an error is (`models.AnswerKind`; acceptance is read from the answer itself)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Meta(_Strict):
    name: str = Field(min_length=1)
    display_name: str | None = Field(default=None, min_length=1, max_length=60)
    """How every text names the upstream (`Resend`); default: `name`."""
    description: str = ""
    key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The variable that holds the upstream's API key (`RESEND_API_KEY`), unless `[upstream] token_env` names one."""
    pass_through: list[str] = Field(default_factory=list)
    """Tools that write to the world and name people, but send nothing (Resend's `create-contact`): forwarded
    unguarded. Any other such tool the profile does not guard is refused (`profiles.sending`)."""
    key_retention_hours: float = Field(default=24.0, gt=0)
    """How long the upstream keeps a key: replays stop this long (less a margin) after the first attempt."""
    guard_tools_taking_key: bool = False
    """Also guard every other upstream tool whose schema takes the defaults' key argument, with the defaults."""


class Literal_(_Strict):
    literal: Any


class Lookup(_Strict):
    """How to read a send back by the upstream's id."""

    tool: str = Field(min_length=1)
    arguments: dict[str, Any]
    id: Pointer = "/id"
    """Where the answer carries the id (it must equal the provider id for the message to be found)."""
    answer_text: Regex | None = None
    """For answers in words: a pattern whose named groups are the answer's fields (`json`: a JSON object)."""
    delivery: bool = False
    """Poll it for delivery (the answer's `status` and `<state>_at` fields, as Hail's records carry them)."""

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked_arguments(value)


class Match(_Strict):
    argument: Pointer
    """In the send's arguments."""
    item: Pointer | None = None
    """In a listed item (default: the same pointer)."""
    compare: Literal["text", "recipients"] = "text"
    """`text`: by meaning (whitespace, case of nothing); `recipients`: as sets of normalised recipients."""


class Search(_Strict):
    """How to find a send among the upstream's messages when no id came back."""

    tool: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    match: list[Pointer | Match] = Field(default_factory=list)
    """What a listed item must say alike (all of them, where the upstream takes no key)."""
    items: Pointer | None = None
    """Where the answer lists its items (default: its first list of objects)."""
    item_text: Regex | None = None
    """For answers in words: a pattern matched line by line, each match an item of its named groups."""
    id: Pointer | None = None
    """An item's id (default: the tool's `provider_id`)."""
    time: list[Pointer] | None = None
    """An item's time, the first of these it has (default: created_at, timestamp, createdAt, sent_at, ...)."""
    key: Pointer | None = None
    """An item's idempotency key: an item under the send's own key is proof that it was accepted."""

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked_arguments(value)

    def matches(self) -> list[Match]:
        return [entry if isinstance(entry, Match) else Match(argument=entry) for entry in self.match]


class Rule(_Strict):
    """One argument rule, checked before anything is recorded (a refusal records nothing)."""

    tools: list[str] | None = None
    """In `[[rules]]`: only for these tools (default: every guarded tool)."""
    field: Pointer | None = None
    when: dict[str, Any] = Field(default_factory=dict)
    """Only when these arguments (pointers) have these values."""
    when_declared: bool = False
    """Only when the tool's schema declares `field`, or the call gives it."""
    equals: Any = None
    length: tuple[int, int] | None = None
    pattern: Regex | None = None
    not_empty: bool = False
    text: bool = False
    """With `not_empty` or `one_of`: a text with something besides whitespace."""
    one_of: list[Pointer] | None = None
    message: str = Field(min_length=1)
    """The refusal; may say {field}, {got} (the value as JSON), {shown} (as Python writes it), {length}."""
    refusal: Literal["input", "policy"] = "input"
    """`input`: bad arguments (`invalid arguments for TOOL: ...`); `policy`: a rule's refusal, said as written."""

    @model_validator(mode="after")
    def _one_check(self) -> Rule:
        checks = [self.equals is not None, self.length is not None, self.pattern is not None, self.not_empty]
        if self.one_of is not None:
            if self.field is not None or any(checks):
                raise ValueError("a rule with one_of takes no field and no other check")
        elif self.field is None or sum(checks) != 1:
            raise ValueError("a rule names a field and exactly one check: equals, length, pattern or not_empty")
        for name in self.when:
            _pointer(name)
        try:
            self.message.format(field="f", got="g", shown="s", length=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"message {self.message!r} uses a placeholder other than {{field}}, {{got}}, "
                             f"{{shown}}, {{length}}: {exc}") from None  # fmt: skip
        return self


class Pattern(_Strict):
    match: Regex
    kind: Kind
    tools: list[str] | None = None
    """Only for these tools (default: every tool)."""
    retry_after_seconds: float | None = Field(default=None, ge=0)
    """For `retry_later`: the wait when the text names none."""


class FailedRecord(_Strict):
    """An answer that is the upstream's record of a send it failed (an SMS the carrier refused, say)."""

    field: Pointer
    equals: Any
    detail: Pointer
    """Where the record says why; the record counts only when it says something here."""
    reason: str = "the upstream refused it"


class Answers(_Strict):
    error: Pointer | None = None
    """Where an ordinary result carries an error text (Hail: `/error`); none: only isError is an error."""
    is_error: Literal["lost", "classify"] = "lost"
    """`lost`: an isError answer may hide a send (unknown); `classify`: sort its text with the patterns."""
    field_errors: bool = False
    """`<field>: ...` errors: refused when the field is in the tool's schema, else a success misread."""
    retry_after: Regex | None = None
    """Reads the wait a `retry_later` text names; its first group is seconds."""
    not_found: Regex | None = None
    """An error text that means "no such message" to a lookup (an answer, not a failure)."""
    patterns: list[Pattern] = Field(default_factory=list)
    """First match wins."""
    failed: list[FailedRecord] = Field(default_factory=list)


class ToolFields(_Strict):
    """What a tool entry and `[defaults]` both say; left out: from the defaults, then the built-in defaults."""

    channel: str | None = None
    recipients: list[Pointer] | None = None
    content: list[Pointer] | None = None
    """The arguments that make up the message; default: every argument but those below and `not_content`."""
    not_content: list[ArgumentPointer] | None = None
    sender: list[Pointer] | None = None
    """Who it is from, compared as addresses or numbers (only where both sends give them)."""
    sender_names: list[Pointer] | None = None
    """Who it is from, compared as names (case-folded)."""
    lead: list[Pointer] | None = None
    """Who a send is for in the caller's own records (default: `/metadata/campaign_id` and `/metadata/lead_id`):
    while a send to a lead is unresolved, nothing new goes to that lead on any channel; `[]`: never held so."""
    key: ArgumentPointer | None = None
    """The upstream's idempotency key argument; none: the upstream takes no key."""
    key_checked: bool | None = None
    """The key argument's name does not say it is a key (`profile check` refuses such a key unless this is true)."""
    provider_id: Pointer | None = None
    """Where an accepted answer carries the upstream's id (default `/id`)."""
    required: list[Pointer] | None = None
    """What else an accepted answer must carry."""
    answer_text: Regex | None = None
    """For answers in words: a pattern whose named groups are the answer's fields (`json`: a JSON object)."""


class ToolEntry(ToolFields):
    name: str = Field(min_length=1)
    lookup: Lookup | None = None
    search: Search | None = None
    rules: list[Rule] = Field(default_factory=list)


class ProfileData(_Strict):
    """A profile file as written."""

    profile: Meta
    defaults: ToolFields = Field(default_factory=ToolFields)
    tools: list[ToolEntry] = Field(default_factory=list)
    answers: Answers = Field(default_factory=Answers)
    rules: list[Rule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names_once(self) -> ProfileData:
        names = [tool.name for tool in self.tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"tools named more than once: {', '.join(twice)}; give each tool one [[tools]] entry")
        if self.profile.guard_tools_taking_key and self.defaults.key is None:
            raise ValueError("guard_tools_taking_key needs the key argument in [defaults] (key = '/...')")
        both = sorted(set(names) & set(self.profile.pass_through))
        if both:
            raise ValueError(f"tools both guarded and in pass_through: {', '.join(both)}; a tool is one or the other")
        return self


def _checked_arguments(value: dict[str, Any]) -> dict[str, Any]:
    for name, source in value.items():
        if isinstance(source, str) and source.startswith("/"):
            _pointer(source)
        elif isinstance(source, str) and source.startswith("$") and source not in (PROVIDER_ID, SINCE):
            raise ValueError(
                f"argument {name!r}: {source!r} is not one of {PROVIDER_ID}, {SINCE}; "
                "write { literal = ... } for a text that starts with $"
            )
        elif isinstance(source, dict):
            Literal_.model_validate(source)
    return value
