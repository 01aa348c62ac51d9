"""One normalisation of addresses and numbers: opt-outs that no spelling and no recipient field bypasses."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hail_guard.config import Settings
from hail_guard.errors import Suppressed
from hail_guard.guard import Guard, GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import Intent, Suppression
from hail_guard.recipients import (
    BadRecipient,
    comparable,
    key_of,
    keys_of,
    normalise_recipient,
    opt_out_key,
    recipients_of,
)
from hail_guard.sandbox.tools import input_schema
from tests.conftest import data, open_harness, text
from tests.postgres import PostgresServer


@pytest.mark.parametrize(
    ("spelling", "channel", "normal"),
    [
        ("Ada@Example.com", "email", "ada@example.com"),
        ("  ada@example.com\t", "email", "ada@example.com"),
        ("Élodie <élodie@example.com>", "email", "élodie@example.com"),
        ('"Ada, the first" <ADA@example.com>', "email", "ada@example.com"),
        (unicodedata.normalize("NFD", "élodie@example.com"), "email", "élodie@example.com"),
        ("ÉLODIE@EXAMPLE.COM", "email", "élodie@example.com"),
        ("mailto:ada@example.com", "email", "ada@example.com"),
        ("ada@example.com.", "email", "ada@example.com"),
        ("ada@xn--exmple-cua.com", "email", "ada@exämple.com"),
        ("+1 (415) 555-0190", "sms", "+14155550190"),
        ("+1 415-555-0181", "sms", "+14155550181"),
        ("+1.415.555.0190", "call", "+14155550190"),
        ("tel:+14155550190", "sms", "+14155550190"),
        ("+44 (0) 20 7946 0958", "sms", "+442079460958"),
        ("＋１ ４１５ ５５５ ０１９０", "sms", "+14155550190"),
        ("+1 (415) 555-0190", "all", "+14155550190"),
        ("Ada@Example.com", "all", "ada@example.com"),
    ],
)
def test_every_spelling_of_one_mailbox_or_number_has_one_normal_form(spelling: str, channel: str, normal: str) -> None:
    assert normalise_recipient(spelling, channel) == normal


@pytest.mark.parametrize(
    ("written", "channel", "key"),
    [("+1 (415) 555-0100 ext. 2", "sms", "+14155550100"), ("+1-800-FLOWERS", "call", "+18003569377")],
)
def test_an_opt_out_is_keyed_as_its_channel_reads_the_recipient(written: str, channel: str, key: str) -> None:
    """An operator's opt-out of a number written with an extension or letters blocks sends to that number: read as
    a phone number because its channel is one, not guessed from the text."""
    assert opt_out_key(written, channel) == key


@pytest.mark.parametrize(
    ("spelling", "channel", "says"),
    [
        ("", "email", "empty"),
        ("   ", "all", "empty"),
        ("e\u200blodie@example.com", "email", "invisible character (U+200B)"),
        ("ada@exam\u200dple.com", "email", "invisible character (U+200D)"),
        ("ad\u00ada@example.com", "email", "invisible character (U+00AD)"),
        ("\u202eada@example.com", "email", "invisible character (U+202E)"),
        ("ada at example.com", "email", "not an email address"),
        ("ada@", "email", "not an email address"),
        ("a b@example.com", "email", "not an email address"),
        ("415 555 0190", "sms", "international form"),
        ("0415 555 0190", "all", "international form"),
        ("+1 415", "sms", "international form"),
        ("not a number", "sms", "international form"),
    ],
)
def test_a_recipient_that_is_no_address_or_number_is_refused_saying_why(spelling: str, channel: str, says: str) -> None:
    with pytest.raises(BadRecipient, match=re.escape(says)):
        normalise_recipient(spelling, channel)


def test_every_recipient_field_counts_each_recipient_once() -> None:
    arguments = {"to": ["Ada@Example.com", "bob@example.com"], "cc": ["ADA@example.com"], "bcc": "Carol <c@x.org>"}
    assert recipients_of("email", arguments) == ("ada@example.com", "bob@example.com", "c@x.org")


def test_a_sub_address_has_its_mailbox_as_its_key() -> None:
    assert key_of("ada+news@example.com") == "ada@example.com"
    assert key_of("ada@example.com") == "ada@example.com"
    assert key_of("+14155550190") == "+14155550190"


@pytest.mark.parametrize(
    ("recipient", "key"),
    [
        ("ada+news@example.com", "ada@example.com"),
        ("ada+x+y@example.com", "ada@example.com"),  # the mailbox is before the first +
        ("ada+@example.com", "ada@example.com"),
        ("+ada@example.com", "+ada@example.com"),  # a leading + is part of the mailbox
        ("+@example.com", "+@example.com"),
        ("X+news@example.com", "X@example.com"),
        ('"ada+x"@example.com', '"ada+x"@example.com'),  # a quoted local part is one mailbox
        ("ada+x@host@example.com", "ada@example.com"),  # the domain is after the last @
        ("ada+news", "ada+news"),  # not an address
        ("+14155550190", "+14155550190"),
    ],
)
def test_the_key_of_a_recipient_is_its_mailbox(recipient: str, key: str) -> None:
    assert key_of(recipient) == key


def test_comparable_reads_what_it_can_and_lowers_the_rest() -> None:
    assert comparable("Ada <ADA@Example.com>", "email") == "ada@example.com"
    assert comparable("020 7946 0958", "sms", region="GB") == "+442079460958"
    assert comparable(" 020 7946 0958 ", "sms") == "020 7946 0958"  # no region: kept, lowered, for comparing
    assert comparable("+1 415 555 0100", "email") == "+1 415 555 0100"  # on email it is no number
    assert comparable("+1 415 555 0100") == "+14155550100"
    assert comparable(unicodedata.normalize("NFD", "ÉCOLE Nord")) == "école nord"


def test_keys_of_reads_each_recipient_on_its_channel_and_region() -> None:
    assert keys_of(["+1 415 555 0100"], "email") == ["+1 415 555 0100"]
    assert keys_of(["+1 415 555 0100", "+14155550100"]) == ["+14155550100"]
    assert keys_of(["020 7946 0958"], "sms", region="GB") == ["+442079460958"]
    assert keys_of(["Ada+News@Example.com", "ada@example.com", "Bob@example.com"]) == [
        "ada@example.com",
        "bob@example.com",
    ]


@pytest.mark.parametrize(
    ("spelling", "normal"),
    [
        ('"ada"@example.com', "ada@example.com"),  # quotes that change nothing go
        ("ada@[192.0.2.1]", "ada@[192.0.2.1]"),  # a domain literal
        ("ada@mail.test", "ada@mail.test"),  # a test domain (the sandbox's and the drill's)
        ("ada@XN--exmple-cua.com", "ada@exämple.com"),
        ("ada@intranet", "ada@intranet"),  # a domain of one label: not globally deliverable, still an address
        ("a1b2c3", "a1b2c3"),  # not shaped like a number: a name
        ("12", "12"),  # too few digits to be a number
        (unicodedata.normalize("NFD", "ÉLODIE"), "élodie"),
    ],
)
def test_what_an_address_a_name_or_a_short_code_normalises_to(spelling: str, normal: str) -> None:
    assert normalise_recipient(spelling) == normal


@pytest.mark.parametrize(
    ("spelling", "channel", "region", "said"),
    [
        ("@example.com", "email", None, "'@example.com' is not an email address such as ada@example.com"),
        (
            "ada smith@example.com",
            "email",
            None,
            "'ada smith@example.com' is not an email address such as ada@example.com",
        ),
        ("ada@xn--zz.com", "email", None, "the domain 'xn--zz.com' has a label that is not valid punycode"),
        (
            "123",
            None,
            None,
            "'123' is not a phone number in international form: write it with + and the country code, such as "
            "+14155550100 (or set [guard] default_region for national numbers)",
        ),
        (
            "12",
            "sms",
            "GB",
            "'12' is not a phone number in international form or as a number of GB: write it with + and the "
            "country code, such as +14155550100 (or set [guard] default_region for national numbers)",
        ),
    ],
)
def test_a_recipient_that_cannot_be_read_is_refused_with_these_words(
    spelling: str, channel: str | None, region: str | None, said: str
) -> None:
    with pytest.raises(BadRecipient) as refused:
        normalise_recipient(spelling, channel, region=region)
    assert str(refused.value) == said


def test_a_recipient_that_is_not_text_empty_or_too_long_is_refused_saying_so() -> None:
    with pytest.raises(BadRecipient, match=r"^a recipient must be text, not int$"):
        normalise_recipient(5)  # type: ignore[arg-type]
    with pytest.raises(BadRecipient, match=r"^a recipient is empty: give an email address or a phone number$"):
        normalise_recipient(" \t")
    assert normalise_recipient("x" * 320) == "x" * 320
    with pytest.raises(BadRecipient, match=r"^a recipient is 321 characters long; the limit is 320$"):
        normalise_recipient("x" * 321)


def test_recipients_are_read_on_their_channel_and_in_the_region() -> None:
    assert recipients_of("sms", {"to": "020 7946 0958"}, region="GB") == ("+442079460958",)
    with pytest.raises(BadRecipient, match=r"^to: 'ada@example\.com' is not a phone number"):
        recipients_of("sms", {"to": "ada@example.com"})


def test_a_long_unreadable_recipient_is_shown_cut_at_80_characters() -> None:
    spelling = "x" * 100 + " @example.com"
    with pytest.raises(BadRecipient) as refused:
        normalise_recipient(spelling, "email")
    assert str(refused.value) == f"{'x' * 80!r} is not an email address such as ada@example.com"


# --- through the proxy ------------------------------------------------------------------------------


async def test_an_opt_out_stops_a_send_that_names_the_recipient_in_cc_or_bcc(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        await harness.call("record_opt_out", {"recipient": "élodie@example.com", "channel": "email", "reason": "STOP"})
        spellings = {"cc": "Élodie <ÉLODIE@example.com>", "bcc": unicodedata.normalize("NFD", "élodie@Example.com")}
        for field, spelling in spellings.items():
            email = {
                "to": ["a@example.com"],
                field: [spelling],
                "subject": f"Hello via {field}",
                "body_text": "Hi",
                "recipient_consent": True,
            }
            refused = await harness.call("send_email", email)
            assert refused.is_error
            assert "opted out of email" in text(refused)
        planned = await harness.call(
            "plan_batch",
            {
                "sends": [
                    {
                        "tool": "send_email",
                        "arguments": {
                            "to": ["b@example.com"],
                            "cc": ["Elodie <élodie@example.com>"],
                            "subject": "Batch",
                            "body_text": "Hi",
                            "recipient_consent": True,
                        },
                    }
                ]
            },
        )
        assert data(planned)["counts"] == {"cancelled": 1}
        assert harness.sandbox.outbox == []


async def test_a_new_send_to_a_sub_address_of_an_opted_out_mailbox_is_refused(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        await harness.call("record_opt_out", {"recipient": "ada@example.com", "channel": "email", "reason": "STOP"})
        mail = {"subject": "Hello", "body_text": "Hi", "recipient_consent": True}
        for spelling in ("ada+news@example.com", "ADA+promo@Example.com", "Ada <ada+x@example.com>"):
            refused = await harness.call("send_email", {**mail, "to": [spelling]})
            assert refused.is_error
            assert "opted out of email" in text(refused)
        other = await harness.call("send_email", {**mail, "to": ["adam+news@example.com"]})  # another mailbox
        assert not other.is_error, text(other)
        assert [line["to"] for line in harness.sandbox.outbox] == [["adam+news@example.com"]]


async def test_an_opt_out_counts_in_the_recipient_and_recipients_fields_of_a_tool_that_has_them(
    tmp_path: Path,
) -> None:
    """Hail's profile reads `recipient` and `recipients` too (a tool of a later Hail may take them)."""
    guard = Guard(ledger=None, upstream=None, settings=GuardSettings())  # type: ignore[arg-type]
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        await ledger.add_suppression(
            Suppression(recipient="carol@example.com", channel="email", reason="STOP", source="test"), actor="t"
        )
        for field, value in (
            ("recipient", "Carol <CAROL@example.com>"),
            ("recipients", ["b@example.com", "carol@example.com"]),
        ):
            arguments = {"to": ["a@example.com"], "subject": f"via {field}", "body_text": "Hi", field: value}
            intent, _ = guard.prepare("send_email", arguments, None)  # a tool whose schema takes the field
            assert "carol@example.com" in intent.recipients
            with pytest.raises(Suppressed, match="opted out of email"):
                await ledger.begin_send(intent, owner="w1", lease_seconds=60)
        assert await ledger.list_operations() == []


async def test_an_opt_out_of_a_formatted_number_stops_an_sms_to_its_e164_form(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        added = data(await harness.call("record_opt_out", {"recipient": "+1 (415) 555-0190", "reason": "STOP"}))
        assert added["recipient"] == "+14155550190"
        sms = {"to": "+14155550190", "body": "Hi", "recipient_consent": True}
        refused = await harness.call("send_sms", sms)
        assert refused.is_error
        assert "opted out" in text(refused)
        assert harness.sandbox.outbox == []


@pytest.mark.parametrize("recipient", ["   ", "e\u200blodie@example.com", "0415 555 0190"])
async def test_an_opt_out_that_names_nobody_is_refused_and_records_nothing(tmp_path: Path, recipient: str) -> None:
    async with open_harness(tmp_path) as harness:
        refused = await harness.call("record_opt_out", {"recipient": recipient, "reason": "STOP"})
        assert refused.is_error
        assert await harness.ledger.list_suppressions() == []


async def test_a_send_to_an_unreadable_address_is_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        email = {"to": ["e\u200blodie@example.com"], "subject": "S", "body_text": "B", "recipient_consent": True}
        refused = await harness.call("send_email", email)
        assert refused.is_error
        assert "to: " in text(refused)
        assert "invisible character" in text(refused)
        assert await harness.ledger.list_operations() == []
        assert harness.sandbox.calls("send_email") == 0


# --- the property, on both ledgers ----------------------------------------------------------------

_SAFE_LETTERS = "abcdefghijklmnopqrstuvwxyzéèüöçñåø"
"""Letters whose lower case reaches the same text from either case (no dotless i; no ß, whose upper case SS is
another mailbox: lower-cased, never case-folded)."""
_locals = st.text(alphabet=_SAFE_LETTERS + "0123456789._-", min_size=1, max_size=12).filter(
    lambda local: local[0] not in "._-" and local[-1] not in "._-" and ".." not in local  # RFC 5322's dot-atoms
)
_labels = st.text(alphabet=_SAFE_LETTERS + "0123456789", min_size=2, max_size=10)


@st.composite
def _mailbox_spellings(draw: st.DrawFn) -> tuple[str, list[str]]:
    """One mailbox, and spellings of it an agent may write (display names, case, Unicode forms, punycode)."""
    local, label = draw(_locals), draw(_labels)

    def cased(text: str) -> str:
        return "".join(ch.upper() if draw(st.booleans()) else ch for ch in text)

    spellings = []
    for _ in range(draw(st.integers(min_value=2, max_value=5))):
        domain = cased(label)
        if not domain.isascii() and draw(st.booleans()):
            domain = "xn--" + unicodedata.normalize("NFC", domain).encode("punycode").decode("ascii")
        form = unicodedata.normalize(draw(st.sampled_from(["NFC", "NFD"])), f"{cased(local)}@{domain}.example")
        wrapped = draw(st.sampled_from(["{}", " {} ", "Lead <{}>", '"Lead, Q" <{}>', "mailto:{}", "{}."]))
        spellings.append(wrapped.format(form))
    return f"{local}@{label}.example", spellings


def _send(tool: str, arguments: dict[str, Any]) -> Intent:
    guard = Guard(ledger=None, upstream=None, settings=GuardSettings())  # type: ignore[arg-type]  # prepare needs neither
    return guard.prepare(tool, arguments, input_schema(tool) or {})[0]


async def _opted_out_everywhere(ledger: Ledger, opt_out: str, spellings: list[str]) -> None:
    """Opt out with one spelling (as `record_opt_out` does), then every other spelling, in any field, is refused."""
    await ledger.add_suppression(
        Suppression(recipient=normalise_recipient(opt_out, "email"), channel="email", reason="STOP", source="test"),
        actor="test",
    )
    for n, spelling in enumerate(spellings):
        field = ("to", "cc", "bcc")[n % 3]
        arguments = {
            "to": [spelling] if field == "to" else ["someone.else@example.org"],
            "subject": f"S{n}",
            "body_text": "B",
            "recipient_consent": True,
            **({field: [spelling]} if field != "to" else {}),
        }
        with pytest.raises(Suppressed):
            await ledger.begin_send(_send("send_email", arguments), owner="t", lease_seconds=60)


_PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPERTY
@given(_mailbox_spellings())
def test_an_opt_out_of_any_spelling_stops_every_spelling_on_sqlite(
    tmp_path_factory: pytest.TempPathFactory, mailbox: tuple[str, list[str]]
) -> None:
    _, spellings = mailbox

    async def check() -> None:
        path = tmp_path_factory.mktemp("ledger") / "ledger.db"
        async with open_ledger(f"sqlite:///{path}") as ledger:
            await _opted_out_everywhere(ledger, spellings[0], spellings[1:])

    anyio.run(check)


@_PROPERTY
@given(_mailbox_spellings())
def test_an_opt_out_of_any_spelling_stops_every_spelling_on_postgresql(
    postgres_server: PostgresServer, mailbox: tuple[str, list[str]]
) -> None:
    _, spellings = mailbox

    async def check() -> None:
        async with postgres_server.database() as url, open_ledger(url) as ledger:
            await _opted_out_everywhere(ledger, spellings[0], spellings[1:])

    anyio.run(check)


_NUMBER_SPELLINGS = ["+1 (415) 555-{}", "+1-415-555-{}", "+1.415.555.{}", "tel:+1415555{}", " +1 415 555 {} "]


@pytest.mark.parametrize("spelling", _NUMBER_SPELLINGS)
async def test_an_opt_out_of_any_number_spelling_stops_sms_and_calls(ledger: Ledger, spelling: str) -> None:
    number = spelling.format("0190")
    await ledger.add_suppression(
        Suppression(recipient=normalise_recipient(number, "all"), channel="all", reason="STOP", source="t"), actor="t"
    )
    sms = _send("send_sms", {"to": "+14155550190", "body": "Hi", "recipient_consent": True})
    call = _send("place_call", {"to": "+14155550190", "system_prompt": "Be brief.", "recipient_consent": True})
    for intent in (sms, call):
        with pytest.raises(Suppressed):
            await ledger.begin_send(intent, owner="t", lease_seconds=60)


def test_a_national_number_is_read_in_the_default_region_when_one_is_set() -> None:
    assert normalise_recipient("020 7946 0958", "sms", region="GB") == "+442079460958"
    with pytest.raises(BadRecipient, match=r"or as a number of GB"):
        normalise_recipient("12", "sms", region="GB")


@pytest.mark.parametrize(("given", "kept"), [("gb", "GB"), (" De ", "DE")])
def test_the_default_region_is_an_iso_code_read_in_upper_case(given: str, kept: str) -> None:
    assert Settings.model_validate({"guard": {"default_region": given}}).guard.default_region == kept


def test_a_default_region_phone_numbers_are_not_known_for_is_refused_saying_what_to_give() -> None:
    with pytest.raises(ValueError, match="give an ISO 3166 code like GB"):
        Settings.model_validate({"guard": {"default_region": "XX"}})


async def test_an_opt_out_given_in_national_form_stops_a_send_to_its_international_one(tmp_path: Path) -> None:
    """Hail takes E.164 only, so the region reads what an operator or an agent writes about a recipient."""
    async with open_harness(tmp_path, default_region="GB") as harness:
        stopped = data(
            await harness.call("record_opt_out", {"recipient": "020 7946 0958", "channel": "sms", "reason": "x"})
        )
        assert stopped["recipient"] == "+442079460958"
        refused = await harness.call("send_sms", {"to": "+442079460958", "body": "Hi", "recipient_consent": True})
        assert "opted out of sms" in text(refused)
        assert harness.sandbox.calls("send_sms") == 0
