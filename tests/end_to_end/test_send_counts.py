"""The counts of sends per hour that the ledger's triggers keep (`sends_by_hour`) against the operations.

After every kind of write the proxy, reconcile and operators make (sends, outcomes, delivery facts,
reviews, resends, expired leases, batches claimed and cancelled, opt-outs, prune), on SQLite and on
PostgreSQL (several connections: several shards), the kept counts must equal a GROUP BY over the
operations table by the hour each first left, its state and its delivery state, in SQL that shares
nothing with the triggers; and `Ledger.sends_by_hour` must read the same. A trigger that missed an
insert, an update or a delete leaves a count that the GROUP BY does not have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import pytest

from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import DeliveryState, Outcome, State, Suppression
from tests.ledger.test_ledger_contract import (
    ACCEPTED,
    LOST,
    accepted_outcome,
    batch_intents,
    intent,
    observed,
    resend_of,
)
from tests.postgres import PostgresServer

Counts = Counter[tuple[datetime, str, str]]
"""(hour it first left, state, delivery state or '') -> how many operations."""

SQLITE_SQL = {
    "operations": "SELECT CAST(first_sent_at AS INTEGER) - CAST(first_sent_at AS INTEGER) % 3600, state,"
    " COALESCE(delivery_state, ''), count(*) FROM operations WHERE first_sent_at IS NOT NULL GROUP BY 1, 2, 3",
    "kept": "SELECT hour, state, delivery_state, count FROM sends_by_hour WHERE count <> 0",
}
POSTGRES_SQL = {
    "operations": "SELECT date_trunc('hour', first_sent_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', state,"
    " COALESCE(delivery_state, ''), count(*) FROM operations WHERE first_sent_at IS NOT NULL GROUP BY 1, 2, 3",
    "kept": "SELECT hour, state, delivery_state, sum(count) FROM sends_by_hour GROUP BY 1, 2, 3 HAVING sum(count) <> 0",
}


@dataclass
class Counted:
    """A ledger, and `query`: the rows of one of the statements above, read beside the ledger."""

    ledger: Ledger
    query: Callable[[str], Awaitable[list[tuple[Any, ...]]]]

    async def counts(self, which: str) -> Counts:
        rows = await self.query(which)
        return Counter({(_hour(row[0]), row[1], row[2]): int(row[3]) for row in rows})


def _hour(value: datetime | int) -> datetime:
    return value.astimezone(UTC) if isinstance(value, datetime) else datetime.fromtimestamp(value, UTC)


@pytest.fixture(params=["sqlite", "postgres"])
async def counted(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Counted]:
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"

        async def sqlite_rows(which: str) -> list[tuple[Any, ...]]:
            async with aiosqlite.connect(path) as db, db.execute(SQLITE_SQL[which]) as cursor:
                return [tuple(row) for row in await cursor.fetchall()]

        async with open_ledger(f"sqlite:///{path}") as ledger:
            yield Counted(ledger, sqlite_rows)
        return
    import asyncpg

    server: PostgresServer = request.getfixturevalue("postgres_server")
    async with server.database() as url, open_ledger(url) as ledger:

        async def postgres_rows(which: str) -> list[tuple[Any, ...]]:
            db = await asyncpg.connect(url)
            try:
                return [tuple(row) for row in await db.fetch(POSTGRES_SQL[which])]
            finally:
                await db.close()

        yield Counted(ledger, postgres_rows)


async def assert_counts_match(counted: Counted) -> None:
    expected = await counted.counts("operations")
    assert await counted.counts("kept") == expected
    read = {
        (hour.start, state.value): n
        for hour in await counted.ledger.sends_by_hour(datetime(2000, 1, 1, tzinfo=UTC))
        for state, n in hour.states.items()
    }
    by_state: Counter[tuple[datetime, str]] = Counter()
    for (hour, state, _), n in expected.items():
        by_state[hour, state] += n
    assert read == dict(by_state)


async def test_the_counts_per_hour_equal_a_group_by_over_the_operations_after_every_kind_of_write(
    counted: Counted,
) -> None:
    ledger = counted.ledger
    rate_limited = Outcome(state=State.READY, reason="429", error="rate", not_before_seconds=0.0)
    unclear = Outcome(state=State.NEEDS_REVIEW, reason="unclear", review_reason="unclear")
    failed = Outcome(state=State.FAILED, reason="refused", error="consent")
    outcomes = [ACCEPTED, failed, LOST, rate_limited, unclear]
    settled: dict[State, list[str]] = {}

    async def send(n: int) -> None:  # concurrent: on PostgreSQL, from several connections (shards)
        op = (
            await ledger.begin_send(
                intent(f"k{n}", body=f"m{n}", to=f"k{n}@example.com"), owner=f"w{n}", lease_seconds=60
            )
        ).operation
        done = await ledger.record_outcome(op.id, owner=f"w{n}", outcome=outcomes[n % 5], actor=f"w{n}")
        settled.setdefault(done.state, []).append(done.id)

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(send, n)
    await assert_counts_match(counted)
    for n, operation_id in enumerate(settled[State.ACCEPTED]):
        states = [DeliveryState.DELIVERED, DeliveryState.OPENED] if n % 2 else [DeliveryState.BOUNCED]
        await ledger.record_delivery(operation_id, [observed(state) for state in states])
    for claimed in await ledger.claim_unknown(owner="r", lease_seconds=60, limit=2):  # reconcile settles two
        await ledger.record_outcome(claimed.id, owner="r", outcome=accepted_outcome(claimed.id), actor="r")
    await ledger.resolve_review(settled[State.NEEDS_REVIEW][0], state=State.CANCELLED, reason="no", actor="op")
    old = await ledger.get(settled[State.NEEDS_REVIEW][1])
    await ledger.resend(old.id, resend_of(old), reason="again", actor="op")
    await ledger.begin_send(intent("lapsed", body="lapsed", to="lapsed@example.com"), owner="w", lease_seconds=0)
    await ledger.expire_leases()
    await assert_counts_match(counted)
    await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(4), state=State.READY, actor="op")
    [first] = await ledger.claim_ready(owner="w", lease_seconds=60, batch_id="B1")
    await ledger.record_outcome(first.id, owner="w", outcome=rate_limited, actor="w")  # left once, ready again
    await ledger.cancel_batch("B1", reason="wrong list", actor="op")
    opt_out = Suppression(recipient="a@example.com", reason="STOP", source="t")
    await ledger.add_suppression(opt_out, actor="op")  # cancels the rate-limited sends, which had left once
    await assert_counts_match(counted)
    before = await counted.counts("operations")
    assert (await ledger.prune(older_than_seconds=1e-3)).operations > 0
    assert sum((await counted.counts("operations")).values()) < sum(before.values())  # sends were pruned
    await assert_counts_match(counted)
