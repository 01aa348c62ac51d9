"""Storage faults on the SQLite ledger (issue 9, part 5): a full disk, an unwritable ledger, a locked one.

Each fault is real, not mocked:
- full: the ledger lives on a small tmpfs mounted for the test, filled to the last page by another file
  (SQLite then answers SQLITE_FULL); freeing that file is "the storage comes back". Mounting needs root
  with CAP_SYS_ADMIN: without it these cases are skipped, saying so (under CI they fail: CI runs as root).
- read_only: the ledger file and its WAL are made immutable (`chattr +i`), which even root cannot write,
  through file descriptors already open too. (Not the `-shm` file: SQLite writes it through a shared
  mapping, and an immutable mapping kills the process with SIGBUS.)
- locked: another connection holds `BEGIN EXCLUSIVE` past the ledger's busy timeout.

The promise under each: nothing is forwarded without a record (the sandbox sees no send when the intent
could not be written) and the agent gets a clear error; once Hail has answered, the answer is not lost:
hail-guard retries it into the ledger, logging `outcome_not_recorded` with the provider id, and when the
storage comes back the send is not repeated and reconcile finds the one accepted message.
"""

from __future__ import annotations

import errno
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator, MutableMapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest
from mcp import types
from structlog.testing import capture_logs

from hail_guard.app import open_proxy
from hail_guard.config import LedgerSettings, Settings, UpstreamSettings
from hail_guard.errors import LedgerUnavailable
from hail_guard.models import State
from hail_guard.policy import LEDGER_UNAVAILABLE
from tests.campaigns.test_network_faults import KEY, Rig, guard_view, on_first_send, open_rig
from tests.conftest import email, missing, text
from tests.tcp_faults import Fault, no_faults

BUSY_TIMEOUT_SECONDS = 0.1
LEASE_SECONDS = 0.5
"""Short, so that once hail-guard gave up recording, the lease has run out and reconcile may claim it."""
TMPFS_BYTES = 8 * 1024 * 1024


class StorageFault(Protocol):
    name: str
    ledger: Path

    def inflict(self) -> None: ...

    def mend(self) -> None: ...


class FullDisk:
    """The ledger on a small tmpfs; `inflict` fills the rest of it with another file."""

    name = "full"

    def __init__(self, disk: Path) -> None:
        self.ledger = disk / "ledger.db"
        self._filler = disk / "filler"

    def inflict(self) -> None:
        with self._filler.open("ab", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(64 * 1024))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            with suppress(OSError):  # the last page a smaller write still fits in
                while True:
                    filler.write(bytes(512))

    def mend(self) -> None:
        self._filler.unlink(missing_ok=True)


class ReadOnlyLedger:
    """The ledger file and its WAL made immutable: no one, root included, may write them."""

    name = "read_only"

    def __init__(self, folder: Path) -> None:
        self.ledger = folder / "ledger.db"

    def _files(self) -> list[str]:
        return [str(path) for path in (self.ledger, self.ledger.with_name("ledger.db-wal")) if path.exists()]

    def inflict(self) -> None:
        chattr("+i", *self._files())

    def mend(self) -> None:
        chattr("-i", *self._files())


class LockedLedger:
    """Another connection holds an exclusive transaction on the ledger."""

    name = "locked"

    def __init__(self, folder: Path) -> None:
        self.ledger = folder / "ledger.db"
        self._holder: sqlite3.Connection | None = None

    def inflict(self) -> None:
        self._holder = sqlite3.connect(self.ledger, isolation_level=None)
        self._holder.execute("BEGIN EXCLUSIVE")

    def mend(self) -> None:
        if self._holder is not None:
            self._holder.execute("ROLLBACK")
            self._holder.close()
            self._holder = None


def chattr(flag: str, *paths: str) -> None:
    try:
        done = subprocess.run(["chattr", flag, *paths], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise OSError("there is no `chattr` command here (Debian's e2fsprogs)") from None
    if done.returncode != 0:
        raise OSError(f"chattr {flag} failed: {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of TMPFS_BYTES mounted for this test only."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(disk)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        missing("a full disk needs a small tmpfs, and there is no `mount` command here (Debian's mount)")
    if mounted.returncode != 0:
        missing(f"a full disk needs a small tmpfs (root with CAP_SYS_ADMIN); mount said: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(params=["full", "read_only", "locked"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageFault]:
    fault: StorageFault
    if request.param == "full":
        fault = FullDisk(request.getfixturevalue("small_disk"))
    elif request.param == "read_only":
        fault = ReadOnlyLedger(tmp_path)
        _needs_chattr(tmp_path)
    else:
        fault = LockedLedger(tmp_path)
    try:
        yield fault
    finally:
        fault.mend()


def _needs_chattr(folder: Path) -> None:
    probe = folder / "chattr-probe"
    probe.write_text("")
    try:
        chattr("+i", str(probe))
    except OSError as exc:
        missing(f"an unwritable ledger needs `chattr +i` (CAP_LINUX_IMMUTABLE, a filesystem with it): {exc}")
    chattr("-i", str(probe))


@asynccontextmanager
async def open_storage_rig(tmp_path: Path, storage: StorageFault, fault: Fault | None = None) -> AsyncIterator[Rig]:
    """hail-guard on `storage.ledger`, reaching the sandbox through a proxy that applies `fault` to the first send."""
    async with open_rig(
        tmp_path,
        on_first_send(fault) if fault is not None else no_faults,
        ledger_path=storage.ledger,
        busy_timeout_seconds=BUSY_TIMEOUT_SECONDS,
        timeout_seconds=10.0,
        lease_seconds=LEASE_SECONDS,
    ) as rig:
        yield rig


def expected_error(storage: StorageFault) -> str:
    return {
        "full": "is full: free space",
        "read_only": "its storage is read-only or failing",
        "locked": "stayed locked past the busy timeout",
    }[storage.name]


async def test_when_the_intent_cannot_be_recorded_nothing_is_forwarded_and_the_agent_is_told(
    tmp_path: Path, storage: StorageFault
) -> None:
    async with open_storage_rig(tmp_path, storage) as rig:
        with anyio.fail_after(20), capture_logs() as logs:
            storage.inflict()
            refused = await rig.harness.call("send_email", email())
            storage.mend()
            assert refused.is_error
            assert text(refused) == LEDGER_UNAVAILABLE  # the agent is told it failed, not where the ledger is
            assert expected_error(storage) in next(e["error"] for e in logs if e["event"] == "call_failed")
            assert rig.wire_sends() == 0
            assert rig.sandbox.outbox == []
            assert await rig.harness.ledger.list_operations() == []  # no half-written intent either

            again = await rig.harness.call("send_email", email())  # the storage is back: it goes, once
        assert guard_view(again)["state"] == "accepted"
        assert rig.outbox_keys() == {KEY: 1}


async def test_on_a_read_only_ledger_hail_guard_refuses_to_start_or_to_send_saying_why(tmp_path: Path) -> None:
    _needs_chattr(tmp_path)
    storage = ReadOnlyLedger(tmp_path)
    outbox = tmp_path / "outbox.jsonl"
    settings = Settings(
        ledger=LedgerSettings(url=f"sqlite:///{storage.ledger}", busy_timeout_seconds=BUSY_TIMEOUT_SECONDS),
        upstream=UpstreamSettings(sandbox_outbox=str(outbox), timeout_seconds=10),
    )
    with anyio.fail_after(20):
        async with open_proxy(settings):
            pass  # the ledger is created and migrated, then closed
        storage.inflict()
        try:
            async with open_proxy(settings) as opened:
                with capture_logs() as logs:
                    refused = await opened.proxy.call("send_email", email())
                assert text(refused) == LEDGER_UNAVAILABLE
                [failed] = [entry for entry in logs if entry["event"] == "call_failed"]
                assert "is read-only: make the file and its folder writable" in failed["error"]
        except LedgerUnavailable as exc:  # refusing to start is as good: nothing can be sent unrecorded
            assert "is read-only: make the file and its folder writable" in str(exc)  # noqa: PT017
        finally:
            storage.mend()
    assert not outbox.exists() or outbox.read_text() == ""


async def agent_send(rig: Rig, results: list[types.CallToolResult]) -> None:
    results.append(await rig.harness.call("send_email", email()))


async def answer_held(rig: Rig) -> None:
    """Return once the sandbox has accepted the first send and the proxy holds its answer back."""
    seen = await rig.link.next_call("send_email")
    await seen.answered.wait()


def not_recorded_signal() -> tuple[anyio.Event, Any]:
    """An event set when hail-guard logs `outcome_not_recorded`, and the structlog processor that sets it."""
    seen = anyio.Event()

    def processor(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if event.get("event") == "outcome_not_recorded":
            seen.set()
        return event

    return seen, processor


async def test_an_answer_that_cannot_be_recorded_is_retried_into_the_ledger_once_the_storage_is_back(
    tmp_path: Path, storage: StorageFault
) -> None:
    release = anyio.Event()
    async with open_storage_rig(tmp_path, storage, Fault("delay", "after", release=release)) as rig:
        not_recorded, processor = not_recorded_signal()
        results: list[types.CallToolResult] = []
        with anyio.fail_after(30), capture_logs(processors=[processor]) as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent_send, rig, results)
                await answer_held(rig)
                storage.inflict()
                release.set()  # Hail's answer reaches hail-guard, which cannot write it down
                await not_recorded.wait()
                storage.mend()
            retry = await rig.harness.call("send_email", email())

        [sent] = rig.sandbox.outbox
        [first] = results
        assert guard_view(first)["state"] == "accepted"
        assert guard_view(first)["replayed"] is False
        loud = [entry for entry in logs if entry["event"] == "outcome_not_recorded"]
        assert {(entry["log_level"], entry["provider_id"], entry["key"]) for entry in loud} == {
            ("error", sent["id"], KEY)
        }
        assert guard_view(retry)["replayed"] is True
        assert rig.wire_sends() == 1
        assert (await rig.harness.ledger.find_by_key(KEY)).provider_id == sent["id"]  # type: ignore[union-attr]


async def send_while_the_answer_cannot_be_recorded(
    rig: Rig, storage: StorageFault, release: anyio.Event
) -> types.CallToolResult:
    """The first send is accepted; the storage fails before its answer reaches hail-guard, and stays failed
    until every record attempt is spent. Returns what the agent was told."""
    results: list[types.CallToolResult] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_send, rig, results)
        await answer_held(rig)
        storage.inflict()
        release.set()
    [result] = results
    return result


async def test_an_answer_that_stays_unrecordable_is_not_lost_and_reconcile_finds_it_once_the_storage_is_back(
    tmp_path: Path, storage: StorageFault
) -> None:
    release = anyio.Event()
    async with open_storage_rig(tmp_path, storage, Fault("delay", "after", release=release)) as rig:
        with anyio.fail_after(40), capture_logs() as logs:
            first = await send_while_the_answer_cannot_be_recorded(rig, storage, release)
            storage.mend()
            retry = await rig.harness.call("send_email", email())
            operation = await rig.harness.ledger.find_by_key(KEY)
            assert operation is not None
            [settled] = await rig.guard.reconcile(operation.id)

        [sent] = rig.sandbox.outbox
        assert first.is_error
        assert expected_error(storage) not in text(first)  # the ledger's detail is the operator's (the log)
        assert "the ledger is unavailable" in text(first)
        assert any(expected_error(storage) in entry["error"] for entry in logs if entry["event"] == "call_failed")
        loud = [entry for entry in logs if entry["event"] == "outcome_not_recorded"]
        assert len(loud) > 1  # retried, not dropped at the first failure
        assert {(entry["log_level"], entry["provider_id"], entry["outcome"]) for entry in loud} == {
            ("error", sent["id"], State.ACCEPTED)
        }
        assert guard_view(retry)["replayed"] is True
        assert guard_view(retry)["state"] == "unknown"  # the lease ran out while `sending`: it may have left
        assert settled.state is State.ACCEPTED
        assert settled.provider_id == sent["id"]
        assert rig.outbox_keys() == {KEY: 1}
        assert rig.wire_sends() == 2  # the send and reconcile's same-key replay; the agent's retry stayed home


async def test_an_agent_whose_accepted_send_could_not_be_recorded_is_told_it_was_accepted(tmp_path: Path) -> None:
    storage = LockedLedger(tmp_path)
    release = anyio.Event()
    try:
        async with open_storage_rig(tmp_path, storage, Fault("delay", "after", release=release)) as rig:
            with anyio.fail_after(40):
                first = await send_while_the_answer_cannot_be_recorded(rig, storage, release)
    finally:
        storage.mend()
    [sent] = rig.sandbox.outbox
    assert sent["id"] in text(first)
    assert "accepted" in text(first).lower()
    assert "do NOT send it again" in text(first)
    assert first.structured_content is not None
    assert first.structured_content["provider_id"] == sent["id"]
