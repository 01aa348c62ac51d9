"""Where sign-ins are kept: one JSON file per upstream in a private folder, and a lock file beside it.

    <sign-in folder>/                      0700; default: `signin/` in the user's data folder (beside the ledger)
        mcp.hail.so-3f2a9c1b7d4e.json      0600: the tokens, the registered client, the servers' metadata
        mcp.hail.so-3f2a9c1b7d4e.lock      0600: `flock`ed while a process renews or replaces the tokens

Writes are atomic (a new file, fsynced, renamed over the old one), so a reader never sees half a file
and needs no lock. Whoever renews or replaces the tokens holds the lock and re-reads the file first:
two processes never spend the same refresh token. `load`, `save` and `forget` block on the disk: call
them from a worker thread, never on the event loop. POSIX only (`fcntl`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import anyio.to_thread
import httpx2
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)
from pydantic import AnyUrl, BaseModel, ConfigDict, Field, ValidationError

from hail_guard.errors import ConfigError

FOLDER_MODE = 0o700
FILE_MODE = 0o600
PLACEHOLDER_REDIRECT = "http://127.0.0.1/callback"
"""The redirect URI of a client record that lists none (a refresh or a revocation never uses it)."""


def default_folder() -> Path:
    import platformdirs  # here: only a sign-in left in its default place needs it

    return Path(platformdirs.user_data_dir("hail-guard")) / "signin"


def upstream_key(url: str) -> str:
    """One name for every spelling of an upstream's URL: no userinfo, query or trailing slash; host in lower case."""
    parsed = httpx2.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"sign-in needs an http:// or https:// upstream URL, not {url!r}")
    return f"{parsed.scheme}://{parsed.netloc.decode().lower()}{parsed.path.rstrip('/')}"


class SignInRecord(BaseModel):
    """One upstream's sign-in as stored. Secret: `tokens` (and the client's secret, if it was issued one)."""

    model_config = ConfigDict(extra="ignore")

    upstream: str
    """The URL signed in to, as given to `login`."""
    tokens: OAuthToken = Field(repr=False)
    expires_at: float | None = None
    """When the access token expires (Unix time); None when the authorization server did not say."""
    client: OAuthClientInformationFull = Field(repr=False)
    authorization_server: OAuthMetadata | None = None
    resource: ProtectedResourceMetadata | None = None
    account: str | None = None
    """Who signed in, as the upstream's `whoami` tool told it; None when it has none."""
    signed_in_at: datetime
    renewed_at: datetime | None = None


class TokenStore:
    """The stored sign-in of one upstream (see the module docstring)."""

    def __init__(self, upstream: str, folder: str | os.PathLike[str] | None = None) -> None:
        self.upstream = upstream
        self.key = upstream_key(upstream)
        self.folder = Path(folder).expanduser() if folder is not None else default_folder()
        host = re.sub(r"[^a-z0-9.-]+", "-", httpx2.URL(self.key).host) or "upstream"
        name = f"{host}-{hashlib.sha256(self.key.encode()).hexdigest()[:12]}"
        self.path = self.folder / f"{name}.json"
        self.lock_path = self.folder / f"{name}.lock"

    def __repr__(self) -> str:
        return f"TokenStore({self.key!r}, path={str(self.path)!r})"

    def load(self) -> SignInRecord | None:
        """The stored sign-in, or None; `ConfigError` for a file others can read or that cannot be read."""
        try:
            with open(self.path, encoding="utf-8") as file:
                if os.fstat(file.fileno()).st_mode & 0o077:
                    raise ConfigError(
                        f"the sign-in file {self.path} can be read by other users: delete it and run "
                        "`hail-guard login` again"
                    )
                text = file.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"cannot read the sign-in file {self.path}: {exc.strerror}") from None
        try:
            return SignInRecord.model_validate_json(text)
        except ValidationError:  # its text would quote the file, tokens included: not chained
            raise ConfigError(
                f"the sign-in file {self.path} is not one hail-guard can read: run `hail-guard login` again"
            ) from None

    def save(self, record: SignInRecord) -> None:
        """Replace the stored sign-in atomically and durably (mode 0600, in a 0700 folder)."""
        self._make_folder()
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with open(descriptor, "w", encoding="utf-8") as file:
                file.write(record.model_dump_json(indent=2))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
            self._sync_folder()
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise ConfigError(f"cannot write the sign-in file {self.path}: {exc.strerror}") from None

    def forget(self) -> bool:
        """Delete the stored sign-in; False when there was none. The lock file stays (others may hold it)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise ConfigError(f"cannot delete the sign-in file {self.path}: {exc.strerror}") from None
        self._sync_folder()
        return True

    @asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """Hold the lock shared by every process using this sign-in.

        Waiting for it is not cancellable (a thread waits); whoever holds it renews within a bounded time.
        """
        descriptor = await anyio.to_thread.run_sync(self._lock)
        try:
            yield
        finally:
            os.close(descriptor)  # releases the lock; no disk wait

    def _lock(self) -> int:
        self._make_folder()
        try:
            descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            raise ConfigError(f"cannot open the sign-in lock {self.lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def _make_folder(self) -> None:
        try:
            self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            if self.folder.stat().st_mode & 0o777 != FOLDER_MODE:
                self.folder.chmod(FOLDER_MODE)
        except OSError as exc:
            raise ConfigError(f"cannot make the sign-in folder {self.folder} private: {exc.strerror}") from None

    def _sync_folder(self) -> None:
        descriptor = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class Held:
    """The SDK's `TokenStorage` for one flow, in memory: it reads what it is given; what it stores is kept here."""

    def __init__(self, tokens: OAuthToken | None = None, client: OAuthClientInformationFull | None = None) -> None:
        self.tokens, self.client = tokens, client
        self.stored: OAuthToken | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = self.stored = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


def client_metadata(redirect_uri: str) -> OAuthClientMetadata:
    """What hail-guard registers as (RFC 7591): a public native client with a loopback redirect (RFC 8252)."""
    return OAuthClientMetadata(
        client_name="hail-guard",
        redirect_uris=[AnyUrl(redirect_uri)],
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
        token_endpoint_auth_method="none",  # noqa: S106  (a method's name, not a password)
    )
