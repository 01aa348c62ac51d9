from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hail_guard import keys, same_send
from hail_guard.errors import BadInput, ConfigError
from hail_guard.profiles import built_in, hail

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


@given(json_objects)
def test_canonical_json_is_independent_of_key_order(value: dict[str, Any]) -> None:
    reordered = dict(reversed(list(value.items())))
    assert keys.canonical_json(value) == keys.canonical_json(reordered)


@given(json_objects)
def test_canonical_json_round_trips_to_an_equal_value(value: dict[str, Any]) -> None:
    assert json.loads(keys.canonical_json(value)) == value


@given(json_objects)
def test_canonical_json_of_its_own_parse_is_a_fixed_point(value: dict[str, Any]) -> None:
    text = keys.canonical_json(value)
    assert keys.canonical_json(json.loads(text)) == text


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_json_refuses_non_finite_numbers(bad: float) -> None:
    with pytest.raises(BadInput, match="not a JSON number"):
        keys.canonical_json({"a": [1, {"b": bad}]})


@given(json_objects, st.sampled_from(["send_email", "send_sms", "place_call"]))
def test_the_legacy_content_key_is_deterministic_and_names_the_channel(value: dict[str, Any], tool: str) -> None:
    key = keys.legacy_key(hail().spec(tool), value)
    assert key == keys.legacy_key(hail().spec(tool), dict(reversed(list(value.items()))))
    assert key.startswith(f"hg:{hail().spec(tool).channel}:")


@given(json_objects, json_objects)
def test_different_requests_get_different_legacy_content_keys(a: dict[str, Any], b: dict[str, Any]) -> None:
    if keys.canonical_json(a) != keys.canonical_json(b):
        assert keys.legacy_key(hail().spec("send_email"), a) != keys.legacy_key(hail().spec("send_email"), b)


@given(
    st.dictionaries(st.sampled_from(["subject", "body_text", "body_html", "reply_to"]), st.text(max_size=20)),
    st.sampled_from(["send_email", "send_sms", "place_call"]),
)
def test_the_meaning_key_is_deterministic_and_names_the_channel(message: dict[str, Any], tool: str) -> None:
    value = {**message, "to": ["a@example.com"] if tool == "send_email" else "+14155550100"}
    key = keys.derive_key(hail().spec(tool), value)
    assert key == keys.derive_key(hail().spec(tool), dict(reversed(list(value.items()))))
    assert key.startswith(f"hgm:{hail().spec(tool).channel}:")


def test_the_same_content_on_two_channels_gets_two_keys() -> None:
    args = {"to": "+15550100", "body": "hi"}
    assert keys.derive_key(hail().spec("send_sms"), args) != keys.derive_key(hail().spec("place_call"), args)


def test_metadata_ids_make_the_documented_key() -> None:
    args = {"metadata": {"campaign_id": "campaign_042", "lead_id": "lead_018", "message_id": "intro"}}
    assert keys.derive_key(hail().spec("send_email"), args) == "campaign_042:lead_018:email:intro"


def test_partial_metadata_falls_back_to_the_meaning_key() -> None:
    args = {"to": ["a@example.com"], "metadata": {"campaign_id": "c1", "lead_id": "l1"}}
    assert keys.derive_key(hail().spec("send_email"), args).startswith("hgm:email:")


def test_a_callers_key_is_used_as_is() -> None:
    assert keys.derive_key(hail().spec("send_email"), {"idempotency_key": "mine-1", "metadata": {}}) == "mine-1"


@pytest.mark.parametrize("bad", ["", "   ", "has space", "tab\there", "x" * 256, 17, None])
def test_bad_caller_keys_are_refused_with_what_to_do(bad: object) -> None:
    with pytest.raises(BadInput, match="idempotency_key"):
        keys.derive_key(hail().spec("send_email"), {"idempotency_key": bad})


def test_a_configured_template_fills_from_arguments_and_metadata() -> None:
    args = {"to": "+15550100", "metadata": {"lead": "L7"}}
    assert keys.derive_key(hail().spec("send_sms"), args, "{metadata.lead}:{channel}:{to}") == "L7:sms:+15550100"


def test_a_template_that_cannot_be_filled_names_what_is_missing() -> None:
    with pytest.raises(BadInput, match=r"missing metadata\.lead.*idempotency_key"):
        keys.derive_key(hail().spec("send_sms"), {"to": "+15550100"}, "{metadata.lead}:{channel}")


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("static", "key_template 'static' has no placeholders: every send would share one key"),
        ("{", "key_template '{' is not a valid template: Single '{' encountered in format string"),
        ("{a!r}x{", "key_template '{a!r}x{' is not a valid template: "),
        (
            "{0}",
            "key_template placeholder {0} is not supported; use {channel}, {tool}, {metadata.NAME} or a top-level "
            "argument name",
        ),
        ("{metadata.}", "key_template placeholder {metadata.} is not supported; use {channel}"),
    ],
)
def test_unusable_templates_are_configuration_errors_saying_what_to_use(template: str, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        keys.template_fields(template)
    assert str(refused.value).startswith(said)


def test_a_key_may_be_255_characters_and_no_more() -> None:
    assert keys.validate_key("k" * 255) == "k" * 255
    with pytest.raises(BadInput, match="idempotency_key is 256 characters long; the limit is 255"):
        keys.validate_key("k" * 256)


def test_metadata_ids_that_are_blank_fall_back_to_the_meaning_key() -> None:
    for blank in (" ", "", "\t"):
        args = {"to": ["a@example.com"], "metadata": {"campaign_id": "c1", "lead_id": blank, "message_id": "m"}}
        assert keys.derive_key(hail().spec("send_email"), args).startswith("hgm:email:")
    numbers = {"to": ["a@example.com"], "metadata": {"campaign_id": 7, "lead_id": 0, "message_id": "m"}}
    assert keys.derive_key(hail().spec("send_email"), numbers) == "7:0:email:m"


def test_a_template_that_cannot_be_filled_names_every_missing_field_in_order() -> None:
    template = "{metadata.lead}:{subject}:{channel}"
    with pytest.raises(BadInput) as refused:
        keys.derive_key(hail().spec("send_email"), {"to": ["a@x.org"], "subject": "  "}, template)
    assert str(refused.value) == (
        f"the key template {template!r} cannot be filled: missing metadata.lead, subject; add them to the "
        "arguments or pass idempotency_key yourself"
    )


def test_content_fingerprint_ignores_key_and_metadata_but_not_the_message() -> None:
    base = {"to": ["a@example.com"], "subject": "Hi", "body_text": "Hello"}
    same = {**base, "idempotency_key": "k2", "metadata": {"x": 1}, "allow_duplicate": True}
    changed = {**base, "body_text": "Hello!"}
    spec = hail().spec("send_email")
    assert same_send.content_fingerprint(spec, base) == same_send.content_fingerprint(spec, same)
    assert same_send.content_fingerprint(spec, base) != same_send.content_fingerprint(spec, changed)


def test_canonical_json_refuses_what_it_cannot_write() -> None:
    with pytest.raises(BadInput, match="not a JSON value"):
        keys.canonical_json({"n": 10**4301})


def test_a_callers_key_is_refused_naming_the_upstreams_own_key_argument() -> None:
    resend = built_in("resend").spec("send-email")
    with pytest.raises(BadInput, match=r"^idempotencyKey must be a non-empty string"):
        keys.derive_key(resend, {"to": "a@example.com", "idempotencyKey": " "})


def test_the_meaning_key_reads_the_recipients_and_sender_on_the_channel_and_in_the_region() -> None:
    sms = hail().spec("send_sms")
    national = {"to": "020 7946 0958", "from_": "020 7946 0959", "body": "Hi"}
    e164 = {"to": "+442079460958", "from_": "+442079460959", "body": "Hi"}
    assert keys.derive_key(sms, national, region="GB") == keys.derive_key(sms, e164)
    with pytest.raises(BadInput, match="is not a phone number"):
        keys.derive_key(sms, {"to": "ada@example.com", "body": "Hi"})  # on SMS an address is no recipient


def test_the_meaning_key_reads_only_the_profiles_recipient_fields() -> None:
    resend = built_in("resend").spec("send-email")  # to, cc and bcc: `recipients` is part of its message
    arguments = {"to": "a@example.com", "subject": "S", "recipients": ["b@example.com"]}
    content = same_send.content_fingerprint(resend, arguments)
    digest = same_send.meaning_digest(resend, ("a@example.com",), content, {})
    assert keys.derive_key(resend, arguments) == f"hgm:email:{digest[:32]}"
