"""Who a send reaches: every recipient field of a tool, each address or number in one normal form.

`normalise_recipient` is the one normalisation of the whole program: opt-outs are stored in it,
the ledger stores an operation's recipients in it, and the duplicate guard compares them in it.
Two spellings that reach the same mailbox or number give the same text:

- an email address loses its display name (`Élodie <élodie@example.com>`), a `mailto:` prefix and
  a trailing dot of the domain; it is NFC-normalised and case-folded, and a punycode domain
  (`xn--...`) is read as Unicode. Invisible characters (zero-width spaces, bidi controls, soft
  hyphens...) and whitespace inside an address are refused, never silently dropped: what reaches
  Hail is what was written.
- a phone number is written in E.164 (`+1 (415) 555-0190` -> `+14155550190`, a `(0)` trunk prefix
  dropped); a number without its country code, or one that cannot be a number, is refused.

`recipient_keys` adds, for an address with a sub-address (`ada+news@example.com`), the mailbox it
reaches (`ada@example.com`): an opt-out of the mailbox covers every sub-address of it.
"""

from __future__ import annotations

import codecs
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
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"})
_DISPLAY_FORM = re.compile(r"^(?P<name>.*)<(?P<address>[^<>]*)>$", re.DOTALL)


class BadRecipient(BadInput):
    """A recipient that cannot be read as an address or a number; nothing is recorded."""


def normalise_recipient(text: str, channel: str | None = None) -> str:
    """The one form of a recipient (see the module docstring); `BadRecipient` when there is none.

    `channel` says what it is: `email`, or `sms`/`call` (a phone number); any other channel (or
    None, or `all`) reads a text with an `@` as an address and one that looks like a number as a
    number, and anything else as a name compared in NFC, case-folded.
    """
    if not isinstance(text, str):
        raise BadRecipient(f"a recipient must be text, not {type(text).__name__}")
    trimmed = text.strip()
    if not trimmed:
        raise BadRecipient("a recipient is empty: give an email address or a phone number")
    if len(trimmed) > MAX_RECIPIENT_LENGTH:
        raise BadRecipient(f"a recipient is {len(trimmed)} characters long; the limit is {MAX_RECIPIENT_LENGTH}")
    _refuse_invisible(trimmed)
    if channel in EMAIL_CHANNELS or (channel not in PHONE_CHANNELS and "@" in trimmed):
        return _address(trimmed)
    if channel in PHONE_CHANNELS or _looks_like_number(trimmed):
        return _number(trimmed)
    return _folded(trimmed)


def comparable(text: str, channel: str | None = None) -> str:
    """`normalise_recipient` where it can; else (a value recorded before it, a query) the text trimmed and folded.

    For comparing, never for recording a new send: there an unreadable recipient is refused.
    """
    try:
        return normalise_recipient(text, channel)
    except BadRecipient:
        return _folded(text.strip())


def recipient_keys(recipient: str) -> list[str]:
    """What an opt-out is probed by for one normalised recipient: itself, and the mailbox of a sub-address."""
    local, at, domain = recipient.rpartition("@")
    if at and "+" in local.lstrip("+"):
        mailbox = f"{local.split('+', 1)[0] or local}@{domain}"
        if mailbox != recipient:
            return [recipient, mailbox]
    return [recipient]


def recipients_of(
    channel: str, arguments: Mapping[str, Any], fields: Sequence[str] = RECIPIENT_POINTERS
) -> tuple[str, ...]:
    """Every recipient of a send in `fields` (JSON pointers: to, cc, bcc, ... alike), normalised, each once,
    in the order given."""
    found: dict[str, None] = {}
    for field in fields:
        for value in _values(pointers.resolve(arguments, field)):
            try:
                found[normalise_recipient(value, channel)] = None
            except BadRecipient as exc:
                raise BadRecipient(f"{pointers.shown(field)}: {exc}") from None
    return tuple(found)


def keys_of(recipients: Iterable[str], channel: str | None = None) -> list[str]:
    """Every opt-out probe key of these recipients (normalised first, as `comparable`), each once."""
    forms = (comparable(recipient, channel) for recipient in recipients)
    return list(dict.fromkeys(key for form in forms for key in recipient_keys(form)))


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
    display = _DISPLAY_FORM.match(text)
    address = (display["address"] if display else text).strip()
    if address.lower().startswith("mailto:"):
        address = address[len("mailto:") :]
    local, at, domain = address.rpartition("@")
    domain = domain.rstrip(".")
    if not at or not local or not domain or any(ch.isspace() or ch in "<>@" for ch in local + domain):
        raise BadRecipient(f"{_shown(text)} is not an email address such as ada@example.com")
    return _folded(f"{local}@{_unicode_domain(domain)}")


def _unicode_domain(domain: str) -> str:
    labels = []
    for label in domain.split("."):
        if label.lower().startswith("xn--"):
            try:
                label = codecs.decode(label[4:].encode("ascii"), "punycode")
            except (UnicodeError, ValueError):
                raise BadRecipient(f"the domain {domain!r} has a label that is not valid punycode") from None
        labels.append(label)
    return ".".join(labels)


_NUMBER_SHAPE = re.compile(r"^(tel:)?[+＋]?[\d\s().\-／/０-９]+$", re.IGNORECASE)


def _looks_like_number(text: str) -> bool:
    return bool(_NUMBER_SHAPE.match(text)) and sum(ch.isdigit() for ch in text) >= 3


def _number(text: str) -> str:
    import phonenumbers  # here: only phone numbers need it (about 20 ms to import)

    try:
        number = phonenumbers.parse(text, None)
    except phonenumbers.NumberParseException:
        number = None
    if number is None or not phonenumbers.is_possible_number(number):
        raise BadRecipient(
            f"{_shown(text)} is not a phone number in international form: write it with + and the country "
            "code, such as +14155550100"
        )
    formatted: str = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    return formatted


def _folded(text: str) -> str:
    """NFC, case-folded, NFC again (case folding can undo the composition)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold())


def _shown(text: str) -> str:
    return repr(text[:80])
