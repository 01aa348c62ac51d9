"""What an agent is told when a send repeats one the ledger holds, and whether a listed message is a send's.

`same_send` decides what counts as the same send (`same_send.judge`); `decide` turns its verdict into the
operation to answer from, or the refusal that says why nothing was sent: the same message overlapping
other recipients, a second copy while the first may be in flight, a recipient (or lead) with an unresolved
send, a text near the same as one a recipient has. No text ever tells an agent how to force a second send.
`sighting` applies the same idea to a message an upstream lists (the profile's `search`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from hail_guard import pointers, recipients, same_send
from hail_guard.errors import Held, KeyConflict, ProbableDuplicate, Suppressed
from hail_guard.models import Intent, Operation
from hail_guard.policy.answers import next_step, sentence, state_phrase
from hail_guard.profiles import DEFAULT_TIMES, Match, ToolSpec
from hail_guard.same_send import Candidates, Finding, Rules, Verdict


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


def decide(intent: Intent, found: Candidates, rules: Rules, where: str | None = None) -> Operation | None:
    """What the ledger does with a send whose key is new: None to record it, the operation to answer from
    (the same message to the same people), or a refusal raised (`same_send.judge` decides). `where` names a
    batch's send being planned (`send 3`, `line 4`)."""
    verdict = same_send.judge(intent, intent.text, found, rules)
    if verdict.finding is Finding.NEW:
        return None
    if verdict.finding is Finding.SAME:
        return verdict.operation
    raise refusal(intent, verdict, where)


def refusal(intent: Intent, verdict: Verdict, where: str | None = None) -> ProbableDuplicate | Held:
    """Why a send was not recorded, naming the operation in its way and the one safe step: for a batch's send
    being planned (`where`), leaving that send out (the earlier operation's own step is not this batch's)."""
    earlier = verdict.operation
    assert earlier is not None
    if verdict.finding is Finding.HELD:
        return Held(f"{where + ': ' if where else ''}{_held(intent, earlier)}", operation_id=earlier.id)
    if verdict.finding is Finding.SECOND_COPY:
        found = f"a second copy cannot be sent yet: {_has_it(earlier, intent)}"
    elif verdict.finding is Finding.NEAR:
        found = _near(earlier, intent, verdict.similarity or 0.0)
    else:
        found = _has_it(earlier, intent)
    if where is not None:
        return ProbableDuplicate(f"{where}: {found}. {_leave_out(where, earlier, intent)}", operation_id=earlier.id)
    said = f"{found}. Nothing was sent. {sentence(next_step(earlier))}."
    if verdict.finding is Finding.OVERLAP:
        said += f" {_the_others(earlier, intent)}"
    return ProbableDuplicate(said, operation_id=earlier.id)


def already_planned(intent: Intent, found: Candidates, rules: Rules, where: str) -> ProbableDuplicate | Held:
    """The refusal of a batch whose send (`where`) the ledger already has (planning refuses rather than answers)."""
    earlier = decide(intent, found, rules, where)  # an overlap or a near-same message is refused there
    assert earlier is not None
    return ProbableDuplicate(
        f"{where}: {_has_it(earlier, intent)}. {_leave_out(where, earlier, intent)}", operation_id=earlier.id
    )


def _leave_out(where: str, earlier: Operation, intent: Intent) -> str:
    """The one step for a batch refused at planning: leave the send out, or give it only the others it names."""
    shared = set(_shared(earlier, intent))
    others = [recipient for recipient in intent.recipients if recipient not in shared]
    instead = f", or give it only the others ({', '.join(others)})" if others else ""
    return f"Nothing was planned. Leave {where} out of the batch{instead}."


def _shared(earlier: Operation, intent: Intent) -> list[str]:
    theirs = {recipients.key_of(recipient) for recipient in earlier.recipients}
    return [recipient for recipient in intent.recipients if recipients.key_of(recipient) in theirs]


def _has_it(earlier: Operation, intent: Intent) -> str:
    shared = _shared(earlier, intent) or list(intent.recipients)
    verb = "has" if len(shared) == 1 else "have"
    return f"{', '.join(shared)} already {verb} this message: operation {earlier.id} is {state_phrase(earlier)}"


def _the_others(earlier: Operation, intent: Intent) -> str:
    shared = set(_shared(earlier, intent))
    others = [recipient for recipient in intent.recipients if recipient not in shared]
    if others:
        return f"Sending it to the others alone ({', '.join(others)}) is fine."
    return "Everyone this send names already has it."


def _held(intent: Intent, earlier: Operation) -> str:
    shared = _shared(earlier, intent)
    if shared:
        whom = f"{', '.join(shared)} {'has' if len(shared) == 1 else 'have'} an unsettled {earlier.channel} send"
    else:  # the same lead, on another channel
        whom = f"the same lead has an unsettled {earlier.channel} send"
    return (
        f"{whom}: operation {earlier.id} is {state_phrase(earlier)}. Nothing was sent: while it is unsettled nothing "
        f"new goes to them, whatever it says. {sentence(next_step(earlier))}; once it is settled, send this only if "
        "it is still wanted."
    )


def _near(earlier: Operation, intent: Intent, score: float) -> str:
    shared = _shared(earlier, intent) or list(intent.recipients)
    verb = "has" if len(shared) == 1 else "have"
    return (
        f"probably a duplicate: {', '.join(shared)} already {verb} a message {score:.0%} the same "
        f"(operation {earlier.id} is {state_phrase(earlier)})"
    )


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
    differing = [name for name in fields if same_send.meaning_of(old.get(name)) != same_send.meaning_of(new.get(name))]
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
    return bool(same_send.meaning_of(item) == same_send.meaning_of(sent))


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
