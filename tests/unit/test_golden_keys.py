"""Golden vectors: fixed requests with the exact keys, stored bytes and fingerprints they get.

A key names a send for its whole life, in our ledger and in Hail's. If a new version derived a
different key for the same request, a retry after an upgrade would be a new send. These values
were computed once and must never change; a derivation that must change gets a new prefix, and the
old form is still looked up: a send whose key was derived from its bytes (`hg:`) before keys were derived
from its meaning (`hgm:`) keeps its legacy key here, beside the key it gets now.
"""

from __future__ import annotations

import json
import sqlite3
import unicodedata
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from hail_guard import keys
from hail_guard.guard import Guard, GuardSettings
from hail_guard.models import Intent
from hail_guard.profiles import hail
from hail_guard.sandbox.tools import input_schema
from tests.conftest import open_harness

GOLDEN: dict[str, tuple[str, dict[str, Any], str, str | None, str, str]] = {
    # name: (tool, arguments, key, the legacy key looked up too, stored canonical request, its fingerprint)
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
        None,
        '{"body_text":"Hi Ada","idempotency_key":"spring:lead001:email:intro","metadata":{"campaign_id":"spring",'
        '"lead_id":"lead001","message_id":"intro"},"recipient_consent":true,"subject":"Hello","to":["Ada@Example.'
        'com"]}',
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
        "hgm:email:12468b6b36c7874a8db2c559cea6afce",
        "hg:email:5dbb16915c275e3a6c9ba37c308c64ef",  # the legacy key, still looked up
        '{"body_html":"<p>Grüße, Élodie</p>","cc":["b@example.com"],"idempotency_key":"hgm:email:12468b6b36c7874a'
        '8db2c559cea6afce","recipient_consent":true,"subject":"Ça va ? 🎉","to":["élodie@example.com"]}',
        "810ee43f91bd1680f40f905b6e904b0ede5c1228dfb31a4c81d178c11b4d2369",
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
        "hgm:email:3206c13c1e857584643e26dd0eb929ad",
        "hg:email:212bc0f493cb371bf3146e762df4bc53",  # the legacy key, still looked up
        '{"body_text":"B","idempotency_key":"hgm:email:3206c13c1e857584643e26dd0eb929ad","metadata":{"campaign_id'
        '":"c","z":{"a":"x","b":[1,2.5,{"c":null}]}},"recipient_consent":true,"subject":"S","to":["a@example.com"'
        "]}",
        "cd8f608670584045362ad70b083b32b2fa9168a9a5cd2b5616aa5668998d4a9d",
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
        None,
        '{"body_text":"B","idempotency_key":"order-42:welcome","recipient_consent":true,"subject":"S","to":["a@ex'
        'ample.com"]}',
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
        "hgm:sms:c7991e14b7291fb7ab83288cfa8eda0b",
        "hg:sms:222bc730f1b67c6afb90de6129172f06",  # the legacy key, still looked up
        '{"body":"Your code is 0042","idempotency_key":"hgm:sms:c7991e14b7291fb7ab83288cfa8eda0b","metadata":{"bi'
        'g":1e+21,"int":10,"neg":-0.0,"score":0.1},"recipient_consent":true,"to":"+14155550100"}',
        "50841ee39763b72d9b543b5bd8daece79430f17560b11382e38be1d53847c427",
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
        None,
        '{"body":"Hi","idempotency_key":"7:8:sms:m","metadata":{"campaign_id":7,"lead_id":8,"message_id":"m"},"re'
        'cipient_consent":true,"to":"+14155550100"}',
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
        "hgm:call:c7e23fc6f630cc373e861ccea1f788c6",
        "hg:call:25d4f7cc859ef64bf83f90e622b9564c",  # the legacy key, still looked up
        '{"first_message":"Hello","idempotency_key":"hgm:call:c7e23fc6f630cc373e861ccea1f788c6","llm":{"api_key":'
        '"sk-test","base_url":"https://llm.example/v1","model":"m"},"recipient_consent":true,"to":"+14155550123"}',
        "e26c1aeb630022eea17b7417b5180a21d02fd9761c94a826b44551ebc152b67c",
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
        "hgm:call:d29e8edd0655c30f867d12cdb52aed16",
        "hg:call:22041765c6a423e80d3e635baff0efec",  # the legacy key, still looked up
        '{"ai_disclosure":true,"idempotency_key":"hgm:call:d29e8edd0655c30f867d12cdb52aed16","language":"fr-FR","'
        'recipient_consent":true,"system_prompt":"Be brief.","to":"+14155550123"}',
        "e2cc690061576729aaf4b6cb7fdeacbaf3f291bbc2c5aade119ef38cd221ede0",
    ),
    "acquire_number": (
        "acquire_number",
        {"quote_id": "q_123", "country_code": "US", "number_type": "local", "confirm_total_cents": 150},
        "hgm:acquire_number:ebdd7c428cf636f4d6dcacc1dd96445a",
        "hg:acquire_number:76f052ad2256a9dbde0a5dffbe5a9f1b",  # the legacy key, still looked up
        '{"confirm_total_cents":150,"country_code":"US","idempotency_key":"hgm:acquire_number:ebdd7c428cf636f4d6d'
        'cacc1dd96445a","number_type":"local","quote_id":"q_123"}',
        "2752eec37a538044c282a401009d76afc57fddc54cc67eeab054443438027840",
    ),
}


def _prepared(tool: str, arguments: dict[str, Any]) -> Intent:
    """What the guard records for a send (nothing is opened: `prepare` needs no ledger or upstream)."""
    guard = Guard(ledger=None, upstream=None, settings=GuardSettings())  # type: ignore[arg-type]
    return guard.prepare(tool, arguments, input_schema(tool) or {})[0]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_request_gets_the_key_it_always_got(name: str) -> None:
    tool, arguments, key, legacy, _, _ = GOLDEN[name]
    assert keys.derive_key(hail().spec(tool), arguments) == key
    intent = _prepared(tool, arguments)
    assert (intent.idempotency_key, intent.legacy_key) == (key, legacy)
    if legacy is not None:
        assert keys.legacy_key(hail().spec(tool), arguments) == legacy


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_stored_request_is_the_same_bytes_as_always(name: str) -> None:
    tool, arguments, _, _, stored, request_fingerprint = GOLDEN[name]
    intent = _prepared(tool, arguments)  # what the guard stores and forwards, not a formula of this test
    assert intent.request == stored
    assert intent.request_fingerprint == request_fingerprint
    assert keys.fingerprint(stored) == request_fingerprint


@pytest.mark.parametrize(
    "regenerated",
    [
        {"bcc": None, "reply_to": None},
        {"to": ["ÉLODIE@Example.COM "], "cc": ["Bee <B@example.com>"]},
        {"subject": " Ça  va ? 🎉\n", "bcc": []},
        {"metadata": {"attempt": 2}},
        {"body_html": unicodedata.normalize("NFD", "<p>Grüße, Élodie</p>")},
    ],
)
def test_a_regenerated_retry_gets_the_same_meaning_key_in_any_ledger(regenerated: dict[str, Any]) -> None:
    tool, arguments, key, _, _, _ = GOLDEN["email_content_unicode"]
    assert keys.derive_key(hail().spec(tool), {**arguments, **regenerated}) == key


def test_another_message_or_another_recipient_gets_another_meaning_key() -> None:
    tool, arguments, key, _, _, _ = GOLDEN["email_content_unicode"]
    for changed in ({"subject": "Ça va ?"}, {"to": ["elodie@example.com"]}, {"from_": "sales@example.com"}):
        assert keys.derive_key(hail().spec(tool), {**arguments, **changed}) != key


def test_a_template_key_is_the_same_as_always() -> None:
    _, arguments, _, _, _, _ = GOLDEN["email_campaign"]
    key = keys.derive_key(hail().spec("send_email"), arguments, "{metadata.campaign_id}/{channel}/{tool}/{subject}")
    assert key == "spring/email/send_email/Hello"


def test_a_resend_key_is_the_same_as_always() -> None:
    assert keys.resend_key("spring:lead001:email:intro") == "spring:lead001:email:intro:resend:1"
    assert keys.resend_key("spring:lead001:email:intro:resend:1") == "spring:lead001:email:intro:resend:2"


@pytest.mark.parametrize("name", sorted(name for name in GOLDEN if GOLDEN[name][0] != "acquire_number"))  # the
# sandbox sells no numbers
async def test_the_bytes_a_send_is_stored_and_forwarded_with_are_read_back_as_always(
    name: str, tmp_path: Path, ledger_url: str
) -> None:
    tool, arguments, key, _, stored, request_fingerprint = GOLDEN[name]
    async with open_harness(tmp_path, ledger_url=ledger_url) as harness:
        await harness.call(tool, arguments)  # whatever Hail answers, the intent was recorded first
        operation = await harness.ledger.find_by_key(key)
        assert operation is not None
        assert (operation.request, operation.request_fingerprint) == (stored, request_fingerprint)
        received = [line for line in harness.sandbox.outbox if line["idempotency_key"] == key]
        assert len(received) <= 1
        line = received[0] if received else None
    if line is not None:  # what Hail received is the stored request
        assert line["request"] == {k: v for k, v in json.loads(stored).items() if k != "idempotency_key"}
    if ledger_url.startswith("sqlite:"):  # and the file holds exactly these bytes
        with closing(sqlite3.connect(tmp_path / "ledger.db")) as db:
            [(raw,)] = db.execute("SELECT request FROM operations WHERE idempotency_key = ?", (key,)).fetchall()
        assert raw == stored
