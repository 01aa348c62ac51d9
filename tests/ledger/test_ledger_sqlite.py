"""SQLite specifics: file permissions, migrations, and every failure mapped to a clear error."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from structlog.testing import capture_logs

from hail_guard.errors import ConfigError, LedgerError, LedgerUnavailable, SchemaTooNew
from hail_guard.ledger import open_ledger, sqlite_path
from hail_guard.ledger.sqlite import migrations
from hail_guard.ledger.sqlite_file import backup_file, errors_mapped, filesystem_type, refuse_network_filesystem
from hail_guard.models import Intent, State
from tests.conftest import missing, subclasses
from tests.ledger.test_ledger_contract import batch_intents, intent
from tests.ledger.test_storage_faults import chattr


async def test_a_new_ledger_file_is_private_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "ledger.db"
    async with open_ledger(f"sqlite:///{path}"):
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]


async def test_reopening_keeps_operations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with open_ledger(url) as ledger:
        op = (await ledger.begin_send(intent(), owner="w1", lease_seconds=60)).operation
    async with open_ledger(url) as ledger:
        assert (await ledger.get(op.id)).idempotency_key == op.idempotency_key


async def test_a_ledger_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with open_ledger(str(path)):
        pass
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 999")
    with pytest.raises(SchemaTooNew, match="upgrade hail-guard"):
        async with open_ledger(str(path)):
            pass


async def test_a_read_only_ledger_refuses_to_record(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with open_ledger(str(path)):
        pass
    with read_only(path), pytest.raises(LedgerUnavailable):
        async with open_ledger(str(path)) as ledger:
            await ledger.begin_send(intent(), owner="w1", lease_seconds=60)


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` read-only for this process: its mode for a user; made immutable for root, who writes read-only
    files anyway."""
    if os.geteuid() != 0:
        path.chmod(0o400)
        yield
        return
    try:
        chattr("+i", str(path))
    except OSError as exc:
        missing(f"a read-only ledger under root needs `chattr +i`: {exc}")
    try:
        yield
    finally:
        chattr("-i", str(path))


def test_sqlite_read_only_and_full_errors_become_clear_ledger_errors(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    sqlite3.connect(path).close()
    read_only = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(LedgerUnavailable, match="read-only: make the file and its folder writable"), errors_mapped("x"):
        read_only.execute("CREATE TABLE t (x)")
    read_only.close()
    with pytest.raises(LedgerUnavailable, match="disk holding the ledger x is full"), errors_mapped("x"):
        raise sqlite3.OperationalError("database or disk is full")


def every_driver_and_file_error() -> list[Exception]:
    """What the SQLite ledger can meet: every sqlite3 (and aiosqlite: the same classes) error and warning,
    every built-in OSError (the file, its folder, the disk), and aiosqlite's ValueError for a closed link."""
    driver = [cls("boom") for cls in subclasses(sqlite3.Error)] + [sqlite3.Warning("boom")]
    files = [cls(5, "boom") for cls in {*subclasses(OSError)} if cls.__module__ == "builtins"]
    return [*driver, *files, ValueError("no active connection")]


@pytest.mark.parametrize("error", every_driver_and_file_error(), ids=lambda error: type(error).__name__)
def test_every_driver_and_file_error_becomes_ledger_unavailable_naming_the_file(error: Exception) -> None:
    with (
        pytest.raises(LedgerUnavailable, match=r"ledger /srv/hail/ledger\.db") as mapped,
        errors_mapped("/srv/hail/ledger.db"),
    ):
        raise error
    assert mapped.value.__cause__ is error  # the operator's log keeps the driver's own words


def test_the_walk_meets_every_kind_of_sqlite_error() -> None:
    names = {type(error).__name__ for error in every_driver_and_file_error()}
    assert {"InterfaceError", "OperationalError", "IntegrityError", "Warning", "PermissionError"} <= names


async def test_a_ledger_locked_past_the_busy_timeout_records_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with open_ledger(str(path), busy_timeout_seconds=0.05) as ledger:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(LedgerUnavailable, match="locked past the busy timeout"):
                await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert await ledger.find_by_key(intent().idempotency_key) is None


async def test_a_folder_that_cannot_be_created_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LedgerUnavailable, match="cannot be used"):
        async with open_ledger(str(blocker / "ledger.db")):
            pass


def test_ledger_urls() -> None:
    assert sqlite_path("sqlite:////abs/l.db") == "/abs/l.db"
    assert sqlite_path("sqlite:///rel/l.db") == "rel/l.db"
    assert sqlite_path("/plain/l.db") == "/plain/l.db"
    with pytest.raises(ConfigError, match="unsupported ledger URL"):
        sqlite_path("mysql://x")


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
server:/export /mnt/shared nfs4 rw,relatime 0 0
//nas/share /mnt/nas cifs rw 0 0
tmpfs /mnt/shared/local tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/me/ledger.db", "ext4"),
        ("/mnt/shared/ledger.db", "nfs4"),
        ("/mnt/shared/local/ledger.db", "tmpfs"),
        ("/mnt/nas/x/ledger.db", "cifs"),
        ("/mnt/sharedother/ledger.db", "ext4"),
    ],
)
def test_the_filesystem_holding_the_ledger_is_found(path: str, kind: str) -> None:
    assert filesystem_type(path, MOUNTS) == kind


def test_a_ledger_on_a_network_filesystem_is_refused_pointing_to_postgresql(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/x {tmp_path} nfs rw 0 0\n")
    with pytest.raises(LedgerUnavailable, match=r"network filesystem \(nfs\).*postgresql://"):
        refuse_network_filesystem(str(tmp_path / "ledger.db"), str(mounts))
    refuse_network_filesystem(str(tmp_path / "ledger.db"), str(tmp_path / "no-such-mounts"))


async def test_processes_opening_a_new_ledger_at_once_migrate_it_once(tmp_path: Path) -> None:
    import anyio

    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def open_and_close() -> None:
        async with open_ledger(url, busy_timeout_seconds=10):
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(6):  # separate connections, as separate processes have
            tg.start_soon(open_and_close)
    async with open_ledger(f"sqlite:///{tmp_path / 'alone.db'}"):  # the same migrations, run once for sure
        pass
    for name in ("ledger.db", "alone.db"):
        with closing(sqlite3.connect(tmp_path / name)) as db:
            assert db.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert schema(tmp_path / "ledger.db") == schema(tmp_path / "alone.db")  # nothing made twice, nothing missing


def schema(path: Path) -> list[tuple[str, str, str]]:
    """Every table, index, view and trigger, with its SQL, and every row the migrations wrote."""
    with closing(sqlite3.connect(path)) as db:
        made = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        tables = [name for kind, name, _ in made if kind == "table" and not name.startswith("sqlite_")]
        rows = [("rows", table, str(db.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0])) for table in tables]
    return [*made, *rows]


async def test_staging_a_batch_leaves_the_ledger_free_for_other_processes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    wrote_meanwhile: list[int] = []

    def sends_while_another_process_writes() -> Iterator[Intent]:
        for n, planned in enumerate(batch_intents(1500)):
            if n == 1000:  # two chunks staged: another process must still get the write lock at once
                with closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as other:
                    other.execute("BEGIN IMMEDIATE")
                    other.execute(
                        "INSERT INTO suppressions (recipient, channel, reason, source, created_at) "
                        "VALUES ('someone@else.example', 'all', 'test', 'test', 0)"
                    )
                    other.execute("COMMIT")
                    wrote_meanwhile.append(n)
            yield planned

    async with open_ledger(str(path)) as ledger:
        await ledger.plan_batch(
            batch_id="B1", name=None, intents=sends_while_another_process_writes(), state=State.READY, actor="op"
        )
        assert wrote_meanwhile == [1000]
        assert (await ledger.batch_status("B1")).counts == {State.READY: 1500}


async def test_a_backup_leaves_an_existing_partial_file_alone(tmp_path: Path) -> None:
    copy, someones = tmp_path / "copy.db", tmp_path / "copy.db.partial"
    someones.write_text("not hail-guard's")
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
        assert await ledger.backup(str(copy)) == 1
    assert someones.read_text() == "not hail-guard's"
    assert sorted(path.name for path in tmp_path.iterdir() if "copy" in path.name) == ["copy.db", "copy.db.partial"]


async def test_a_file_created_at_the_path_while_the_backup_runs_is_never_replaced(tmp_path: Path) -> None:
    """The copy is held back (another connection holds the ledger exclusively) until the file appears."""
    source, copy = tmp_path / "ledger.db", tmp_path / "copy.db"
    async with open_ledger(f"sqlite:///{source}") as ledger:
        await ledger.begin_send(intent(), owner="w1", lease_seconds=60)
    outcome: list[BaseException | int] = []

    def back_up() -> None:  # what `SqliteLedger.backup` runs on its worker thread
        try:
            outcome.append(backup_file(str(source), str(copy)))
        except LedgerError as exc:
            outcome.append(exc)

    holder = sqlite3.connect(source, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE operations SET attempts = attempts")  # a write: the lock is taken, readers wait
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, back_up)
        try:
            with anyio.fail_after(10):
                while not list(tmp_path.glob("*.partial")):  # noqa: ASYNC110  (a file, not an event, says it began)
                    await anyio.sleep(0.01)
            copy.write_text("someone's file")
        finally:
            holder.close()  # the lock goes with the connection: the copy goes on
    [refused] = outcome
    assert isinstance(refused, LedgerError)
    assert "appeared while the backup was being written" in str(refused)
    assert copy.read_text() == "someone's file"
    assert not list(tmp_path.glob("*.partial"))


async def test_a_new_ledger_is_made_with_a_notice_naming_where_and_only_where_no_file_was(tmp_path: Path) -> None:
    path = tmp_path / "new" / "ledger.db"
    with capture_logs() as logs:
        async with open_ledger(f"sqlite:///{path}"):
            pass
        async with open_ledger(f"sqlite:///{path}"):
            pass
    [notice] = [entry for entry in logs if entry["event"] == "ledger_created"]
    assert (notice["log_level"], notice["ledger"]) == ("warning", str(path))
    assert list(path.parent.iterdir()) == [path]  # the file it was made as is gone


async def test_an_empty_file_where_the_ledger_should_be_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.write_bytes(b"")
    with pytest.raises(LedgerUnavailable, match=r"is an empty file \(0 bytes\).*restore the last backup"):
        async with open_ledger(str(path)):
            pass
    assert path.stat().st_size == 0


async def test_a_file_that_is_no_database_is_refused_naming_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    path.write_text("my notes, not a ledger\n" * 400)
    with pytest.raises(LedgerUnavailable, match=r"is not a hail-guard ledger.*\[ledger\] url"):
        async with open_ledger(str(path)):
            pass


def damage(path: Path) -> None:
    """Overwrite part of a page of the operations table, as a failing disk would."""
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = db.execute("SELECT pageno FROM dbstat WHERE name = 'operations' AND pagetype = 'leaf'").fetchone()[0]
    with path.open("r+b") as file:
        file.seek(4096 * (page - 1) + 100)
        file.write(b"\xff" * 300)


async def test_a_damaged_ledger_is_found_by_its_check_and_named_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with open_ledger(str(path)) as ledger:
        await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(300), state=State.READY, actor="op")
        await ledger.verify()
    damage(path)
    async with open_ledger(str(path)) as ledger:
        with pytest.raises(LedgerUnavailable, match=r"is damaged \(.*\.recover"):
            await ledger.verify()
