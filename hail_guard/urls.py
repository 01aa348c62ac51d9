"""URLs as people see them: rebuilt from the parts that say where a thing is, never echoed.

A ledger or upstream URL may carry a password (`postgresql://user:PASSWORD@host/db`,
`?password=...`) or a token, and a password with an unescaped `/`, `#`, `?` or `@` makes the URL
ambiguous: parsers disagree on where the host starts, so masking "the password part" of the raw
text leaks it. `parse_url` reads the URL the safe way round: when an `@` follows the first `/`, `?`
or `#` (outside a `password=` value), the user information runs to the last such `@`. Its
`display` shows only the scheme, the host(s) and port(s) and the path (the database), read back
from those parts: never the user information, the query or the fragment. Its `secrets` are every
spelling of a password the URL may hold, to scrub (`masked`) from a driver's message that echoes it.

    parse_url("postgresql://hg:pa/ss@db.internal:5432/hg?sslmode=require").display
    -> "postgresql://db.internal:5432/hg"

The one function for the whole program: ledger URLs (SQLite, PostgreSQL) and upstream URLs alike.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from contextlib import suppress
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_AUTHORITY_END = re.compile(r"[/?#]")
_QUERY_PASSWORD = re.compile(r"password=([^&#]*)", re.IGNORECASE)
_HOST = re.compile(r"^(?:[A-Za-z0-9._~%-]*|\[[0-9A-Fa-f:.]+\])(?::([0-9]*))?$")
"""A host name, an IPv4 or a bracketed IPv6 address, and an optional port; empty for `sqlite:///`."""
UNREADABLE_HOST = "(unreadable host)"


@dataclass(frozen=True)
class UrlParts:
    scheme: str
    """`postgresql`, `sqlite`, `https`...; empty for a plain path."""
    hosts: tuple[str, ...]
    """`host` or `host:port`, each checked; `(unreadable host)` for one that is not a host."""
    path: str
    """The path (a database name, a file, `/mcp`), without query or fragment."""
    secrets: frozenset[str]
    """Every spelling of a password the URL may carry (raw and percent-decoded)."""
    ambiguous: bool = False
    """The user information holds a `/`, `?`, `#` or `@` that must be percent-encoded: drivers read
    such a URL differently (asyncpg takes the first `@`), so it should be refused, not used."""

    @property
    def display(self) -> str:
        return f"{self.scheme}://{','.join(self.hosts)}{self.path}" if self.scheme else self.path

    @property
    def ports(self) -> tuple[int, ...]:
        """The ports written in the URL (any number of digits: range checks are the caller's)."""
        found = (_HOST.match(host) for host in self.hosts)
        return tuple(int(match.group(1)) for match in found if match is not None and match.group(1))


def display_url(url: str) -> str:
    """The URL as it may be printed or logged: scheme, host, port and path only."""
    return parse_url(url).display


def masked(text: str, secrets: Collection[str]) -> str:
    """`text` with every secret (`UrlParts.secrets`, a token) shown as `***` where it stands whole, the longest
    first: as a part of a URL (`user:SECRET@`, `?password=SECRET`) or a value of its own, never inside a word.
    So a password `p` hides `hg:p@` and `password=p`, and leaves `postgres` and `port` as they are."""
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = re.sub(rf"(?<![^\W_]){re.escape(secret)}(?![^\W_])", "***", text)
    return text


def parse_url(url: str) -> UrlParts:
    scheme, separator, rest = url.partition("://")
    if not separator:
        return UrlParts("", (), _before_query(url), frozenset())
    credentials, authority, tail = _split_authority(rest)
    hosts = tuple(host if _HOST.match(host) else UNREADABLE_HOST for host in authority.split(","))
    ambiguous = any(char in credentials for char in "/?#@")
    return UrlParts(scheme.lower(), hosts, _before_query(tail), _secrets(url, credentials, tail), ambiguous)


def _split_authority(rest: str) -> tuple[str, str, str]:
    """(user information, authority, the rest): the user information runs to the last `@` that
    could end it, so a password with `/`, `?`, `#` or `@` in it never lands in the host or path."""
    end = _end_of_authority(rest)
    tail = rest[end:]
    in_passwords = [range(*match.span(1)) for match in _QUERY_PASSWORD.finditer(tail)]
    late = [at for at, char in enumerate(tail) if char == "@" and not any(at in span for span in in_passwords)]
    if late:
        cut = end + late[-1]
        credentials, rest = rest[:cut], rest[cut + 1 :]
        end = _end_of_authority(rest)
        return credentials, rest[:end], rest[end:]
    credentials, _, authority = rest[:end].rpartition("@")
    return credentials, authority, tail


def _end_of_authority(rest: str) -> int:
    found = _AUTHORITY_END.search(rest)
    return found.start() if found else len(rest)


def _before_query(text: str) -> str:
    return re.split(r"[?#]", text, maxsplit=1)[0]


def _secrets(url: str, credentials: str, tail: str) -> frozenset[str]:
    found = [credentials.partition(":")[2]] if ":" in credentials else []
    found += [match.group(1) for match in _QUERY_PASSWORD.finditer(tail)]
    with suppress(ValueError):  # an unbalanced `[`: urlsplit refuses the whole URL
        found.append(urlsplit(url).password or "")  # what a plain parser takes for the password
    return frozenset(spelling for raw in found if raw for spelling in (raw, unquote(raw)))
