"""The rules about the same send (`hail_guard.same_send`), function by function: what a message means, who it is
from and for, and what `judge` decides from the candidates a ledger found. The ledgers' side (which candidates
they find) is the contract suite's; the agent's side, `tests/end_to_end/test_guarded_sends.py` and the model test's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from hail_guard import keys, same_send
from hail_guard.models import Intent, Operation, State
from hail_guard.profiles import hail
from hail_guard.same_send import Candidates, Finding, Rules, Verdict, judge

EMAIL = hail().spec("send_email")
SMS = hail().spec("send_sms")
NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
MESSAGE = {"subject": "Spring offer", "body_text": "20% off every plan until May."}


def operation(n: int = 1, *, recipients: tuple[str, ...] = ("ada@example.com",), **changes: Any) -> Operation:
    request = {"to": list(recipients), **MESSAGE, **changes.pop("request", {})}
    text = keys.canonical_json(request)
    values: dict[str, Any] = {
        "id": f"op-{n}",
        "idempotency_key": f"k{n}",
        "tool": "send_email",
        "channel": "email",
        "recipients": list(recipients),
        "request": text,
        "request_fingerprint": keys.fingerprint(text),
        "content_fingerprint": same_send.content_fingerprint(EMAIL, request),
        "state": State.ACCEPTED,
        "created_at": NOW,
        "updated_at": NOW,
    }
    return Operation.model_validate({**values, **changes})


def intent(*, recipients: tuple[str, ...] = ("ada@example.com",), **changes: Any) -> Intent:
    request = {"to": list(recipients), **MESSAGE, **changes.pop("request", {})}
    text = keys.canonical_json(request)
    values: dict[str, Any] = {
        "idempotency_key": "k-new",
        "tool": "send_email",
        "channel": "email",
        "recipients": recipients,
        "request": text,
        "request_fingerprint": keys.fingerprint(text),
        "content_fingerprint": same_send.content_fingerprint(EMAIL, request),
        "text": same_send.message_text(EMAIL, request),
    }
    return Intent.model_validate({**values, **changes})


def texts(by_id: dict[str, str]) -> Rules:
    """Rules whose stored sends read as these texts, by operation id (a `named` operation's subject)."""
    return Rules(message_of=lambda tool, arguments: by_id[arguments["subject"]])


def named(n: int) -> Operation:
    """`operation(n)` whose subject is its id, so that `texts` finds its text."""
    return operation(n, request={"subject": f"op-{n}"})


# --- what a message means --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "meaning"),
    [
        (" Hello \n  world\t", "Hello world"),
        ("e\u0301", "\u00e9"),
        ("   ", None),
        ({"a": None, "b": "", "c": [], "d": {}, "e": " x "}, {"e": "x"}),
        ({"a": None}, None),
        ([None, " ", "x", [], 2.0], ["x", 2]),
        ([None, ""], None),
        ((1, "a"), [1, "a"]),
        (2.0, 2),
        (-3.0, -3),
        (2.5, 2.5),
        (float(2**53), float(2**53)),  # past what a float holds exactly: left as it is
        (float(2**53 - 1), 2**53 - 1),
        (0, 0),
        (False, False),
        ({1: "x"}, {"1": "x"}),
    ],
)
def test_a_value_means_what_it_says_whatever_its_form(value: Any, meaning: Any) -> None:
    meant = same_send.meaning_of(value)
    assert meant == meaning
    assert type(meant) is type(meaning)


def test_the_message_text_is_every_field_by_name_lower_cased() -> None:
    request = {"to": ["ada@example.com"], "subject": " Spring  OFFER ", "body_text": "Hi", "metadata": {"x": "y"}}
    assert same_send.message_text(EMAIL, request) == "hi\nspring offer"
    nested = {"to": "+14155550100", "body": "Code", "tools": [{"b": "Two", "a": 1}], "metadata": {}}
    assert same_send.message_text(hail().spec("place_call"), nested) == "code\n1\ntwo"
    assert same_send.message_text(SMS, {"to": "+14155550100", "body": None}) == ""


def test_similarity_is_rapidfuzzs_ratio_from_0_to_1() -> None:
    assert same_send.similarity("spring offer", "spring offer") == 1.0
    assert same_send.similarity("abcd", "abce") == 0.75
    assert same_send.similarity("abc", "xyz") == 0.0


def test_the_sender_is_compared_in_its_normal_form_and_names_case_folded() -> None:
    arguments = {"from_": "Sales <SALES@Example.com>", "reply_to": "not an address", "from_name": " ACME Straße "}
    assert same_send.sender_of(EMAIL, arguments) == {
        "from_": "sales@example.com",
        "reply_to": "not an address",
        "from_name": "acme strasse",
    }
    assert same_send.sender_of(EMAIL, {"from_": None, "from_name": "  "}) == {}
    assert same_send.sender_of(EMAIL, {"from_": None, "reply_to": "B@x.org"}) == {"reply_to": "b@x.org"}
    assert same_send.sender_of(EMAIL, {"from_name": "Straße@Example.com"}) == {"from_name": "strasse@example.com"}
    assert same_send.sender_of(EMAIL, {"from_": "+1 415 555 0100"}) == {"from_": "+1 415 555 0100"}  # no address
    assert same_send.sender_of(SMS, {"from_": "020 7946 0958"}, region="GB") == {"from_": "+442079460958"}
    assert same_send.sender_of(SMS, {"from_": "020 7946 0958"}) == {"from_": "020 7946 0958"}


def test_the_lead_is_the_campaign_and_lead_ids_when_both_are_given() -> None:
    metadata = {"metadata": {"campaign_id": " spring ", "lead_id": 7}}
    assert same_send.lead_of(EMAIL, metadata) == '["spring","7"]'
    for partial in ({}, {"lead_id": " "}, {"lead_id": True}, {"lead_id": None}):
        assert same_send.lead_of(EMAIL, {"metadata": {"campaign_id": "spring", **partial}}) is None
    assert same_send.lead_at((), {"a": "x"}) is None
    assert same_send.lead_at(("/a",), {"a": 0}) == '["0"]'
    assert same_send.lead_at(("/a",), {"a": 1.5}) is None


def test_senders_agree_where_both_name_one() -> None:
    assert same_send.senders_agree({"from_": "a@x.org"}, {"from_": "a@x.org", "reply_to": "b@x.org"})
    assert same_send.senders_agree({"from_": "a@x.org"}, {"reply_to": "b@x.org"})
    assert not same_send.senders_agree({"from_": "a@x.org"}, {"from_": "c@x.org"})


def test_the_keys_of_an_intent_are_its_mailboxes_each_once() -> None:
    reached = intent(recipients=("ada+news@example.com", "ada@example.com", "bob@example.com"))
    assert same_send.keys_of_intent(reached) == ["ada@example.com", "bob@example.com"]
    number = intent(recipients=("+1 415 555 0100",), channel="email")
    assert same_send.keys_of_intent(number) == ["+1 415 555 0100"]  # on email it is no number


def test_match_states_let_a_second_copy_pass_only_what_has_settled() -> None:
    assert Rules().match_states(allow_duplicate=True) == (["needs_review", "sending", "unknown"], [], False)
    assert Rules().match_states(allow_duplicate=False) == (
        ["needs_review", "planned", "ready", "sending", "unknown"],
        ["accepted"],
        True,
    )
    assert not Rules(similarity_threshold=None, message_of=lambda tool, arguments: tool).compares_near
    assert not Rules().compares_near
    assert Rules(message_of=lambda tool, arguments: tool).compares_near


# --- the same send ---------------------------------------------------------------------------------------


def test_the_same_meaning_is_the_same_tool_message_people_and_senders() -> None:
    earlier = operation(recipients=("ada@example.com",), sender={"from_": "sales@x.org"})
    assert same_send.same_meaning(
        earlier, intent(recipients=("ADA+news@example.com",), sender='{"from_":"sales@x.org"}')
    )
    assert same_send.same_meaning(earlier, intent(sender="{}"))
    assert not same_send.same_meaning(earlier, intent(tool="send_sms"))
    assert not same_send.same_meaning(earlier, intent(request={"subject": "Other"}))
    assert not same_send.same_meaning(earlier, intent(recipients=("ada@example.com", "bob@example.com")))
    assert not same_send.same_meaning(earlier, intent(sender='{"from_":"ceo@x.org"}'))


def test_a_repeat_is_the_same_bytes_or_the_same_meaning() -> None:
    earlier = operation()
    same_bytes = intent(request_fingerprint=earlier.request_fingerprint, content_fingerprint="other", tool="other")
    assert same_send.repeats(earlier, same_bytes)
    assert same_send.repeats(earlier, intent())
    assert not same_send.repeats(earlier, intent(request={"subject": "Other"}))


@pytest.mark.parametrize(
    ("state", "may_have_left", "blocks", "blocks_a_second_copy"),
    [
        (State.ACCEPTED, False, True, False),
        (State.READY, False, True, False),
        (State.UNKNOWN, False, True, True),
        (State.SENDING, False, True, True),
        (State.NEEDS_REVIEW, False, True, True),
        (State.FAILED, False, False, False),
        (State.CANCELLED, False, False, False),
        (State.CANCELLED, True, True, False),
        (State.FAILED, True, True, False),
    ],
)
def test_what_stops_a_new_send_of_the_same_message(
    state: State, may_have_left: bool, blocks: bool, blocks_a_second_copy: bool
) -> None:
    earlier = operation(state=state, may_have_left=may_have_left)
    assert stops(earlier, allow_duplicate=False) is blocks
    assert stops(earlier, allow_duplicate=True) is blocks_a_second_copy


def stops(earlier: Operation, *, allow_duplicate: bool) -> bool:
    """Whether the ledgers' SQL counts `earlier` (sent within the window) as the same message already there, as
    `Rules.match_states` gives it the states: those compared at any age or within the window, and whether an
    operator's close after the send may have left counts."""
    always, windowed, closed_counts = Rules().match_states(allow_duplicate=allow_duplicate)
    closed = earlier.state in (State.FAILED, State.CANCELLED) and earlier.may_have_left
    return earlier.state.value in always + windowed or (closed_counts and closed)


# --- judge -----------------------------------------------------------------------------------------------


def test_nothing_in_the_way_is_new() -> None:
    assert judge(intent(), "x", Candidates(), Rules()) == Verdict(Finding.NEW)


def test_the_same_message_to_the_same_people_is_answered_from_the_live_one() -> None:
    superseded = operation(1, resent_as="op-2", state=State.CANCELLED, may_have_left=True)
    live = operation(2)
    assert judge(intent(), "x", Candidates(matches=[superseded, live]), Rules()) == Verdict(Finding.SAME, live)
    assert judge(intent(), "x", Candidates(matches=[live, superseded]), Rules()) == Verdict(Finding.SAME, live)
    other = operation(3)
    assert judge(intent(), "x", Candidates(matches=[live, other]), Rules()) == Verdict(Finding.SAME, live)


def test_the_same_message_overlapping_other_people_is_an_overlap_naming_the_first_match() -> None:
    both = operation(1, recipients=("ada@example.com", "bob@example.com"))
    second = operation(2, recipients=("ada@example.com", "carol@example.com"))
    verdict = judge(intent(), "x", Candidates(matches=[both, second]), Rules())
    assert verdict == Verdict(Finding.OVERLAP, both)


def test_a_second_copy_while_a_match_may_be_in_flight_is_refused_naming_the_first() -> None:
    first, second = operation(1, state=State.UNKNOWN), operation(2, state=State.SENDING)
    verdict = judge(intent(allow_duplicate=True), "x", Candidates(matches=[first, second]), Rules())
    assert verdict == Verdict(Finding.SECOND_COPY, first)


def test_a_hold_names_the_first_unresolved_send() -> None:
    first, second = operation(1, state=State.UNKNOWN), operation(2, state=State.NEEDS_REVIEW)
    assert judge(intent(), "x", Candidates(holds=[first, second]), Rules()) == Verdict(Finding.HELD, first)
    near = named(3)
    held = Candidates(holds=[first], near=[near])
    assert judge(intent(), "x", held, texts({"op-3": "x"})) == Verdict(Finding.HELD, first)


def test_a_text_near_enough_is_near_naming_the_nearest() -> None:
    far, close, closer = named(1), named(2), named(3)
    rules = texts({"op-1": "something else entirely", "op-2": "spring offer for all", "op-3": "spring offer for you"})
    found = Candidates(near=[far, close, closer])
    verdict = judge(
        intent(), "spring offer for yoU", found, Rules(message_of=rules.message_of, similarity_threshold=0.8)
    )
    assert verdict == Verdict(Finding.NEAR, closer, 0.95)
    tie = Candidates(near=[close, named(4)])
    equal = texts({"op-2": "abcd", "op-4": "abcd"})
    assert judge(intent(), "abce", tie, Rules(message_of=equal.message_of, similarity_threshold=0.75)) == Verdict(
        Finding.NEAR, close, 0.75
    )  # the first of two as near, at exactly the threshold
    assert judge(intent(), "abce", tie, Rules(message_of=equal.message_of, similarity_threshold=0.76)) == Verdict(
        Finding.NEW
    )


def test_the_score_is_rounded_to_three_places() -> None:
    rules = Rules(message_of=lambda tool, arguments: "abcdefg", similarity_threshold=0.5)
    assert judge(intent(), "abcdefh", Candidates(near=[operation()]), rules) == Verdict(
        Finding.NEAR, operation(), 0.857
    )


@pytest.mark.parametrize(
    ("rules", "allow_duplicate"),
    [
        (Rules(message_of=lambda tool, arguments: "spring offer"), True),  # a second copy asked for
        (Rules(message_of=lambda tool, arguments: "spring offer", similarity_threshold=None), False),  # not compared
        (Rules(message_of=None), False),  # no stored texts
    ],
)
def test_near_texts_are_not_compared_when_the_rules_say_so(rules: Rules, allow_duplicate: bool) -> None:
    found = Candidates(near=[operation()])
    assert judge(intent(allow_duplicate=allow_duplicate), "spring offer", found, rules) == Verdict(Finding.NEW)


def test_judge_reads_the_stored_message_of_each_candidate() -> None:
    seen: list[str] = []

    def message_of(tool: str, arguments: Mapping[str, Any]) -> str:
        seen.append(arguments["subject"])
        return json.dumps(arguments["subject"])

    judge(intent(), "zzz", Candidates(near=[named(1), named(2)]), Rules(message_of=message_of))
    assert seen == ["op-1", "op-2"]
