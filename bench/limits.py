"""Case 6, the physical limits the other figures stand beside, measured in the same run on the same disk.

- `disk`: one-row transactions committed one after another, each fsync'd as hail-guard's are (SQLite:
  WAL, `synchronous = FULL`; PostgreSQL: the durable cluster): how many commits a second this disk
  allows when nothing shares a flush;
- `ledger`: a batch drained through the real ledger with no upstream at all (claim, then record the
  outcome, with 32 loops): two commits a send, so without shared fsyncs it could not pass half the
  disk's rate. Group commits (SQLite) and the server's own (PostgreSQL) are what take it further.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio

from bench.figures import Figure
from bench.growth import new_intents
from hail_guard.guard import claim_token
from hail_guard.ledger import Ledger, open_ledger, sqlite_path
from hail_guard.models import Outcome, State

DISK_SECONDS = 2.0
SQLITE_TARGET_RATIO = 0.8
"""The SQLite ledger alone, against the disk's two-commit limit (issue 28): at least this share of it."""
POSTGRES_TARGET = 2000.0
"""Durable sends a second the PostgreSQL ledger alone must allow at concurrency 32 (issue 28)."""


def sqlite_commits_per_second(folder: Path, seconds: float = DISK_SECONDS) -> float:
    path = folder / "fsync-probe.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute("CREATE TABLE probe (n INTEGER)")
        return _commits(lambda n: db.execute("INSERT INTO probe VALUES (?)", (n,)), seconds)
    finally:
        db.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


def _commits(insert: Any, seconds: float) -> float:
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        insert(count)  # autocommit: one transaction, one fsync, per row
        count += 1
    return count / elapsed


async def postgres_commits_per_second(url: str, seconds: float = DISK_SECONDS) -> float:
    import asyncpg  # optional: the `postgres` extra

    db = await asyncpg.connect(url)
    try:
        await db.execute("CREATE TEMPORARY TABLE IF NOT EXISTS probe (n INTEGER)")
        await db.execute("CREATE TABLE IF NOT EXISTS hg_fsync_probe (n INTEGER)")
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            await db.execute("INSERT INTO hg_fsync_probe VALUES ($1)", count)  # each commits, WAL flushed
            count += 1
        await db.execute("DROP TABLE hg_fsync_probe")
    finally:
        await db.close()
    return count / elapsed


async def ledger_only(url: str, sends: int, concurrency: int) -> float:
    """Sends a second through the ledger alone: plan a batch, then claim and record each with `concurrency` loops."""
    async with open_ledger(url) as ledger:
        batch = f"batch-limits-{sends}"
        await ledger.plan_batch(
            batch_id=batch, name=None, intents=new_intents(sends, "limits"), state=State.READY, actor="bench"
        )
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(_drain, ledger, batch)
        return sends / (time.perf_counter() - started)


async def _drain(ledger: Ledger, batch: str) -> None:
    while True:
        owner = claim_token()
        claimed = await ledger.claim_ready(owner=owner, lease_seconds=60, batch_id=batch, limit=1)
        if not claimed:
            return
        provider_id = f"p-{claimed[0].id}"  # each message has its own id, as Hail gives them
        accepted = Outcome(
            state=State.ACCEPTED, reason="ok", provider_id=provider_id, result={"id": provider_id, "status": "sent"}
        )
        await ledger.record_outcome(claimed[0].id, owner=owner, outcome=accepted, actor=owner)


def disk_figure(ledger: str, commits: float, settings: str) -> Figure:
    return Figure(
        case="limits",
        name="disk: fsync'd one-row commits, one after another",
        ledger=ledger,
        unit="ops/s",
        median=commits,
        note=f"{settings}; one fsync per commit allows {commits / 2:,.0f} sends/s at two commits a send",
    )


def ledger_figure(ledger: str, rate: float, commits: float, sends: int, concurrency: int) -> Figure:
    return Figure(
        case="limits",
        name=f"ledger alone: {sends:,} sends claimed and recorded, no upstream, concurrency {concurrency}",
        ledger=ledger,
        unit="ops/s",
        median=rate,
        baseline=commits / 2,
        ratio=rate / (commits / 2),
        target=f">= {SQLITE_TARGET_RATIO}x" if ledger == "sqlite" else f">= {POSTGRES_TARGET:,.0f} durable sends/s",
        met=rate >= SQLITE_TARGET_RATIO * commits / 2 if ledger == "sqlite" else rate >= POSTGRES_TARGET,
        note="baseline: two commits a send, one fsync each (the disk line above, halved); above 1x, fsyncs are shared",
    )


def sqlite_folder(url: str) -> Path:
    return Path(sqlite_path(url)).parent
