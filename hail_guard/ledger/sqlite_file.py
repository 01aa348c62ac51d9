"""The SQLite ledger's file: created private, whole and durable, refused on network filesystems, copied online.

`create_private` makes a new ledger file only where no file is: 0600 in a 0700 folder, a database from
its first byte (made under a temporary name, then linked into place), its folder synced so the file
survives a power cut. So an empty file is never a ledger being made: `refuse_empty` refuses one, rather
than start a new ledger over what may have held every key and opt-out. `refuse_network_filesystem`
refuses a folder where SQLite's locks do not hold across hosts; `backup_file` copies a ledger in use into
a new file that never replaces another. `errors_mapped` is the one place sqlite3's and the file's errors
become ours, each saying what to do.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress

from hail_guard.errors import BadInput, HailGuardError, LedgerError, LedgerUnavailable

NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smbfs", "smb3", "afs", "ceph", "glusterfs", "lustre", "9p", "fuse.sshfs", "davfs"}
)
"""SQLite's locking is not reliable on these: several processes could each think they hold a claim."""


def filesystem_type(path: str, mounts: str) -> str | None:
    """The type of the filesystem holding `path`, from a `/proc/mounts`-style table."""
    target = os.path.realpath(path)
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > len(best):
            best, kind = mount_point, fields[2]
    return kind


def refuse_network_filesystem(path: str, mounts_file: str = "/proc/mounts") -> None:
    try:
        with open(mounts_file, encoding="utf-8") as file:
            mounts = file.read()
    except OSError:
        return  # not Linux: nothing to read the filesystem type from
    kind = filesystem_type(os.path.dirname(os.path.abspath(path)), mounts)
    if kind in NETWORK_FILESYSTEMS:
        raise LedgerUnavailable(
            f"the ledger {path} is on a network filesystem ({kind}), where SQLite's locks do not hold across "
            'hosts; keep it on a local disk, or share one PostgreSQL ledger ([ledger] url = "postgresql://...")'
        )


def create_private(path: str) -> bool:
    """Create a new, empty ledger file 0600 (its folder 0700) unless a file is there; True when this call made it.

    The file appears whole: an SQLite database in WAL mode (its header written and synced) is made under a
    temporary name and hard-linked into place, which never replaces a file that appeared meanwhile (another
    process starting at once: then that one is used); the folder is synced, so the new name survives a power
    cut as the commits into it do. A folder is refused (SQLite would say only "unable to open")."""
    if os.path.isdir(path):
        raise BadInput(f"the ledger {path} is a folder: name a file in it, such as {os.path.join(path, 'ledger.db')}")
    if path == ":memory:" or os.path.exists(path):
        return False
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".new", dir=folder)
    os.close(descriptor)  # created 0600
    try:
        with closing(sqlite3.connect(temporary)) as db:
            db.execute("PRAGMA journal_mode = WAL")  # writes (and syncs) the header: a database from its first byte
        created = _link_unless_there(temporary, path)
    finally:
        for leftover in (temporary, f"{temporary}-wal", f"{temporary}-shm", f"{temporary}-journal"):
            with suppress(FileNotFoundError):
                os.remove(leftover)
    _sync_folder(folder)
    return created


def _link_unless_there(temporary: str, path: str) -> bool:
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        return _copy_unless_there(temporary, path)  # a filesystem without hard links
    return True


def _copy_unless_there(temporary: str, path: str) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "wb") as file, open(temporary, "rb") as source:
        file.write(source.read())
        file.flush()
        os.fsync(file.fileno())
    return True


def refuse_empty(path: str) -> None:
    """An empty file where the ledger should be is refused: it holds none of a ledger's keys or opt-outs, and a
    new ledger is only ever made where no file is (`create_private`)."""
    if path != ":memory:" and os.path.getsize(path) == 0:
        raise LedgerUnavailable(
            f"the ledger {path} is an empty file (0 bytes): it holds no keys and no opt-outs, so hail-guard will not "
            "start a new ledger in it. If it held your ledger, restore the last backup there (`hail-guard backup` "
            "makes them); to start a new ledger, delete the empty file and run again"
        )


def backup_file(source: str, path: str) -> int:
    """Copy into a new, uniquely named file beside `path`, then link it there: a backup is whole or
    absent, and never replaces a file (not one that was there, nor one that appears meanwhile)."""
    target = os.path.abspath(path)
    if os.path.lexists(target):
        raise BadInput(f"{path} already exists; a backup never overwrites a file: give a new path")
    folder = os.path.dirname(target)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".partial", dir=folder)
    os.close(descriptor)  # created 0600, and only ever ours: mkstemp refuses a name that exists
    try:
        count = _copy_online(source, temporary)
        _link_new(temporary, target, path)
    finally:
        for leftover in (temporary, f"{temporary}-journal"):
            with suppress(FileNotFoundError):
                os.remove(leftover)
    _sync_folder(folder)
    return count


def _link_new(temporary: str, target: str, path: str) -> None:
    """Give the finished copy its name; a hard link fails, rather than replace, when the name is taken."""
    try:
        os.link(temporary, target)
    except FileExistsError:
        raise LedgerError(f"{path} appeared while the backup was being written; it was left as it is") from None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise LedgerError(
                f"cannot back up to {path}: its filesystem has no hard links, which a backup needs to be sure never "
                "to replace a file; back up to a folder on a local filesystem"
            ) from exc
        raise


def _sync_folder(folder: str) -> None:
    """The backup's name is durable too (the copy itself was synced by SQLite's commit)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _copy_online(source: str, target: str) -> int:
    """SQLite's online backup of `source` into `target` (one self-contained file), checked; returns its operations.

    A reader of its own, so writers (in WAL mode, in any process) go on while it copies.
    """
    with closing(sqlite3.connect(source)) as origin, closing(sqlite3.connect(target)) as copy:
        origin.backup(copy)
        copy.execute("PRAGMA journal_mode = DELETE")
        check = copy.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise sqlite3.DatabaseError(f"the copy failed its integrity check: {check}")
        row = copy.execute("SELECT COUNT(*) FROM operations").fetchone()
    return int(row[0])


@contextmanager
def errors_mapped(path: str) -> Iterator[None]:
    """The one place sqlite3, aiosqlite (`ValueError` on a closed connection) and file errors become ours."""
    try:
        yield
    except HailGuardError:
        raise
    except sqlite3.OperationalError as exc:
        raise LedgerUnavailable(_explain(str(exc), path)) from exc
    except sqlite3.DatabaseError as exc:  # what the file holds: damaged, or no database at all
        raise LedgerUnavailable(damaged(str(exc), path)) from exc
    except (sqlite3.Error, sqlite3.Warning, OSError, ValueError) as exc:
        raise LedgerUnavailable(f"the ledger {path} cannot be used: {exc}") from exc


def damaged(message: str, path: str) -> str:
    """What to do about a file that is no ledger, or a damaged one."""
    if "not a database" in message.lower():
        return (
            f"{path} is not a hail-guard ledger (not an SQLite database: {message}); check [ledger] url. A new "
            "ledger is only ever made where no file is"
        )
    return (
        f"the ledger {path} is damaged ({message}): stop every hail-guard that uses it, keep a copy of the file, "
        f"then restore the last backup (`hail-guard backup` makes them), or salvage it with `sqlite3 {path} .recover`"
    )


def _explain(message: str, path: str) -> str:
    lowered = message.lower()
    if "locked" in lowered or "busy" in lowered:
        return (
            f"the ledger {path} stayed locked past the busy timeout; another process holds it: "
            "retry, or raise [ledger] busy_timeout_seconds"
        )
    if "readonly" in lowered or "read-only" in lowered:
        return f"the ledger {path} is read-only: make the file and its folder writable by this user"
    if "disk i/o" in lowered:
        return (
            f"cannot write the ledger {path} ({message}): its storage is read-only or failing; "
            "check the disk and the file's permissions, then retry"
        )
    if "full" in lowered:
        return f"the disk holding the ledger {path} is full: free space, then retry"
    if "unable to open" in lowered:
        return f"cannot open the ledger {path}: check that the folder exists and is writable"
    return f"the ledger {path} failed: {message}"
