"""What an upstream's answer means (`policy.outcomes`), function by function, compared whole: every field of
every `Answer`, `Outcome` and `ReconcilePlan`, so that a changed word, a dropped field or a turned condition
fails here (the mutation score of `scripts/mutation` counts on it)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hail_guard import keys
from hail_guard.errors import UpstreamLost, UpstreamUnavailable
from hail_guard.models import Answer, AnswerKind, Operation, Outcome, State
from hail_guard.policy import naming
from hail_guard.policy.outcomes import (
    CHECK_AGAIN_SECONDS,
    NO_KEY,
    UNREACHABLE_RETRY_SECONDS,
    ReconcilePlan,
    ReconcileStep,
    answer_of_failure,
    classify,
    declared_fields,
    lookup_failed,
    outcome_of_replay,
    outcome_of_search,
    outcome_of_send,
    plan_reconcile,
    provider_id_taken,
    reason_of,
    replay_not_made,
)
from hail_guard.policy.repeats import Sighted
from hail_guard.profiles import built_in, hail
from hail_guard.profiles.loading import parse_profile

EMAIL = hail().spec("send_email")
SMS = hail().spec("send_sms")
CALL = hail().spec("place_call")
RESEND = built_in("resend").spec("send-email")
REQUEST = {"to": ["a@example.com"], "subject": "Hi", "body_text": "B"}
NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def classified(spec: Any = EMAIL, *, error: bool = False, payload: Any = None, text: str = "", **more: Any) -> Answer:
    return classify(spec, is_error=error, payload=payload, text=text, request=more.pop("request", REQUEST), **more)


# --- classify -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "answer"),
    [
        ({"error": True}, Answer(kind=AnswerKind.LOST, error="the upstream answered with an error")),
        ({"error": True, "text": "timed out"}, Answer(kind=AnswerKind.LOST, error="timed out")),
        (
            {"text": "not json " + "x" * 300},
            Answer(kind=AnswerKind.LOST, error=f"unreadable answer: {'not json ' + 'x' * 191!r}"),
        ),
        ({"text": '["a list"]'}, Answer(kind=AnswerKind.LOST, error="unreadable answer: '[\"a list\"]'")),
        (
            {"text": '{"id": "e-1", "status": "sent"}'},
            Answer(kind=AnswerKind.ACCEPTED, result={"id": "e-1", "status": "sent"}, provider_id="e-1"),
        ),
        (
            {"payload": {"id": "e-1", "status": "queued", "extra": [1]}, "text": "ignored"},
            Answer(kind=AnswerKind.ACCEPTED, result={"id": "e-1", "status": "queued", "extra": [1]}, provider_id="e-1"),
        ),
        (
            {"payload": {"id": "e-1"}},
            Answer(kind=AnswerKind.LOST, result={"id": "e-1"}, error="the answer has no id and status"),
        ),
        (
            {"payload": {"id": "", "status": "sent"}},
            Answer(kind=AnswerKind.LOST, result={"id": "", "status": "sent"}, error="the answer has no id and status"),
        ),
        (
            {"payload": {"id": 7, "status": "sent"}},
            Answer(kind=AnswerKind.LOST, result={"id": 7, "status": "sent"}, error="the answer has no id and status"),
        ),
        (
            {"payload": {"error": "hail api error 402: insufficient credit"}},
            Answer(kind=AnswerKind.REFUSED, error="hail api error 402: insufficient credit"),
        ),
        (
            {"payload": {"error": {"code": 9, "said": "odd"}}},
            Answer(kind=AnswerKind.UNRECOGNISED, error='{"code": 9, "said": "odd"}'),
        ),
        (
            {"payload": {"error": ["x" * 600]}},
            Answer(kind=AnswerKind.UNRECOGNISED, error=('["' + "x" * 600 + '"]')[:500]),
        ),
    ],
    ids=[
        "isError-without-text",
        "isError-with-text",
        "unreadable-text-cut-at-200",
        "json-that-is-not-an-object",
        "a-record-in-text",
        "structured-content-first",
        "no-status",
        "an-empty-id",
        "an-id-that-is-not-text",
        "an-error-field",
        "an-error-that-is-not-text",
        "an-error-object-cut-at-500",
    ],
)
def test_an_answer_is_sorted_as_the_hail_profile_says(kwargs: dict[str, Any], answer: Answer) -> None:
    assert classified(**kwargs) == answer


def test_an_sms_the_carrier_refused_is_refused_with_hails_id_and_the_code() -> None:
    record = {"id": "s-1", "status": "failed", "error_code": "30007"}
    assert classified(SMS, payload=record) == Answer(
        kind=AnswerKind.REFUSED, result=record, provider_id="s-1", error="carrier refused: 30007"
    )
    failed_without_code = {"id": "s-2", "status": "failed"}
    assert classified(SMS, payload=failed_without_code) == Answer(
        kind=AnswerKind.ACCEPTED, result=failed_without_code, provider_id="s-2"
    )
    sent_with_code = {"id": "s-3", "status": "sent", "error_code": "0"}
    assert classified(SMS, payload=sent_with_code).kind is AnswerKind.ACCEPTED


@pytest.mark.parametrize(
    ("error", "answer"),
    [
        ("hail api error 429: rate limit exceeded (retry after 7 seconds)", (AnswerKind.RETRY_LATER, 7.0)),
        ("hail api error 429: slow down (Retry After 2.5 Seconds)", (AnswerKind.RETRY_LATER, 2.5)),
        ("hail api error 429: slow down", (AnswerKind.RETRY_LATER, 30.0)),
        ("auth failed: token rejected by Hail API", (AnswerKind.RETRY_LATER, None)),
        ("Auth Failed: token rejected", (AnswerKind.RETRY_LATER, None)),
        ("idempotency key reused with a different request body", (AnswerKind.KEY_CONFLICT, None)),
        ("request with this idempotency key is still processing", (AnswerKind.STILL_PROCESSING, None)),
        ("hail upstream error: 502", (AnswerKind.GATEWAY_ERROR, None)),
        ("hail api error 403: blocked", (AnswerKind.REFUSED, None)),
        ("hail api error 403: blocked (retry after 5 seconds)", (AnswerKind.REFUSED, None)),  # a wait for 429s only
        ("[{'loc': ['body'], 'msg': 'no'}]", (AnswerKind.REFUSED, None)),
        ("no shared caller number is free right now", (AnswerKind.UNRECOGNISED, None)),  # not a call
        ("subject: too long", (AnswerKind.REFUSED, None)),  # a field of the request
        ("sent_at: Input should be a valid datetime", (AnswerKind.MISREAD_SUCCESS, None)),  # a field it never had
        ("something else went wrong", (AnswerKind.UNRECOGNISED, None)),
    ],
)
def test_an_error_is_sorted_by_the_first_pattern_it_matches(
    error: str, answer: tuple[AnswerKind, float | None]
) -> None:
    kind, retry_after = answer
    assert classified(payload={"error": error}) == Answer(kind=kind, error=error, retry_after_seconds=retry_after)


def test_a_pattern_for_one_tool_applies_to_that_tool_alone() -> None:
    busy = "no shared caller number is free right now; retry shortly"
    assert classified(CALL, payload={"error": busy}).kind is AnswerKind.RETRY_LATER
    assert classified(EMAIL, payload={"error": busy}).kind is AnswerKind.UNRECOGNISED


def test_a_field_error_is_a_refusal_only_for_a_field_the_schema_declares() -> None:
    error = {"error": "priority: must be high or low"}
    assert classified(payload=error).kind is AnswerKind.MISREAD_SUCCESS  # no schema: the request's fields stand in
    assert classified(payload=error, request={**REQUEST, "priority": "x"}).kind is AnswerKind.REFUSED
    assert classified(payload=error, declared=frozenset({"priority"})).kind is AnswerKind.REFUSED
    assert classified(payload=error, declared=frozenset(), request={**REQUEST, "priority": "x"}).kind is (
        AnswerKind.MISREAD_SUCCESS
    )
    assert classified(payload={"error": "priority.level: bad"}, declared=frozenset({"priority"})).kind is (
        AnswerKind.REFUSED
    )


def test_an_upstream_whose_errors_are_classified_reads_its_is_error_text_by_its_patterns() -> None:
    limited = '{"name": "rate_limit_exceeded", "statusCode": 429}'
    assert classified(RESEND, error=True, text=limited) == Answer(
        kind=AnswerKind.RETRY_LATER, error=limited, retry_after_seconds=1.0
    )
    assert classified(RESEND, error=True, text="a stack trace") == Answer(kind=AnswerKind.LOST, error="a stack trace")
    said = "subject: too long"  # Resend's profile reads no `<field>: ` errors
    assert classified(RESEND, error=True, text=said) == Answer(kind=AnswerKind.LOST, error=said)
    assert classified(RESEND, error=True) == Answer(kind=AnswerKind.LOST, error="the upstream answered with an error")
    sent = 'Email sent successfully! {"id": "re-1"}'
    assert classified(RESEND, text=sent) == Answer(kind=AnswerKind.ACCEPTED, result={"id": "re-1"}, provider_id="re-1")


def test_the_fields_a_schema_declares() -> None:
    assert declared_fields(None) is None
    assert declared_fields({"properties": {"to": {}, "subject": {}}}) == frozenset({"to", "subject"})
    assert declared_fields({"properties": ["to"]}) == frozenset()
    assert declared_fields({"type": "object"}) == frozenset()


def test_a_call_that_raised_is_retried_later_only_when_nothing_left() -> None:
    assert answer_of_failure(UpstreamUnavailable("connection refused")) == Answer(
        kind=AnswerKind.RETRY_LATER, error="connection refused", retry_after_seconds=UNREACHABLE_RETRY_SECONDS
    )
    assert answer_of_failure(UpstreamLost("read timed out")) == Answer(kind=AnswerKind.LOST, error="read timed out")


# --- outcomes ----------------------------------------------------------------------------------------------


REASONS = {
    AnswerKind.ACCEPTED: "Hail accepted the request",
    AnswerKind.REFUSED: "Hail refused the request for good",
    AnswerKind.STILL_PROCESSING: "Hail is still processing this key",
    AnswerKind.KEY_CONFLICT: "Hail holds this key for a different request",
    AnswerKind.RETRY_LATER: "Hail saved nothing (rate limit, auth or no free number); the same key is safe later",
    AnswerKind.GATEWAY_ERROR: "a gateway error that may hide a success",
    AnswerKind.LOST: "no usable answer: the request may have been sent",
    AnswerKind.MISREAD_SUCCESS: "Hail could not read its own answer; the message may have been sent",
    AnswerKind.UNRECOGNISED: "an error hail-guard does not recognise",
}


@pytest.mark.parametrize("kind", list(AnswerKind))
def test_every_kind_of_answer_has_its_reason_naming_the_upstream(kind: AnswerKind) -> None:
    assert reason_of(kind) == REASONS[kind]
    with naming("Resend"):
        assert reason_of(kind) == REASONS[kind].replace("Hail", "Resend")


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (
            Answer(kind=AnswerKind.ACCEPTED, result={"id": "e-1"}, provider_id="e-1", retry_after_seconds=3.0),
            Outcome(state=State.ACCEPTED, reason=REASONS[AnswerKind.ACCEPTED], provider_id="e-1", result={"id": "e-1"}),
        ),
        (
            Answer(kind=AnswerKind.REFUSED, error="no credit"),
            Outcome(state=State.FAILED, reason=REASONS[AnswerKind.REFUSED], error="no credit"),
        ),
        (
            Answer(kind=AnswerKind.RETRY_LATER, error="429", retry_after_seconds=7.0),
            Outcome(state=State.READY, reason=REASONS[AnswerKind.RETRY_LATER], error="429", not_before_seconds=7.0),
        ),
        (
            Answer(kind=AnswerKind.STILL_PROCESSING, error="busy", retry_after_seconds=9.0),
            Outcome(
                state=State.UNKNOWN,
                reason=REASONS[AnswerKind.STILL_PROCESSING],
                error="busy",
                check_after_seconds=CHECK_AGAIN_SECONDS,
            ),
        ),
        (
            Answer(kind=AnswerKind.LOST, error="dropped"),
            Outcome(state=State.UNKNOWN, reason=REASONS[AnswerKind.LOST], error="dropped", check_after_seconds=0.0),
        ),
        (
            Answer(kind=AnswerKind.GATEWAY_ERROR, error="502"),
            Outcome(
                state=State.UNKNOWN, reason=REASONS[AnswerKind.GATEWAY_ERROR], error="502", check_after_seconds=0.0
            ),
        ),
        (
            Answer(kind=AnswerKind.KEY_CONFLICT, error="reused"),
            Outcome(
                state=State.NEEDS_REVIEW,
                reason=REASONS[AnswerKind.KEY_CONFLICT],
                error="reused",
                review_reason=REASONS[AnswerKind.KEY_CONFLICT],
            ),
        ),
    ],
    ids=["accepted", "refused", "retry-later", "still-processing", "lost", "gateway", "key-conflict"],
)
def test_a_first_attempts_answer_gives_its_outcome(answer: Answer, outcome: Outcome) -> None:
    assert outcome_of_send(answer) == outcome


def replayed(kind: AnswerKind, *, error: str | None = "e", previous: str | None = None, attempts: int = 1) -> Outcome:
    answer = Answer(kind=kind, error=error, result={"r": 1}, provider_id="p", retry_after_seconds=4.0)
    return outcome_of_replay(answer, previous_error=previous, attempts=attempts, max_attempts=3)


def test_a_replays_answer_gives_its_outcome() -> None:
    base = {"reason": "", "provider_id": "p", "result": {"r": 1}, "error": "e"}
    assert replayed(AnswerKind.ACCEPTED) == Outcome(
        **{**base, "state": State.ACCEPTED, "reason": REASONS[AnswerKind.ACCEPTED]}
    )
    assert replayed(AnswerKind.REFUSED) == Outcome(
        **{**base, "state": State.FAILED, "reason": "Hail replayed a saved failure"}
    )
    assert replayed(AnswerKind.UNRECOGNISED, previous="e") == Outcome(
        **{**base, "state": State.FAILED, "reason": "Hail replayed a saved failure"}
    )
    assert replayed(AnswerKind.KEY_CONFLICT) == Outcome(
        **{**base, "state": State.NEEDS_REVIEW, "reason": REASONS[AnswerKind.KEY_CONFLICT]},
        review_reason=REASONS[AnswerKind.KEY_CONFLICT],
    )
    assert replayed(AnswerKind.MISREAD_SUCCESS, previous="e") == Outcome(
        **{**base, "state": State.NEEDS_REVIEW, "reason": REASONS[AnswerKind.MISREAD_SUCCESS]},
        review_reason=REASONS[AnswerKind.MISREAD_SUCCESS],
    )
    unclear = f"still unclear after 3 reconcile attempts: {REASONS[AnswerKind.LOST]}"
    assert replayed(AnswerKind.LOST, attempts=3) == Outcome(
        **{**base, "state": State.NEEDS_REVIEW, "reason": unclear}, review_reason=unclear
    )
    assert replayed(AnswerKind.RETRY_LATER, attempts=2) == Outcome(
        **{**base, "state": State.UNKNOWN, "reason": REASONS[AnswerKind.RETRY_LATER]}, check_after_seconds=4.0
    )
    assert replayed(AnswerKind.GATEWAY_ERROR, attempts=2) == Outcome(
        **{**base, "state": State.UNKNOWN, "reason": REASONS[AnswerKind.GATEWAY_ERROR]},
        check_after_seconds=CHECK_AGAIN_SECONDS,
    )


def test_only_an_error_repeated_unchanged_is_what_the_upstream_saved() -> None:
    assert replayed(AnswerKind.UNRECOGNISED, previous="other").state is State.UNKNOWN
    assert replayed(AnswerKind.UNRECOGNISED, error=None, previous=None).state is State.UNKNOWN
    assert replayed(AnswerKind.MISREAD_SUCCESS, previous="other").state is State.UNKNOWN
    assert replayed(AnswerKind.MISREAD_SUCCESS, error=None, previous=None).state is State.UNKNOWN
    assert replayed(AnswerKind.LOST, attempts=2).state is State.UNKNOWN
    wait = outcome_of_replay(Answer(kind=AnswerKind.RETRY_LATER), previous_error=None, attempts=1, max_attempts=3)
    assert wait.check_after_seconds == CHECK_AGAIN_SECONDS  # no wait named: the usual one


def test_an_id_another_operation_holds_sends_the_answer_to_review_keeping_what_was_said() -> None:
    accepted = Outcome(state=State.ACCEPTED, reason="ok", provider_id="e-1", result={"id": "e-1"}, error="x")
    said = (
        "the upstream answered with message id e-1, which operation op-1 already holds: one message is one send, "
        "so a human decides whether this one was sent"
    )
    assert provider_id_taken(accepted, "op-1") == Outcome(
        state=State.NEEDS_REVIEW, reason=said, review_reason=said, provider_id=None, result={"id": "e-1"}, error="x"
    )
    bare = Outcome(state=State.ACCEPTED, reason="ok", provider_id="e-1")
    assert provider_id_taken(bare, "op-1").result == {}


def test_a_replay_that_never_left_and_a_lookup_without_an_answer_stay_unknown() -> None:
    assert replay_not_made("refused") == Outcome(
        state=State.UNKNOWN,
        reason="Hail could not be reached; nothing was replayed",
        error="refused",
        check_after_seconds=CHECK_AGAIN_SECONDS,
        attempted=False,
    )
    assert lookup_failed("502") == Outcome(
        state=State.UNKNOWN, reason="the lookup got no answer", error="502", check_after_seconds=CHECK_AGAIN_SECONDS
    )


# --- reconcile's plan and search ----------------------------------------------------------------------------


def unknown(**changes: Any) -> Operation:
    request = keys.canonical_json(REQUEST)
    values: dict[str, Any] = {
        "id": "op-1",
        "idempotency_key": "k1",
        "tool": "send_email",
        "channel": "email",
        "recipients": ["a@example.com"],
        "request": request,
        "request_fingerprint": keys.fingerprint(request),
        "content_fingerprint": "c",
        "state": State.UNKNOWN,
        "created_at": NOW,
        "updated_at": NOW,
    }
    return Operation.model_validate({**values, **changes})


def plan(
    operation: Operation, *, now: datetime = NOW, suppressed: bool = False, replayable: bool = True
) -> ReconcilePlan:
    return plan_reconcile(
        operation, now=now, key_retention_hours=24, recipient_suppressed=suppressed, replayable=replayable
    )


def test_reconcile_looks_up_a_known_id_before_anything_else() -> None:
    assert plan(unknown(provider_id="e-1"), suppressed=True, replayable=False) == ReconcilePlan(ReconcileStep.LOOKUP)


def test_reconcile_sends_to_review_what_a_replay_could_send_again() -> None:
    assert plan(unknown(), suppressed=True) == ReconcilePlan(
        ReconcileStep.REVIEW, "the recipient opted out; a replay could be the first send"
    )
    assert plan(unknown(), replayable=False) == ReconcilePlan(ReconcileStep.REVIEW, NO_KEY)
    assert NO_KEY == "the upstream takes no idempotency key, so a replay could send it twice"


def test_reconcile_replays_until_an_hour_before_the_keys_retention_runs_out() -> None:
    horizon = timedelta(hours=23)  # 24 h of retention less the margin
    first_sent = NOW - timedelta(hours=30)
    assert plan(unknown(), now=NOW + horizon) == ReconcilePlan(ReconcileStep.REPLAY)
    old = plan(unknown(), now=NOW + horizon + timedelta(seconds=1))
    assert old == ReconcilePlan(
        ReconcileStep.REVIEW,
        f"first sent {NOW.isoformat()}, older than Hail's key retention (24 h) less a margin: a replay could send "
        "again",
    )
    sent_long_ago = unknown(first_sent_at=first_sent, created_at=NOW)  # the first send counts, not the record
    assert plan(sent_long_ago).step is ReconcileStep.REVIEW
    assert first_sent.isoformat() in plan(sent_long_ago).reason


def test_only_a_sighting_that_proves_the_send_settles_it() -> None:
    record = {"id": "e-1", "status": "sent"}
    by_key = Sighted(record, "e-1", proven=True, by_key=True)
    assert outcome_of_search(unknown(), by_key, "list_emails to a@example.com", "why") == Outcome(
        state=State.ACCEPTED,
        reason="list_emails to a@example.com found it under its key",
        result=record,
        provider_id="e-1",
    )
    alike = Sighted(record, "e-1", proven=True)
    assert outcome_of_search(unknown(), alike, "list_emails", "why").reason == "list_emails found it"
    looks = Sighted(record, "e-1", proven=False)
    said = "why; list_emails shows a message that looks like it (e-1): check it"
    assert outcome_of_search(unknown(), looks, "list_emails", "why") == Outcome(
        state=State.NEEDS_REVIEW, reason=said, review_reason=said
    )


def test_a_search_that_finds_nothing_says_how_much_it_could_look() -> None:
    nothing = outcome_of_search(unknown(), None, "list_emails to a@example.com", NO_KEY)
    said = "no answer came back, and list_emails to a@example.com found no such message: a human decides"
    assert nothing == Outcome(state=State.NEEDS_REVIEW, reason=said, review_reason=said)
    other = outcome_of_search(unknown(), None, "list_emails", "the recipient opted out")
    assert other.reason == "the recipient opted out"
    blind = outcome_of_search(unknown(), None, "no tool lists email messages", NO_KEY, complete=False)
    assert blind.reason == f"{NO_KEY}; no tool lists email messages"
    assert blind.review_reason == blind.reason


def test_an_is_error_text_naming_a_field_of_the_request_is_a_refusal_where_the_profile_reads_them() -> None:
    profile = parse_profile(
        '[profile]\nname = "strict"\n[[tools]]\nname = "post"\nchannel = "chat"\nrecipients = ["/to"]\n'
        'provider_id = "/id"\n[answers]\nis_error = "classify"\nfield_errors = true\n',
        "strict.toml",
    )
    spec = profile.spec("post")
    request = {"to": "x", "text": "hi"}
    assert classified(spec, error=True, text="text: too long", request=request) == Answer(
        kind=AnswerKind.REFUSED, error="text: too long"
    )
    assert classified(spec, error=True, text="sent_at: bad", request=request) == Answer(
        kind=AnswerKind.MISREAD_SUCCESS, error="sent_at: bad"
    )
