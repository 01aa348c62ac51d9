"""Facts the ledger stores that this hail-guard derives differently, recomputed from each stored row.

A migration that changes how a stored value is derived (SQLite 6, PostgreSQL 8: every recipient field
in the one normal form, the message fingerprint by meaning, the sender) recomputes it here, from what
the row itself holds (its stored request), in the migration's own transaction. Both backends call the
same functions. A value recorded before the normal form existed that it cannot read (an address with
an invisible character, a number without its country code) is kept as it was written, trimmed and
case-folded (`recipients.comparable`): an opt-out is never lost and a send is never hidden.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hail_guard import keys, profiles, recipients

PAGE = 1000
"""Rows recomputed per round of a migration."""


@dataclass(frozen=True)
class Facts:
    """What an operation's row derives from its stored request."""

    recipients: list[str]
    recipient_keys: list[str]
    content_fingerprint: str
    sender: str
    """Canonical JSON of the sender fields given."""


def facts(tool: str, channel: str, request: str) -> Facts:
    arguments: dict[str, Any] = json.loads(request)
    spec = profiles.hail().spec(tool)  # the rows it backfills were all written in front of Hail
    reached: dict[str, None] = {}
    for name in recipients.RECIPIENT_FIELDS:
        value = arguments.get(name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item.strip():
                reached[recipients.comparable(item, channel)] = None
    return Facts(
        recipients=list(reached),
        recipient_keys=recipients.keys_of(reached),
        content_fingerprint=keys.content_fingerprint(spec, arguments),
        sender=keys.canonical_json(keys.sender_of(spec, arguments)),
    )


def pages(rows: Iterator[Any]) -> Iterator[list[Any]]:
    """`rows` a page at a time."""
    page: list[Any] = []
    for row in rows:
        page.append(row)
        if len(page) == PAGE:
            yield page
            page = []
    if page:
        yield page
