"""Write the ledger's schema snapshots (hail_guard/ledger/schema/<dialect>.sql) from the migrations: run it
after adding a migration. Starts a throwaway PostgreSQL cluster (as tests/postgres.py does).

Usage: scripts/schema
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hail_guard.ledger import open_ledger
from hail_guard.logs import configure_logging
from tests.postgres import postgres_server
from tests.schema import SNAPSHOTS, postgres_schema, sqlite_schema


async def _migrated_sqlite(path: Path) -> None:
    async with open_ledger(f"sqlite:///{path}"):
        pass  # opening migrates


def main() -> int:
    configure_logging("warning")  # to stderr
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ledger.db"
        asyncio.run(_migrated_sqlite(path))
        (SNAPSHOTS / "sqlite.sql").write_text(sqlite_schema(path))
    with postgres_server() as server:
        (SNAPSHOTS / "postgres.sql").write_text(postgres_schema(server.url(server.template)))
    print(f"wrote {SNAPSHOTS / 'sqlite.sql'} and {SNAPSHOTS / 'postgres.sql'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
