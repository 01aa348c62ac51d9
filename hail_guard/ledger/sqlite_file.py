"""The SQLite ledger's file: created private and durable, refused on network filesystems, copied online.

`create_private` makes the file 0600 in a 0700 folder and syncs the folder, so the file itself survives a
power cut; `refuse_network_filesystem` refuses a folder where SQLite's locks do not hold across hosts;
`backup_file` copies a ledger in use into a new file that never replaces another.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from contextlib import closing, suppress

from hail_guard.errors import BadInput, LedgerError, LedgerUnavailable

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


def create_private(path: str) -> None:
    """Create the ledger file 0600 (its folder 0700) unless it exists; its folder is synced, so the new name
    survives a power cut as the commits into it do. A folder is refused (SQLite would say only "unable to open")."""
    if os.path.isdir(path):
        raise BadInput(f"the ledger {path} is a folder: name a file in it, such as {os.path.join(path, 'ledger.db')}")
    if path == ":memory:" or os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    _sync_folder(folder)


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
