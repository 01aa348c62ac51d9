"""Group commit for the PostgreSQL ledger's send path: the outcomes and claims of concurrent sends, together.

A write that finds no other in flight runs on its own, as it always did (one statement, or the outcome's short
transaction): a lone write never waits for company. Writes that arrive while one is in flight queue; the caller
that finds the writer free next takes the whole queue (up to `MAX_GROUP`) into one transaction on one connection,
one statement a step (not a savepoint a write, as SQLite's group: here each would cost a round trip):

- the outcomes: `record_outcomes` (hg_record_outcomes: their message ids locked in one order, then every one
  recorded, fenced on its owner, as alone; webhooks kept for a message id are applied in the same transaction);
- the claims: `claim_ready_for` for each kind asked (a batch, the lease, holding leads), the n-th operation claimed
  going to the n-th caller (hg_claim_ready_for: the same locks and checks as a claim alone).

Then one commit, one WAL flush, and only then is any caller answered; they queue their next writes before the
writer is free again, so the next group gathers them all. One group is in flight at a time (two at once, on two
connections, measured slower: a claim beside another group's claims walks past the rows that group locked).

A refusal of one write (not its lease, no such operation) is its own answer and touches no other: it is a row of
the statement's answer, not an error. An error of the group (the server, a lock's timeout, a deadlock between two
hosts' groups) rolls the whole transaction back, and each write of it is run again on its own, so only a write
that fails alone fails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import asyncpg

from hail_guard.errors import HailGuardError, LeaseLost
from hail_guard.ledger import core, sql
from hail_guard.ledger.core import LEASE_EXPIRED, PARKED_WEBHOOK_SECONDS, Row
from hail_guard.ledger.params import Params
from hail_guard.ledger.turns import Turn, Turns
from hail_guard.models import Operation

_SQL: Final = sql.statements("postgres")
MAX_GROUP = 64
"""Send-path writes committed together at most."""
RELEASE_SECONDS = 10.0


@dataclass(eq=False)
class Job(Turn):
    """One write waiting for its turn: what it does alone, and how it joins a group."""

    alone: Callable[[], Awaitable[Any]]
    outcome: Params | None = None
    """`record_outcome`'s parameters, for an outcome."""
    claim: tuple[Any, ...] | None = None
    """(lease seconds, batch id, hold leads) and the owner, for a claim of one."""

    @property
    def joins(self) -> bool:
        """Whether it can be committed with others (else it runs alone: a claim of several, say)."""
        return self.outcome is not None or self.claim is not None

    @property
    def subjects(self) -> tuple[str, ...]:
        """What two jobs of one group must not share: an operation, a message id, a claim's owner."""
        if self.claim is not None:
            return (f"owner:{self.claim[3]}",)
        if self.outcome is None:
            return ()
        provider_id, operation_id = self.outcome["provider_id"], self.outcome["id"]
        return (operation_id,) if provider_id is None else (operation_id, f"provider:{provider_id}")


class GroupCommit(Turns[Job]):
    """The queue of send-path writes of one ledger (`turns`), and the transactions that commit them (module
    docstring)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        super().__init__()
        self._pool = pool

    async def _commit_next(self) -> None:
        group = self._take()
        if len(group) == 1:
            await _alone(group[0])
        else:
            try:
                await self._together(group)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                for job in group:  # nothing of the group was committed: each again, on its own
                    job.result, job.error = None, None
                    await _alone(job)
            except BaseException as exc:  # a bug: every caller of the group gets it (nothing was committed)
                for job in group:
                    job.result, job.error = None, exc
        for job in group:
            job.done = True
            job.wake.set()

    def _take(self) -> list[Job]:
        """The next group: queued jobs in order, but none that shares an operation or a message id with an earlier
        one of it (those wait for the next)."""
        group: list[Job] = []
        taken: set[str] = set()
        left: deque[Job] = deque()
        while self._queue and len(group) < MAX_GROUP:
            if not self._queue[0].joins:  # it runs alone: now if it is first, else next time
                if not group:
                    group.append(self._queue.popleft())
                break
            job = self._queue.popleft()
            if taken.intersection(job.subjects):
                left.append(job)
                continue
            taken.update(job.subjects)
            group.append(job)
        self._queue.extendleft(reversed(left))
        return group

    async def _together(self, group: Sequence[Job]) -> None:
        db = await self._pool.acquire()
        try:
            async with db.transaction():
                await _record_outcomes(db, [job for job in group if job.outcome is not None])
                await _claims(db, [job for job in group if job.claim is not None])
        finally:
            await self._pool.release(db, timeout=RELEASE_SECONDS)


async def _alone(job: Job) -> None:
    try:
        job.result = await job.alone()
    except BaseException as exc:  # the caller gets it, mapped, as any error of its write
        job.error = exc


async def _record_outcomes(db: asyncpg.Connection, jobs: Sequence[Job]) -> None:
    outcomes = [job.outcome for job in jobs if job.outcome is not None]
    if not outcomes:
        return
    answers = await record_outcomes(db, outcomes, refuse_parked=False)
    assert answers is not None
    for job, answer in zip(jobs, answers, strict=True):
        if isinstance(answer, HailGuardError):
            job.error = answer  # this write's refusal: its own answer
        else:
            job.result = answer


PARKED_SQLSTATE = "HG001"
"""What hg_record_outcomes raises, asked to refuse, when a webhook is kept for a message id it would record."""


async def record_outcomes(
    db: asyncpg.Connection, outcomes: Sequence[Params], *, refuse_parked: bool
) -> list[Operation | HailGuardError] | None:
    """Record `record_outcome`'s parameters for each, in one statement (hg_record_outcomes): each one's operation as
    recorded, or its refusal (`NotFound`, `LeaseLost`). Webhooks kept for a message id recorded are applied on `db`,
    in its transaction; with `refuse_parked`, where there are any, nothing is recorded and the answer is None."""
    columns = {name: [outcome[name] for outcome in outcomes] for name in outcomes[0]}  # an array a parameter
    parked = {"parked_seconds": float(PARKED_WEBHOOK_SECONDS), "refuse_parked": refuse_parked}
    try:
        rows = await db.fetch(*bound("record_outcomes", **columns, **parked))
    except asyncpg.PostgresError as exc:
        if refuse_parked and getattr(exc, "sqlstate", None) == PARKED_SQLSTATE:
            return None
        raise
    found = {row["given_id"]: dict(row) for row in rows}
    answers: list[Operation | HailGuardError] = []
    for outcome in outcomes:
        operation_id = outcome["id"]
        row = found[operation_id]
        try:
            recorded = recorded_operation(row if row["before_state"] is not None else None, operation_id)
        except HailGuardError as refused:
            answers.append(refused)
            continue
        if row["parked"]:  # webhooks that came before the id: applied in this same transaction
            tx = Tx(db)
            await core.apply_parked(tx, recorded)
            recorded = await core.must(tx, operation_id)
        answers.append(recorded)
    return answers


async def _claims(db: asyncpg.Connection, jobs: Sequence[Job]) -> None:
    kinds: dict[tuple[Any, ...], list[Job]] = {}
    for job in jobs:
        assert job.claim is not None
        kinds.setdefault(job.claim[:3], []).append(job)
    for (lease_seconds, batch_id, hold_lead), asking in kinds.items():
        owners = [job.claim[3] for job in asking if job.claim is not None]
        rows = await db.fetch(
            *bound(
                "claim_ready_for",
                owners=owners,
                lease_seconds=lease_seconds,
                expired_reason=LEASE_EXPIRED,
                batch_id=batch_id,
                hold_lead=hold_lead,
            )
        )
        claimed = {row["lease_owner"]: core.operation_of(dict(row)) for row in rows}
        for job, owner in zip(asking, owners, strict=True):
            job.result = [claimed[owner]] if owner in claimed else []


def recorded_operation(row: Row | None, operation_id: str) -> Operation:
    """The operation `record_outcome` answered with; `NotFound`, or `LeaseLost` when it was not ours to record."""
    if row is None:
        raise core.not_found(operation_id)
    if row["id"] is None or row["state"] is None:
        raise LeaseLost(
            f"operation {operation_id} is no longer ours to record (state {row['before_state']}, "
            f"claimed by another worker); its outcome was not overwritten"
        )
    return core.operation_of(row)


def bound(name: str, /, **params: Any) -> tuple[Any, ...]:
    """Statement `name` as asyncpg takes it: its `$n` text, then its parameters in `$n`'s order (`sql.Statement`), for
    `fetch`, `fetchrow`, `fetchval` and `execute` alike: `await db.fetch(*bound("batch_name", batch_id=...))`."""
    statement = _SQL[name]
    return (statement.text, *statement.values(params))


class Tx:
    """`core.Tx` over one asyncpg connection."""

    def __init__(self, db: asyncpg.Connection) -> None:
        self._db = db

    async def rows(self, name: str, /, **params: Any) -> list[Row]:
        return [dict(record) for record in await self._db.fetch(*bound(name, **params))]

    async def row(self, name: str, /, **params: Any) -> Row | None:
        record = await self._db.fetchrow(*bound(name, **params))
        return dict(record) if record is not None else None

    async def run(self, name: str, /, **params: Any) -> int:
        status: str = await self._db.execute(*bound(name, **params))
        last = status.rsplit(" ", 1)[-1]
        return int(last) if last.isdigit() else 0

    async def run_many(self, name: str, params: Sequence[Params], /) -> None:
        if params:
            statement = _SQL[name]
            await self._db.executemany(statement.text, [statement.values(each) for each in params])
