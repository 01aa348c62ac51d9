"""Golden vectors: fixed requests with the exact keys, stored bytes and fingerprints they get.

A key names a send for its whole life, in our ledger and in Hail's. If a new version derived a
different key for the same request, a retry after an upgrade would be a new send. These values
were computed once and must never change; a derivation that must change gets a new prefix, and the
old form is still looked up.
"""

from __future__ import annotations

from typing import Any

import pytest

from hail_guard import keys
from hail_guard.profiles import hail

GOLDEN: dict[str, tuple[str, dict[str, Any], str, str, str]] = {
    # name: (tool, arguments, key, stored canonical request, its fingerprint)
    "email_campaign": (
        "send_email",
        {
            "to": ["Ada@Example.com"],
            "subject": "Hello",
            "body_text": "Hi Ada",
            "recipient_consent": True,
            "metadata": {"campaign_id": "spring", "lead_id": "lead001", "message_id": "intro"},
        },
        "spring:lead001:email:intro",
        '{"body_text":"Hi Ada","idempotency_key":"spring:lead001:email:intro","metadata":{"campaign_id":"spring",'
        '"lead_id":"lead001","message_id":"intro"},"recipient_consent":true,"subject":"Hello","to":["Ada@Example.com"]}',
        "bece9183fbf800297917946095bbb581498fd2a37c7080aabf788deb12713891",
    ),
    "email_content_unicode": (
        "send_email",
        {
            "to": ["élodie@example.com"],
            "cc": ["b@example.com"],
            "subject": "Ça va ? 🎉",
            "body_html": "<p>Grüße, Élodie</p>",
            "recipient_consent": True,
        },
        "hg:email:5dbb16915c275e3a6c9ba37c308c64ef",
        '{"body_html":"<p>Grüße, Élodie</p>","cc":["b@example.com"],"idempotency_key":'
        '"hg:email:5dbb16915c275e3a6c9ba37c308c64ef","recipient_consent":true,"subject":"Ça va ? 🎉",'
        '"to":["élodie@example.com"]}',
        "35e33aecbd2726d5d5ff538981ffe49a509c1a94082ef07da7776c05f44e862d",
    ),
    "email_nested_metadata": (
        "send_email",
        {
            "to": ["a@example.com"],
            "subject": "S",
            "body_text": "B",
            "recipient_consent": True,
            "metadata": {"z": {"b": [1, 2.5, {"c": None}], "a": "x"}, "campaign_id": "c"},
        },
        "hg:email:212bc0f493cb371bf3146e762df4bc53",
        '{"body_text":"B","idempotency_key":"hg:email:212bc0f493cb371bf3146e762df4bc53","metadata":{"campaign_id":"c",'
        '"z":{"a":"x","b":[1,2.5,{"c":null}]}},"recipient_consent":true,"subject":"S","to":["a@example.com"]}',
        "e2a8204b794fae36a8c4bb9d9b115375893274283284c4c8b407a044b67453ff",
    ),
    "email_caller_key": (
        "send_email",
        {
            "to": ["a@example.com"],
            "subject": "S",
            "body_text": "B",
            "recipient_consent": True,
            "idempotency_key": "order-42:welcome",
        },
        "order-42:welcome",
        '{"body_text":"B","idempotency_key":"order-42:welcome","recipient_consent":true,"subject":"S",'
        '"to":["a@example.com"]}',
        "b71c6f2b8fc9131ebb4b223207ae0d31e29ae23e4295a2615953e18337c77dfb",
    ),
    "sms_floats": (
        "send_sms",
        {
            "to": "+14155550100",
            "body": "Your code is 0042",
            "recipient_consent": True,
            "metadata": {"score": 0.1, "big": 1e21, "neg": -0.0, "int": 10},
        },
        "hg:sms:222bc730f1b67c6afb90de6129172f06",
        '{"body":"Your code is 0042","idempotency_key":"hg:sms:222bc730f1b67c6afb90de6129172f06","metadata":'
        '{"big":1e+21,"int":10,"neg":-0.0,"score":0.1},"recipient_consent":true,"to":"+14155550100"}',
        "62cae6cce7cd977871c52fa6ffacb2411d2787869ffb5ed72724001e233f2590",
    ),
    "sms_campaign_int_ids": (
        "send_sms",
        {
            "to": "+14155550100",
            "body": "Hi",
            "recipient_consent": True,
            "metadata": {"campaign_id": 7, "lead_id": 8, "message_id": "m"},
        },
        "7:8:sms:m",
        '{"body":"Hi","idempotency_key":"7:8:sms:m","metadata":{"campaign_id":7,"lead_id":8,"message_id":"m"},'
        '"recipient_consent":true,"to":"+14155550100"}',
        "6af949e78fc2715fc7dbdc36254cd2550f51397fbd694af52dbe2e1b63d3796f",
    ),
    "call_llm": (
        "place_call",
        {
            "to": "+14155550123",
            "recipient_consent": True,
            "llm": {"base_url": "https://llm.example/v1", "api_key": "sk-test", "model": "m"},
            "first_message": "Hello",
        },
        "hg:call:25d4f7cc859ef64bf83f90e622b9564c",
        '{"first_message":"Hello","idempotency_key":"hg:call:25d4f7cc859ef64bf83f90e622b9564c","llm":{"api_key":'
        '"sk-test","base_url":"https://llm.example/v1","model":"m"},"recipient_consent":true,"to":"+14155550123"}',
        "5a9762a650390a98c69ad48f710a4623f7452752dff29d348973b12506cbb8ed",
    ),
    "call_prompt": (
        "place_call",
        {
            "to": "+14155550123",
            "recipient_consent": True,
            "system_prompt": "Be brief.",
            "language": "fr-FR",
            "ai_disclosure": True,
        },
        "hg:call:22041765c6a423e80d3e635baff0efec",
        '{"ai_disclosure":true,"idempotency_key":"hg:call:22041765c6a423e80d3e635baff0efec","language":"fr-FR",'
        '"recipient_consent":true,"system_prompt":"Be brief.","to":"+14155550123"}',
        "96a12b33b63b512589624273b88794232469babe9a151d6c8faf544c0bb03134",
    ),
    "acquire_number": (
        "acquire_number",
        {"quote_id": "q_123", "country_code": "US", "number_type": "local", "confirm_total_cents": 150},
        "hg:acquire_number:76f052ad2256a9dbde0a5dffbe5a9f1b",
        '{"confirm_total_cents":150,"country_code":"US","idempotency_key":'
        '"hg:acquire_number:76f052ad2256a9dbde0a5dffbe5a9f1b","number_type":"local","quote_id":"q_123"}',
        "04fd178e87feeae04f80ecd4e55dbdb62b06d7f81c6f3b1ad287f7b9d0d4240c",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_request_gets_the_key_it_always_got(name: str) -> None:
    tool, arguments, key, _, _ = GOLDEN[name]
    assert keys.derive_key(hail().spec(tool), arguments) == key


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_stored_request_is_the_same_bytes_as_always(name: str) -> None:
    _, arguments, key, stored, request_fingerprint = GOLDEN[name]
    text = keys.canonical_json({**arguments, keys.KEY_FIELD: key})
    assert text == stored
    assert keys.fingerprint(text) == request_fingerprint


def test_a_template_key_is_the_same_as_always() -> None:
    _, arguments, _, _, _ = GOLDEN["email_campaign"]
    key = keys.derive_key(hail().spec("send_email"), arguments, "{metadata.campaign_id}/{channel}/{tool}/{subject}")
    assert key == "spring/email/send_email/Hello"


def test_a_resend_key_is_the_same_as_always() -> None:
    assert keys.resend_key("spring:lead001:email:intro") == "spring:lead001:email:intro:resend:1"
    assert keys.resend_key("spring:lead001:email:intro:resend:1") == "spring:lead001:email:intro:resend:2"
