"""PostgreSQL specifics: clear errors without the password, migrations, and several hosts on one ledger.

The contract suite (test_ledger_contract.py) already runs on PostgreSQL; these tests cover what only
a server shared by several processes has.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hail_guard.errors import (
    BadInput,
    ConfigError,
    HailGuardError,
    LeaseLost,
    LedgerUnavailable,
    NotFound,
    ProbableDuplicate,
    RefusedByPolicy,
    SchemaTooNew,
)
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import DeliveryState, Intent, Outcome, State, WebhookOutcome
from hail_guard.same_send import Rules
from tests.conftest import missing, subclasses
from tests.ledger.test_ledger_contract import accepted_outcome, batch_intents, intent, webhook
from tests.postgres import PASSWORD, PASSWORD_ROLE, PostgresServer, find_bindir, missing_reason, throwaway_cluster

try:
    import asyncpg
except ImportError:
    missing("the PostgreSQL ledger needs the `postgres` extra: pip install -e '.[dev,postgres]'", module=True)
from hail_guard.ledger import sql
from hail_guard.ledger.core import LEASE_EXPIRED
from hail_guard.ledger.planning import PLAN_CHUNK
from hail_guard.ledger.postgres import migrate, migrations, open_postgres_ledger
from hail_guard.ledger.postgres_errors import describe, errors_mapped

LATEST = migrations()[-1][0]


async def fetch(url: str, query: str, *args: Any) -> list[Any]:
    db = await asyncpg.connect(url)
    try:
        return [row[0] for row in await db.fetch(query, *args)]
    finally:
        await db.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # nothing listens on it once the probe is closed


def needs_password_role(server: PostgresServer) -> None:
    if not server.password_login:
        missing(f"needs the throwaway cluster's role {PASSWORD_ROLE} that logs in with a password")


def assert_never_mentions(error: BaseException, secret: str) -> None:
    """Neither the error nor any error chained to it (what a logged traceback would print) says `secret`."""
    seen: BaseException | None = error
    while seen is not None:
        assert secret not in str(seen)
        assert all(secret not in repr(arg) for arg in seen.args)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


async def test_an_unreachable_server_is_a_clear_error_without_the_password() -> None:
    url = f"postgresql://hg:s3cret-pw@127.0.0.1:{closed_port()}/ledger"
    with pytest.raises(
        LedgerUnavailable, match=r"cannot reach the PostgreSQL ledger at postgresql://127\.0\.0\.1:\d+/"
    ) as e:
        async with open_ledger(url):
            pass
    assert_never_mentions(e.value, "s3cret-pw")


async def test_a_malformed_url_is_a_clear_error_without_the_password() -> None:
    with pytest.raises(LedgerUnavailable, match="cannot be used") as e:
        await migrate("postgresql://hg:s3cret-pw@127.0.0.1:notaport/ledger")
    assert_never_mentions(e.value, "s3cret-pw")


async def test_a_missing_database_is_named(postgres_server: PostgresServer) -> None:
    with pytest.raises(LedgerUnavailable, match=r"does not exist: .*create the database or fix the ledger URL"):
        async with open_ledger(postgres_server.url("hg_no_such_database")):
            pass


async def test_a_wrong_password_is_refused_without_repeating_it(postgres_server: PostgresServer) -> None:
    needs_password_role(postgres_server)
    url = postgres_server.url("postgres", user=PASSWORD_ROLE, password="wrong-pw-7781")
    with pytest.raises(LedgerUnavailable, match="refused the password: check the user and password") as e:
        async with open_ledger(url):
            pass
    assert_never_mentions(e.value, "wrong-pw-7781")


async def test_migrating_with_a_password_never_logs_it(postgres_server: PostgresServer) -> None:
    needs_password_role(postgres_server)
    async with postgres_server.database(migrated=False, options=f"OWNER {PASSWORD_ROLE}") as admin_url:
        url = postgres_server.url(admin_url.rsplit("/", 1)[-1], user=PASSWORD_ROLE, password=PASSWORD)
        with capture_logs() as logs:
            assert await migrate(url) == LATEST
    assert [entry["version"] for entry in logs if entry["event"] == "ledger_migrated"] == list(range(1, LATEST + 1))
    assert PASSWORD not in repr(logs)
    assert logs[0]["ledger"].startswith("postgresql://127.0.0.1:")
    assert PASSWORD_ROLE not in logs[0]["ledger"]


async def test_a_role_that_cannot_create_tables_uses_a_migrated_ledger(postgres_server: PostgresServer) -> None:
    needs_password_role(postgres_server)
    async with postgres_server.database(migrated=True) as admin_url:
        db = await asyncpg.connect(admin_url)
        try:
            await db.execute(
                f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {PASSWORD_ROLE};"
                f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {PASSWORD_ROLE}"
            )
        finally:
            await db.close()
        url = postgres_server.url(admin_url.rsplit("/", 1)[-1], user=PASSWORD_ROLE, password=PASSWORD)
        async with open_ledger(url) as ledger:
            assert (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).claimed


async def test_migrations_are_idempotent_and_return_the_version(postgres_url: str) -> None:
    assert await migrate(postgres_url) == LATEST
    assert await migrate(postgres_url) == LATEST
    async with open_ledger(postgres_url):
        pass
    versions = await fetch(postgres_url, "SELECT version FROM hail_guard_schema_version ORDER BY version")
    assert versions == list(range(1, LATEST + 1))


async def test_connections_migrating_at_once_take_turns(postgres_url: str) -> None:
    returned: list[int] = []

    async def migrate_once() -> None:
        returned.append(await migrate(postgres_url))

    async def open_once() -> None:
        async with open_ledger(postgres_url) as ledger:
            await ledger.expire_leases()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(migrate_once)
                tg.start_soon(open_once)
    assert returned == [LATEST] * 4
    versions = await fetch(postgres_url, "SELECT version FROM hail_guard_schema_version ORDER BY version")
    assert versions == list(range(1, LATEST + 1))


async def test_a_ledger_from_a_newer_version_is_refused(postgres_url: str) -> None:
    await migrate(postgres_url)
    await fetch(postgres_url, "INSERT INTO hail_guard_schema_version (version) VALUES (999) RETURNING version")
    with pytest.raises(
        SchemaTooNew, match=r"schema version 999, newer than this hail-guard knows .*upgrade hail-guard"
    ):
        async with open_ledger(postgres_url):
            pass
    with pytest.raises(SchemaTooNew):
        await migrate(postgres_url)


async def test_a_database_that_is_not_utf8_is_refused(postgres_server: PostgresServer) -> None:
    latin1 = "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'"
    async with postgres_server.database(migrated=False, options=latin1) as url:
        with pytest.raises(LedgerUnavailable, match=r"uses encoding LATIN1; .* needs a UTF8 database"):
            async with open_ledger(url):
                pass


async def test_unusual_text_and_answers_round_trip_exactly(postgres_url: str) -> None:
    given = intent(body='Grüße 😀 \u2028 "quoted" \\ tab\t nul\x00 end')
    answer = {"status": "sent", "id": "e-1", "note": "nul\x00 ünïcode 😀", "amount": 0.1, "nested": {"z": 1, "a": 2}}
    async with open_ledger(postgres_url) as ledger:
        op = (await ledger.begin_send(given, owner="w1", lease_seconds=60)).operation
        accepted = Outcome(state=State.ACCEPTED, reason="ok", provider_id="e-1", result=answer)
        await ledger.record_outcome(op.id, owner="w1", outcome=accepted, actor="w1")
        stored = await ledger.get(op.id)
    assert stored.request == given.request
    assert stored.result == answer
    assert list(stored.result) == list(answer)  # the answer's own order, not jsonb's
    assert stored.created_at.utcoffset() is not None


async def test_a_row_locked_past_the_busy_timeout_records_nothing(postgres_url: str) -> None:
    async with open_ledger(postgres_url, busy_timeout_seconds=0.05) as ledger:
        op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
        holder = await asyncpg.connect(postgres_url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM operations WHERE id = $1 FOR UPDATE", op.id)
                with pytest.raises(LedgerUnavailable, match="stayed locked past the lock timeout"):
                    await ledger.record_outcome(op.id, owner="w1", outcome=accepted_outcome(op.id), actor="w1")
        finally:
            await holder.close()
        assert (await ledger.get(op.id)).state is State.SENDING


async def test_two_hosts_beginning_one_key_at_once_claim_it_exactly_once(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as host_a, open_ledger(postgres_url) as host_b:
        results = []

        async def begin(ledger: Ledger, owner: str) -> None:
            results.append(await ledger.begin_send(intent(), owner=owner, lease_seconds=60))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    tg.start_soon(begin, (host_a, host_b)[n % 2], f"w{n}")
        events = await host_a.events(results[0].operation.id)
    assert sum(r.claimed for r in results) == 1
    assert len({r.operation.id for r in results}) == 1
    assert [(e.from_state, e.to_state) for e in events] == [(None, State.SENDING)]


async def test_two_hosts_claiming_unknowns_never_take_the_same_one(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as host_a, open_ledger(postgres_url) as host_b:
        for n in range(40):
            await host_a.begin_send(
                intent(f"k{n}", body=f"Hello {n}", to=f"r{n}@example.com"), owner="w", lease_seconds=0
            )
        await host_b.expire_leases()
        assert len(await host_b.list_operations(state=State.UNKNOWN)) == 40
        taken: list[str] = []

        async def reconciler(ledger: Ledger, name: str) -> None:
            while claimed := await ledger.claim_unknown(owner=name, lease_seconds=60, limit=3):
                taken.extend(op.id for op in claimed)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(6):
                    tg.start_soon(reconciler, (host_a, host_b)[n % 2], f"r{n}")
    assert len(taken) == len(set(taken)) == 40


async def test_two_hosts_claiming_a_batch_never_take_the_same_send(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as host_a, open_ledger(postgres_url) as host_b:
        await host_a.plan_batch(batch_id="B1", name=None, intents=batch_intents(40), state=State.READY, actor="op")
        taken: list[str] = []

        async def worker(ledger: Ledger, name: str) -> None:
            while claimed := await ledger.claim_ready(owner=name, lease_seconds=60, batch_id="B1", limit=3):
                taken.extend(op.id for op in claimed)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(6):
                    tg.start_soon(worker, (host_a, host_b)[n % 2], f"w{n}")
        status = await host_b.batch_status("B1")
    assert len(taken) == len(set(taken)) == 40
    assert status.counts == {State.SENDING: 40}


def every_driver_and_socket_error(message: str = "boom") -> list[Exception]:
    """What the PostgreSQL ledger can meet: every class asyncpg defines below its three roots (loaded now:
    the walk finds `_base.DataError`, which `asyncpg.exceptions` does not name), every built-in OSError and
    socket error, and the ValueError or OverflowError of a value asyncpg cannot send."""
    roots = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError)
    driver = [cls(message) for root in roots for cls in subclasses(root)]
    sockets = [cls(5, message) for cls in {*subclasses(OSError)} if cls.__module__ in ("builtins", "socket")]
    return [*driver, *sockets, ValueError(message), OverflowError(message)]


def test_every_driver_and_socket_error_becomes_ledger_unavailable_naming_the_server_without_the_password() -> None:
    where = "postgresql://db.example/ledger"
    errors = every_driver_and_socket_error("boom near pw-SECRET")
    assert len(errors) > 250
    for error in errors:
        expected = pytest.raises(LedgerUnavailable, match=r"PostgreSQL ledger at postgresql://db\.example/ledger")
        with expected as mapped, errors_mapped(where, frozenset({"pw-SECRET"})):
            raise error
        assert_never_mentions(mapped.value, "pw-SECRET")


def test_a_driver_message_that_repeats_the_password_is_masked_and_not_chained() -> None:
    with pytest.raises(LedgerUnavailable) as e, errors_mapped("postgresql://h/db", frozenset({"pw-123"})):
        raise ValueError("bad option near pw-123")
    assert "pw-123" not in str(e.value)
    assert e.value.__cause__ is None
    assert e.value.__suppress_context__


def test_a_one_letter_password_is_masked_where_it_stands_and_nowhere_else() -> None:
    """A password `p` once gave "***ostgres ... ***ort": every occurrence of its text was masked."""
    where, secrets = describe("postgresql://hg:p@db.example:5432/ledger")
    with pytest.raises(LedgerUnavailable) as e, errors_mapped(where, secrets):
        raise OSError("connect to postgresql://hg:p@db.example:5432/ledger?password=p failed (p)")
    assert str(e.value) == (
        "cannot reach the PostgreSQL ledger at postgresql://db.example:5432/ledger: connect to "
        "postgresql://hg:***@db.example:5432/ledger?password=*** failed (***); check that the server is running "
        "and the host and port in the ledger URL"
    )


def test_our_own_errors_pass_through_the_mapping_unchanged() -> None:
    with pytest.raises(SchemaTooNew), errors_mapped("postgresql://h/db"):
        raise SchemaTooNew("newer")
    assert issubclass(LedgerUnavailable, HailGuardError)


def test_messages_name_the_server_by_host_port_and_database_and_scrub_every_spelling_of_the_password() -> None:
    where, secrets = describe("postgresql://hg:p%40ss@db.example:5432/ledger?password=other&sslmode=require")
    assert where == "postgresql://db.example:5432/ledger"
    assert secrets == {"p%40ss", "p@ss", "other"}
    assert describe("postgres://hg@db.example/ledger") == ("postgres://db.example/ledger", frozenset())


@pytest.mark.parametrize("password", ["pa/ss-SECRET", "pa#ss-SECRET", "pa?ss-SECRET", "p@ss-SECRET", "12/ss-SECRET"])
async def test_a_password_that_drivers_would_misread_is_refused_without_being_printed(password: str) -> None:
    with pytest.raises(ConfigError, match="percent-encoded") as e:
        async with open_ledger(f"postgresql://hg:{password}@127.0.0.1:15432/hg"):
            pass
    assert "postgresql://127.0.0.1:15432/hg" in str(e.value)
    assert_never_mentions(e.value, "ss-SECRET")


async def test_a_port_out_of_range_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"postgresql://127\.0\.0\.1:99999/hg names a port outside 1-65535"):
        async with open_ledger("postgresql://hg:pw@127.0.0.1:99999/hg"):
            pass


async def test_a_postgres_url_without_asyncpg_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)
    monkeypatch.delitem(sys.modules, "hail_guard.ledger.postgres")
    with pytest.raises(ConfigError, match=r"pip install 'hail-guard\[postgres\]'"):
        async with open_ledger("postgresql://hg@db.example/ledger"):
            pass


async def test_tool_pins_record_changes_until_accepted(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as ledger:
        first = await ledger.observe_tools({"send_sms": "s1", "send_email": "e1"})
        assert [(p.name, p.changed, p.changed_at) for p in first] == [
            ("send_email", False, None),
            ("send_sms", False, None),
        ]
        changed = {p.name: p for p in await ledger.observe_tools({"send_email": "e2", "send_sms": "s1"})}
        assert (changed["send_email"].changed, changed["send_email"].accepted_fingerprint) == (True, "e1")
        assert changed["send_email"].changed_at is not None
        assert not changed["send_sms"].changed
        assert await ledger.accept_tools([]) == []
        assert await ledger.accept_tools() == ["send_email"]
        assert [(p.name, p.fingerprint, p.changed) for p in await ledger.tool_pins()] == [
            ("send_email", "e2", False),
            ("send_sms", "s1", False),
        ]


async def test_the_oldest_operation_in_a_state(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as ledger:
        assert await ledger.oldest(State.READY) is None
        await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
        oldest = await ledger.oldest(State.READY)
    assert oldest is not None
    assert oldest.idempotency_key == "b:0"


async def test_claiming_from_a_large_batch_reads_a_row_not_the_whole_batch(postgres_url: str) -> None:
    """Without an index in claim order, each claim checked and sorted every ready send: O(N^2) per batch. The claim
    runs inside hg_claim_ready, so its statements' plans are read as auto_explain reports them."""
    async with open_ledger(postgres_url) as ledger:
        await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(2000), state=State.READY, actor="op")
    db = await asyncpg.connect(postgres_url)
    notices: list[str] = []
    db.add_log_listener(lambda _, message: notices.append(message.message))
    try:
        await db.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET auto_explain.log_analyze = on; "
            "SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice"
        )
        for _ in range(8):  # past the fifth call plpgsql may turn a statement's plan generic
            transaction = db.transaction()
            await transaction.start()
            try:
                claim = sql.statements("postgres")["claim_ready_in_batch"]
                given = {"owner": "w", "lease_seconds": 60.0, "limit": 1, "expired_reason": LEASE_EXPIRED}
                given |= {"hold_lead": True, "batch_id": "B1"}
                assert len(await db.fetch(claim.text, *claim.values(given))) == 1
            finally:
                await transaction.rollback()
    finally:
        await db.close()
    candidates = [notice for notice in notices if "o.batch_id = p_batch_id" in notice]
    assert len(candidates) == 8
    for plan in candidates:
        rows_read = [int(n) for n in re.findall(r"actual time=\S+ rows=(\d+)", plan)]
        assert rows_read, plan
        assert max(rows_read) <= PLPGSQL_FETCH, plan  # a loop fetches its query 10 rows at a time


PLPGSQL_FETCH = 10
"""Rows a plpgsql FOR loop fetches from its query at a time."""


def streamed(intents: list[Intent], *, then: BaseException | None = None) -> Iterator[Intent]:
    """The intents one at a time, as a batch file is read; then `then` is raised, if given."""
    yield from intents
    if then is not None:
        raise then


async def test_a_batch_streamed_in_many_chunks_is_planned_in_order_and_counted(postgres_url: str) -> None:
    sends = batch_intents(PLAN_CHUNK * 2 + 7)
    async with open_ledger(postgres_url) as ledger:
        planned = await ledger.plan_batch(
            batch_id="B1", name=None, intents=streamed(sends), state=State.READY, actor="op"
        )
        claimed = await ledger.claim_ready(owner="w1", lease_seconds=60, batch_id="B1", limit=3)
        status = await ledger.batch_status("B1")
    assert planned == len(sends)
    assert status.counts == {State.READY: len(sends) - 3, State.SENDING: 3}
    assert [op.idempotency_key for op in claimed] == ["b:0", "b:1", "b:2"]


async def test_a_refusal_while_the_batch_is_read_plans_nothing_of_it(postgres_url: str) -> None:
    sends = batch_intents(PLAN_CHUNK * 2 + 7)
    refusal = BadInput("line 1008: not valid JSON; nothing was planned")
    async with open_ledger(postgres_url) as ledger:
        with pytest.raises(BadInput, match="line 1008"):
            await ledger.plan_batch(
                batch_id="B1", name=None, intents=streamed(sends, then=refusal), state=State.READY, actor="op"
            )
        assert await ledger.count_by_state() == {}
        with pytest.raises(NotFound):
            await ledger.batch_status("B1")
        assert await ledger.plan_batch(batch_id="B2", name=None, intents=sends, state=State.READY, actor="op") == len(
            sends
        )


async def test_an_error_of_the_sends_themselves_is_not_called_a_ledger_failure(postgres_url: str) -> None:
    sends = batch_intents(PLAN_CHUNK + 1)
    async with open_ledger(postgres_url) as ledger:
        with pytest.raises(ValueError, match=r"^a bug in the batch reader$"):
            await ledger.plan_batch(
                batch_id="B1",
                name=None,
                intents=streamed(sends, then=ValueError("a bug in the batch reader")),
                state=State.READY,
                actor="op",
            )
        assert await ledger.count_by_state() == {}


async def test_a_plan_cancelled_while_the_sends_are_read_records_nothing(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as ledger:
        with anyio.CancelScope() as scope:

            def sends() -> Iterator[Intent]:
                for n, send in enumerate(batch_intents(PLAN_CHUNK * 3)):
                    if n == PLAN_CHUNK + 1:
                        scope.cancel()  # the operator pressed Ctrl-C while the file was read
                    yield send

            await ledger.plan_batch(batch_id="B1", name=None, intents=sends(), state=State.READY, actor="op")
        assert scope.cancelled_caught
        assert await ledger.count_by_state() == {}
        again = await ledger.plan_batch(
            batch_id="B2", name=None, intents=batch_intents(3), state=State.READY, actor="op"
        )
        assert again == 3


async def test_known_keys_and_duplicates_past_the_first_chunk_are_named_by_their_position(postgres_url: str) -> None:
    sends = batch_intents(PLAN_CHUNK * 2 + 7)
    taken = PLAN_CHUNK + 4  # a position in the second chunk
    async with open_ledger(postgres_url) as ledger:
        await ledger.begin_send(sends[taken - 1], owner="w1", lease_seconds=60)
        with pytest.raises(RefusedByPolicy, match=rf"^1 send\(s\) already exist in the ledger: send {taken} "):
            await ledger.plan_batch(batch_id="B1", name=None, intents=streamed(sends), state=State.READY, actor="op")
        renamed = [send.model_copy(update={"idempotency_key": f"new:{n}"}) for n, send in enumerate(sends)]
        with pytest.raises(ProbableDuplicate, match=rf"^send {taken}: lead{taken - 1}@example.com already has"):
            await ledger.plan_batch(
                batch_id="B2",
                name=None,
                intents=streamed(renamed),
                state=State.READY,
                actor="op",
                rules=Rules(window_seconds=3600),
            )
        assert await ledger.count_by_state() == {State.SENDING: 1}


async def test_an_outcome_after_the_lease_ran_out_is_logged_from_unknown(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as ledger:
        op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=0)).operation
        assert await ledger.expire_leases() == 1
        recorded = await ledger.record_outcome(op.id, owner="w1", outcome=accepted_outcome(op.id), actor="w1")
        events = await ledger.events(op.id)
    assert recorded.state is State.ACCEPTED
    assert [(e.from_state, e.to_state) for e in events] == [
        (None, State.SENDING),
        (State.SENDING, State.UNKNOWN),
        (State.UNKNOWN, State.ACCEPTED),
    ]


async def test_migrating_onto_a_server_that_may_forget_commits_says_so(postgres_server: PostgresServer) -> None:
    async with postgres_server.database(migrated=False) as url:
        await postgres_server.execute(f'ALTER DATABASE "{url.rsplit("/", 1)[-1]}" SET synchronous_commit = off')
        with capture_logs() as logs:
            await migrate(url)
    [warning] = [entry for entry in logs if entry["event"] == "ledger_not_durable"]
    assert warning["log_level"] == "warning"
    assert warning["synchronous_commit"] == "off"
    assert "turn fsync and synchronous_commit on" in warning["message"]


def test_a_durable_server_migrates_without_a_warning() -> None:
    bindir = find_bindir()
    if bindir is None:
        missing(missing_reason() or "no PostgreSQL binaries")
    with throwaway_cluster(bindir, durable=True) as url, capture_logs() as logs:
        anyio.run(migrate, url)
    assert [entry["version"] for entry in logs if entry["event"] == "ledger_migrated"] == list(range(1, LATEST + 1))
    assert not [entry for entry in logs if entry["event"] == "ledger_not_durable"]


async def test_a_send_never_waits_on_another_writers_count_of_the_same_hour(postgres_url: str) -> None:
    """Counts per hour are sharded by writer: a transaction that counted a send in this hour and has not
    committed holds its own shard's row, not the row a send on another connection adds to."""
    async with open_postgres_ledger(postgres_url, busy_timeout_seconds=0.05, max_connections=1) as ledger:
        await ledger.now()
        [pid] = await fetch(postgres_url, "SELECT pid FROM pg_stat_activity WHERE application_name = 'hail-guard'")
        holder = await asyncpg.connect(postgres_url)
        while await holder.fetchval("SELECT pg_backend_pid() % 16") == pid % 16:  # another shard than the ledger's
            await holder.close()
            holder = await asyncpg.connect(postgres_url)
        try:
            async with holder.transaction():
                await holder.execute(
                    "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,"
                    " request_fingerprint, content_fingerprint, state, first_sent_at, created_at, updated_at)"
                    " VALUES ('held', 'held', 'send_email', 'email', '[]', '{}', '{}', 'f', 'f', 'sending', now(),"
                    " now(), now())"
                )
                begin = await ledger.begin_send(intent(), owner="w1", lease_seconds=60)  # not past the lock timeout
        finally:
            await holder.close()
        [hour] = await ledger.sends_by_hour((await ledger.now()).replace(minute=0, second=0, microsecond=0))
    assert begin.claimed
    assert hour.states == {State.SENDING: 2}  # each counted in its own shard, summed when read


async def test_outcomes_recorded_at_once_each_get_their_own_answer_and_a_refusal_touches_no_other(
    postgres_url: str,
) -> None:
    async with open_ledger(postgres_url) as ledger:
        await ledger.plan_batch(batch_id="G", name=None, intents=batch_intents(12), state=State.READY, actor="op")
        claimed = [(await ledger.claim_ready(owner=f"w{n}", lease_seconds=60, batch_id="G"))[0] for n in range(12)]
        answers: dict[str, Any] = {}

        async def record(n: int, owner: str, outcome: Outcome) -> None:
            try:
                answers[claimed[n].id] = await ledger.record_outcome(
                    claimed[n].id, owner=owner, outcome=outcome, actor=owner
                )
            except LeaseLost as refused:
                answers[claimed[n].id] = refused

        twin = accepted_outcome("twin")  # one message id answered for two sends: the second goes to review
        early = webhook("d1", "email.delivered", f"e-{claimed[7].id}")  # before its message id is recorded
        assert await ledger.record_webhook(early) is WebhookOutcome.PARKED
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(12):
                    owner = "not-the-owner" if n == 3 else f"w{n}"
                    outcome = twin if n in (5, 6) else accepted_outcome(claimed[n].id)
                    tg.start_soon(record, n, owner, outcome)
        stored = {op.id: await ledger.get(op.id) for op in claimed}
    assert isinstance(answers[claimed[3].id], LeaseLost)
    assert stored[claimed[3].id].state is State.SENDING
    recorded = [n for n in range(12) if n != 3]
    assert all(answers[claimed[n].id].state == stored[claimed[n].id].state for n in recorded)
    assert sorted(stored[claimed[n].id].state.value for n in (5, 6)) == ["accepted", "needs_review"]
    assert {stored[claimed[n].id].state for n in recorded if n not in (5, 6)} == {State.ACCEPTED}
    assert [stored[claimed[n].id].provider_id for n in (0, 1)] == [f"e-{claimed[n].id}" for n in (0, 1)]
    assert answers[claimed[7].id].delivery_state is stored[claimed[7].id].delivery_state is DeliveryState.DELIVERED
    assert {stored[claimed[n].id].delivery_state for n in recorded if n != 7} == {None}


async def test_claims_made_at_once_each_take_a_send_of_their_own_under_their_own_owner(postgres_url: str) -> None:
    async with open_ledger(postgres_url) as ledger:
        await ledger.plan_batch(batch_id="C", name=None, intents=batch_intents(30), state=State.READY, actor="op")
        taken: dict[str, list[Any]] = {}

        async def claim(owner: str) -> None:
            taken[owner] = await ledger.claim_ready(owner=owner, lease_seconds=60, batch_id="C")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(40):
                    tg.start_soon(claim, f"c{n}")
        status = await ledger.batch_status("C")
    ids = [op.id for claimed in taken.values() for op in claimed]
    assert len(ids) == len(set(ids)) == 30
    assert all(op.lease_owner == owner for owner, claimed in taken.items() for op in claimed)
    assert sorted(len(claimed) for claimed in taken.values()) == [0] * 10 + [1] * 30
    assert status.counts == {State.SENDING: 30}
