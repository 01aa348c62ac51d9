"""`hail-guard login` and `logout`: the sign-in a person does once, kept in the `TokenStore`.

`login` runs the MCP SDK's OAuth client (`OAuthClientProvider`) against the upstream: an `initialize`
without a token gets HTTP 401 with `WWW-Authenticate: Bearer resource_metadata=...`, and the provider
discovers the protected resource's metadata (RFC 9728) and its authorization server's (RFC 8414),
registers a client when it has none (RFC 7591) and runs the authorization-code flow with PKCE (S256),
`state` and `resource` (RFC 8707). hail-guard adds the loopback redirect that receives the code (RFC 8252:
on 127.0.0.1, at the port of the kept registration when that port is free, else a new registration on
any port) and what is kept: tokens, client, both servers' metadata, when the access token expires, and
who signed in (from the upstream's `whoami` tool, when it has one).

`logout` forgets the tokens and revokes the grant (RFC 7009) where the authorization server offers it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread
import httpx2
import structlog
from mcp.client.auth import OAuthClientProvider, OAuthFlowError
from mcp.client.auth.oauth2 import OAuthContext
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER

from hail_guard.errors import ConfigError, HailGuardError, UpstreamError
from hail_guard.oauth.loopback import receiving
from hail_guard.oauth.store import PLACEHOLDER_REDIRECT, Held, SignInRecord, TokenStore, client_metadata
from hail_guard.upstream import UpstreamTarget, connect_upstream
from hail_guard.urls import masked

log = structlog.get_logger(__name__)

Show = Callable[[str], Awaitable[None]]
"""Given the authorization URL: open it in a browser, or print it for a person to open."""

LOGIN_WAIT_SECONDS = 300.0
HTTP_SECONDS = 30.0
_PROTOCOL = "2025-11-25"
_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": _PROTOCOL, "capabilities": {}, "clientInfo": {"name": "hail-guard", "version": "0"}},
}
_MCP_HEADERS = {"Accept": "application/json, text/event-stream", MCP_PROTOCOL_VERSION_HEADER: _PROTOCOL}


async def login(
    store: TokenStore,
    *,
    show: Show,
    port: int | None = None,
    wait_seconds: float = LOGIN_WAIT_SECONDS,
    clock: Callable[[], float] = time.time,
) -> SignInRecord:
    """Sign in to `store`'s upstream and keep the result; `show` is given the address a person must open.

    The browser comes back to 127.0.0.1:`port` (default: the kept registration's port if free, else any).
    """
    previous = await anyio.to_thread.run_sync(_load_quietly, store)
    async with receiving(port if port is not None else _kept_port(previous), required=port is not None) as callback:
        kept = previous.client if previous is not None and _registered(previous, callback.redirect_uri) else None
        held = Held(client=kept)
        provider = OAuthClientProvider(
            store.upstream,
            client_metadata(callback.redirect_uri),
            held,
            redirect_handler=callback.showing(show),
            callback_handler=callback.result,
        )
        await _challenge(provider, store, wait_seconds, hidden=lambda: callback.state)
    record = _signed_in(store, provider, held, clock())
    record.account = await _account(store.upstream, record.tokens.access_token)
    async with store.locked():  # not while a process renews the old tokens
        await anyio.to_thread.run_sync(store.save, record)
    log.info("signin_saved", upstream=store.key, account=record.account, expires_at=record.expires_at)
    return record


async def logout(store: TokenStore) -> str:
    """Forget the stored sign-in, revoked first where the authorization server allows; says what was done."""
    async with store.locked():
        record = await anyio.to_thread.run_sync(_load_quietly, store)
        forgotten = await anyio.to_thread.run_sync(store.forget)
    if not forgotten:
        return f"not signed in to {store.key}: nothing to forget"
    if record is None:
        return f"signed out of {store.key} (its sign-in file was unreadable and is deleted)"
    return f"signed out of {store.key}: forgotten here; {await _revoke(record)}"


def _signed_in(store: TokenStore, provider: OAuthClientProvider, held: Held, now: float) -> SignInRecord:
    """What the provider obtained, as kept; an error when the upstream never asked for a sign-in."""
    if held.stored is None or held.client is None:
        raise HailGuardError(
            f"{store.key} answered without asking for a sign-in: it needs none, or takes an API key instead"
        )
    lifetime = held.stored.expires_in
    return SignInRecord(
        upstream=store.upstream,
        tokens=held.stored,
        expires_at=now + lifetime if lifetime is not None else None,
        client=held.client,
        authorization_server=provider.context.oauth_metadata,
        resource=provider.context.protected_resource_metadata,
        signed_in_at=datetime.now(UTC),
    )


async def _challenge(
    provider: OAuthClientProvider, store: TokenStore, wait_seconds: float, *, hidden: Callable[[], str | None]
) -> None:
    """An `initialize` through the provider: its 401 sets off the whole sign-in, then it is sent again.
    `hidden()` (the sign-in's state) is never shown, even where the SDK's error repeats it."""
    try:
        with _sdk_flow_errors_unlogged(), anyio.fail_after(wait_seconds):
            async with (
                httpx2.AsyncClient(auth=provider, timeout=HTTP_SECONDS) as http,
                http.stream("POST", store.upstream, json=_INITIALIZE, headers=_MCP_HEADERS) as response,
            ):
                status = response.status_code
    except TimeoutError:
        raise HailGuardError(
            f"no sign-in came back within {wait_seconds / 60:g} minutes; run `hail-guard login` again"
        ) from None
    except OAuthFlowError as exc:
        said = masked(str(exc), {secret for secret in (hidden(),) if secret})
        raise HailGuardError(f"signing in to {store.key} failed: {said}") from None
    except httpx2.HTTPError as exc:
        raise HailGuardError(f"could not reach {store.key} to sign in ({type(exc).__name__}: {exc})") from None
    if status in (401, 403):
        raise HailGuardError(f"{store.key} refused the new sign-in (HTTP {status}); nothing was kept")


async def _account(upstream: str, token: str) -> str | None:
    """Who signed in, from the upstream's `whoami` tool; None when it has none or cannot say."""
    target = UpstreamTarget(kind="http", url=upstream, token=token)
    try:
        async with connect_upstream(target, timeout_seconds=HTTP_SECONDS, heartbeat_seconds=None) as upstream_:
            if "whoami" not in {tool.name for tool in await upstream_.list_tools()}:
                return None
            answer = await upstream_.call_tool("whoami", {})
    except UpstreamError as exc:
        log.warning("signin_account_unknown", upstream=upstream, error=str(exc))
        return None
    return _who(answer.structured_content)


def _who(payload: Any) -> str | None:
    """`email (organisation)` from a Hail-like `whoami` answer."""
    if not isinstance(payload, dict):
        return None
    user, org = payload.get("user"), payload.get("org")
    email = user.get("email") if isinstance(user, dict) else None
    name = org.get("name") if isinstance(org, dict) else None
    words = [str(email)] if email else []
    if name:
        words.append(f"({name})")
    return "".join(char for char in " ".join(words) if char.isprintable())[:200] or None


async def _revoke(record: SignInRecord) -> str:
    """Revoke the grant at the authorization server (RFC 7009), authenticated as the SDK authenticates."""
    endpoint = record.authorization_server.revocation_endpoint if record.authorization_server else None
    if endpoint is None:
        return "its authorization server offers no revocation, so the grant lasts until it expires"
    token, hint = (
        (record.tokens.refresh_token, "refresh_token")
        if record.tokens.refresh_token
        else (record.tokens.access_token, "access_token")
    )
    context = OAuthContext(record.upstream, client_metadata(_redirect(record)), Held(), None, None)
    context.client_info = record.client
    form, headers = context.prepare_token_auth(
        {"token": token, "token_type_hint": hint, "client_id": record.client.client_id},
        {"Content-Type": "application/x-www-form-urlencoded"},
    )
    try:
        async with httpx2.AsyncClient(timeout=HTTP_SECONDS) as http:
            response = await http.post(str(endpoint), data=form, headers=headers)
    except httpx2.HTTPError as exc:
        return f"the authorization server could not be told ({type(exc).__name__}), so the grant lasts until it expires"
    if response.status_code != 200:
        return f"the authorization server refused to revoke it (HTTP {response.status_code})"
    return "the authorization server revoked the grant"


def _redirect(record: SignInRecord) -> str:
    uris = record.client.redirect_uris
    return str(uris[0]) if uris else PLACEHOLDER_REDIRECT


class _SdkFlowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "OAuth flow error"


@contextmanager
def _sdk_flow_errors_unlogged() -> Iterator[None]:
    """The SDK logs a failed sign-in with its traceback; `login` raises it as one clear error instead."""
    logger, quiet = logging.getLogger("mcp.client.auth.oauth2"), _SdkFlowError()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _load_quietly(store: TokenStore) -> SignInRecord | None:
    """The stored sign-in, or None when there is none or it is unreadable (it is about to be replaced)."""
    try:
        return store.load()
    except ConfigError as exc:
        log.warning("signin_unreadable", upstream=store.key, error=str(exc))
        return None


def _kept_port(previous: SignInRecord | None) -> int:
    """The port the kept registration redirects to, to be reused (0: none; any port will do)."""
    uris = (previous.client.redirect_uris or []) if previous is not None else []
    if not uris:
        return 0
    url = httpx2.URL(str(uris[0]))
    return (url.port or 0) if url.host == "127.0.0.1" else 0


def _registered(previous: SignInRecord, redirect_uri: str) -> bool:
    return redirect_uri in {str(uri) for uri in previous.client.redirect_uris or []}
