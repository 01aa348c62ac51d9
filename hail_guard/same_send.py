"""What counts as the same send: the one home of every rule that compares a new send with the ledger's.

An agent repeats by intent, not by bytes: it regenerates a call (a null added, a field re-cased, the
order changed), rewords it, switches channel, or runs a second proxy. So the unit of protection is the
recipient (its key: `recipients.key_of`), and every rule here compares sends recipient by recipient. One
text sent to many leads (a campaign) is never a duplicate of itself.

1. **The same message** (`same_meaning`): the same tool, the same message by meaning (`content_fingerprint`:
   nulls, empty fields, whitespace, Unicode form and `2.0`/`2` alike), the same recipients, the senders
   agreeing where both give one. The ledger answers it from the operation that has it; a send that
   overlaps one (some recipients have it, some not) is refused, naming who has it.
2. **A hold** (`HOLDING`): while a send to a recipient is `sending`, `unknown` or `needs_review`, nothing
   new goes to that recipient on that channel, whatever it says, nor (`Rules.hold_lead`) to the same lead
   on any channel (`lead_of`: the profile's `lead` pointers, Hail's `campaign_id` and `lead_id`). Settling
   it (`reconcile`, a human) lifts the hold. `allow_duplicate` never passes a hold.
3. **Near the same** (`similarity`): a text whose similarity to one a recipient has on that channel is at
   least `Rules.similarity_threshold` is a probable duplicate (a paraphrased retry); `allow_duplicate`
   (the user asked for a second copy) passes it.

**The window** (`Rules.window_seconds`) bounds only what has settled: a settled send (`accepted`, or closed
by an operator after it may have left) is compared while it first left within the window; unresolved and
waiting sends (`planned`, `ready`) are compared at any age. A window of 0 compares no settled send, nothing
more.

Both ledgers find the candidates with SQL written from the state sets here (`HOLDING`, `WAITING`,
`SETTLED_LIVE`, `Rules.match_states`) and decide with `judge`, so a rule is changed in this module only.
`policy.repeats` words the refusals.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from hail_guard import pointers
from hail_guard.canonical import canonical_json, fingerprint
from hail_guard.lifecycle import LIVE, UNRESOLVED
from hail_guard.models import Intent, Operation, State
from hail_guard.profiles import ToolSpec
from hail_guard.recipients import BadRecipient, key_of, keys_of, normalise_recipient

HOLDING: Final = UNRESOLVED
"""A send in these states may have reached its recipient, and nobody knows yet: it holds every new send to them."""
SETTLED_LIVE: Final = LIVE - UNRESOLVED - frozenset({State.PLANNED, State.READY})
"""It reached the recipient (`accepted`): compared only within the window."""
WAITING: Final = LIVE - UNRESOLVED - SETTLED_LIVE
"""It will be sent (`planned`, `ready`): compared at any age."""
DEFAULT_SIMILARITY = 0.85
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Rules:
    """How strict the comparison is (`[guard]` in the config), and how a stored send's message reads."""

    window_seconds: float = 24 * 3600.0
    """Settled sends are compared while they first left within this many seconds; 0: none are."""
    hold_lead: bool = True
    """A send to a lead with an unresolved send on any channel is held (`[guard] hold_lead_across_channels`)."""
    similarity_threshold: float | None = DEFAULT_SIMILARITY
    """A text at least this similar to one a recipient has is a probable duplicate; None: not compared."""
    message_of: Callable[[str, Mapping[str, Any]], str] | None = None
    """A send's `message_text` from its tool and arguments (by the tool's profile entry); None: texts are not
    compared."""

    @property
    def compares_near(self) -> bool:
        return self.similarity_threshold is not None and self.message_of is not None

    def match_states(self, *, allow_duplicate: bool) -> tuple[list[str], list[str], bool]:
        """For the SQL that finds the same message: the states compared at any age, those compared within the
        window, and whether an operator's close after it may have left counts (within the window)."""
        if allow_duplicate:  # a second copy of what settled is wanted: only what may be in flight blocks
            return _values(HOLDING), [], False
        return _values(HOLDING | WAITING), _values(SETTLED_LIVE), True


def _values(states: frozenset[State]) -> list[str]:
    return sorted(state.value for state in states)


# --- what a send means ----------------------------------------------------------------------------------


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


def content_fingerprint(spec: ToolSpec, arguments: Mapping[str, Any]) -> str:
    """What a message says, by meaning: the same for every form an agent's regenerated retry takes.

    Only the message counts (`ToolSpec.message`: the profile's `content`, else every argument but the
    recipients, sender, key and `not_content`; recipients are matched one by one, the sender only when both
    sends name one). Text is NFC with its whitespace collapsed; null, empty text, empty lists and empty
    objects count as absent; 2.0 is 2. It names the message in the ledger and, with the recipients and
    the sender, in a key derived from meaning (`meaning_digest`): it never changes between versions.
    """
    message = meaning_of(spec.message(arguments))
    return fingerprint(canonical_json({"tool": spec.name, "message": message or {}}))


def sender_of(spec: ToolSpec, arguments: Mapping[str, Any], *, region: str | None = None) -> dict[str, str]:
    """The sender fields a send gives, in their compared form (an address or number normalised, a name
    case-folded), by name."""
    sender: dict[str, str] = {}
    for pointer in (*spec.sender, *spec.sender_names):
        value = meaning_of(pointers.resolve(arguments, pointer))
        if value is None:
            continue
        text, name = str(value), pointers.shown(pointer)
        try:
            sender[name] = normalise_recipient(text, spec.channel, region=region) if pointer in spec.sender else ""
        except BadRecipient:
            sender[name] = ""
        sender[name] = sender[name] or text.casefold()
    return sender


def lead_of(spec: ToolSpec, arguments: Mapping[str, Any]) -> str | None:
    """Who a send is for by the caller's own records (the profile's `lead` pointers), as one text; None when a
    pointer gives nothing."""
    return lead_at(spec.lead, arguments)


def lead_at(where: Sequence[str], arguments: Mapping[str, Any]) -> str | None:
    """The lead the pointers `where` give in `arguments` (each a text or a number), as one text; else None."""
    values = [pointers.resolve(arguments, pointer) for pointer in where]
    if not values or not all(_usable(value) for value in values):
        return None
    return canonical_json([str(value).strip() for value in values])


def _usable(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool) and bool(str(value).strip())


def meaning_digest(spec: ToolSpec, reached: Sequence[str], content: str, sender: Mapping[str, str]) -> str:
    """A digest of the send's meaning (tool, recipients, message, sender): the same in every ledger for every
    form a regenerated retry takes, so a key derived from it (`keys.derive_key`) is too."""
    shape = {"tool": spec.name, "recipients": sorted(reached), "message": content, "sender": dict(sender)}
    return fingerprint(canonical_json(shape))


def message_text(spec: ToolSpec, arguments: Mapping[str, Any]) -> str:
    """The message as one text for `similarity`: its fields' text by meaning, in field order, lower-cased."""
    parts: list[str] = []
    _texts(meaning_of(spec.message(arguments)), parts)
    return "\n".join(parts).lower()


def _texts(value: Any, into: list[str]) -> None:
    if isinstance(value, Mapping):
        for name in sorted(value):
            _texts(value[name], into)
    elif isinstance(value, list):
        for item in value:
            _texts(item, into)
    elif value is not None:
        into.append(str(value))


def similarity(first: str, second: str) -> float:
    """How near two message texts are, from 0 to 1 (rapidfuzz's normalised Indel similarity)."""
    from rapidfuzz import fuzz  # here: only a send with a near candidate needs it

    return float(fuzz.ratio(first, second)) / 100.0


# --- the rules --------------------------------------------------------------------------------------------


def senders_agree(earlier: Mapping[str, str], later: Mapping[str, str]) -> bool:
    """Sender fields are compared only where both sends give them (left out: the upstream's default)."""
    return all(earlier[name] == later[name] for name in earlier.keys() & later.keys())


def keys_of_intent(intent: Intent) -> list[str]:
    """The recipients' keys (mailboxes) of a send, each once: what every rule compares."""
    return list(_keys(intent.recipients, intent.channel))


def forget_recipient_keys() -> None:
    """Empty the kept recipient keys (tests: each reads its recipients afresh)."""
    _keys.cache_clear()


@functools.lru_cache(maxsize=1024)
def _keys(reached: tuple[str, ...], channel: str) -> tuple[str, ...]:
    return tuple(keys_of(reached, channel))  # read as `comparable` first: an intent may come from anywhere


def same_meaning(operation: Operation, intent: Intent) -> bool:
    """True when `intent` is the same message to the same people as `operation`, whatever its form."""
    return (
        operation.tool == intent.tool
        and operation.content_fingerprint == intent.content_fingerprint
        and {key_of(recipient) for recipient in operation.recipients} == set(keys_of_intent(intent))
        and senders_agree(operation.sender, json.loads(intent.sender))
    )


def repeats(operation: Operation, intent: Intent) -> bool:
    """True when `intent` is `operation` again (under its key): the same bytes, or the same meaning."""
    return operation.request_fingerprint == intent.request_fingerprint or same_meaning(operation, intent)


class Finding(StrEnum):
    """What `judge` found about a new send."""

    NEW = "new"
    """Nothing in the ledger stands in its way: record it."""
    SAME = "same"
    """The same message to the same recipients: answer from `operation`."""
    OVERLAP = "overlap"
    """The same message, and some of its recipients have it: refused."""
    SECOND_COPY = "second_copy"
    """A second copy asked for (`allow_duplicate`) while the first may still be in flight: refused."""
    HELD = "held"
    """A recipient (or the lead) has an unresolved send: refused, whatever it says."""
    NEAR = "near"
    """A recipient has a text near the same (`similarity`): a probable duplicate, refused."""


@dataclass(frozen=True)
class Verdict:
    finding: Finding
    operation: Operation | None = None
    similarity: float | None = None


@dataclass(frozen=True)
class Candidates:
    """What a ledger found for a new send, each list newest first."""

    matches: Sequence[Operation] = ()
    """The same message to a shared recipient key, in a blocking state (`Rules.match_states`)."""
    holds: Sequence[Operation] = ()
    """Unresolved sends to a shared recipient key on the channel, or to the same lead."""
    near: Sequence[Operation] = ()
    """Other messages to a shared recipient key on the channel that would count as sent (`WAITING`, or
    `SETTLED_LIVE` within the window): compared by `similarity`."""


def judge(intent: Intent, text: str, found: Candidates, rules: Rules) -> Verdict:
    """The one decision about a send whose key is new (`text`: its `message_text`)."""
    if found.matches:
        return _the_same(intent, found.matches)
    if found.holds:
        return Verdict(Finding.HELD, found.holds[0])
    threshold = rules.similarity_threshold
    if threshold is None or rules.message_of is None or intent.allow_duplicate:
        return Verdict(Finding.NEW)
    best = Verdict(Finding.NEW)
    for operation in found.near:
        score = similarity(text, rules.message_of(operation.tool, operation.arguments()))
        if score >= threshold and (best.similarity is None or score > best.similarity):
            best = Verdict(Finding.NEAR, operation, round(score, 3))
    return best


def _the_same(intent: Intent, matches: Sequence[Operation]) -> Verdict:
    if intent.allow_duplicate:
        return Verdict(Finding.SECOND_COPY, matches[0])
    wanted = set(keys_of_intent(intent))
    same = [operation for operation in matches if {key_of(r) for r in operation.recipients} == wanted]
    if same:  # the live one of a resend first
        return Verdict(Finding.SAME, min(same, key=lambda operation: operation.resent_as is not None))
    return Verdict(Finding.OVERLAP, matches[0])
