"""What Hail's answer to a send means, which state follows it, and what reconcile does next.

Every text Hail is known to answer is matched here, in `_ERROR_PATTERNS`, and nowhere else
(DESIGN.md, classification; HAIL_CONTRACT.md, how failures read). The first attempt and a same-key
replay are judged apart (`outcome_of_send`, `outcome_of_replay`): an error Hail repeats unchanged
is what it saved.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from hail_guard.models import Answer, AnswerKind, Operation, Outcome, State

DEFAULT_RETRY_AFTER_SECONDS = 30.0
"""A rate limit that names no wait waits this long; auth and no-free-number answers may retry at once."""
CHECK_AGAIN_SECONDS = 5.0
"""How soon reconcile looks again at an operation that is still unclear."""
RETENTION_MARGIN_SECONDS = 3600.0
"""Replays stop this long before the upstream's key retention runs out."""


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
