"""Pure decisions: what Hail's answer means, what state follows, what is refused up front.

Every text Hail is known to answer is matched here, in `_ERROR_PATTERNS`, and nowhere else
(DESIGN.md, classification; HAIL_CONTRACT.md, how failures read). No I/O in this module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import jsonschema

from hail_guard import keys, nesting
from hail_guard.errors import BadInput, KeyConflict, ProbableDuplicate, RefusedByPolicy, Suppressed
from hail_guard.lifecycle import LIVE, UNRESOLVED
from hail_guard.models import Answer, AnswerKind, Intent, Operation, Outcome, State, Suppression

DEFAULT_RETRY_AFTER_SECONDS = 30.0
"""A rate limit that names no wait waits this long; auth and no-free-number answers may retry at once."""
CHECK_AGAIN_SECONDS = 5.0
"""How soon reconcile looks again at an operation that is still unclear."""
RETENTION_MARGIN_SECONDS = 3600.0
"""Replays stop this long before the upstream's key retention runs out."""
REVIEW_RESOLUTIONS = (State.ACCEPTED, State.FAILED, State.CANCELLED)
"""What an operator may decide a `needs_review` operation became."""
WEBHOOK_DEDUPE_SECONDS = 3 * 86400.0
"""Processed webhook deliveries are kept at least this long: Hail retries one for about 31 hours."""


@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern[str]
    kind: AnswerKind
    tools: frozenset[str] | None = None
    """Only for these tools (None: every tool)."""


def _pattern(regex: str, kind: AnswerKind, tools: set[str] | None = None) -> _Pattern:
    return _Pattern(re.compile(regex, re.IGNORECASE | re.DOTALL), kind, frozenset(tools) if tools else None)


# Order matters: the first match wins.
_ERROR_PATTERNS: tuple[_Pattern, ...] = (
    _pattern(r"^idempotency key reused with a different request body", AnswerKind.KEY_CONFLICT),
    _pattern(r"^request with this idempotency key is still processing", AnswerKind.STILL_PROCESSING),
    _pattern(r"^hail api error 429\b", AnswerKind.RETRY_LATER),
    _pattern(r"^auth failed\b", AnswerKind.RETRY_LATER),
    _pattern(r"\bno\b.*\bnumbers?\b.*\b(free|available)\b", AnswerKind.RETRY_LATER, {"place_call"}),
    _pattern(r"^hail upstream error: 5\d\d\b", AnswerKind.GATEWAY_ERROR),
    _pattern(r"^hail api error 4\d\d\b", AnswerKind.REFUSED),
    _pattern(r"^\[\{'loc': ", AnswerKind.REFUSED),
    _pattern(r"^resource not found$", AnswerKind.REFUSED),
)
_RETRY_AFTER = re.compile(r"retry after (\d+(?:\.\d+)?) seconds?", re.IGNORECASE)
_FIELD_ERROR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z0-9_.]+)?: ")


def classify(
    tool: str,
    *,
    is_error: bool,
    payload: Mapping[str, Any] | None,
    text: str,
    request: Mapping[str, Any],
    declared: Collection[str] | None = None,
) -> Answer:
    """Sort one upstream answer to a send (see the table in DESIGN.md).

    `declared` names the properties of the tool's input schema (None: unknown, then the request's own
    fields stand in for them).
    """
    if is_error:
        return Answer(kind=AnswerKind.LOST, error=text or "the upstream answered with an error")
    if payload is None:
        payload = _payload_from_text(text)
    if payload is None:
        return Answer(kind=AnswerKind.LOST, error=f"unreadable answer: {text[:200]!r}")
    if "error" in payload:
        return _classify_error(tool, payload["error"], request if declared is None else declared)
    provider_id = payload.get("id")
    if not isinstance(provider_id, str) or not provider_id or "status" not in payload:
        return Answer(kind=AnswerKind.LOST, result=dict(payload), error="the answer has no id and status")
    if payload.get("status") == "failed" and payload.get("error_code") is not None:
        return Answer(
            kind=AnswerKind.REFUSED,
            result=dict(payload),
            provider_id=provider_id,
            error=f"carrier refused: {payload.get('error_code')}",
        )
    return Answer(kind=AnswerKind.ACCEPTED, result=dict(payload), provider_id=provider_id)


def _payload_from_text(text: str) -> Mapping[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _classify_error(tool: str, error: object, declared: Collection[str]) -> Answer:
    if not isinstance(error, str):
        return Answer(kind=AnswerKind.UNRECOGNISED, error=json.dumps(error, default=str)[:500])
    for pattern in _ERROR_PATTERNS:
        if (pattern.tools is None or tool in pattern.tools) and pattern.regex.search(error):
            retry_after = _retry_after(error) if pattern.kind is AnswerKind.RETRY_LATER else None
            if retry_after is None and error.lower().startswith("hail api error 429"):
                retry_after = DEFAULT_RETRY_AFTER_SECONDS
            return Answer(kind=pattern.kind, error=error, retry_after_seconds=retry_after)
    field = _FIELD_ERROR.match(error)
    if field is not None:
        # A local validation error names a field of the tool's schema; one naming any other field is Hail
        # failing to read its own success answer (HAIL_CONTRACT.md), even when the request carried it.
        refused = field.group(1) in declared
        return Answer(kind=AnswerKind.REFUSED if refused else AnswerKind.MISREAD_SUCCESS, error=error)
    return Answer(kind=AnswerKind.UNRECOGNISED, error=error)


def declared_fields(schema: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The property names a tool's input schema declares (None when the schema is not known)."""
    if schema is None:
        return None
    properties = schema.get("properties")
    return frozenset(properties) if isinstance(properties, Mapping) else frozenset()


def _retry_after(error: str) -> float | None:
    match = _RETRY_AFTER.search(error)
    return float(match.group(1)) if match else None


_FIRST_ATTEMPT: dict[AnswerKind, State] = {
    AnswerKind.ACCEPTED: State.ACCEPTED,
    AnswerKind.REFUSED: State.FAILED,
    AnswerKind.STILL_PROCESSING: State.UNKNOWN,
    AnswerKind.KEY_CONFLICT: State.NEEDS_REVIEW,
    AnswerKind.RETRY_LATER: State.READY,
    AnswerKind.GATEWAY_ERROR: State.UNKNOWN,
    AnswerKind.LOST: State.UNKNOWN,
    AnswerKind.MISREAD_SUCCESS: State.UNKNOWN,
    AnswerKind.UNRECOGNISED: State.UNKNOWN,
}

_REASONS: dict[AnswerKind, str] = {
    AnswerKind.ACCEPTED: "Hail accepted the request",
    AnswerKind.REFUSED: "Hail refused the request for good",
    AnswerKind.STILL_PROCESSING: "Hail is still processing this key",
    AnswerKind.KEY_CONFLICT: "Hail holds this key for a different request",
    AnswerKind.RETRY_LATER: ("Hail saved nothing (rate limit, auth or no free number); the same key is safe later"),
    AnswerKind.GATEWAY_ERROR: "a gateway error that may hide a success",
    AnswerKind.LOST: "no usable answer: the request may have been sent",
    AnswerKind.MISREAD_SUCCESS: "Hail could not read its own answer; the message may have been sent",
    AnswerKind.UNRECOGNISED: "an error hail-guard does not recognise",
}


def outcome_of_send(answer: Answer) -> Outcome:
    """The outcome of a first attempt (`sending` -> ...)."""
    state = _FIRST_ATTEMPT[answer.kind]
    return Outcome(
        state=state,
        reason=_REASONS[answer.kind],
        provider_id=answer.provider_id,
        result=answer.result,
        error=answer.error,
        not_before_seconds=answer.retry_after_seconds if state is State.READY else None,
        check_after_seconds=_first_check_after(answer.kind) if state is State.UNKNOWN else None,
        review_reason=_REASONS[answer.kind] if state is State.NEEDS_REVIEW else None,
    )


def _first_check_after(kind: AnswerKind) -> float:
    """An unknown is due for reconcile at once, unless Hail said it is still working on it."""
    return CHECK_AGAIN_SECONDS if kind is AnswerKind.STILL_PROCESSING else 0.0


def outcome_of_replay(answer: Answer, *, previous_error: str | None, attempts: int, max_attempts: int) -> Outcome:
    """The outcome of a same-key replay by reconcile (`unknown` -> ...).

    `attempts` counts the replay being judged. An error that repeats unchanged is Hail replaying
    what it saved: an unrecognised one is a saved failure, a misread success stays unreadable.
    """
    kind = answer.kind
    repeated = answer.error is not None and answer.error == previous_error
    base = Outcome(
        state=State.UNKNOWN,
        reason=_REASONS[kind],
        provider_id=answer.provider_id,
        result=answer.result,
        error=answer.error,
    )
    if kind is AnswerKind.ACCEPTED:
        return base.model_copy(update={"state": State.ACCEPTED})
    if kind is AnswerKind.REFUSED or (kind is AnswerKind.UNRECOGNISED and repeated):
        return base.model_copy(update={"state": State.FAILED, "reason": "Hail replayed a saved failure"})
    if kind is AnswerKind.KEY_CONFLICT or (kind is AnswerKind.MISREAD_SUCCESS and repeated):
        return base.model_copy(update={"state": State.NEEDS_REVIEW, "review_reason": _REASONS[kind]})
    if attempts >= max_attempts:
        reason = f"still unclear after {attempts} reconcile attempts: {_REASONS[kind]}"
        return base.model_copy(update={"state": State.NEEDS_REVIEW, "review_reason": reason, "reason": reason})
    wait = answer.retry_after_seconds if kind is AnswerKind.RETRY_LATER else None
    return base.model_copy(update={"check_after_seconds": wait or CHECK_AGAIN_SECONDS})


def replay_not_made(error: str) -> Outcome:
    """A reconcile replay that never left (Hail unreachable): still unknown, and the attempt is not spent."""
    return Outcome(
        state=State.UNKNOWN,
        reason="Hail could not be reached; nothing was replayed",
        error=error,
        check_after_seconds=CHECK_AGAIN_SECONDS,
        attempted=False,
    )


def lookup_failed(error: str) -> Outcome:
    """A reconcile lookup that got no answer: still unknown, looked up again soon."""
    return Outcome(
        state=State.UNKNOWN, reason="the lookup got no answer", error=error, check_after_seconds=CHECK_AGAIN_SECONDS
    )


class ReconcileStep(StrEnum):
    LOOKUP = "lookup"
    """The provider id is known: read the message back."""
    REVIEW = "review"
    """A replay could send again: a human decides (after a search of Hail's messages found nothing)."""
    REPLAY = "replay"
    """Replay the stored request under the same key."""


@dataclass(frozen=True)
class ReconcilePlan:
    step: ReconcileStep
    reason: str = ""


def plan_reconcile(
    operation: Operation, *, now: datetime, key_retention_hours: float, recipient_suppressed: bool
) -> ReconcilePlan:
    """DESIGN.md, reconcile: what to do with one `unknown` operation."""
    if operation.provider_id:
        return ReconcilePlan(ReconcileStep.LOOKUP)
    if recipient_suppressed:
        return ReconcilePlan(ReconcileStep.REVIEW, "the recipient opted out; a replay could be the first send")
    started = operation.first_sent_at or operation.created_at
    horizon = timedelta(hours=key_retention_hours) - timedelta(seconds=RETENTION_MARGIN_SECONDS)
    if now - started > horizon:
        return ReconcilePlan(
            ReconcileStep.REVIEW,
            f"first sent {started.isoformat()}, older than Hail's key retention "
            f"({key_retention_hours:g} h) less a margin: a replay could send again",
        )
    return ReconcilePlan(ReconcileStep.REPLAY)


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


def key_conflict(earlier: Operation, intent: Intent, request: Mapping[str, Any]) -> KeyConflict:
    """The refusal for a used key with a different message (by meaning); names the differences."""
    fields = meaning_differences(earlier, intent, request)
    return KeyConflict(
        f"idempotency key {earlier.idempotency_key!r} belongs to operation {earlier.id}, which is "
        f"{state_phrase(earlier)}, with a different message (it differs in: {', '.join(fields)}). Nothing was "
        f"sent. {sentence(next_step(earlier))}.",
        differing_fields=fields,
    )


def meaning_differences(earlier: Operation, intent: Intent, request: Mapping[str, Any]) -> list[str]:
    """What differs by meaning between a stored operation and a new send under its key (names only)."""
    old, new = earlier.arguments(), dict(request)
    fields = [name for name in sorted(set(old) | set(new)) if keys.message_field(name)]
    differing = [name for name in fields if keys.meaning_of(old.get(name)) != keys.meaning_of(new.get(name))]
    if set(earlier.recipients) != set(intent.recipients):
        differing.append("recipients")
    later = json.loads(intent.sender)
    differing += sorted(name for name in earlier.sender.keys() & later.keys() if earlier.sender[name] != later[name])
    return differing or ["(the request)"]


def state_phrase(operation: Operation) -> str:
    """How an answer names an operation's state, honest about what it means for the recipient."""
    if operation.may_have_left:
        return f"{operation.state.value} (closed by an operator; it may have been sent)"
    return {
        State.ACCEPTED: "accepted by Hail",
        State.UNKNOWN: "unknown (Hail may have sent it)",
        State.SENDING: "being sent right now",
        State.NEEDS_REVIEW: "waiting for a human decision (it may have been sent)",
        State.READY: "waiting to be sent",
        State.PLANNED: "planned, waiting for approval",
        State.FAILED: "failed (refused by Hail)",
        State.CANCELLED: "cancelled before it was sent",
    }[operation.state]


_NEXT_STEP = {
    State.ACCEPTED: "done: Hail accepted it (delivery is tracked apart); do not send it again",
    State.FAILED: "Hail refused it for good: fix the cause, then send a new message (it needs a new key)",
    State.UNKNOWN: "do NOT resend it, in any form: call `reconcile` with operation_id={id}",
    State.SENDING: "do not send it again: call `get_operation` with operation_id={id} in a minute",
    State.READY: "call again later with the same arguments (the same key is safe)",
    State.PLANNED: "wait for an operator to approve the batch (`hail-guard batch approve`)",
    State.NEEDS_REVIEW: "do not send it again: a human decides (`hail-guard review list`)",
    State.CANCELLED: "nothing to do: it was cancelled before it left",
}
_MAY_HAVE_LEFT_STEP = "do not send it again: an operator closed it, and it may have reached the recipient"


def sentence(clause: str) -> str:
    """A clause such as `next_step`'s as a sentence of its own."""
    return clause[:1].upper() + clause[1:]


def next_step(operation: Operation) -> str:
    """The one safe thing to do next about `operation` (a clause: lower case, no full stop)."""
    if operation.resent_as is not None:
        return f"do not send it again: it was superseded by an operator's resend, operation {operation.resent_as}"
    if operation.may_have_left:
        return _MAY_HAVE_LEFT_STEP
    return _NEXT_STEP[operation.state].format(id=operation.id)


SIGHTING_MARGIN_SECONDS = 300.0
"""A message Hail lists this long before an operation was recorded may still be it (clocks differ)."""
_SIGHTING_FIELDS = {"email": ("subject",), "sms": ("body",), "call": ("first_message", "system_prompt")}
"""What a listed record must say alike, per channel, to be an operation's message (where both say it)."""


def outcome_of_search(
    operation: Operation, record: Mapping[str, Any] | None, searched: str, why_not_replay: str
) -> Outcome:
    """Reconcile without a replay: only a record under the operation's own key proves it was accepted."""
    if record is not None and record.get("idempotency_key") == operation.idempotency_key:
        found = record.get("id")
        return Outcome(
            state=State.ACCEPTED,
            reason=f"{searched} found it under its key",
            result=dict(record),
            provider_id=found if isinstance(found, str) else None,
        )
    if record is not None:
        why_not_replay += f"; {searched} shows a message that looks like it ({record.get('id')}): check it"
    return Outcome(state=State.NEEDS_REVIEW, reason=why_not_replay, review_reason=why_not_replay)


def first_recipient_as_sent(operation: Operation) -> str | None:
    """The operation's first `to` recipient, spelt as it was sent (what an upstream's `to` filter matches)."""
    to = operation.arguments().get("to")
    first = to[0] if isinstance(to, list) and to else to
    return first if isinstance(first, str) else None


def sighting(operation: Operation, records: Sequence[object]) -> dict[str, Any] | None:
    """Among records an upstream listed for the operation's recipient, the one that is its message."""
    request = operation.arguments()
    since = operation.created_at - timedelta(seconds=SIGHTING_MARGIN_SECONDS)
    for record in records:
        if not isinstance(record, dict):
            continue
        if record.get("idempotency_key") == operation.idempotency_key:
            return record
        created = _moment(record.get("created_at") or record.get("requested_at"))
        if created is None or created < since:
            continue
        fields = _SIGHTING_FIELDS.get(operation.channel, ())
        said = [name for name in fields if record.get(name) is not None and request.get(name) is not None]
        if all(keys.meaning_of(record[name]) == keys.meaning_of(request[name]) for name in said):
            return record
    return None


def _moment(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def found_in_upstream(operation: Operation, record: Mapping[str, Any], searched: str) -> RefusedByPolicy:
    """The refusal of a resend whose message Hail already has."""
    found = record.get("id", "?")
    return RefusedByPolicy(
        f"Hail has this message ({searched} found {found}, status {record.get('status', '?')}): it was sent, so "
        f"nothing was resent. Record it with `hail-guard review resolve {operation.id} --as accepted "
        f'--provider-id {found} --reason "found in Hail"`'
    )


def check_review_decision(state: State, reason: str, provider_id: str | None = None) -> None:
    """An operator's resolution must be a final state, say why, and give a provider id only when accepted."""
    if state not in REVIEW_RESOLUTIONS:
        names = ", ".join(s.value for s in REVIEW_RESOLUTIONS)
        raise BadInput(f"a review is resolved as one of {names}, not {state.value}; nothing changed")
    if not reason.strip():
        raise BadInput("say why (--reason): every review decision is kept in the history; nothing changed")
    if provider_id is not None and state is not State.ACCEPTED:
        raise BadInput("a provider id goes only with `accepted` (the id Hail gave the message); nothing changed")


def not_in_review(operation: Operation, action: str) -> RefusedByPolicy:
    """The refusal for a review decision on an operation that is not waiting for one."""
    return RefusedByPolicy(
        f"operation {operation.id} is {operation.state.value}, not in review: only a needs_review operation "
        f"can be {action}; nothing changed (see `hail-guard review list`)"
    )


def prune_age_seconds(older_than_days: float | None, *, key_retention_hours: float) -> float:
    """How old a resolved operation must be to be pruned; refuses no age, and one inside Hail's key retention.

    A pruned key is forgotten by hail-guard; while Hail may still remember it, the ledger must too.
    """
    if older_than_days is None:
        raise BadInput("prune needs an age: --older-than DAYS; nothing was removed")
    seconds = older_than_days * 86400.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadInput(f"--older-than must be a positive number of days (got {older_than_days:g})")
    retention = key_retention_hours * 3600.0
    if seconds < retention:
        raise RefusedByPolicy(
            f"--older-than {older_than_days:g} is inside Hail's key retention ({key_retention_hours:g} h): those "
            f"operations are kept; use --older-than {math.ceil(retention / 86400.0)} or more. Nothing was removed"
        )
    return seconds


def review_decision_text(state: State, reason: str, provider_id: str | None = None) -> str:
    """The history line of an operator's review decision (both ledger backends write it)."""
    given = f" (provider id {provider_id})" if provider_id else ""
    return f"review: resolved as {state.value}{given}: {reason.strip()}"


@dataclass(frozen=True)
class ResendTexts:
    new_event: str
    old_event: str
    cancel_reason: str


def resend_texts(old_id: str, new_id: str, reason: str) -> ResendTexts:
    """What an operator's resend writes on the new operation and on the one it supersedes."""
    return ResendTexts(
        new_event=f"review: resend of {old_id}: {reason.strip()}",
        old_event=f"review: superseded by resend {new_id}: {reason.strip()}",
        cancel_reason=f"superseded by resend {new_id} (an operator's decision; Hail may have this one too)",
    )


def resend_key_taken(key: str, taken: Operation) -> RefusedByPolicy:
    return RefusedByPolicy(f"the resend key {key!r} already belongs to operation {taken.id}; nothing changed")


def suppression_reason(suppression: Suppression) -> str:
    """Why sends were cancelled by an opt-out (both ledger backends write it)."""
    return f"the recipient opted out: {suppression.reason} (source: {suppression.source})"
