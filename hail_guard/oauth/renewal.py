"""A stored sign-in kept usable without a person: `SignIn`, the credentials of `serve` and `worker`.

`upstream` asks a `SignIn` for a bearer token before each HTTP request and for another after a 401
(it fits `upstream.Credentials`). The tokens are read from the `TokenStore` once, then used from memory;
they are renewed with the refresh token when less than a margin of their life is left, and once after
a 401. The renewal is the MCP SDK's own refresh grant (`OAuthClientProvider`: the token endpoint from the
stored metadata, RFC 8707 `resource`, the registered client's token-endpoint authentication): its auth
flow is driven up to the request it would authenticate, which is never sent, and what it stored is kept.

Around the SDK, what a proxy without a person needs:
* processes share a sign-in: a renewal holds the store's lock and re-reads the file first, so a second
  process adopts the first one's new tokens instead of spending a rotated refresh token again;
* the expiry is kept on disk as a time (the SDK keeps only `expires_in`, in memory);
* a renewal, once sent, is seen through (shielded): a rotated refresh token is never lost to a cancel;
* a refused renewal (revoked grant, expired refresh token) never becomes an interactive sign-in: it sets
  `problem`, every request is then refused here (nothing sent), and a new `hail-guard login` is picked up
  from the store without a restart.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime

import anyio
import anyio.to_thread
import httpx2
import structlog
from mcp.client.auth import OAuthClientProvider, OAuthFlowError
from mcp.shared.auth import OAuthToken
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER

from hail_guard.errors import SignInRequired, UpstreamUnavailable
from hail_guard.oauth.store import PLACEHOLDER_REDIRECT, Held, SignInRecord, TokenStore, client_metadata

log = structlog.get_logger(__name__)

RENEW_MARGIN_SECONDS = 300.0
"""Tokens are renewed when less than this (or a tenth of their life, if that is shorter) is left."""
RENEW_TIMEOUT_SECONDS = 15.0
LOGIN_NEEDED = "an operator must run `hail-guard login`"
_PROBE_PROTOCOL = "2025-11-25"
_ERROR_CODE = re.compile(r"^[a-z_]{1,64}$")


class SignIn:
    """The tokens `hail-guard login` stored for one upstream, renewed as needed (see the module docstring)."""

    def __init__(
        self,
        store: TokenStore,
        *,
        clock: Callable[[], float] = time.time,
        timeout_seconds: float = RENEW_TIMEOUT_SECONDS,
    ) -> None:
        self.store = store
        self._clock, self._timeout = clock, timeout_seconds
        self._record: SignInRecord | None = None
        self._loaded = False
        self._refused: OAuthToken | None = None
        self._problem: str | None = None
        self._lock = anyio.Lock()

    @property
    def problem(self) -> str | None:
        """Why nothing can be sent until an operator signs in again; None while the sign-in works."""
        return self._problem

    async def bearer(self) -> str | None:
        """The access token to send (renewed first if it is about to expire); None when never signed in."""
        if not self._loaded or self._problem is not None:
            await self._reload()
        record = self._record
        if record is None:
            return None
        if self._due(record):
            record = await self._renew(record.tokens.access_token)
        return record.tokens.access_token

    async def renew(self, rejected: str | None) -> str:
        """After Hail refused `rejected` (HTTP 401): another token, re-read or renewed; else `SignInRequired`."""
        return (await self._renew(rejected)).tokens.access_token

    def refused(self, token: str) -> str:
        """Hail refused a token just renewed or re-read: only a new sign-in helps. Returns why, for the agent."""
        if self._record is not None and self._record.tokens.access_token == token:
            self._refuse(self._record.tokens, "Hail refused a freshly renewed token")
        return self._problem or self._not_signed_in()

    async def _reload(self) -> None:
        record = await anyio.to_thread.run_sync(self.store.load)
        self._loaded = True
        if record is None or (self._refused is not None and record.tokens == self._refused):
            if self._problem is not None:
                raise SignInRequired(self._problem)
            return
        if self._problem is not None:
            log.info("signin_restored", upstream=self.store.key, account=record.account)
        self._adopt(record)

    async def _renew(self, rejected: str | None) -> SignInRecord:
        async with self._lock:  # one renewal at a time in this process; the tasks that waited find it done
            held = self._record
            if held is not None and held.tokens.access_token != rejected and not self._due(held):
                return held
            with anyio.CancelScope(shield=True):  # bounded by the HTTP timeouts and the lock holder's
                renewed = await self._renew_holding_the_lock(rejected)
            return renewed  # noqa: RET504  (returning inside the shield reads to mypy as a missing return)

    async def _renew_holding_the_lock(self, rejected: str | None) -> SignInRecord:
        async with self.store.locked():
            current = await anyio.to_thread.run_sync(self.store.load)
            if current is None:
                self._record, self._problem = None, self._not_signed_in()
                raise SignInRequired(self._problem)
            if self._refused is not None and current.tokens == self._refused and self._problem is not None:
                raise SignInRequired(self._problem)
            if current.tokens.access_token != rejected and not self._due(current):
                self._adopt(current)  # another process renewed it, or an operator signed in again
                return current
            renewed = await self._refresh(current)
            await anyio.to_thread.run_sync(self.store.save, renewed)
        self._adopt(renewed)
        log.info("signin_renewed", upstream=self.store.key, expires_at=renewed.expires_at)
        return renewed

    async def _refresh(self, record: SignInRecord) -> SignInRecord:
        """The SDK's refresh grant for `record`; `SignInRequired` when the authorization server refuses it."""
        uris = record.client.redirect_uris
        held = Held(record.tokens, record.client)
        metadata = client_metadata(str(uris[0]) if uris else PLACEHOLDER_REDIRECT)  # unused by a refresh
        provider = OAuthClientProvider(record.upstream, metadata, held)
        provider.context.oauth_metadata = record.authorization_server
        provider.context.protected_resource_metadata = record.resource
        provider.context.token_expiry_time = 1.0  # long past (0 would read as "never expires"): it renews first
        why = await self._drive(provider, record.upstream)
        if held.stored is None:
            self._refuse(record.tokens, why)
            raise SignInRequired(self._problem)
        lifetime = held.stored.expires_in
        expires_at = self._clock() + lifetime if lifetime is not None else None
        return record.model_copy(update={"tokens": held.stored, "expires_at": expires_at, "renewed_at": _now()})

    async def _drive(self, provider: OAuthClientProvider, upstream: str) -> str:
        """Run the provider's flow up to the request it would authenticate (not sent); return what refused it."""
        probe = httpx2.Request("POST", upstream, headers={MCP_PROTOCOL_VERSION_HEADER: _PROBE_PROTOCOL})
        why = "no refresh token was issued"
        try:
            async with httpx2.AsyncClient(timeout=self._timeout) as http:
                flow = provider.async_auth_flow(probe)
                try:
                    outgoing = await flow.__anext__()
                    while outgoing is not probe:
                        response = await http.send(outgoing)
                        if response.status_code >= 500 or response.status_code == 429:
                            raise UpstreamUnavailable(
                                f"the authorization server answered HTTP {response.status_code} when hail-guard "
                                "renewed its sign-in; nothing was sent"
                            )
                        why = _refusal(response)
                        outgoing = await flow.asend(response)
                finally:
                    await flow.aclose()
        except httpx2.HTTPError as exc:
            raise UpstreamUnavailable(
                f"could not reach the authorization server to renew hail-guard's sign-in ({type(exc).__name__}); "
                "nothing was sent"
            ) from None
        except OAuthFlowError as exc:
            return str(exc)
        return why

    def _due(self, record: SignInRecord) -> bool:
        if record.expires_at is None:
            return False
        margin = min(RENEW_MARGIN_SECONDS, (record.tokens.expires_in or 0) / 10)
        return self._clock() >= record.expires_at - margin

    def _adopt(self, record: SignInRecord) -> None:
        self._record, self._refused, self._problem = record, None, None

    def _refuse(self, tokens: OAuthToken, why: str) -> None:
        self._refused = tokens
        self._problem = (
            f"hail-guard's sign-in to Hail at {self.store.key} is no longer accepted ({why}), so nothing was sent: "
            f"{LOGIN_NEEDED}"
        )
        log.warning("signin_refused", upstream=self.store.key, reason=why)

    def _not_signed_in(self) -> str:
        return f"hail-guard is not signed in to Hail at {self.store.key}: {LOGIN_NEEDED} (or give it an API key)"


def _refusal(response: httpx2.Response) -> str:
    """Why a token endpoint refused: its OAuth error code when it gave a plain one, else the HTTP status."""
    try:
        code = json.loads(response.content).get("error")
    except (ValueError, AttributeError):
        code = None
    if isinstance(code, str) and _ERROR_CODE.match(code):
        return f"the authorization server refused to renew it: {code}"
    return f"the authorization server refused to renew it: HTTP {response.status_code}"


def _now() -> datetime:
    return datetime.now(UTC)
