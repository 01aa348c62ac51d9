"""Facts the ledger stores that this hail-guard derives differently, recomputed from each stored row.

A migration that changes how a stored value is derived recomputes it here, from what the row itself
holds, in the migration's own transaction; both backends run the same step (`Step`), over statements of
the same names and parameters (`backfill_<step>_rows`, `backfill_<step>`, `backfill_recipient`, then
each opt-out stored by its recipient's key):

- SQLite 6, PostgreSQL 8 (`FACTS`): every recipient field in the one normal form, the message fingerprint
  by meaning, the sender, from the stored request;
- SQLite 9, PostgreSQL 11 (`KEYS`): recipients in the normal form of `email-validator` (lower-cased,
  never case-folded), each recipient's key (its mailbox), the lead.

A value recorded before the normal form existed that it cannot read (an address with an invisible
character, a number without its country code) is kept as it was written, trimmed and lower-cased
(`recipients.comparable`): an opt-out is never lost and a send is never hidden.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hail_guard import profiles, recipients, same_send
from hail_guard.canonical import canonical_json
from hail_guard.ledger.params import Params
from hail_guard.profiles.spec import DEFAULT_LEAD

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
        content_fingerprint=same_send.content_fingerprint(spec, arguments),
        sender=canonical_json(same_send.sender_of(spec, arguments)),
    )


@dataclass(frozen=True)
class Renormalised:
    """An operation's recipients in today's normal form, their keys, and its lead."""

    recipients: list[str]
    recipient_keys: list[str]
    lead: str | None


def renormalised(channel: str, stored: list[str], request: str) -> Renormalised:
    """What a row's stored recipients and request give now (the lead by the default pointers: the campaign and
    lead ids its metadata carries)."""
    reached = list(dict.fromkeys(recipients.comparable(recipient, channel) for recipient in stored))
    arguments = json.loads(request)
    lead = same_send.lead_at(DEFAULT_LEAD, arguments) if isinstance(arguments, dict) else None
    return Renormalised(reached, recipients.keys_of(reached), lead)


def facts_params(page: Sequence[Mapping[str, Any]]) -> tuple[list[Params], list[Params]]:
    """For rows of `backfill_facts_rows`: the parameters of `backfill_facts`, and of `backfill_recipient`."""
    updates: list[Params] = []
    reached: list[Params] = []
    for row in page:
        found = facts(row["tool"], row["channel"], row["request"])
        updates.append(
            {
                "recipients": json.dumps(found.recipients),
                "recipient_keys": json.dumps(found.recipient_keys),
                "content_fingerprint": found.content_fingerprint,
                "sender": found.sender,
                "id": row["id"],
            }
        )
        reached += [_recipient(row["id"], each, found.content_fingerprint) for each in found.recipients]
    return updates, reached


def keys_params(page: Sequence[Mapping[str, Any]]) -> tuple[list[Params], list[Params]]:
    """For rows of `backfill_keys_rows`: the parameters of `backfill_keys`, and of `backfill_recipient`."""
    updates: list[Params] = []
    reached: list[Params] = []
    for row in page:
        found = renormalised(row["channel"], json.loads(row["recipients"]), row["request"])
        keys = json.dumps(found.recipient_keys)
        updates.append(
            {"recipients": json.dumps(found.recipients), "recipient_keys": keys, "lead": found.lead, "id": row["id"]}
        )
        reached += [_recipient(row["id"], key, row["content_fingerprint"]) for key in found.recipient_keys]
    return updates, reached


def _recipient(operation_id: str, recipient: str, content_fingerprint: str) -> Params:
    return {"operation_id": operation_id, "recipient": recipient, "content_fingerprint": content_fingerprint}


@dataclass(frozen=True)
class Step:
    """One migration's recomputation: its statements' names (`backfill_<name>_rows`, `backfill_<name>`), the
    parameters a page of rows gives them and `backfill_recipient`, and how an opt-out's recipient is keyed now."""

    name: str
    recompute: Callable[[Sequence[Mapping[str, Any]]], tuple[list[Params], list[Params]]]
    opt_out_key: Callable[[str, str], str]


FACTS = Step("facts", facts_params, recipients.comparable)
KEYS = Step("keys", keys_params, recipients.opt_out_key)


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
