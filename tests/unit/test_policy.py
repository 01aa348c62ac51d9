from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hail_guard import policy
from hail_guard.errors import BadInput, RefusedByPolicy
from hail_guard.models import Answer, AnswerKind, Operation, State
from hail_guard.profiles import hail

EMAIL_REQUEST = {"to": ["lead@example.com"], "subject": "Hi", "body_text": "Hello", "recipient_consent": True}
CONSENT_422 = (
    "[{'loc': ['body', 'recipient_consent'], 'msg': 'recipient_consent must be true to send', 'type': 'value_error'}]"
)
MARKETING_422 = (
    "[{'loc': ['body', 'consent_source'], 'msg': 'marketing sends require a non-empty consent_source', "
    "'type': 'value_error'}]"
)


def classify_error(text: str, tool: str = "send_email") -> Answer:
    return policy.classify(hail().spec(tool), is_error=False, payload={"error": text}, text="", request=EMAIL_REQUEST)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("idempotency key reused with a different request body", AnswerKind.KEY_CONFLICT),
        ("request with this idempotency key is still processing", AnswerKind.STILL_PROCESSING),
        ("hail api error 429: rate limit exceeded (retry after 7 seconds)", AnswerKind.RETRY_LATER),
        ("auth failed: token rejected by Hail API", AnswerKind.RETRY_LATER),
        ("hail upstream error: 502", AnswerKind.GATEWAY_ERROR),
        ("hail upstream error: 504", AnswerKind.GATEWAY_ERROR),
        ("hail api error 402: insufficient credit", AnswerKind.REFUSED),
        ("hail api error 403: recipient is suppressed", AnswerKind.REFUSED),
        (CONSENT_422, AnswerKind.REFUSED),
        (MARKETING_422, AnswerKind.REFUSED),
        ("resource not found", AnswerKind.REFUSED),
        ("subject: String should have at most 998 characters", AnswerKind.REFUSED),
        ("sent_at: Input should be a valid datetime", AnswerKind.MISREAD_SUCCESS),
        ("something nobody has seen before", AnswerKind.UNRECOGNISED),
    ],
)
def test_every_known_hail_text_is_classified(text: str, kind: AnswerKind) -> None:
    assert classify_error(text).kind is kind


def test_rate_limits_carry_their_retry_after() -> None:
    answer = classify_error("hail api error 429: rate limit exceeded (retry after 7 seconds)")
    assert answer.retry_after_seconds == 7.0


@pytest.mark.parametrize(
    "text", ["no shared caller number is free right now; retry shortly", "no shared number is available right now"]
)
def test_a_call_503_without_a_free_number_releases_the_key(text: str) -> None:
    assert classify_error(text, tool="place_call").kind is AnswerKind.RETRY_LATER


def test_the_same_503_text_on_email_is_not_trusted_to_have_released_anything() -> None:
    answer = classify_error("no shared number is available right now, try again", tool="send_email")
    assert answer.kind is AnswerKind.UNRECOGNISED


def test_a_record_with_id_and_status_is_accepted() -> None:
    payload = {"id": "e-1", "status": "sent", "idempotency_key": "k"}
    answer = policy.classify(hail().spec("send_email"), is_error=False, payload=payload, text="", request=EMAIL_REQUEST)
    assert (answer.kind, answer.provider_id) == (AnswerKind.ACCEPTED, "e-1")


def test_an_sms_the_carrier_refused_is_failed_with_its_id() -> None:
    payload = {"id": "s-1", "status": "failed", "error_code": "30006"}
    answer = policy.classify(hail().spec("send_sms"), is_error=False, payload=payload, text="", request={"to": "+1"})
    assert (answer.kind, answer.provider_id) == (AnswerKind.REFUSED, "s-1")


def test_the_json_text_is_read_when_there_is_no_structured_content() -> None:
    answer = policy.classify(
        hail().spec("send_email"),
        is_error=False,
        payload=None,
        text='{"id": "e-2", "status": "sent"}',
        request=EMAIL_REQUEST,
    )
    assert answer.kind is AnswerKind.ACCEPTED


@pytest.mark.parametrize(
    ("is_error", "payload", "text"),
    [
        (True, None, "Error executing tool send_email: "),
        (False, None, "<html>bad gateway</html>"),
        (False, {"status": "sent"}, ""),
        (False, {"id": "", "status": "sent"}, ""),
    ],
)
def test_errors_and_malformed_answers_are_lost_not_sent_or_unsent(
    is_error: bool, payload: dict[str, Any] | None, text: str
) -> None:
    answer = policy.classify(
        hail().spec("send_email"), is_error=is_error, payload=payload, text=text, request=EMAIL_REQUEST
    )
    assert answer.kind is AnswerKind.LOST


@pytest.mark.parametrize(
    ("kind", "state"),
    [
        (AnswerKind.ACCEPTED, State.ACCEPTED),
        (AnswerKind.REFUSED, State.FAILED),
        (AnswerKind.STILL_PROCESSING, State.UNKNOWN),
        (AnswerKind.KEY_CONFLICT, State.NEEDS_REVIEW),
        (AnswerKind.RETRY_LATER, State.READY),
        (AnswerKind.GATEWAY_ERROR, State.UNKNOWN),
        (AnswerKind.LOST, State.UNKNOWN),
        (AnswerKind.MISREAD_SUCCESS, State.UNKNOWN),
        (AnswerKind.UNRECOGNISED, State.UNKNOWN),
    ],
)
def test_first_attempt_outcomes_follow_the_design_table(kind: AnswerKind, state: State) -> None:
    assert policy.outcome_of_send(Answer(kind=kind, error="e")).state is state


def test_a_rate_limited_first_attempt_waits_the_retry_after() -> None:
    outcome = policy.outcome_of_send(Answer(kind=AnswerKind.RETRY_LATER, retry_after_seconds=7.0))
    assert outcome.not_before_seconds == 7.0


def replay(kind: AnswerKind, *, error: str | None = "e", previous: str | None = None, attempts: int = 1) -> State:
    answer = Answer(kind=kind, error=error)
    return policy.outcome_of_replay(answer, previous_error=previous, attempts=attempts, max_attempts=3).state


def test_a_replayed_unrecognised_error_that_repeats_is_a_saved_failure() -> None:
    assert replay(AnswerKind.UNRECOGNISED, previous="odd") is State.UNKNOWN
    assert replay(AnswerKind.UNRECOGNISED, error="odd", previous="odd") is State.FAILED


def test_a_misread_success_that_repeats_goes_to_a_human() -> None:
    assert replay(AnswerKind.MISREAD_SUCCESS, error="sent_at: bad", previous="sent_at: bad") is State.NEEDS_REVIEW


def test_replays_that_stay_unclear_end_in_review_after_the_attempt_limit() -> None:
    assert replay(AnswerKind.LOST, attempts=2) is State.UNKNOWN
    assert replay(AnswerKind.LOST, attempts=3) is State.NEEDS_REVIEW


def test_a_rate_limited_replay_stays_unknown_never_ready() -> None:
    assert replay(AnswerKind.RETRY_LATER) is State.UNKNOWN


def test_replays_settle_accepted_and_refused() -> None:
    assert replay(AnswerKind.ACCEPTED) is State.ACCEPTED
    assert replay(AnswerKind.REFUSED) is State.FAILED
    assert replay(AnswerKind.KEY_CONFLICT) is State.NEEDS_REVIEW


def operation(**changes: Any) -> Operation:
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    base: dict[str, Any] = dict(
        id="op",
        idempotency_key="k",
        tool="send_email",
        channel="email",
        recipients=["a@example.com"],
        request="{}",
        request_fingerprint="f",
        content_fingerprint="c",
        state=State.UNKNOWN,
        created_at=now,
        updated_at=now,
        first_sent_at=now,
    )
    return Operation(**{**base, **changes})


def test_reconcile_looks_up_a_known_provider_id_first() -> None:
    plan = policy.plan_reconcile(
        operation(provider_id="e-1"), now=operation().created_at, key_retention_hours=24, recipient_suppressed=True
    )
    assert plan.step is policy.ReconcileStep.LOOKUP


def test_reconcile_never_replays_to_a_suppressed_recipient() -> None:
    plan = policy.plan_reconcile(
        operation(), now=operation().created_at, key_retention_hours=24, recipient_suppressed=True
    )
    assert plan.step is policy.ReconcileStep.REVIEW


def test_reconcile_sends_old_unknowns_to_review_instead_of_replaying() -> None:
    op = operation()
    assert op.first_sent_at is not None
    fresh = policy.plan_reconcile(
        op, now=op.first_sent_at + timedelta(hours=22), key_retention_hours=24, recipient_suppressed=False
    )
    stale = policy.plan_reconcile(
        op, now=op.first_sent_at + timedelta(hours=23, minutes=1), key_retention_hours=24, recipient_suppressed=False
    )
    assert fresh.step is policy.ReconcileStep.REPLAY
    assert stale.step is policy.ReconcileStep.REVIEW
    assert "retention" in stale.reason


SCHEMA = {"type": "object", "properties": {"recipient_consent": {"type": "boolean"}}}


@pytest.mark.parametrize("consent", ["yes", "true", 1, False, None])
def test_consent_must_be_the_json_boolean_true(consent: object) -> None:
    with pytest.raises(RefusedByPolicy, match="recipient_consent must be the JSON boolean true"):
        policy.check_rules(hail().spec("acquire_number"), {"recipient_consent": consent}, SCHEMA)


def test_marketing_needs_a_consent_source() -> None:
    with pytest.raises(RefusedByPolicy, match="consent_source"):
        policy.check_rules(
            hail().spec("acquire_number"),
            {"recipient_consent": True, "message_type": "marketing", "consent_source": " "},
            SCHEMA,
        )
    policy.check_rules(
        hail().spec("acquire_number"),
        {"recipient_consent": True, "message_type": "marketing", "consent_source": "form"},
        SCHEMA,
    )


def test_invalid_arguments_name_the_field() -> None:
    schema = {"type": "object", "properties": {"to": {"type": "array", "minItems": 1}}, "required": ["to"]}
    with pytest.raises(BadInput, match=r"invalid arguments for send_email: to: \[\] should be non-empty"):
        policy.validate_arguments("send_email", {"to": []}, schema)


def test_differing_fields_are_named_by_path() -> None:
    old = {"subject": "a", "metadata": {"x": 1, "y": 2}, "to": ["p"]}
    new = {"subject": "b", "metadata": {"x": 1, "z": 2}, "to": ["p"]}
    assert policy.differing_fields(old, new) == ["metadata.y", "metadata.z", "subject"]


def test_tools_taking_a_key_are_guarded_unless_configured() -> None:
    schemas: dict[str, dict[str, Any]] = {
        "send_email": {"properties": {"idempotency_key": {}}},
        "whoami": {"properties": {}},
    }
    assert hail().guarded(schemas, None) == {"send_email"}
    assert hail().guarded(schemas, ["whoami"]) == {"whoami"}


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("send_email", {"to": [], "subject": "s", "body_text": "b"}, "at least one recipient"),
        ("send_email", {"to": ["a@x"], "subject": "", "body_text": "b"}, "subject: must be 1 to 998"),
        ("send_email", {"to": ["a@x"], "subject": "s", "body_html": " "}, "non-empty body"),
        ("send_sms", {"to": "555-0100", "body": "b"}, "E.164"),
        ("send_sms", {"to": "+15550100", "body": "b" * 1601}, "body: must be 1 to 1600"),
        ("place_call", {"to": "+15550100"}, "system_prompt, llm or agent_id"),
    ],
)
def test_hails_own_pre_send_rules_are_checked_before_recording(
    tool: str, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadInput, match=message):
        policy.check_rules(hail().spec(tool), arguments, {})


@pytest.mark.parametrize(
    ("tool", "valid", "broken", "message"),
    [
        ("send_email", {"to": ["a@x"], "subject": "s", "body_text": "b"}, {"subject": ""}, "subject: must be 1 to 998"),
        ("send_email", {"to": ["a@x"], "subject": "s", "body_html": "<p>b</p>"}, {"body_html": " "}, "body_text or"),
        ("send_sms", {"to": "+15550100", "body": "b"}, {"to": "5550100"}, "is not an E.164 number"),
        ("place_call", {"to": "+15550100", "agent_id": "a1"}, {"agent_id": None}, "system_prompt, llm or agent_id"),
    ],
)
def test_a_valid_send_passes_hails_rules_where_one_field_changed_does_not(
    tool: str, valid: dict[str, Any], broken: dict[str, Any], message: str
) -> None:
    spec = hail().spec(tool)
    policy.check_rules(spec, valid, {})  # passes: no BadInput
    changed = {name: value for name, value in {**valid, **broken}.items() if value is not None}
    with pytest.raises(BadInput, match=message):
        policy.check_rules(spec, changed, {})


def test_a_rate_limit_without_a_wait_waits_the_default() -> None:
    assert classify_error("hail api error 429: slow down").retry_after_seconds == policy.DEFAULT_RETRY_AFTER_SECONDS
    assert classify_error("auth failed: token rejected by Hail API").retry_after_seconds is None
