"""A PostgreSQL server for the test session, and a fresh database for each test.

The server is the one named by `HAIL_GUARD_TEST_POSTGRES_URL` (a role that may create databases),
or else a throwaway cluster started here: `initdb` into a temporary folder (in /dev/shm when it
has room), `pg_ctl start` on a free port of 127.0.0.1 with its unix socket in the same folder and
durability switched off for speed; stopped and deleted when the session ends. PostgreSQL refuses
to run as root, so as root (here and in CI) its binaries run as the `postgres` user.

Each test gets its own database, copied from a migrated template (`database()`), or empty.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

ENV_URL = "HAIL_GUARD_TEST_POSTGRES_URL"
SUPERUSER = "postgres"
PASSWORD_ROLE = "hail_guard_pw"
"""A role of the throwaway cluster that must log in with a password over TCP."""
PASSWORD = "correct-horse-battery"
START_SECONDS = 60
SHM_NEEDED_BYTES = 1 << 30
T = TypeVar("T")


@dataclass
class PostgresServer:
    admin_url: str
    """A URL to a database of the server as a role that may create databases."""
    template: str
    """A migrated database that each test's database is copied from."""
    password_login: bool
    """True when `PASSWORD_ROLE` exists and must give `PASSWORD` (the throwaway cluster)."""

    def url(self, database: str, *, user: str | None = None, password: str | None = None) -> str:
        parts = urlsplit(self.admin_url)
        netloc = parts.netloc
        if user is not None:
            host = netloc.rsplit("@", 1)[-1]
            netloc = f"{user}:{password}@{host}" if password is not None else f"{user}@{host}"
        return urlunsplit(parts._replace(netloc=netloc, path=f"/{database}"))

    @asynccontextmanager
    async def database(self, *, migrated: bool = True, options: str = "") -> AsyncIterator[str]:
        """A new database (a copy of the migrated template, or empty), dropped afterwards; yields its URL.

        `options` go to CREATE DATABASE (`OWNER ...`, `ENCODING ...`).
        """
        name = f"hg_test_{uuid.uuid4().hex[:16]}"
        template = self.template if migrated else "template0"
        await self.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}" {options}')
        try:
            yield self.url(name)
        finally:
            await self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    async def execute(self, sql: str) -> None:
        import asyncpg  # optional: the `postgres` extra

        db = await asyncpg.connect(self.admin_url)
        try:
            await db.execute(sql)
        finally:
            await db.close()


def missing_reason() -> str | None:
    """Why no PostgreSQL server can be had, or None."""
    if find_spec("asyncpg") is None:
        return "asyncpg is not installed: pip install -e '.[dev,postgres]'"
    if os.environ.get(ENV_URL) or find_bindir() is not None:
        return None
    return (
        f"PostgreSQL is not installed (no initdb via `pg_config --bindir` or /usr/lib/postgresql/*/bin) and "
        f"{ENV_URL} is not set: install PostgreSQL (apt-get install postgresql) or point {ENV_URL} at a server"
    )


def find_bindir() -> Path | None:
    """The folder holding initdb and pg_ctl."""
    candidates: list[Path] = []
    if pg_config := shutil.which("pg_config"):
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if found.returncode == 0:
            candidates.append(Path(found.stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    return next((c for c in candidates if (c / "initdb").exists() and (c / "pg_ctl").exists()), None)


@contextmanager
def postgres_server(*, durable: bool = False) -> Iterator[PostgresServer]:
    """The server named by the environment, or a throwaway cluster; with a migrated template database.

    `durable` (the benchmarks): a cluster on disk with PostgreSQL's durable defaults (`fsync`,
    `synchronous_commit` and `full_page_writes` on), as a ledger is run; the tests' is fast instead."""
    if url := os.environ.get(ENV_URL):
        with _template(url, password_login=False) as server:
            yield server
        return
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError(missing_reason())
    with throwaway_cluster(bindir, durable=durable) as url, _template(url, password_login=True) as server:
        run(server.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'"))
        yield server


@contextmanager
def _template(admin_url: str, *, password_login: bool) -> Iterator[PostgresServer]:
    from hail_guard.ledger.postgres import migrate  # optional: the `postgres` extra

    server = PostgresServer(admin_url, f"hg_template_{uuid.uuid4().hex[:12]}", password_login)
    run(server.execute(f"CREATE DATABASE \"{server.template}\" TEMPLATE template0 ENCODING 'UTF8'"))
    try:
        run(migrate(server.url(server.template)))
        yield server
    finally:
        run(server.execute(f'DROP DATABASE IF EXISTS "{server.template}" WITH (FORCE)'))


@contextmanager
def throwaway_cluster(bindir: Path, *, durable: bool = False) -> Iterator[str]:
    """initdb + pg_ctl start in a temporary folder; yields the superuser's URL; stops and deletes it all."""
    folder = Path(tempfile.mkdtemp(prefix="hail-guard-pg-", dir=None if durable else _fast_folder()))
    data = folder / "data"
    try:
        _chown_to_postgres(folder)
        _as_postgres(
            [str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C", "-N"]
        )
        (data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
        )
        port = _start(bindir, data, folder, durable=durable)
        try:
            yield f"postgresql://{SUPERUSER}@127.0.0.1:{port}/postgres"
        finally:
            _as_postgres([str(bindir / "pg_ctl"), "stop", "-D", str(data), "-m", "immediate", "-w"], check=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fast_folder() -> str | None:
    """Memory (/dev/shm) when there is room: creating a database per test is then ~20x faster."""
    shm = Path("/dev/shm")  # noqa: S108  (mkdtemp makes a private, unpredictable folder in it)
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > SHM_NEEDED_BYTES:
        return str(shm)
    return None  # the system's temporary folder


FAST = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c wal_level=minimal -c max_wal_senders=0"
"""The tests' cluster forgets commits on a power cut, which a test never meets; a ledger must never run so."""


def _start(bindir: Path, data: Path, folder: Path, *, durable: bool = False) -> int:
    """Start on a free port (another process may take it in between: then try another)."""
    for _ in range(3):
        port = _free_port()
        options = (
            f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={folder} "
            f"-c max_connections=200 -c max_wal_size=256MB {'' if durable else FAST}"
        )
        log = folder / "postgres.log"
        pg_ctl = [str(bindir / "pg_ctl"), "start", "-w", "-t", str(START_SECONDS), "-D", str(data), "-l", str(log)]
        started = _as_postgres([*pg_ctl, "-o", options], check=False)
        if started.returncode == 0:
            return port
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"the throwaway PostgreSQL did not start: {started.stdout}{started.stderr}\n{tail}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _as_postgres(command: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL binary: as the `postgres` user when we are root."""
    user: dict[str, Any] = {}
    if os.geteuid() == 0:
        account = _postgres_account()
        user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": [], "cwd": "/"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=START_SECONDS, **user)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done


def _chown_to_postgres(folder: Path) -> None:
    if os.geteuid() == 0:
        account = _postgres_account()
        os.chown(folder, account.pw_uid, account.pw_gid)


def _postgres_account() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SUPERUSER)
    except KeyError:
        raise RuntimeError(
            f"running as root, the throwaway PostgreSQL needs a `{SUPERUSER}` user to run as (PostgreSQL refuses "
            "root): install the postgresql package, which creates it, or run the tests as another user"
        ) from None


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code, on its own loop in its own thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
