"""Retry by meaning: whether a new send repeats a message the ledger holds, and the refusals that say so.

A retry of a send is recognised by what it says and to whom (`same_meaning`: the tool, the message's
content fingerprint, the recipients, the sender fields both give), not by its bytes or its key. Both
ledger backends decide with these functions (the PostgreSQL one in SQL, from `blocking_states`), so a
repeat is answered from the ledger, an overlap or an opt-out is refused, and no text ever invites a
second send. `sighting` applies the same idea to a message an upstream lists (the profile's `search`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hail_guard import keys, pointers, recipients
from hail_guard.errors import (
    KeyConflict,
    ProbableDuplicate,
    Suppressed,
)
from hail_guard.lifecycle import LIVE, UNRESOLVED
from hail_guard.models import Intent, Operation
from hail_guard.policy.answers import next_step, sentence, state_phrase
from hail_guard.profiles import DEFAULT_TIMES, Match, ToolSpec


def suppressed_refusal(recipients: Sequence[str], channel: str) -> Suppressed:
    """The refusal for a send to a recipient who opted out (both ledger backends raise it)."""
    if len(recipients) == 1:
        return Suppressed(
            f"{recipients[0]} opted out of {channel}; nothing was recorded or sent (see `hail-guard suppress list`)"
        )
    return Suppressed(
        f"one of {', '.join(recipients)} opted out of {channel}; nothing was recorded or sent. Send it without "
        "them (`hail-guard suppress list` names who)"
    )


def blocks(operation: Operation, *, allow_duplicate: bool) -> bool:
    """Whether `operation` (the same message to a shared recipient) stops a new one being recorded.

    `allow_duplicate` (the user asked for a second copy) passes what has settled, never what may still
    be sending or may have been sent unseen: `sending`, `unknown`, `needs_review`.
    """
    if allow_duplicate:
        return operation.state in UNRESOLVED
    return operation.state in LIVE or operation.may_have_left


def blocking_states(*, allow_duplicate: bool) -> tuple[list[str], bool]:
    """`blocks` for SQL: the states that block, and whether an operator's close after sending does."""
    states = UNRESOLVED if allow_duplicate else LIVE
    return sorted(state.value for state in states), not allow_duplicate


def senders_agree(earlier: Mapping[str, str], later: Mapping[str, str]) -> bool:
    """Sender fields are compared only where both sends give them (left out: the upstream's default)."""
    return all(earlier[name] == later[name] for name in earlier.keys() & later.keys())


def same_meaning(operation: Operation, intent: Intent) -> bool:
    """True when `intent` is the same message to the same people as `operation`, whatever its form."""
    return (
        operation.tool == intent.tool
        and operation.content_fingerprint == intent.content_fingerprint
        and set(operation.recipients) == set(intent.recipients)
        and senders_agree(operation.sender, json.loads(intent.sender))
    )


def repeat_of(intent: Intent, matches: Sequence[Operation], position: int | None = None) -> Operation:
    """The operation a new send repeats, among `matches`: operations that block it (`blocks`), each with the
    same message for at least one of its recipients, newest first.

    The same recipients: the send is that operation again (answer from it). Overlapping ones: refused,
    naming who already has it. Either way nothing new is recorded, and no text invites a second send.
    """
    where = f"send {position}: " if position is not None else ""
    if intent.allow_duplicate:
        raise ProbableDuplicate(
            f"{where}a second copy cannot be sent yet: {_has_it(matches[0], intent)}. "
            f"Nothing was sent. {sentence(next_step(matches[0]))}.",
            operation_id=matches[0].id,
        )
    wanted = set(intent.recipients)
    same = [operation for operation in matches if set(operation.recipients) == wanted]
    if same:
        return min(same, key=lambda operation: operation.resent_as is not None)  # the live one of a resend
    earlier = matches[0]
    others = [recipient for recipient in intent.recipients if recipient not in earlier.recipients]
    rest = (
        f"Sending it to the others alone ({', '.join(others)}) is fine."
        if others
        else "Everyone this send names already has it."
    )
    raise ProbableDuplicate(
        f"{where}{_has_it(earlier, intent)}. Nothing was sent. {sentence(next_step(earlier))}. {rest}",
        operation_id=earlier.id,
    )


def already_planned(intent: Intent, matches: Sequence[Operation], position: int) -> ProbableDuplicate:
    """The refusal of a batch whose send `position` the ledger already has (`repeat_of`, for planning)."""
    earlier = repeat_of(intent, matches, position)  # an overlap is refused there
    return ProbableDuplicate(
        f"send {position}: {_has_it(earlier, intent)}. Nothing was planned. Leave send {position} out of the batch",
        operation_id=earlier.id,
    )


def _has_it(earlier: Operation, intent: Intent) -> str:
    shared = [recipient for recipient in intent.recipients if recipient in earlier.recipients]
    verb = "has" if len(shared) == 1 else "have"
    return f"{', '.join(shared)} already {verb} this message: operation {earlier.id} is {state_phrase(earlier)}"


def key_conflict(spec: ToolSpec, earlier: Operation, intent: Intent, request: Mapping[str, Any]) -> KeyConflict:
    """The refusal for a used key with a different message (by meaning); names the differences."""
    fields = meaning_differences(spec, earlier, intent, request)
    return KeyConflict(
        f"idempotency key {earlier.idempotency_key!r} belongs to operation {earlier.id}, which is "
        f"{state_phrase(earlier)}, with a different message (it differs in: {', '.join(fields)}). Nothing was "
        f"sent. {sentence(next_step(earlier))}.",
        differing_fields=fields,
    )


def meaning_differences(spec: ToolSpec, earlier: Operation, intent: Intent, request: Mapping[str, Any]) -> list[str]:
    """What differs by meaning between a stored operation and a new send under its key (names only)."""
    old, new = spec.message(earlier.arguments()), spec.message(request)
    fields = sorted(set(old) | set(new))
    differing = [name for name in fields if keys.meaning_of(old.get(name)) != keys.meaning_of(new.get(name))]
    if set(earlier.recipients) != set(intent.recipients):
        differing.append("recipients")
    later = json.loads(intent.sender)
    differing += sorted(name for name in earlier.sender.keys() & later.keys() if earlier.sender[name] != later[name])
    return differing or ["(the request)"]


SIGHTING_MARGIN_SECONDS = 300.0
"""A message the upstream lists this long before an operation was recorded may still be it (clocks differ)."""


@dataclass(frozen=True)
class Sighted:
    """A listed item that is, or looks like, an operation's message."""

    record: dict[str, Any]
    provider_id: str | None
    proven: bool
    """True when it is the message for sure: it carries the operation's key, or (an upstream that takes no
    key) it says everything the profile matches alike, it was sent after the operation was recorded, and no
    other operation holds its id."""
    by_key: bool = False


def sighting(
    spec: ToolSpec, operation: Operation, records: Sequence[object], *, claimed: Collection[str] = ()
) -> Sighted | None:
    """Among items an upstream listed for an operation's search (`spec.search`), the one that is its message,
    or the first that looks like it. `claimed` holds the ids other operations already have."""
    search = spec.search
    if search is None:
        return None
    request = operation.arguments()
    since = operation.created_at - timedelta(seconds=SIGHTING_MARGIN_SECONDS)
    matches = search.matches()
    for record in records:
        if not isinstance(record, dict):
            continue
        found = pointers.resolve(record, search.id or spec.provider_id)
        found_id = str(found) if isinstance(found, str | int) and not isinstance(found, bool) else None
        if search.key is not None and pointers.resolve(record, search.key) == operation.idempotency_key:
            return Sighted(record, found_id, proven=True, by_key=True)
        created = _time_of(record, search.time)
        if created is None or created < since or (found_id is not None and found_id in claimed):
            continue
        said = [match for match in matches if _said(record, request, match)]
        if all(_alike(record, request, match, spec.channel) for match in said):
            proven = not spec.forwards_key and found_id is not None and bool(matches) and len(said) == len(matches)
            return Sighted(record, found_id, proven=proven)
    return None


def _said(record: Mapping[str, Any], request: Mapping[str, Any], match: Match) -> bool:
    item = pointers.resolve(record, match.item or match.argument)
    return item is not None and pointers.resolve(request, match.argument) is not None


def _alike(record: Mapping[str, Any], request: Mapping[str, Any], match: Match, channel: str) -> bool:
    item = pointers.resolve(record, match.item or match.argument)
    sent = pointers.resolve(request, match.argument)
    if match.compare == "recipients":
        return _recipient_set(item, channel) == _recipient_set(sent, channel)
    return bool(keys.meaning_of(item) == keys.meaning_of(sent))


def _recipient_set(value: object, channel: str) -> frozenset[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    return frozenset(recipients.comparable(str(item), channel) for item in items if str(item).strip())


def _time_of(record: Mapping[str, Any], fields: Sequence[str] | None) -> datetime | None:
    for pointer in fields if fields is not None else DEFAULT_TIMES:
        value = pointers.resolve(record, pointer)
        if value:
            return _moment(value)
    return None


def _moment(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
