"""Wiring: settings in, a running proxy out (a ledger and an upstream, and the proxy over them).

The only place that decides which upstream to talk to and which ledger to open; everything
below takes these as arguments.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import stat
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import anyio
import anyio.to_thread
import structlog
from mcp.server.stdio import stdio_server

from hail_guard import profiles
from hail_guard.config import Settings
from hail_guard.errors import ConfigError, HailGuardError
from hail_guard.guard import GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.profiles import Profile
from hail_guard.server import Proxy, UpstreamTools, build_server
from hail_guard.tracker import Tracker, TrackerSettings
from hail_guard.upstream import UpstreamTarget, connect_upstream
from hail_guard.urls import display_url

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
        duplicate_window_hours=settings.guard.duplicate_window_hours,
        similarity_threshold=settings.guard.similarity_threshold or None,
        hold_lead_across_channels=settings.guard.hold_lead_across_channels,
        default_region=settings.guard.default_region,
    )


@asynccontextmanager
async def open_ledger_from(settings: Settings) -> AsyncIterator[Ledger]:
    async with open_ledger(settings.ledger.url, busy_timeout_seconds=settings.ledger.busy_timeout_seconds) as ledger:
        yield ledger


@dataclass(frozen=True)
class Opened:
    """What `open_proxy` opened for its block: the ledger and the upstream, and the proxy over them. The edge
    (the commands, the HTTP app, the console) hands each part the role of the ledger it uses."""

    ledger: Ledger
    upstream: UpstreamTools
    proxy: Proxy


@asynccontextmanager
async def open_proxy(settings: Settings, *, metrics: Metrics | None = None) -> AsyncIterator[Opened]:
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
            "proxy_ready",
            ledger=display_url(settings.ledger.url),  # absolute (`config.absolute_ledger_url`), no password
            profile=proxy.profile.name,
            tools=len(proxy.tools),
            guarded=sorted(proxy.guarded),
        )
        yield Opened(ledger, upstream, proxy)


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
async def tracking(settings: Settings, opened: Opened) -> AsyncIterator[Tracker | None]:
    """Poll delivery in the background while the block runs (`serve`, `worker`); None with `[delivery] poll = false`."""
    if not settings.delivery.poll:
        yield None
        return
    tracker = Tracker(opened.ledger, opened.upstream, tracker_settings(settings, opened.proxy.profile))
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
    """Serve one client on stdin and stdout until it closes stdin or this is cancelled (`until_signalled`)."""
    async with open_proxy(settings) as opened, tracking(settings, opened), stdio_server(_stdin()) as (read, write):
        server = build_server(opened.proxy)
        await server.run(read, write, server.create_initialization_options())


async def until_signalled(run: Callable[[], Awaitable[None]], *, event: str) -> None:
    """Run `run` until SIGINT or SIGTERM (logged as `event`), then cancel it: `serve` on either transport.

    Cancelled, a send in flight is recorded `unknown` by the guard, shielded, before the ledger closes
    (over HTTP only those still running after `[http] shutdown_grace_seconds`). Errors come out as raised
    (`ConfigError` for a port in use...), not wrapped in a group. Off the main thread (`main` embedded in a
    thread), where no signal arrives, it just runs `run`.
    """
    on_main = threading.current_thread() is threading.main_thread()
    receiver = anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if on_main else _no_signals()
    with receiver as signals:
        try:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        log.info(event, signal=signal.Signals(signum).name)
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                await run()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and isinstance(group.exceptions[0], HailGuardError):
                raise group.exceptions[0] from None
            raise


@contextmanager
def _no_signals() -> Iterator[AsyncIterator[int]]:
    async def never() -> AsyncIterator[int]:
        await anyio.sleep_forever()
        yield signal.SIGTERM  # never reached: it only makes this an async generator

    yield never()


def _stdin() -> ReadableStdin | None:
    """stdin read when readable where reading it can block for as long as the client likes (a pipe, a socket, a
    terminal); None, for the SDK's own reader, where it cannot (a file, /dev/null) or is no descriptor."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced by an embedding or a test
        return None
    mode = os.fstat(fd).st_mode
    return ReadableStdin(sys.stdin) if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd) else None


class ReadableStdin(anyio.AsyncFile[str]):
    """stdin's lines, each read once the descriptor is readable, never by a worker thread blocked in `read()`.

    The MCP SDK reads stdin in a worker thread, which no cancel reaches: after SIGTERM, while the client
    keeps stdin open (`docker stop` of a `docker run -i`), that thread kept the process alive.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._fd = stream.fileno()
        self._buffer = bytearray()

    async def readline(self) -> str:
        searched = 0
        while (end := self._buffer.find(b"\n", searched)) < 0:
            searched = len(self._buffer)
            await anyio.wait_readable(self._fd)
            chunk = os.read(self._fd, _STDIN_CHUNK_BYTES)  # readable: returns at once
            if not chunk:  # end of input: what is left, then ""
                end = len(self._buffer) - 1
                break
            self._buffer += chunk
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return line.decode("utf-8", errors="replace")


_STDIN_CHUNK_BYTES = 64 * 1024


async def serve_http(
    settings: Settings,
    *,
    host: str | None = None,
    port: int | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP app (`web.build_http_app`) until cancelled; `await tg.start(serve_http, settings)` returns the
    base URL once listening (`listener` runs uvicorn with the connection limits). Cancelled, it shuts down
    gracefully: in-flight requests get `[http] shutdown_grace_seconds`, then are cancelled, and a send Hail may
    have is recorded `unknown` by the guard (shielded, bounded).

    `host`/`port` override `[http]`; port 0 picks a free port. Refuses (`ConfigError`) a non-loopback
    address without a token and a port in use, before the ledger or the upstream is opened.
    """
    from hail_guard.gate import is_loopback  # here: the HTTP edge loads only when serving over HTTP
    from hail_guard.listener import listening, serve_app
    from hail_guard.metrics import Metrics
    from hail_guard.web import build_http_app

    overrides = {"host": host, "port": port}
    http = settings.http.model_copy(update={name: value for name, value in overrides.items() if value is not None})
    if (problem := http.token_problem(loopback=is_loopback(http.host))) is not None:
        raise ConfigError(problem)
    metrics = Metrics()
    with listening(http.host, http.port) as sock:
        async with open_proxy(settings, metrics=metrics) as opened, tracking(settings, opened):
            warning = await anyio.to_thread.run_sync(credentials_warning, settings)
            warnings = [warning] if warning is not None else []
            app = build_http_app(
                opened.proxy,
                http,
                ledger=opened.ledger,
                metrics=metrics,
                hooks=settings.webhooks,
                warnings=warnings,
                console=settings.console,
            )
            await serve_app(app, sock, settings=http, task_status=task_status)


async def serve_http_until_signalled(
    settings: Settings,
    *,
    host: str | None = None,
    port: int | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """`serve_http` until SIGINT or SIGTERM, then shut down gracefully (the CLI's entry point; `app.until_signalled`).

    Errors come out as raised (`ConfigError` for a port in use...), not wrapped in a group.
    """
    serving = functools.partial(serve_http, settings, host=host, port=port, task_status=task_status)
    await until_signalled(serving, event="http_stopping")
