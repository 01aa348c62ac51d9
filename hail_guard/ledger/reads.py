"""What operators read of the ledger (the console's pages), over the core's transactions and named SQL.

`OperatorReads` is `LedgerCore` with the reads an operator's pages need, each walking an index
(SQLite schema 7, PostgreSQL 9): sends per hour, counts of the states that wait for someone, a
search by key prefix and every filter a page at a time, batches newest first, opt-outs by prefix
and what each cancelled, and upstream tool definitions by fingerprint; the one decision those
pages add beside approving a batch, `cancel_batch`; and what the console and `status` keep of who
is at work (SQLite schema 8, PostgreSQL 10): the console's sign-ins, by a hash of their id, and the
heartbeats of whoever is sending. Both backends are `OperatorReads`: each statement is named once
per dialect in `sql/<dialect>/queries.sql`, and the Python here runs on either.

Sends per hour are not counted from the operations at all: the database keeps them, in a small table
(`sends_by_hour`) that triggers on `operations` update in the transaction of each write (the
migrations say how), so a week is one range of that table whatever the ledger's size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hail_guard import policy, recipients
from hail_guard.errors import BadInput, NotFound
from hail_guard.ledger.core import LedgerCore, Row, Tx, as_time, batch_name, cancel_pending, epoch, operation_of
from hail_guard.ledger.params import Params
from hail_guard.ledger.roles import ConsoleSession, Heartbeat
from hail_guard.models import BatchSummary, DeliveryState, HourOfSends, Operation, State, Suppression

_LAST_CHARACTER = "\U0010ffff"
_AFTER_NOTHING = (float("inf"), 2**62, "")
"""(created at, position, key) past every operation: a search's page after nothing (the first page)."""
_SEARCHES = ("key", "recipient", "batch", "campaign", "state")
"""The filter that drives a search, in this order of preference (`search_by_<filter>`, else `search_all`)."""
HEARTBEAT_FORGET_SECONDS = 86400.0
"""A heartbeat silent this long is taken away (its process ended without saying so)."""


@dataclass(frozen=True)
class OperationSearch:
    """The filters of `Ledger.search_operations` (None: not filtered on)."""

    key_prefix: str | None = None
    state: State | None = None
    campaign_id: str | None = None
    batch_id: str | None = None
    recipient: str | None = None
    since: datetime | None = None


def key_range(prefix: str) -> tuple[str, str]:
    """[low, high): every text that starts with `prefix`, in code point order (no key holds U+10FFFF)."""
    return prefix, prefix + _LAST_CHARACTER


def sub_address_pattern(mailbox: str) -> tuple[str, str, str] | None:
    """For `ada@example.com`: the range of `ada+...` and a LIKE pattern (escaped with `\\`) of `ada+%@example.com`:
    the sub-addresses an opt-out of the mailbox covers. None for anything that is not a plain mailbox."""
    local, at, domain = mailbox.rpartition("@")
    if not at or not local or "+" in local:
        return None

    def escaped(text: str) -> str:
        return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

    low, high = key_range(f"{local}+")
    return low, high, f"{escaped(local)}+%@{escaped(domain)}"


def opt_out_cancel_prefix() -> str:
    """How every cancel an opt-out made begins (`policy.suppression_reason`, and a batch planned for one)."""
    return policy.suppression_reason(Suppression(recipient="-", reason="-", source="-")).split(":", 1)[0]


def batch_cancel_reason(reason: str) -> str:
    """The cancel reason of an operator's `cancel_batch`; refused (`BadInput`) without a reason."""
    if not reason.strip():
        raise BadInput("cancelling a batch's unsent sends needs a reason; nothing was cancelled")
    return f"cancelled with its batch by an operator before it was sent: {reason.strip()}"


class OperatorReads(LedgerCore):
    """The ledger core with what operators read (see the module docstring); each backend is one."""

    async def list_batches(self, *, after: str | None = None, limit: int = 50) -> list[BatchSummary]:
        rows = await self._read(_rows, "list_batches", limit=limit, after=after)
        return batch_summaries(
            (row["batch_id"], row["name"], as_time(row["created_at"]), row["state"], int(row["count"])) for row in rows
        )

    async def sends_by_hour(self, since: datetime) -> list[HourOfSends]:
        return hours_of_sends(await self._read(_rows, "sends_by_hour", since=epoch(since)))

    async def count_states(self, states: Sequence[State]) -> dict[State, int]:
        return await self._read(_count_states, list(states))

    async def search_operations(
        self,
        *,
        key_prefix: str | None = None,
        state: State | None = None,
        campaign_id: str | None = None,
        batch_id: str | None = None,
        recipient: str | None = None,
        since: datetime | None = None,
        after: str | None = None,
        limit: int = 50,
    ) -> list[Operation]:
        search = OperationSearch(key_prefix, state, campaign_id, batch_id, recipient, since)
        return await self._read(_search_operations, search, after, limit)

    async def cancel_batch(self, batch_id: str, *, reason: str, actor: str) -> list[str]:
        return await self._write(_cancel_batch, batch_id, batch_cancel_reason(reason), actor)

    async def search_suppressions(
        self, *, prefix: str | None = None, after: tuple[str, str] | None = None, limit: int = 100
    ) -> list[Suppression]:
        low, high = key_range(recipients.comparable(prefix)) if prefix is not None else ("", _LAST_CHARACTER)
        after_recipient, after_channel = after or ("", "")
        rows = await self._read(
            _rows,
            "search_suppressions",
            low=low,
            high=high,
            after_recipient=after_recipient,
            after_channel=after_channel,
            limit=limit,
        )
        return [Suppression.model_validate(dict(row)) for row in rows]

    async def opt_out_cancellations(self, recipient: str, channel: str, *, limit: int = 20) -> list[Operation]:
        key = recipients.opt_out_key(recipient, channel)
        low, high, like = sub_address_pattern(key) or (key, key, key)
        rows = await self._read(
            _rows,
            "opt_out_cancelled",
            recipient=key,
            sub_low=low,
            sub_high=high,
            sub_like=like,
            cancel_like=f"{opt_out_cancel_prefix()}%",
            channel=channel,
            limit=limit,
        )
        return [operation_of(row) for row in rows]

    async def remember_tool_definitions(self, definitions: Mapping[str, str]) -> None:
        remembered = [{"fingerprint": each, "definition": definitions[each]} for each in sorted(definitions)]
        await self._write(_run_many, "remember_tool_definition", remembered)

    async def tool_definitions(self, fingerprints: Sequence[str]) -> dict[str, str]:
        rows = await self._read(_rows, "tool_definitions", fingerprints=json.dumps(list(fingerprints)))
        return {row["fingerprint"]: row["definition"] for row in rows}

    async def start_session(self, digest: str, *, name: str, seconds: float) -> None:
        started = {"digest": digest, "name": name, "seconds": seconds}
        await self._write(_run_all, [("forget_sessions", {}), ("start_session", started)])

    async def find_session(self, digest: str) -> ConsoleSession | None:
        row = await self._read(_row, "find_session", digest=digest)
        if row is None:
            return None
        return ConsoleSession(row["name"], as_time(row["created_at"]), as_time(row["expires_at"]))

    async def end_session(self, digest: str) -> None:
        await self._write(_run_all, [("end_session", {"digest": digest})])

    async def record_heartbeat(self, beat: Heartbeat) -> None:
        recorded = {"id": beat.id, "who": beat.who, "role": beat.role, "batch_id": beat.batch_id}
        forgotten = {"silent_seconds": HEARTBEAT_FORGET_SECONDS}
        await self._write(_run_all, [("forget_heartbeats", forgotten), ("record_heartbeat", recorded)])

    async def end_heartbeat(self, beat_id: str) -> None:
        await self._write(_run_all, [("end_heartbeat", {"id": beat_id})])

    async def heartbeats(self) -> list[Heartbeat]:
        rows = await self._read(_rows, "heartbeats")
        return [
            Heartbeat(
                row["id"], row["who"], row["role"], row["batch_id"], as_time(row["started_at"]), as_time(row["seen_at"])
            )
            for row in rows
        ]


# --- work, as functions of a Tx ----------------------------------------------------------------------


async def _rows(tx: Tx, name: str, /, **params: Any) -> list[Row]:
    return await tx.rows(name, **params)


async def _row(tx: Tx, name: str, /, **params: Any) -> Row | None:
    return await tx.row(name, **params)


async def _run_many(tx: Tx, name: str, params: Sequence[Params]) -> None:
    await tx.run_many(name, params)


async def _run_all(tx: Tx, statements: Sequence[tuple[str, Params]]) -> None:
    for name, params in statements:
        await tx.run(name, **params)


def batch_summaries(rows: Iterable[tuple[str, str | None, datetime, str | None, int]]) -> list[BatchSummary]:
    """Fold (batch id, name, created at, state, count) rows, in batch order, into summaries."""
    summaries: dict[str, BatchSummary] = {}
    for batch_id, name, created_at, state, count in rows:
        summary = summaries.setdefault(
            batch_id, BatchSummary(batch_id=batch_id, name=name, created_at=created_at, counts={})
        )
        if state is not None:
            summary.counts[State(state)] = count
    return list(summaries.values())


def hours_of_sends(rows: Sequence[Row]) -> list[HourOfSends]:
    """Fold (hour, state, delivery state or '', count) rows, in hour order, into one `HourOfSends` an hour."""
    hours: dict[datetime, HourOfSends] = {}
    for row in rows:
        start, state, count = as_time(row["hour"]), State(row["state"]), int(row["count"])
        hour = hours.setdefault(start, HourOfSends(start=start, sent=0, states={}, deliveries={}))
        hour.sent += count
        hour.states[state] = hour.states.get(state, 0) + count
        if row["delivery_state"]:
            delivered = DeliveryState(row["delivery_state"])
            hour.deliveries[delivered] = hour.deliveries.get(delivered, 0) + count
    return list(hours.values())


async def _count_states(tx: Tx, states: list[State]) -> dict[State, int]:
    """One index range per state: the unresolved ones, which hold few, are counted at once."""
    counts = {}
    for state in states:
        row = await tx.row("count_in_state", state=state.value)
        if row is not None and row["count"]:
            counts[state] = int(row["count"])
    return counts


async def _search_operations(tx: Tx, search: OperationSearch, after: str | None, limit: int) -> list[Operation]:
    """The first filter given of `_SEARCHES` drives (its own statement walks its index); the others are checked on
    the rows it yields. Newest first, or by key for a key search; `after` continues after that operation."""
    anchor = _AFTER_NOTHING
    if after is not None:
        found = await tx.row("search_anchor", id=after)
        if found is None:
            raise NotFound(f"no operation {after} to continue the search after")
        anchor = (float(found["created_at"]), int(found["position"]), found["idempotency_key"])  # exact: ties page
    low, high = key_range(search.key_prefix) if search.key_prefix is not None else (None, None)
    given = {
        "key": search.key_prefix,
        "recipient": search.recipient,
        "batch": search.batch_id,
        "campaign": search.campaign_id,
        "state": search.state,
    }
    driver = next((name for name in _SEARCHES if given[name] is not None), "all")
    rows = await tx.rows(
        f"search_by_{driver}" if driver != "all" else "search_all",
        key_low=low,
        key_high=high,
        recipient=recipients.comparable(search.recipient) if search.recipient is not None else None,
        batch_id=search.batch_id,
        campaign_id=search.campaign_id,
        state=search.state.value if search.state is not None else None,
        since=epoch(search.since),
        after_created_at=anchor[0],
        after_position=anchor[1],
        after_key=anchor[2],
        limit=limit,
    )
    return [operation_of(row) for row in rows]


async def _cancel_batch(tx: Tx, batch_id: str, reason: str, actor: str) -> list[str]:
    await batch_name(tx, batch_id)  # NotFound for a batch that does not exist
    return await cancel_pending(tx, await tx.rows("unsent_in_batch", batch_id=batch_id), actor, reason)
