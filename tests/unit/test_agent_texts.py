"""Every text an agent can be answered with reads cleanly, names its one next step once, and never invites a
second send of something that may already have gone (no new key, no changed request, no allow_duplicate).

The answers are built the way the server builds them: from an operation in each state (and each way an
operator may have closed it), and from every refusal the guard, the ledgers and the review queue raise.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from mcp import MCPError

from hail_guard import keys, policy, same_send
from hail_guard.errors import HailGuardError
from hail_guard.guard import SendReport
from hail_guard.models import Intent, Operation, State
from hail_guard.profiles import hail
from hail_guard.same_send import Candidates, Finding, Rules, Verdict
from hail_guard.server import _send_result
from hail_guard.upstream import map_error
from tests.conftest import text

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
REQUEST = {"to": ["ada@example.com", "bob@example.com"], "subject": "Hello", "body_text": "Hi", "idempotency_key": "k1"}
MAY_HAVE_GONE = {State.SENDING, State.UNKNOWN, State.ACCEPTED, State.NEEDS_REVIEW}
INVITATIONS = ("new key", "allow_duplicate", "use a new", "change the request", "changed request", "send it again")


def operation(state: State, **changes: object) -> Operation:
    text_ = keys.canonical_json(REQUEST)
    values: dict[str, object] = {
        "id": "0b9a3c4e-0000-4000-8000-000000000001",
        "idempotency_key": "k1",
        "tool": "send_email",
        "channel": "email",
        "recipients": ["ada@example.com"],
        "request": text_,
        "request_fingerprint": keys.fingerprint(text_),
        "content_fingerprint": same_send.content_fingerprint(hail().spec("send_email"), REQUEST),
        "state": state,
        "created_at": NOW,
        "updated_at": NOW,
        "review_reason": "Hail could not read its own answer; the message may have been sent"
        if state is State.NEEDS_REVIEW
        else None,
        "last_error": str(
            map_error(MCPError(-32090, "HTTP 401", {"hail_guard_not_sent": "auth"}), target="x", timeout_seconds=1)
        )
        if state is State.READY
        else None,
        "cancel_reason": "the recipient opted out: STOP (source: sms reply)" if state is State.CANCELLED else None,
    }
    return Operation.model_validate({**values, **changes})


def intent(**changes: object) -> Intent:
    values: dict[str, object] = {
        "idempotency_key": "k2",
        "tool": "send_email",
        "channel": "email",
        "recipients": ("ada@example.com", "bob@example.com"),
        "request": "{}",
        "request_fingerprint": "r",
        "content_fingerprint": same_send.content_fingerprint(hail().spec("send_email"), REQUEST),
    }
    return Intent.model_validate({**values, **changes})


OPERATIONS = {
    **{state.value: operation(state) for state in State},
    "cancelled by an operator after it may have left": operation(
        State.CANCELLED, may_have_left=True, cancel_reason="review: resolved as cancelled: the lead left"
    ),
    "failed by an operator after it may have left": operation(
        State.FAILED, may_have_left=True, last_error="review: resolved as failed: Hail shows nothing"
    ),
    "superseded by a resend": operation(State.CANCELLED, may_have_left=True, resent_as="an-other-operation-id"),
}


def _refusal(make: object) -> str:
    with pytest.raises(HailGuardError) as refused:
        raise make  # type: ignore[misc]
    return str(refused.value)


def _raised(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except HailGuardError as exc:
        return str(exc)
    raise AssertionError("expected a refusal")


def refusals() -> dict[str, tuple[str, Operation | None]]:
    """Every refusal an agent can meet about an earlier operation: text, and the operation it names."""
    found: dict[str, tuple[str, Operation | None]] = {}
    rules = Rules()
    for name, earlier in OPERATIONS.items():
        found[f"overlap with {name}"] = (str(policy.refusal(intent(), Verdict(Finding.OVERLAP, earlier))), earlier)
        both = earlier.model_copy(update={"recipients": ["ada@example.com", "bob@example.com"]})
        found[f"subset of {name}"] = (
            _raised(
                lambda e=both: policy.decide(intent(recipients=("ada@example.com",)), Candidates(matches=[e]), rules)
            ),
            earlier,
        )
        found[f"allow_duplicate against {name}"] = (
            str(policy.refusal(intent(allow_duplicate=True), Verdict(Finding.SECOND_COPY, earlier))),
            earlier,
        )
        found[f"a paraphrase of {name}"] = (
            str(policy.refusal(intent(), Verdict(Finding.NEAR, earlier, 0.93))),
            earlier,
        )
        found[f"a batch paraphrasing {name}"] = (
            str(policy.refusal(intent(), Verdict(Finding.NEAR, earlier, 0.93), "line 4")),
            earlier,
        )
        found[f"a batch overlapping {name}"] = (
            str(policy.refusal(intent(), Verdict(Finding.OVERLAP, earlier), "line 4")),
            earlier,
        )
        if earlier.state in same_send.HOLDING:
            found[f"a new send held by {name}"] = (
                str(policy.refusal(intent(), Verdict(Finding.HELD, earlier))),
                earlier,
            )
            by_lead = earlier.model_copy(update={"channel": "sms", "recipients": ["+14155550100"]})
            found[f"a new send held by its lead's {name} sms"] = (
                str(policy.refusal(intent(), Verdict(Finding.HELD, by_lead))),
                by_lead,
            )
        found[f"a changed message under the key of {name}"] = (
            str(
                policy.key_conflict(
                    hail().spec("send_email"), earlier, intent(idempotency_key="k1"), {**REQUEST, "subject": "Other"}
                )
            ),
            earlier,
        )
        found[f"a batch repeating {name}"] = (
            str(
                policy.already_planned(
                    intent(recipients=("ada@example.com",)), Candidates(matches=[earlier]), rules, "send 3"
                )
            ),
            earlier,
        )
    found["an opt-out of one"] = (str(policy.suppressed_refusal(("ada@example.com",), "email")), None)
    found["an opt-out among several"] = (
        str(policy.suppressed_refusal(("ada@example.com", "bob@example.com"), "email")),
        None,
    )
    found["a resend of a message Hail has"] = (
        str(
            policy.found_in_upstream(OPERATIONS["needs_review"], {"id": "e-1", "status": "sent"}, "list_emails", "e-1")
        ),
        OPERATIONS["needs_review"],
    )
    found["a review decision on an operation not in review"] = (
        str(policy.not_in_review(OPERATIONS["accepted"], "resolved")),
        OPERATIONS["accepted"],
    )
    return found


def answers() -> dict[str, tuple[str, Operation | None]]:
    every: dict[str, tuple[str, Operation | None]] = {
        f"a send that is {name}": (text(_send_result(SendReport(op, replayed=True))), op)
        for name, op in OPERATIONS.items()
    }
    every.update(refusals())
    return every


ANSWERS = answers()


def _clauses(answer: str) -> list[str]:
    return [c.strip().lower() for c in re.split(r"[.;:()]\s", answer) if len(c.strip()) > 12]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_an_answer_reads_cleanly(name: str) -> None:
    answer, _ = ANSWERS[name]
    assert ".." not in answer
    assert " ." not in answer
    assert ". ." not in answer
    assert "  " not in answer
    clauses = _clauses(answer)
    assert len(clauses) == len(set(clauses)), f"a phrase is said twice: {answer}"
    assert answer.lower().count("nothing was sent") + answer.lower().count("not sent:") <= 1, answer


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_an_answer_names_its_next_step_once(name: str) -> None:
    answer, earlier = ANSWERS[name]
    if earlier is None:
        assert "see `hail-guard suppress list`" in answer or "suppress list" in answer
        return
    step = policy.next_step(earlier)
    if name.startswith("a batch repeating"):
        step = "leave send 3 out of the batch"  # the planner's step: the earlier operation is not the batch's
    elif name.startswith("a batch "):
        step = "leave line 4 out of the batch"  # a file's send, named by its line
    elif "review decision" in name or "Hail has" in answer:
        step = "hail-guard review"  # an operator's command
    assert answer.lower().count(step.lower()) == 1, answer


def _may_have_gone(earlier: Operation | None) -> bool:
    return earlier is not None and (earlier.state in MAY_HAVE_GONE or earlier.may_have_left)


ABOUT_SENDS_THAT_MAY_HAVE_GONE = sorted(name for name, (_, earlier) in ANSWERS.items() if _may_have_gone(earlier))


def test_the_answers_about_sends_that_never_left_are_the_only_ones_left_out() -> None:
    left_out = {name for name in ANSWERS if name not in ABOUT_SENDS_THAT_MAY_HAVE_GONE}
    never_left = {State.PLANNED, State.READY, State.FAILED, State.CANCELLED}
    for name in left_out:
        earlier = ANSWERS[name][1]
        assert earlier is None or (earlier.state in never_left and not earlier.may_have_left), name
    assert any(name.startswith("an opt-out") for name in left_out)
    assert "a send that is accepted" in ABOUT_SENDS_THAT_MAY_HAVE_GONE


@pytest.mark.parametrize("name", ABOUT_SENDS_THAT_MAY_HAVE_GONE)
def test_no_answer_about_a_send_that_may_have_gone_invites_another(name: str) -> None:
    answer, _ = ANSWERS[name]
    for invitation in INVITATIONS:
        assert invitation not in answer.lower().replace("do not send it again", ""), (invitation, answer)


def test_a_refused_token_is_one_clean_sentence_naming_the_variable() -> None:
    answer, _ = ANSWERS["a send that is ready"]
    assert answer.startswith("NOT SENT YET: Hail at x refused hail-guard's token")
    assert "an operator must set HAIL_API_KEY to a valid Hail token." in answer
    assert answer.lower().count("nothing was sent") == 1
