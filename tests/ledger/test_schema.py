"""The schema snapshots (hail_guard/ledger/schema/<dialect>.sql) are what the migrations make: a reader sees the
current schema without replaying the migrations, and a migration added without `scripts/schema` fails here."""

from __future__ import annotations

from pathlib import Path

from hail_guard.ledger import open_ledger
from tests.postgres import PostgresServer
from tests.schema import SNAPSHOTS, postgres_schema, sqlite_schema

STALE = "the snapshot is not what the migrations make: run scripts/schema and commit what it writes"


async def test_the_sqlite_snapshot_is_what_the_migrations_make(tmp_path: Path) -> None:
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}"):
        pass  # opening migrates
    assert sqlite_schema(tmp_path / "ledger.db") == (SNAPSHOTS / "sqlite.sql").read_text(), STALE


def test_the_postgres_snapshot_is_what_the_migrations_make(postgres_server: PostgresServer) -> None:
    made = postgres_schema(postgres_server.url(postgres_server.template))  # the session's migrated template
    assert made == (SNAPSHOTS / "postgres.sql").read_text(), STALE


def test_each_snapshot_has_every_table_and_function_of_the_ledger() -> None:
    sqlite, postgres = ((SNAPSHOTS / f"{dialect}.sql").read_text() for dialect in ("sqlite", "postgres"))
    for table in ("operations", "events", "suppressions", "batches", "upstream_tools", "webhook_deliveries"):
        assert f"CREATE TABLE {table} " in sqlite
        assert f"CREATE TABLE public.{table} " in postgres
    for function in ("hg_begin_send", "hg_claim_ready", "hg_holds"):
        assert f"CREATE FUNCTION public.{function}(" in postgres
