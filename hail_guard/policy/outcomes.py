"""What an upstream's answer to a send means, which state follows it, and what reconcile does next.

`classify` sorts an answer by the tool's profile (`[answers]`: where an error is, its table of patterns,
first match wins; the built-in `hail` profile holds every text Hail is known to answer: docs/explanation/hail.md,
"How hail-guard sorts an answer"). The first attempt and a same-key replay are judged apart (`outcome_of_send`,
`outcome_of_replay`): an error the upstream repeats unchanged is what it saved. An upstream that takes no
key is never replayed: reconcile looks for the send instead (`plan_reconcile`, `outcome_of_search`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from hail_guard import pointers
from hail_guard.errors import UpstreamError, UpstreamUnavailable
from hail_guard.models import Answer, AnswerKind, Operation, Outcome, State
from hail_guard.policy.answers import upstream_name
from hail_guard.profiles import ToolSpec, read_answer

if TYPE_CHECKING:
    from hail_guard.policy.repeats import Sighted

DEFAULT_RETRY_AFTER_SECONDS = 30.0
"""The wait the `hail` profile gives a rate limit that names none (its 429 pattern's `retry_after_seconds`)."""
CHECK_AGAIN_SECONDS = 5.0
"""How soon reconcile looks again at an operation that is still unclear."""
UNREACHABLE_RETRY_SECONDS = 5.0
"""How soon a send that could not reach the upstream at all (nothing left) may be tried again."""
RETENTION_MARGIN_SECONDS = 3600.0
"""Replays stop this long before the upstream's key retention runs out."""


_FIELD_ERROR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z0-9_.]+)?: ")
_FLAGS = re.IGNORECASE | re.DOTALL
"""How a profile's patterns are matched: any letter case, `.` across lines."""


def classify(
    spec: ToolSpec,
    *,
    is_error: bool,
    payload: Mapping[str, Any] | None,
    text: str,
    request: Mapping[str, Any],
    declared: Collection[str] | None = None,
) -> Answer:
    """Sort one upstream answer to a send by the tool's profile (see the table in docs/explanation/hail.md).

    `declared` names the properties of the tool's input schema (None: unknown, then the request's own
    fields stand in for them).
    """
    answers = spec.answers
    fields = request if declared is None else declared
    if is_error:
        if answers.is_error == "classify" and text:
            return _classify_error(spec, text, fields, AnswerKind.LOST)
        return Answer(kind=AnswerKind.LOST, error=text or "the upstream answered with an error")
    if payload is None:
        payload = read_answer(None, text, spec.answer_text)
    if payload is None:
        return Answer(kind=AnswerKind.LOST, error=f"unreadable answer: {text[:200]!r}")
    if answers.error is not None and pointers.present(payload, answers.error):
        return _classify_error(spec, pointers.resolve(payload, answers.error), fields, AnswerKind.UNRECOGNISED)
    provider_id = pointers.resolve(payload, spec.provider_id)
    if not (isinstance(provider_id, str) and provider_id and all(pointers.present(payload, p) for p in spec.required)):
        said = " and ".join(pointers.shown(pointer) for pointer in (spec.provider_id, *spec.required))
        return Answer(kind=AnswerKind.LOST, result=dict(payload), error=f"the answer has no {said}")
    for failed in answers.failed:
        detail = pointers.resolve(payload, failed.detail)
        if pointers.resolve(payload, failed.field) == failed.equals and detail is not None:
            error = f"{failed.reason}: {detail}"
            return Answer(kind=AnswerKind.REFUSED, result=dict(payload), provider_id=provider_id, error=error)
    return Answer(kind=AnswerKind.ACCEPTED, result=dict(payload), provider_id=provider_id)


def answer_of_failure(error: UpstreamError) -> Answer:
    """A call that raised instead of answering: when no connection was made nothing left, so the same key is
    safe later; any other failure (a timeout, a dropped connection) may have come after the upstream had it."""
    if isinstance(error, UpstreamUnavailable):
        return Answer(kind=AnswerKind.RETRY_LATER, error=str(error), retry_after_seconds=UNREACHABLE_RETRY_SECONDS)
    return Answer(kind=AnswerKind.LOST, error=str(error))


def _classify_error(spec: ToolSpec, error: object, declared: Collection[str], unmatched: AnswerKind) -> Answer:
    """An error text by the profile's table of patterns (first match wins), then its `<field>: ` rule."""
    if not isinstance(error, str):
        return Answer(kind=AnswerKind.UNRECOGNISED, error=json.dumps(error, default=str)[:500])
    answers = spec.answers
    for pattern in answers.patterns:
        if (pattern.tools is None or spec.name in pattern.tools) and re.search(pattern.match, error, _FLAGS):
            kind = AnswerKind(pattern.kind)
            retry_after = _retry_after(answers.retry_after, error) if kind is AnswerKind.RETRY_LATER else None
            if retry_after is None and kind is AnswerKind.RETRY_LATER:
                retry_after = pattern.retry_after_seconds
            return Answer(kind=kind, error=error, retry_after_seconds=retry_after)
    field = _FIELD_ERROR.match(error) if answers.field_errors else None
    if field is not None:
        # A local validation error names a field of the tool's schema; one naming any other field is the
        # upstream failing to read its own success answer (docs/explanation/hail.md), even when the request carried it.
        refused = field.group(1) in declared
        return Answer(kind=AnswerKind.REFUSED if refused else AnswerKind.MISREAD_SUCCESS, error=error)
    return Answer(kind=unmatched, error=error)


def declared_fields(schema: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The property names a tool's input schema declares (None when the schema is not known)."""
    if schema is None:
        return None
    properties = schema.get("properties")
    return frozenset(properties) if isinstance(properties, Mapping) else frozenset()


def _retry_after(pattern: str | None, error: str) -> float | None:
    match = re.search(pattern, error, re.IGNORECASE) if pattern is not None else None
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
    AnswerKind.ACCEPTED: "{upstream} accepted the request",
    AnswerKind.REFUSED: "{upstream} refused the request for good",
    AnswerKind.STILL_PROCESSING: "{upstream} is still processing this key",
    AnswerKind.KEY_CONFLICT: "{upstream} holds this key for a different request",
    AnswerKind.RETRY_LATER: "{upstream} saved nothing (rate limit, auth or no free number); the same key is safe later",
    AnswerKind.GATEWAY_ERROR: "a gateway error that may hide a success",
    AnswerKind.LOST: "no usable answer: the request may have been sent",
    AnswerKind.MISREAD_SUCCESS: "{upstream} could not read its own answer; the message may have been sent",
    AnswerKind.UNRECOGNISED: "an error hail-guard does not recognise",
}
"""Why each kind of answer led where it did: ledger texts, naming the upstream (`reason_of`)."""


def reason_of(kind: AnswerKind) -> str:
    return _REASONS[kind].format(upstream=upstream_name())


def outcome_of_send(answer: Answer) -> Outcome:
    """The outcome of a first attempt (`sending` -> ...)."""
    state = _FIRST_ATTEMPT[answer.kind]
    return Outcome(
        state=state,
        reason=reason_of(answer.kind),
        provider_id=answer.provider_id,
        result=answer.result,
        error=answer.error,
        not_before_seconds=answer.retry_after_seconds if state is State.READY else None,
        check_after_seconds=_first_check_after(answer.kind) if state is State.UNKNOWN else None,
        review_reason=reason_of(answer.kind) if state is State.NEEDS_REVIEW else None,
    )


def _first_check_after(kind: AnswerKind) -> float:
    """An unknown is due for reconcile at once, unless the upstream said it is still working on it."""
    return CHECK_AGAIN_SECONDS if kind is AnswerKind.STILL_PROCESSING else 0.0


def outcome_of_replay(answer: Answer, *, previous_error: str | None, attempts: int, max_attempts: int) -> Outcome:
    """The outcome of a same-key replay by reconcile (`unknown` -> ...).

    `attempts` counts the replay being judged. An error that repeats unchanged is the upstream replaying
    what it saved: an unrecognised one is a saved failure, a misread success stays unreadable.
    """
    kind = answer.kind
    repeated = answer.error is not None and answer.error == previous_error
    base = Outcome(
        state=State.UNKNOWN,
        reason=reason_of(kind),
        provider_id=answer.provider_id,
        result=answer.result,
        error=answer.error,
    )
    if kind is AnswerKind.ACCEPTED:
        return base.model_copy(update={"state": State.ACCEPTED})
    if kind is AnswerKind.REFUSED or (kind is AnswerKind.UNRECOGNISED and repeated):
        return base.model_copy(update={"state": State.FAILED, "reason": f"{upstream_name()} replayed a saved failure"})
    if kind is AnswerKind.KEY_CONFLICT or (kind is AnswerKind.MISREAD_SUCCESS and repeated):
        return base.model_copy(update={"state": State.NEEDS_REVIEW, "review_reason": reason_of(kind)})
    if attempts >= max_attempts:
        reason = f"still unclear after {attempts} reconcile attempts: {reason_of(kind)}"
        return base.model_copy(update={"state": State.NEEDS_REVIEW, "review_reason": reason, "reason": reason})
    wait = answer.retry_after_seconds if kind is AnswerKind.RETRY_LATER else None
    return base.model_copy(update={"check_after_seconds": wait or CHECK_AGAIN_SECONDS})


def provider_id_taken(outcome: Outcome, holder_id: str) -> Outcome:
    """An accepted answer whose message id operation `holder_id` already holds: one message is one send, so the
    second is for a human (`needs_review`), keeping what the upstream said; the id stays with the first."""
    reason = (
        f"the upstream answered with message id {outcome.provider_id}, which operation {holder_id} already holds: "
        "one message is one send, so a human decides whether this one was sent"
    )
    kept = outcome.result if outcome.result is not None else {}
    return outcome.model_copy(
        update={
            "state": State.NEEDS_REVIEW,
            "reason": reason,
            "review_reason": reason,
            "provider_id": None,
            "result": kept,
        }
    )


def replay_not_made(error: str) -> Outcome:
    """A reconcile replay that never left (the upstream unreachable): still unknown, and the attempt is not spent."""
    return Outcome(
        state=State.UNKNOWN,
        reason=f"{upstream_name()} could not be reached; nothing was replayed",
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
    """A replay could send again: a human decides (after a search of the upstream's messages found nothing)."""
    REPLAY = "replay"
    """Replay the stored request under the same key."""


@dataclass(frozen=True)
class ReconcilePlan:
    step: ReconcileStep
    reason: str = ""


def plan_reconcile(
    operation: Operation,
    *,
    now: datetime,
    key_retention_hours: float,
    recipient_suppressed: bool,
    replayable: bool = True,
) -> ReconcilePlan:
    """What to do with one `unknown` operation (`replayable`: the upstream takes a key): docs/explanation/states.md,
    "What reconcile does, in order"."""
    if operation.provider_id:
        return ReconcilePlan(ReconcileStep.LOOKUP)
    if recipient_suppressed:
        return ReconcilePlan(ReconcileStep.REVIEW, "the recipient opted out; a replay could be the first send")
    if not replayable:
        return ReconcilePlan(ReconcileStep.REVIEW, NO_KEY)
    started = operation.first_sent_at or operation.created_at
    horizon = timedelta(hours=key_retention_hours) - timedelta(seconds=RETENTION_MARGIN_SECONDS)
    if now - started > horizon:
        return ReconcilePlan(
            ReconcileStep.REVIEW,
            f"first sent {started.isoformat()}, older than {upstream_name()}'s key retention "
            f"({key_retention_hours:g} h) less a margin: a replay could send again",
        )
    return ReconcilePlan(ReconcileStep.REPLAY)


NO_KEY = "the upstream takes no idempotency key, so a replay could send it twice"
"""Why reconcile never replays a send to an upstream that takes no key."""


def outcome_of_search(
    operation: Operation, sighted: Sighted | None, searched: str, why_not_replay: str, *, complete: bool = True
) -> Outcome:
    """Reconcile without a replay: only a sighting that proves the send (under its own key, or, where the
    upstream takes no key, everything alike and sent after it was recorded) settles it as accepted."""
    if sighted is not None and sighted.proven:
        return Outcome(
            state=State.ACCEPTED,
            reason=f"{searched} found it" + (" under its key" if sighted.by_key else ""),
            result=dict(sighted.record),
            provider_id=sighted.provider_id,
        )
    if sighted is not None:
        why_not_replay += f"; {searched} shows a message that looks like it ({sighted.provider_id}): check it"
    elif not complete:
        why_not_replay += f"; {searched}"
    elif why_not_replay == NO_KEY:
        why_not_replay = f"no answer came back, and {searched} found no such message: a human decides"
    return Outcome(state=State.NEEDS_REVIEW, reason=why_not_replay, review_reason=why_not_replay)
