"""Who a send reaches: every recipient field of a tool, each address or number in one normal form.

`normalise_recipient` is the one normalisation of the whole program: opt-outs are stored in it,
the ledger stores an operation's recipients in it, and every rule about the same send compares them in
it. Two spellings that reach the same mailbox or number give the same text:

- an email address is read by `email-validator` (RFC 5322 syntax, IDNA 2008 with the UTS 46 mapping):
  it loses its display name (`Élodie <élodie@example.com>`), a `mailto:` prefix and a trailing dot of
  the domain; full-width forms and other compatibility characters read as what they stand for (NFKC,
  and UTS 46's mapping of the ideographic full stop in a domain); quotes that change nothing go (`"ada"@example.com`); a
  punycode domain (`xn--...`) is read as Unicode; the whole is lower-cased, never case-folded, so
  `straße.de` and `strasse.de` stay two domains. Invisible characters (zero-width spaces, bidi
  controls, soft hyphens...) and whitespace inside an address are refused, never silently dropped: what
  reaches the upstream is what was written.
- a phone number is read by `phonenumbers` and written in E.164 (`+1 (415) 555-0190` -> `+14155550190`,
  a `(0)` trunk prefix dropped); a number without its country code is read in the `region` given
  (`[guard] default_region`), else refused, as is one that cannot be a number.

`key_of` is the mailbox a recipient reaches: a sub-address (`ada+news@example.com`) is its mailbox
(`ada@example.com`). Keys are what opt-outs are stored and probed by, and what the rules about the same
send compare: an opt-out of `ada+news@` stops `ada@` and `ada+promo@` alike, and a send to one of them
while another is unresolved is held the same way.
"""

from __future__ import annotations

import codecs
import functools
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hail_guard import pointers
from hail_guard.errors import BadInput

RECIPIENT_FIELDS = ("to", "cc", "bcc", "recipient", "recipients")
"""Argument names that name who receives a send where a profile does not say; every one is checked
against opt-outs."""
RECIPIENT_POINTERS = tuple(f"/{name}" for name in RECIPIENT_FIELDS)
EMAIL_CHANNELS = frozenset({"email"})
PHONE_CHANNELS = frozenset({"sms", "call"})
MAX_RECIPIENT_LENGTH = 320
NORMALISED_KEPT = 4096
"""Recipients whose normal form is kept (`_normalised`)."""
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"})
_DISPLAY_FORM = re.compile(r"^(?P<name>.*)<(?P<address>[^<>]*)>$", re.DOTALL)
_NUMBER_SHAPE = re.compile(r"^(tel:)?[+＋]?[\d\s().\-／/０-９]+$", re.IGNORECASE)


class BadRecipient(BadInput):
    """A recipient that cannot be read as an address or a number; nothing is recorded."""


def normalise_recipient(text: str, channel: str | None = None, *, region: str | None = None) -> str:
    """The one form of a recipient (see the module docstring); `BadRecipient` when there is none.

    `channel` says what it is: `email`, or `sms`/`call` (a phone number); any other channel (or
    None, or `all`) reads a text with an `@` as an address and one that looks like a number as a
    number, and anything else as a name compared in NFC, lower-cased. `region` (ISO 3166, `GB`) reads
    a national number.
    """
    if not isinstance(text, str):
        raise BadRecipient(f"a recipient must be text, not {type(text).__name__}")
    return _normalised(text, channel, region)


def forget_normal_forms() -> None:
    """Empty the kept normal forms (tests: each reads its recipients afresh)."""
    _normalised.cache_clear()


@functools.lru_cache(maxsize=NORMALISED_KEPT)
def _normalised(text: str, channel: str | None, region: str | None) -> str:
    """`normalise_recipient` of a text, kept: a send's recipients are read again for its keys, its opt-out
    probes and its checks, and an address's validation is the costly part (a refusal is not kept)."""
    trimmed = text.strip()
    if not trimmed:
        raise BadRecipient("a recipient is empty: give an email address or a phone number")
    if len(trimmed) > MAX_RECIPIENT_LENGTH:
        raise BadRecipient(f"a recipient is {len(trimmed)} characters long; the limit is {MAX_RECIPIENT_LENGTH}")
    _refuse_invisible(trimmed)
    if channel in EMAIL_CHANNELS or (channel not in PHONE_CHANNELS and "@" in trimmed):
        return _address(trimmed)
    if channel in PHONE_CHANNELS or _looks_like_number(trimmed):
        return _number(trimmed, region)
    return _lowered(trimmed)


def comparable(text: str, channel: str | None = None, *, region: str | None = None) -> str:
    """`normalise_recipient` where it can; else (a value recorded before it, a query) the text trimmed and
    lower-cased.

    For comparing, never for recording a new send: there an unreadable recipient is refused.
    """
    try:
        return normalise_recipient(text, channel, region=region)
    except BadRecipient:
        return _lowered(text.strip())


def key_of(recipient: str) -> str:
    """The mailbox a normalised recipient reaches: an address without its sub-address (`ada+news@` is
    `ada@`); anything else itself. What opt-outs and the rules about the same send compare."""
    local, at, domain = recipient.rpartition("@")
    if at and "+" in local.lstrip("+") and not local.startswith('"'):
        return f"{local.split('+', 1)[0] or local}@{domain}"
    return recipient


def opt_out_key(recipient: str, channel: str) -> str:
    """What an opt-out of `recipient` on `channel` is stored and probed by: its key, read as `comparable` (a
    webhook's sender that cannot be read is kept as written)."""
    return key_of(comparable(recipient, channel))


def recipients_of(
    channel: str, arguments: Mapping[str, Any], fields: Sequence[str] = RECIPIENT_POINTERS, *, region: str | None = None
) -> tuple[str, ...]:
    """Every recipient of a send in `fields` (JSON pointers: to, cc, bcc, ... alike), normalised, each once,
    in the order given."""
    found: dict[str, None] = {}
    for field in fields:
        for value in _values(pointers.resolve(arguments, field)):
            try:
                found[normalise_recipient(value, channel, region=region)] = None
            except BadRecipient as exc:
                raise BadRecipient(f"{pointers.shown(field)}: {exc}") from None
    return tuple(found)


def keys_of(recipients: Iterable[str], channel: str | None = None, *, region: str | None = None) -> list[str]:
    """The key of each of these recipients (read as `comparable` first), each once, in order."""
    return list(dict.fromkeys(key_of(comparable(recipient, channel, region=region)) for recipient in recipients))


def _values(value: object) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [item for item in value if item is not None]
    return [value]


def _refuse_invisible(text: str) -> None:
    for character in text:
        if unicodedata.category(character) in _INVISIBLE_CATEGORIES:
            raise BadRecipient(
                f"{text.encode('unicode_escape').decode('ascii')!r} holds an invisible character "
                f"(U+{ord(character):04X}); write the recipient without it"
            )


def _address(text: str) -> str:
    from email_validator import EmailNotValidError, validate_email  # here: only addresses need it (20 ms)

    display = _DISPLAY_FORM.match(text)
    address = unicodedata.normalize("NFKC", (display["address"] if display else text).strip())
    if address.lower().startswith("mailto:"):
        address = address[len("mailto:") :]
    local, at, domain = address.rpartition("@")
    if not at or not local or any(ch.isspace() for ch in address):
        raise BadRecipient(f"{_shown(text)} is not an email address such as ada@example.com")
    try:
        read = validate_email(
            f"{local}@{_unicode_domain(domain.removesuffix('.'))}",
            check_deliverability=False,
            allow_quoted_local=True,
            allow_domain_literal=True,
            globally_deliverable=False,
            test_environment=True,
        )
    except EmailNotValidError as exc:
        raise BadRecipient(f"{_shown(text)} is not an email address such as ada@example.com ({exc})") from None
    return str(read.normalized).lower()


def _unicode_domain(domain: str) -> str:
    """Punycode labels (`xn--...`) read as Unicode, lower-cased: IDNA then maps and checks the whole."""
    labels = []
    for label in domain.split("."):
        if label.lower().startswith("xn--"):
            try:
                label = codecs.decode(label[4:].encode("ascii"), "punycode")
            except (UnicodeError, ValueError):
                raise BadRecipient(f"the domain {domain!r} has a label that is not valid punycode") from None
        labels.append(label.lower())
    return ".".join(labels)


def _looks_like_number(text: str) -> bool:
    return bool(_NUMBER_SHAPE.match(text)) and sum(ch.isdigit() for ch in text) >= 3


def _number(text: str, region: str | None) -> str:
    import phonenumbers  # here: only phone numbers need it (about 20 ms to import)

    try:
        number = phonenumbers.parse(text, region)
    except phonenumbers.NumberParseException:
        number = None
    if number is None or not phonenumbers.is_possible_number(number):
        where = f" or as a number of {region}" if region else ""
        raise BadRecipient(
            f"{_shown(text)} is not a phone number in international form{where}: write it with + and the "
            "country code, such as +14155550100 (or set [guard] default_region for national numbers)"
        )
    formatted: str = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    return formatted


def _lowered(text: str) -> str:
    """NFC, lower-cased, NFC again (lower-casing can undo the composition); never case-folded."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).lower())


def _shown(text: str) -> str:
    return repr(text[:80])
