"""The error tree: a usage error (a bad value, an unreadable file, a missing confirmation) is `BadInput`;
`RefusedByPolicy` is a rule's refusal only. The command line exits 1 for both (tests/end_to_end/test_cli.py), 2 only
where argparse refuses the words themselves. Each error has one answer for an agent (`policy.failure_of`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hail_guard import keys, policy, recipients
from hail_guard.batch import read_batch_file, sends_from_tool
from hail_guard.errors import (
    BadInput,
    KeyConflict,
    LeaseLost,
    LedgerUnavailable,
    OutcomeNotRecorded,
    RefusedByPolicy,
    SignInRequired,
    UpstreamLost,
)
from hail_guard.models import State
from hail_guard.policy import LEDGER_UNAVAILABLE
from hail_guard.profiles import hail

CONSENTED = {"properties": {"recipient_consent": {"type": "boolean"}}}
USAGE_ERRORS: dict[str, Callable[[], Any]] = {
    "a batch file that is not there": lambda: list(read_batch_file("/no/such/file.jsonl", lambda _: None)),
    "a send that is not an object": lambda: sends_from_tool(["send_email"]),
    "a key with a space": lambda: keys.validate_key("has space"),
    "a number JSON cannot hold": lambda: keys.canonical_json({"n": float("nan")}),
    "an address that cannot be read": lambda: recipients.normalise_recipient("not an address", "email"),
    "arguments the schema refuses": lambda: policy.validate_arguments("t", {"to": 1}, {"required": ["subject"]}),
    "a number Hail refuses": lambda: policy.check_rules(hail().spec("send_sms"), {"to": "555-0100", "body": "b"}, {}),
    "a review resolved as ready": lambda: policy.check_review_decision(State.READY, "why"),
    "a review decision without a reason": lambda: policy.check_review_decision(State.FAILED, " "),
    "prune without an age": lambda: policy.prune_age_seconds(None, key_retention_hours=24),
}
RULES: dict[str, Callable[[], Any]] = {
    "consent that is not true": lambda: policy.check_rules(
        hail().spec("acquire_number"), {"recipient_consent": "yes"}, CONSENTED
    ),
    "prune inside Hail's key retention": lambda: policy.prune_age_seconds(0.5, key_retention_hours=24),
}


@pytest.mark.parametrize("make", USAGE_ERRORS.values(), ids=USAGE_ERRORS)
def test_a_usage_error_is_bad_input_not_a_policy_refusal(make: Callable[[], Any]) -> None:
    with pytest.raises(BadInput) as refused:
        make()
    assert not isinstance(refused.value, RefusedByPolicy)


@pytest.mark.parametrize("make", RULES.values(), ids=RULES)
def test_a_rule_is_a_policy_refusal_not_bad_input(make: Callable[[], Any]) -> None:
    with pytest.raises(RefusedByPolicy) as refused:
        make()
    assert not isinstance(refused.value, BadInput)


def _not_recorded() -> OutcomeNotRecorded:
    """What the guard raises (`guard._not_recorded`): the ledger's own failure is its cause."""
    cause = LedgerUnavailable("the PostgreSQL ledger at postgresql://db.internal/hg failed: disk full")
    said = f"Hail's answer: accepted; but hail-guard could not record it ({cause}). Do NOT send it again"
    error = OutcomeNotRecorded(said, operation_id="op-1", state="accepted", provider_id="e-1")
    error.__cause__ = cause
    return error


ANSWERS: dict[str, tuple[Exception, str, dict[str, Any], bool]] = {
    "a key conflict": (
        KeyConflict("key k1 differs", differing_fields=["subject"]),
        "key k1 differs",
        {"differing_fields": ["subject"]},
        False,
    ),
    "bad input": (BadInput("to: give one"), "to: give one", {}, False),
    "a sign-in": (
        SignInRequired("run hail-guard login; nothing was sent"),
        "run hail-guard login; nothing was sent",
        {},
        False,
    ),
    "Hail lost": (UpstreamLost("no answer within 45 s"), "Hail did not answer: no answer within 45 s", {}, False),
    "the ledger": (LedgerUnavailable("postgresql://db.internal/hg is full"), LEDGER_UNAVAILABLE, {}, True),
    "an answer not recorded": (
        _not_recorded(),
        "Hail's answer: accepted; but hail-guard could not record it (the ledger is unavailable). Do NOT send it again",
        {"operation_id": "op-1", "hail_answer": "accepted", "provider_id": "e-1"},
        True,
    ),
    "another error of ours": (LeaseLost("taken over"), "hail-guard could not do this: taken over", {}, True),
}


@pytest.mark.parametrize(("error", "message", "details", "logged"), ANSWERS.values(), ids=ANSWERS)
def test_each_error_has_one_answer_and_what_it_leaves_out_is_logged(
    error: Exception, message: str, details: dict[str, Any], logged: bool
) -> None:
    failure = policy.failure_of(error)
    assert (failure.message, dict(failure.details), failure.logged, failure.crashed) == (
        message,
        details,
        logged,
        False,
    )
    assert "db.internal" not in failure.message


def test_a_bug_is_answered_plainly_and_logged_with_its_traceback() -> None:
    failure = policy.failure_of(KeyError("operation_id"))
    assert (failure.message, failure.logged, failure.crashed) == (policy.CRASHED, True, True)
