"""The PostgreSQL ledger: several processes and hosts share one database through a connection pool.

It behaves exactly like the SQLite ledger (the contract tests run on both); what differs is how:

- The clock is the database's `statement_timestamp()`: fixed within one statement (as SQLite's
  'now'), fresh for each statement. Inside `hg_begin_send` the lease runs from `clock_timestamp()`,
  read after its locks.
- The send path's writes are one statement each, committed on its own: one round trip to the
  server (`_alone`). `begin_send` calls the server-side function `hg_begin_send`
  (sql/postgres/begin_send.sql: lease expiry, the key's row, the opt-out check, the check for the
  same message to a shared recipient under advisory locks, the insert or the claim). Claims take
  rows with `FOR UPDATE SKIP LOCKED`: two workers never take the same row nor wait for each other.
  Completion is fenced on the lease owner. Outcomes and claims that arrive while another is in
  flight are committed together, one statement a step (`postgres_group`). Writes of several
  statements (the core's) run in one transaction (`_write`).
- Durability is the server's: a commit is acknowledged once its WAL is flushed, while `fsync` and
  `synchronous_commit` are on (their defaults; hail-guard never turns them off, and warns at start
  when the server has). Concurrent commits share a WAL flush on the server (its group commit).
- A batch is staged (COPY) into a temporary table inside its planning transaction, then checked and
  copied into the ledger by the core's statements.
- Migrations are versioned (`hail_guard_schema_version`) and applied under an advisory lock; the
  server-side functions are (re)created when their text changes (`hail_guard_functions`).

Every asyncpg and socket error is mapped to our tree in `errors_mapped` (`postgres_errors`), and only
there; messages name the server as `urls.parse_url` shows it, with the password masked."""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from importlib import resources
from typing import Any

import anyio
import asyncpg
import structlog

from hail_guard import policy, same_send
from hail_guard.errors import HailGuardError, LedgerError, LedgerUnavailable
from hail_guard.ledger import backfill, core, params, planning, reads, sql
from hail_guard.ledger.core import DEFAULT_RULES, LEASE_EXPIRED, Row, Work
from hail_guard.ledger.params import Params
from hail_guard.ledger.postgres_errors import describe, errors_mapped
from hail_guard.ledger.postgres_group import GroupCommit, Job, Tx, bound, record_outcomes
from hail_guard.ledger.roles import Begin, Plan
from hail_guard.models import Intent, Operation, Outcome, State
from hail_guard.same_send import Candidates, Rules

log = structlog.get_logger(__name__)

MIGRATION_LOCK = 0x4861696C47756172
"""Advisory lock key ("HailGuar") held while migrating, so processes starting at once take turns."""
_COMPARE_ROUNDS = 3
"""How often `begin_send` compares new near messages before it gives up (each round, others came meanwhile)."""
MIGRATION_LOCK_TIMEOUT = "60s"
CLOSE_SECONDS = 5.0
COMMAND_TIMEOUT_SECONDS = 60.0
"""Longest a single statement may take before the call fails as `LedgerUnavailable`."""
RELEASE_SECONDS = 10.0
"""Longest a connection's reset may take when it goes back to the pool; past it the pool drops it."""
_FUNCTIONS = ("begin_send", "claims", "outcomes")
"""Server-side functions, each in sql/postgres/<name>.sql, (re)created by `migrate` when their text changes."""
_STAGED = operator.itemgetter(*planning.STAGE_COLUMNS)
"""A staged send's row (`planning.stage_rows`) as COPY takes it: its values in the stage's column order."""


class PostgresLedger(reads.OperatorReads):
    def __init__(self, pool: asyncpg.Pool, where: str, secrets: frozenset[str]) -> None:
        self._pool = pool
        self._where = where
        self._secrets = secrets
        self._group = GroupCommit(pool)

    async def _read(self, work: Work[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with errors_mapped(self._where, self._secrets):
            async with self._pool.acquire() as db:
                return await work(Tx(db), *args, **kwargs)

    async def _write(self, work: Work[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        async with self._transaction() as db:
            return await work(Tx(db), *args, **kwargs)

    # --- the send path ------------------------------------------------------------------------------

    async def begin_send(
        self, intent: Intent, *, owner: str, lease_seconds: float, rules: Rules = DEFAULT_RULES
    ) -> Begin:
        compared: list[str] | None = None
        async with self._alone() as db:
            for _ in range(_COMPARE_ROUNDS):
                rows = await db.fetch(
                    *bound("begin_send", **begin_arguments(intent, owner, lease_seconds, rules, compared))
                )
                verdict = rows[0]["verdict"]
                if verdict == "claimed":
                    return Begin(core.operation_of(rows[0]), claimed=True)
                found = _found(intent, verdict, rows, rules)
                if verdict == "near" and found is None:  # compared, none near the same: again, with their ids
                    compared = [row["id"] for row in rows]
                    continue
                if found is None or found.state is not State.READY or not same_send.repeats(found, intent):
                    return Begin(found or core.operation_of(rows[0]), claimed=False)
                again = {"owner": owner, "lease_seconds": lease_seconds, "id": found.id, "hold_lead": rules.hold_lead}
                claimed = await db.fetchrow(*bound("claim_ready_by_id", **again))
                return Begin(core.operation_of(claimed), claimed=True) if claimed else Begin(found, claimed=False)
        raise LedgerUnavailable(
            f"the messages of {', '.join(intent.recipients)} kept changing while a send to them was compared; retry"
        )

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        taken = policy.provider_id_taken(outcome, "{holder}").reason  # the SQL names the holder
        arguments = {
            **params.outcome_values(outcome),
            "id": operation_id,
            "owner": owner,
            "actor": actor,
            "reason": outcome.reason,
            "taken": taken,
        }

        async def alone() -> Operation:
            return await self._record_alone(arguments)

        with errors_mapped(self._where, self._secrets):
            recorded: Operation = await self._group.run(Job(alone, outcome=arguments))
        return recorded

    async def _record_alone(self, arguments: Params) -> Operation:
        """One round trip; where webhooks are kept for its message id, a transaction that applies them too."""
        async with self._alone() as db:
            answered = await record_outcomes(db, [arguments], refuse_parked=True)
        if answered is None:
            async with self._transaction() as db:  # the id, and the webhooks that came before it, in one commit
                answered = await record_outcomes(db, [arguments], refuse_parked=False)
        assert answered is not None
        if isinstance(answered[0], HailGuardError):
            raise answered[0]
        return answered[0]

    async def _claim_unknown(
        self, owner: str, lease_seconds: float, operation_id: str | None, batch_id: str | None, limit: int
    ) -> list[Operation]:
        lease = {"owner": owner, "lease_seconds": lease_seconds, "batch_id": batch_id}
        async with self._alone() as db:
            # first: what it turns `unknown` is claimed next
            await db.fetchval(*bound("expire_leases", expired_reason=LEASE_EXPIRED))
            if operation_id is not None:  # an operator asked for this one: wait for a lock rather than skip it
                rows = await db.fetch(*bound("claim_unknown_by_id", **lease, id=operation_id))
            else:
                rows = await db.fetch(*bound("claim_unknown_due", **lease, limit=limit))
        return [core.operation_of(row) for row in rows]

    async def claim_ready(
        self, *, owner: str, lease_seconds: float, batch_id: str | None = None, limit: int = 1, hold_lead: bool = True
    ) -> list[Operation]:
        async def alone() -> list[Operation]:
            return await self._claim_alone(owner, lease_seconds, batch_id, limit, hold_lead)

        together = (lease_seconds, batch_id, hold_lead, owner) if limit == 1 else None
        with errors_mapped(self._where, self._secrets):
            claimed: list[Operation] = await self._group.run(Job(alone, claim=together))
        return claimed

    async def _claim_alone(
        self, owner: str, lease_seconds: float, batch_id: str | None, limit: int, hold_lead: bool
    ) -> list[Operation]:
        claim = {"owner": owner, "lease_seconds": lease_seconds, "limit": limit, "hold_lead": hold_lead}
        async with self._alone() as db:
            if batch_id is None:
                rows = await db.fetch(*bound("claim_ready_any", **claim, expired_reason=LEASE_EXPIRED))
            else:
                rows = await db.fetch(
                    *bound("claim_ready_in_batch", **claim, expired_reason=LEASE_EXPIRED, batch_id=batch_id)
                )
        return [core.operation_of(row) for row in rows]

    async def expire_leases(self) -> int:
        async with self._alone() as db:
            expired: int = await db.fetchval(*bound("expire_leases", expired_reason=LEASE_EXPIRED))
        return expired

    async def claim_delivery_checks(
        self, *, channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int = 50
    ) -> list[Operation]:
        wanted = params.delivery_check_args(channels, max_age_seconds, hold_seconds, limit)
        async with self._alone() as db:
            rows = await db.fetch(*bound("claim_delivery_checks", **wanted))
        return [core.operation_of(row) for row in rows]

    async def _plan_batch(self, intents: Iterable[Intent], plan: Plan) -> int:
        """One transaction: the sends are staged a chunk at a time in a temporary table (nothing of the ledger is
        locked while `intents` is read, which may take long and may raise), then checked against the ledger and
        copied into it. Any error anywhere rolls it all back."""
        try:
            async with self._transaction(shielded=False) as db:
                tx = Tx(db)
                await tx.run("create_stage")
                staged, subjects = 0, set[str]()
                for chunk in _chunks(intents, planning.PLAN_CHUNK):
                    records = map(_STAGED, planning.stage_rows(chunk, first=staged + 1))
                    await db.copy_records_to_table("hg_plan_stage", records=records, columns=planning.STAGE_COLUMNS)
                    subjects.update(key for intent in chunk for key in same_send.keys_of_intent(intent))
                    staged += len(chunk)
                if subjects:  # sends to these recipients wait for this plan: its checks see them, theirs see it
                    await tx.run("lock_recipients", subjects=sorted(subjects))
                await planning.plan_staged(tx, plan, staged)
        except _IntentsRaised as raised:
            raise raised.error from raised.error.__cause__  # the caller's own error, not the ledger's
        return staged

    async def backup(self, path: str) -> int:
        raise LedgerError(
            f"hail-guard copies SQLite ledgers only; back up the PostgreSQL ledger at {self._where} with pg_dump "
            "(e.g. `pg_dump --format=custom --file ledger.dump DATABASE_URL`), then restore with pg_restore"
        )

    async def verify(self) -> None:
        """Nothing to read here: the server checks its own pages (with data checksums) as it reads them."""
        await self.now()

    async def aclose(self) -> None:
        """Close the pool: wait a moment for connections in use, then cut them."""
        with errors_mapped(self._where, self._secrets), anyio.move_on_after(CLOSE_SECONDS):
            await self._pool.close()  # cancelled, it terminates the connections itself

    @asynccontextmanager
    async def _transaction(self, *, shielded: bool = True) -> AsyncIterator[asyncpg.Connection]:
        """One transaction on one pooled connection: committed on success, rolled back on any error.

        Shielded from cancellation once the connection is ours, up to and including its release: a write
        committed and then cancelled on its way out must still be answered. Unshielded (planning a batch,
        which reads its sends while the transaction is open), a cancellation rolls everything back; the
        commit and the release are still shielded.
        """
        with errors_mapped(self._where, self._secrets):
            db = await self._pool.acquire()  # cancellable: nothing has started yet
            try:
                with anyio.CancelScope(shield=shielded):
                    transaction = db.transaction()
                    await transaction.start()
                    try:
                        yield db
                    except BaseException:
                        with (
                            anyio.CancelScope(shield=True),
                            suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError),
                        ):
                            await transaction.rollback()  # a dead connection is discarded by the pool anyway
                        raise
                    with anyio.CancelScope(shield=True):
                        await transaction.commit()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._pool.release(db, timeout=RELEASE_SECONDS)  # a dead link is dropped, not awaited

    @asynccontextmanager
    async def _alone(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for writes that are one statement each: each commits on its own, in one round
        trip. Shielded as `_transaction` is."""
        with errors_mapped(self._where, self._secrets):
            db = await self._pool.acquire()  # cancellable: nothing has started yet
            with anyio.CancelScope(shield=True):
                try:
                    yield db
                finally:
                    await self._pool.release(db, timeout=RELEASE_SECONDS)


def begin_arguments(
    intent: Intent, owner: str, lease_seconds: float, rules: Rules, compared: list[str] | None
) -> Params:
    """The parameters of `begin_send` (hg_begin_send's)."""
    always, windowed, closed_block = rules.match_states(allow_duplicate=intent.allow_duplicate)
    return {
        "id": str(uuid.uuid4()),
        **params.intent_values(intent),
        "owner": owner,
        "lease_seconds": lease_seconds,
        "legacy_key": intent.legacy_key,
        "always": json.dumps(always),
        "windowed": json.dumps(windowed),
        "closed_block": closed_block,
        "window_seconds": rules.window_seconds,
        "hold_lead": rules.hold_lead,
        "compares_near": rules.compares_near and not intent.allow_duplicate,
        "compared": compared,
        "expired_reason": LEASE_EXPIRED,
    }


def _found(intent: Intent, verdict: str, rows: Sequence[Row], rules: Rules) -> Operation | None:
    """What hg_begin_send's verdict means for `intent`: the operation to answer from (None: nothing stands in its
    way); a refusal is raised."""
    if verdict == "suppressed":
        raise policy.suppressed_refusal(intent.recipients, intent.channel)
    if verdict == "vanished":
        raise LedgerUnavailable(
            f"the operation under key {intent.idempotency_key!r} changed while it was recorded; retry"
        )
    operations = [core.operation_of(row) for row in rows]
    if verdict == "existing":
        return operations[0]
    found = {"matches": Candidates(matches=operations), "holds": Candidates(holds=operations)}
    candidates = found.get(verdict, Candidates(near=operations))
    return policy.decide(intent, candidates, rules)


class _IntentsRaised(HailGuardError):
    """What reading the caller's intents raised, carried through the ledger's error mapping unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _chunks(intents: Iterable[Intent], size: int) -> Iterator[list[Intent]]:
    iterator = iter(intents)
    while True:
        try:
            chunk = list(itertools.islice(iterator, size))
        except HailGuardError:
            raise
        except Exception as exc:  # not the ledger's: `_mapped` must not call it a ledger failure
            raise _IntentsRaised(exc) from exc
        if not chunk:
            return
        yield chunk


# --- connections, migrations, errors --------------------------------------------------------------------


@asynccontextmanager
async def open_postgres_ledger(
    url: str,
    *,
    busy_timeout_seconds: float = 5.0,
    connect_timeout_seconds: float = 10.0,
    min_connections: int = 1,
    max_connections: int = 10,
    command_timeout_seconds: float = COMMAND_TIMEOUT_SECONDS,
) -> AsyncIterator[PostgresLedger]:
    """Migrate the database, then connect a pool to `url`.

    `busy_timeout_seconds` bounds every wait for a lock held by another process (`lock_timeout`),
    like the SQLite ledger's busy timeout. `command_timeout_seconds` bounds every statement, so a
    network that goes silent fails the call (nothing forwarded) instead of hanging it.
    """
    where, secrets = describe(url)
    await migrate(url, connect_timeout_seconds=connect_timeout_seconds)  # no statement bound: it may wait its turn
    with errors_mapped(where, secrets):
        pool = await asyncpg.create_pool(
            url,
            min_size=min_connections,
            max_size=max_connections,
            timeout=connect_timeout_seconds,
            command_timeout=command_timeout_seconds,
            connection_class=_Connection,
            server_settings={
                "application_name": "hail-guard",
                "lock_timeout": f"{max(1, int(busy_timeout_seconds * 1000))}ms",
            },
        )
    ledger = PostgresLedger(pool, where, secrets)
    try:
        yield ledger
    finally:
        with anyio.CancelScope(shield=True):
            await ledger.aclose()


class _Connection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg is untyped: its classes are Any
    """A pooled connection that keeps its session when it goes back to the pool.

    hail-guard sets no session state (no `SET`, `LISTEN`, cursors or session advisory locks), and the pool
    still rolls back any open transaction. The default reset (`RESET ALL`, `UNLISTEN *`, ...) would cost a
    round trip on every release.
    """

    def get_reset_query(self) -> str:
        return ""


async def migrate(url: str, *, connect_timeout_seconds: float = 10.0) -> int:
    """Bring the database at `url` to the newest schema this hail-guard knows; returns that version.

    Safe to run from several processes at once: they take turns under an advisory lock.
    """
    where, secrets = describe(url)
    with errors_mapped(where, secrets):
        db = await asyncpg.connect(url, timeout=connect_timeout_seconds)
        try:
            await _warn_if_not_durable(db, where)
            return await _migrate(db, where)
        finally:
            with anyio.CancelScope(shield=True):
                await db.close()


async def _warn_if_not_durable(db: asyncpg.Connection, where: str) -> None:
    """The server acknowledges commits before they are on disk when `fsync` or `synchronous_commit` is off.

    (`local`, `remote_write` and `remote_apply` all wait for the primary's own flush.)"""
    settings = {name: await db.fetchval(f"SHOW {name}") for name in ("fsync", "synchronous_commit")}
    if "off" in settings.values():
        log.warning(
            "ledger_not_durable",
            ledger=where,
            message="the PostgreSQL server may forget acknowledged commits on a power cut: turn fsync and "
            "synchronous_commit on",
            **settings,
        )


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) for every migration shipped, in order."""
    return sql.migrations("postgres")


_SCHEMA_TABLE = "hail_guard_schema_version"
CREATE_SCHEMA_TABLE = f"""
    CREATE TABLE IF NOT EXISTS {_SCHEMA_TABLE} (
        version    INTEGER PRIMARY KEY,
        applied_at TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp())
"""


async def _migrate(db: asyncpg.Connection, where: str) -> int:
    """Check the encoding and the version; apply what is missing, all or nothing, one process at a time."""
    encoding = await db.fetchval("SHOW server_encoding")
    if encoding != "UTF8":
        raise LedgerUnavailable(
            f"the PostgreSQL ledger at {where} uses encoding {encoding}; hail-guard stores requests exactly as "
            "sent and needs a UTF8 database (CREATE DATABASE ... ENCODING 'UTF8')"
        )
    known = migrations()
    latest = known[-1][0]
    functions = function_texts()
    wanted = {(name, checksum) for name, (checksum, _) in functions.items()}
    if sql.check_version(await _version(db), latest, where) == latest and wanted <= await _applied(db):
        return latest  # nothing to do: no lock, no DDL (a role without CREATE can use a migrated database)
    async with db.transaction():
        await db.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'")
        await db.execute(*bound("lock_migrations", lock=MIGRATION_LOCK))
        await db.execute(CREATE_SCHEMA_TABLE)
        current = sql.check_version(await _version(db), latest, where)
        pending = [(version, script) for version, script in known if version > current]
        for version, script in pending:
            await db.execute(script)
            if version in _BACKFILLS:
                await _backfill(Tx(db), _BACKFILLS[version])
            await db.execute(*bound("record_version", version=version))
        applied = await _applied(db)
        for (checksum, script), name in ((functions[name], name) for name in _FUNCTIONS):
            if (name, checksum) not in applied:
                await db.execute(script)
                await db.execute(*bound("record_function", name=name, checksum=checksum))
    for version, _ in pending:  # committed
        log.info("ledger_migrated", backend="postgres", ledger=where, version=version)
    return latest


async def _version(db: asyncpg.Connection) -> int:
    if not await db.fetchval(f"SELECT to_regclass('{_SCHEMA_TABLE}') IS NOT NULL"):
        return 0
    version: int = await db.fetchval(f"SELECT COALESCE(max(version), 0) FROM {_SCHEMA_TABLE}")
    return version


def function_texts() -> dict[str, tuple[str, str]]:
    """Each server-side function's (checksum, SQL), from sql/postgres/<name>.sql."""
    folder = resources.files("hail_guard.ledger") / "sql" / "postgres"
    texts = {name: sql.filled((folder / f"{name}.sql").read_text(), "postgres") for name in _FUNCTIONS}
    return {name: (hashlib.sha256(script.encode()).hexdigest(), script) for name, script in texts.items()}


async def _applied(db: asyncpg.Connection) -> set[tuple[str, str]]:
    """(name, checksum) of the functions the database has (none before the version that records them)."""
    if not await db.fetchval("SELECT to_regclass('hail_guard_functions') IS NOT NULL"):
        return set()
    return {(row["name"], row["checksum"]) for row in await db.fetch("SELECT name, checksum FROM hail_guard_functions")}


async def _backfill(tx: Tx, step: backfill.Step) -> None:
    """A migration's stored values recomputed (`backfill`), then each opt-out stored by its recipient's key now."""
    for page in backfill.pages(iter(await tx.rows(f"backfill_{step.name}_rows"))):
        updates, reached = step.recompute(page)
        await tx.run_many(f"backfill_{step.name}", updates)
        await tx.run_many("backfill_recipient", reached)
    for row in await tx.rows("backfill_opt_outs"):
        key = step.opt_out_key(row["recipient"], row["channel"])
        if key != row["recipient"]:
            await tx.run("backfill_opt_out_key", key=key, recipient=row["recipient"], channel=row["channel"])
            await tx.run("backfill_drop_opt_out", recipient=row["recipient"], channel=row["channel"])


_BACKFILLS = {8: backfill.FACTS, 11: backfill.KEYS}
"""Migrations whose stored values are recomputed in Python right after their SQL, in their transaction."""
