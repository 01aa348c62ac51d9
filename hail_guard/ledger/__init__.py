"""The ledger: the durable record of every intended send and what is known of it.

`Ledger` (`roles`) is every role a part of the program plays against the ledger: `Sending`, `Batching`,
`OptOuts`, `Tracking`, ...; each part is given the role it uses. `core.LedgerCore` does what both backends do
alike over named statements (`sql`), and `reads.OperatorReads` adds what operators read (the
console); each backend owns its dialect's SQL, the send path, migrations and one error mapping
(`sqlite.errors_mapped`, `postgres_errors.errors_mapped`). Nothing outside this package uses a
name of it that starts with `_`. `open_ledger` picks the backend from a URL:

- `sqlite:///path/to/ledger.db` (or a plain path): one host, the default;
- `postgresql://...` (or `postgres://`): several processes and hosts (needs the `postgres` extra).

Leases and deadlines use the database's clock, so several processes agree on them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from hail_guard.errors import ConfigError, NotFound
from hail_guard.ledger.roles import (
    Batching,
    Begin,
    ConsoleSession,
    Heartbeat,
    Heartbeats,
    Ledger,
    OptOuts,
    Overview,
    Records,
    Reviewing,
    Sending,
    Sessions,
    ToolPins,
    Tracking,
    Upkeep,
)
from hail_guard.models import Operation

__all__ = [
    "POSTGRES_SCHEMES",
    "Batching",
    "Begin",
    "ConsoleSession",
    "Heartbeat",
    "Heartbeats",
    "Ledger",
    "OptOuts",
    "Overview",
    "Records",
    "Reviewing",
    "Sending",
    "Sessions",
    "ToolPins",
    "Tracking",
    "Upkeep",
    "find_operation",
    "migrate",
    "open_ledger",
    "sqlite_path",
]


async def find_operation(ledger: Records, reference: str) -> Operation:
    """The operation `reference` names, by its operation id or by its idempotency key: the one lookup
    wherever an operator or an agent names an operation."""
    try:
        return await ledger.get(reference)
    except NotFound:
        found = await ledger.find_by_key(reference)
    if found is None:
        raise NotFound(f"no operation has the id or key {reference!r}; `hail-guard ops list` shows them")
    return found


POSTGRES_SCHEMES = ("postgres://", "postgresql://")


@asynccontextmanager
async def open_ledger(url: str, *, busy_timeout_seconds: float = 5.0) -> AsyncIterator[Ledger]:
    """Open (creating and migrating) the ledger named by `url`."""
    if url.startswith(POSTGRES_SCHEMES):
        with _needs_asyncpg():
            from hail_guard.ledger.postgres import open_postgres_ledger
        async with open_postgres_ledger(url, busy_timeout_seconds=busy_timeout_seconds) as ledger:
            yield ledger
        return
    from hail_guard.ledger.sqlite import open_sqlite_ledger

    async with open_sqlite_ledger(sqlite_path(url), busy_timeout_seconds=busy_timeout_seconds) as ledger:
        yield ledger


async def migrate(url: str) -> int:
    """Bring the ledger at `url` to the newest schema this hail-guard knows; returns that version."""
    if url.startswith(POSTGRES_SCHEMES):
        with _needs_asyncpg():
            from hail_guard.ledger.postgres import migrate as migrate_postgres
        return await migrate_postgres(url)
    from hail_guard.ledger.sqlite import migrations, open_sqlite_ledger

    async with open_sqlite_ledger(sqlite_path(url)):
        pass  # opening migrates
    return migrations()[-1][0]


@contextmanager
def _needs_asyncpg() -> Iterator[None]:
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name != "asyncpg":
            raise
        raise ConfigError(
            "a postgresql:// ledger needs the asyncpg driver: pip install 'hail-guard[postgres]'"
        ) from exc


def sqlite_path(url: str) -> str:
    """The file path in `sqlite:///relative` / `sqlite:////absolute` / a plain path."""
    if url.startswith("sqlite:///"):
        return url.removeprefix("sqlite:///")
    if "://" in url:
        raise ConfigError(f"unsupported ledger URL scheme in {url.split('://')[0]}://...; use sqlite:///PATH")
    return url
