"""Fresh ledgers for the benchmarks: a SQLite file, or a database on a throwaway PostgreSQL.

Both run as users run them, durable. SQLite is the product's own file (WAL, `synchronous = FULL`)
on the ordinary temporary filesystem (a disk). PostgreSQL comes from the tests' own code path
(`tests/postgres.py`): the server named by `HAIL_GUARD_TEST_POSTGRES_URL`, else a cluster started
from `pg_config --bindir` (as the `postgres` user when root) on disk with PostgreSQL's durable
defaults (`fsync`, `synchronous_commit`, `full_page_writes` on), stopped and deleted at the end; the
settings it ran with are read back and printed with the figures. Each case gets its own database,
copied from a migrated template. A machine without PostgreSQL gets `skipped: <why>`.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from pathlib import Path

from tests import postgres
from tests.postgres import PostgresServer

KINDS = ("sqlite", "postgres")


class Ledgers:
    """Where each kind of ledger comes from in this run (PostgreSQL started once, on first use)."""

    def __init__(self, kinds: Sequence[str], folder: Path) -> None:
        self.kinds = tuple(kinds)
        self.folder = folder
        self._postgres: PostgresServer | None = None
        self._postgres_missing: str | None = None
        self._postgres_cm: AbstractContextManager[PostgresServer] | None = None
        self.postgres_version: str | None = None
        self.postgres_settings: str | None = None

    def start(self) -> None:
        if "postgres" not in self.kinds:
            return
        if reason := postgres.missing_reason():
            self._postgres_missing = reason
            return
        try:
            self._postgres_cm = postgres.postgres_server(durable=True)
            self._postgres = self._postgres_cm.__enter__()
            self.postgres_version, self.postgres_settings = postgres.run(_server_facts(self._postgres.admin_url))
        except (RuntimeError, OSError) as exc:
            self._postgres_missing = f"the throwaway PostgreSQL did not start: {exc}"

    def stop(self) -> None:
        if self._postgres_cm is not None:
            self._postgres_cm.__exit__(None, None, None)
            self._postgres_cm = self._postgres = None

    def missing(self, kind: str) -> str | None:
        """Why this kind of ledger cannot be had in this run, or None."""
        return self._postgres_missing if kind == "postgres" else None

    @asynccontextmanager
    async def fresh(self, kind: str) -> AsyncIterator[str]:
        """The URL of a new, empty (migrated on open) ledger of `kind`, removed afterwards."""
        if kind == "sqlite":
            with _sqlite_file(self.folder) as path:
                yield f"sqlite:///{path}"
            return
        if self._postgres is None:
            raise RuntimeError(self._postgres_missing or "PostgreSQL was not started")
        async with self._postgres.database() as url:
            yield url


@contextmanager
def _sqlite_file(folder: Path) -> Iterator[Path]:
    where = folder / f"ledger-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    try:
        yield where / "ledger.db"
    finally:
        shutil.rmtree(where, ignore_errors=True)


@contextmanager
def scratch_folder() -> Iterator[Path]:
    """A folder on the ordinary temporary filesystem (a disk, not memory) for ledger files."""
    folder = Path(tempfile.mkdtemp(prefix="hail-guard-bench-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


SQLITE_SETTINGS = "WAL, synchronous = FULL (the product's own), on disk"


async def _server_facts(admin_url: str) -> tuple[str, str]:
    """The server's version, and the durability settings every PostgreSQL figure ran with."""
    import asyncpg  # optional: the `postgres` extra

    db = await asyncpg.connect(admin_url)
    try:
        version: str = await db.fetchval("SHOW server_version")
        names = ("fsync", "synchronous_commit", "full_page_writes")
        settings = ", ".join([f"{name} = {await db.fetchval(f'SHOW {name}')}" for name in names])
    finally:
        await db.close()
    return version, settings
