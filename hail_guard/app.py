"""Wiring: settings in, a running proxy out (a ledger and an upstream, and the proxy over them).

The only place that decides which upstream to talk to and which ledger to open; everything
below takes these as arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import structlog
from mcp.server.stdio import stdio_server

from hail_guard import profiles
from hail_guard.config import Settings
from hail_guard.errors import ConfigError
from hail_guard.guard import GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.profiles import Profile
from hail_guard.server import Proxy, build_server
from hail_guard.tracker import Tracker, TrackerSettings
from hail_guard.upstream import UpstreamTarget, connect_upstream

if TYPE_CHECKING:
    from hail_guard.metrics import Metrics  # only HTTP serving counts: prometheus_client stays out of stdio
    from hail_guard.oauth import SignIn

log = structlog.get_logger(__name__)


def upstream_target(settings: Settings, profile: Profile | None = None) -> UpstreamTarget:
    """Where the configured upstream is, named as `profile` (default: the configured one) names it."""
    upstream = settings.upstream
    kind = upstream.kind
    name = (profile or load_profile(settings)).display_name
    if kind == "sandbox":
        from hail_guard.sandbox import Sandbox

        log.warning(
            "sandbox_upstream",
            message="no upstream configured: using the built-in sandbox; nothing real is sent",
            outbox=upstream.sandbox_outbox,
        )
        return UpstreamTarget(kind="inprocess", server=Sandbox(outbox_path=upstream.sandbox_outbox).server())
    if kind == "stdio":
        command, env = tuple(upstream.command or ()), upstream.resolved_env()
        return UpstreamTarget(
            kind="stdio", command=command, token=upstream.token(), token_env=upstream.token_env, env=env, name=name
        )
    token = upstream.token()
    signed_in = sign_in(settings) if kind == "http" and token is None else None
    return UpstreamTarget(
        kind=kind, url=upstream.url, token=token, credentials=signed_in, token_env=upstream.token_env, name=name
    )


def sign_in(settings: Settings) -> SignIn:
    """The stored sign-in (`hail-guard login`) for the configured upstream: used when no API key is set."""
    from hail_guard.oauth import SignIn, TokenStore  # here: only an HTTP upstream without a key needs it

    return SignIn(TokenStore(settings.upstream.url or "", settings.upstream.signin_dir))


def credentials_warning(settings: Settings) -> str | None:
    """Why every send may be refused (HTTP 401): a Hail URL, no token in its variable, and no stored
    sign-in. It may read the sign-in file: call it off the event loop."""
    upstream = settings.upstream
    if upstream.kind != "http" or upstream.token() is not None:
        return upstream.token_warning()
    from hail_guard.oauth import TokenStore  # here: only an HTTP upstream without a key needs it

    try:
        signed_in = TokenStore(upstream.url or "", upstream.signin_dir).load() is not None
    except ConfigError:
        signed_in = False  # an unusable sign-in file: `status` and the first send say why
    return upstream.token_warning(signed_in=signed_in)


def load_profile(settings: Settings) -> Profile:
    """The profile `[upstream] profile` names (a built-in name or a file)."""
    return profiles.load_profile(settings.upstream.profile)


def key_retention_hours(settings: Settings) -> float:
    """How long the upstream keeps a key: as configured, else as its profile says."""
    return settings.upstream.key_retention_hours or load_profile(settings).key_retention_hours


def guard_settings(settings: Settings, profile: Profile) -> GuardSettings:
    return GuardSettings(
        profile=profile,
        key_template=settings.guard.key_template,
        key_retention_hours=settings.upstream.key_retention_hours,
        timeout_seconds=settings.upstream.timeout_seconds,
        lease_seconds=settings.guard.lease_seconds,
        max_reconcile_attempts=settings.guard.max_reconcile_attempts,
        duplicate_window_hours=settings.guard.duplicate_window_hours or None,
    )


@asynccontextmanager
async def open_ledger_from(settings: Settings) -> AsyncIterator[Ledger]:
    async with open_ledger(settings.ledger.url, busy_timeout_seconds=settings.ledger.busy_timeout_seconds) as ledger:
        yield ledger


@asynccontextmanager
async def open_proxy(settings: Settings, *, metrics: Metrics | None = None) -> AsyncIterator[Proxy]:
    """Open the ledger and the upstream; the proxy lives as long as the block.

    With `metrics`, ledger and upstream calls are timed and every tool call is counted there.
    """
    if (warning := await anyio.to_thread.run_sync(credentials_warning, settings)) is not None:
        log.warning("upstream_token_missing", message=warning, variable=settings.upstream.token_env)
    profile = await anyio.to_thread.run_sync(load_profile, settings)  # a bad one is refused before anything opens
    async with (
        open_ledger_from(settings) as opened_ledger,
        connect_upstream(
            upstream_target(settings, profile), timeout_seconds=settings.upstream.timeout_seconds
        ) as opened,
    ):
        ledger, upstream = opened_ledger, opened
        if metrics is not None:
            ledger, upstream = metrics.timed(ledger, "ledger"), metrics.timed(upstream, "upstream")
        proxy = Proxy(
            ledger,
            upstream,
            guard_settings(settings, profile),
            guarded_tools=settings.guard.guarded_tools,
            require_approval=settings.guard.require_approval,
            observer=metrics,
            pin_tools=settings.upstream.pin_tools,
            record_tools=settings.upstream.record_tools,
            expose_review=settings.review.expose_to_agent,
        )
        await proxy.refresh_tools()
        if (misfit := proxy.misfit_text()) is not None:
            raise ConfigError(f"{misfit}; hail-guard did not start")
        log.info(
            "proxy_ready", profile=proxy.settings.profile.name, tools=len(proxy.tools), guarded=sorted(proxy.guarded)
        )
        yield proxy


def tracker_settings(settings: Settings, profile: Profile) -> TrackerSettings:
    return TrackerSettings(
        profile=profile,
        interval_seconds=settings.delivery.poll_interval_seconds,
        backoff_factor=settings.delivery.backoff_factor,
        max_backoff_seconds=settings.delivery.max_backoff_seconds,
        max_age_hours=settings.delivery.max_age_hours,
        timeout_seconds=settings.upstream.timeout_seconds,
    )


@asynccontextmanager
async def tracking(settings: Settings, proxy: Proxy) -> AsyncIterator[Tracker | None]:
    """Poll delivery in the background while the block runs (`serve`, `worker`); None with `[delivery] poll = false`."""
    if not settings.delivery.poll:
        yield None
        return
    tracker = Tracker(proxy.ledger, proxy.upstream, tracker_settings(settings, proxy.settings.profile))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(tracker.run)
            try:
                yield tracker
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The tracker never raises, so a group holds what the block raised: let it out as raised.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def serve_stdio(settings: Settings) -> None:
    async with open_proxy(settings) as proxy, tracking(settings, proxy), stdio_server() as (read, write):
        server = build_server(proxy)
        await server.run(read, write, server.create_initialization_options())
