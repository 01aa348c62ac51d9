"""The HTTP listener: uvicorn on a socket hail-guard opened, with the limits of a server other hosts reach.

- Each request's headers must arrive within `[http] header_timeout_seconds` of the connection (or of
  the previous answer on it); a client that drips them is disconnected (bodies: see `gate`).
- At most `[http] max_connections` connections are open at once (fewer when the open-file limit
  leaves less room: logged at start); one past it is answered 503 and closed, so slow clients cannot
  hold every file descriptor. `PROBE_CONNECTIONS` more are kept for `GET /healthz` alone: a
  connection among them is served if it asks for `/healthz`, else answered 503, so a full server is
  never taken for a dead one (an orchestrator would restart it mid-send); past those, one is answered
  503 at once.
- `X-Forwarded-For` is believed only from `[http] trusted_proxies`; otherwise the client is the
  connection's own address (the rate limit and the logs use it).
- `accept()` failing for want of file descriptors or memory (EMFILE...) is logged once per burst,
  not once per attempt (asyncio retries it, and would log a traceback each time).
- Cancelled, the server shuts down gracefully: in-flight requests get `[http] shutdown_grace_seconds`.

    with listening("127.0.0.1", 0) as sock:
        await serve_app(app, sock, settings=http, task_status=task_status)   # -> "http://127.0.0.1:PORT/"
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.abc
import h11
import structlog
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hail_guard.config import HttpSettings
from hail_guard.errors import ConfigError, HailGuardError

log = structlog.get_logger(__name__)

LISTEN_BACKLOG = 128
PROBE_CONNECTIONS = 4
"""Connections past `[http] max_connections` kept for the health probe (`GET /healthz`) alone."""
HEALTH_PATH = "/healthz"
RESERVED_FILES = 32
"""File descriptors kept for everything but client connections: the ledger, its pool, the upstream, pipes."""
BURST_SECONDS = 30.0
"""A refusal of the same kind within this long of the last one is the same burst: logged once."""
_ACCEPT_FAILED = "socket.accept() out of system resource"
"""asyncio's context message when `accept()` fails with EMFILE, ENFILE, ENOBUFS or ENOMEM; it then
retries after a second, once for every attempt that failed."""
_RETRY_SECONDS = 5.0


class _OncePerBurst:
    """Logs an event the first time it happens, then again only after `BURST_SECONDS` without it."""

    def __init__(self, event: str, message: str) -> None:
        self.event, self.message, self.last = event, message, -math.inf

    def happened(self, **fields: Any) -> None:
        now = time.monotonic()
        if now - self.last > BURST_SECONDS:
            log.warning(self.event, message=self.message, **fields)
        self.last = now

    def within(self, seconds: float) -> bool:
        return time.monotonic() - self.last < seconds


_SLOW_HEADERS = _OncePerBurst("http_slow_headers", "closed connections whose request headers came too slowly")
_TOO_MANY = _OncePerBurst("http_connections_capped", "refused connections past [http] max_connections (503)")
_BUSY_BODY = json.dumps(
    {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "HTTP 503: too many connections; retry"}}
).encode()
_BUSY_HEADERS = [
    (b"content-type", b"application/json"),
    (b"retry-after", b"5"),
    (b"connection", b"close"),
    (b"content-length", b"%d" % len(_BUSY_BODY)),
]
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\n%s\r\n%s" % (
    b"".join(b"%s: %s\r\n" % header for header in _BUSY_HEADERS),
    _BUSY_BODY,
)


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and a cap on open connections."""

    header_timeout_seconds = 10.0
    max_connections = 100
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]  # uvicorn's is typed for a Transport
        if len(self.connections) > self.max_connections:
            _TOO_MANY.happened(open=len(self.connections))
            if len(self.connections) > self.max_connections + PROBE_CONNECTIONS:
                self.transport.write(_BUSY)
                self.transport.close()
                return
            self.app = _health_only(self.app)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the gate bounds the body
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:  # answered before the body came: nothing waits for it
            self.transport.close()
        elif self.conn.their_state is h11.IDLE:
            self._await_headers()  # the next request on this connection has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._deadline = self.loop.call_later(self.header_timeout_seconds, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            _SLOW_HEADERS.happened(seconds=self.header_timeout_seconds)
            self.transport.close()


def _health_only(app: ASGIApp) -> ASGIApp:
    """`app` for `GET /healthz` alone, on a connection closed after its answer; anything else is answered 503."""

    async def health_only(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != HEALTH_PATH:
            await send({"type": "http.response.start", "status": 503, "headers": _BUSY_HEADERS})
            await send({"type": "http.response.body", "body": _BUSY_BODY})
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, closing)

    return health_only


def _protocol(settings: HttpSettings, cap: int) -> type[H11Protocol]:
    class Bounded(_BoundedH11):
        header_timeout_seconds = settings.header_timeout_seconds
        max_connections = cap

    return Bounded


def connection_cap(wanted: int) -> int:
    """`wanted`, or fewer when the open-file limit leaves less room (then say so): past the limit,
    `accept()` fails and new connections wait in the queue, unanswered."""
    try:
        import resource  # here: not on every platform
    except ModuleNotFoundError:
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - RESERVED_FILES >= wanted:
        return wanted
    room = max(1, soft - RESERVED_FILES)
    log.warning(
        "http_connections_limited",
        message="the open-file limit leaves room for fewer connections than [http] max_connections; raise it "
        "(ulimit -n) to allow more",
        open_file_limit=soft,
        max_connections=room,
    )
    return room


@contextlib.contextmanager
def _accept_errors_logged_once(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """While serving, asyncio's report of a failed `accept()` is logged once per burst, as JSON."""
    previous = loop.get_exception_handler()
    burst = _OncePerBurst(
        "http_accept_failed",
        "cannot accept connections: out of file descriptors or memory; new connections wait. Raise the "
        "open-file limit (ulimit -n) or lower [http] max_connections",
    )

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        failure, message = context.get("exception"), str(context.get("message", ""))
        if message == _ACCEPT_FAILED and isinstance(failure, OSError):
            burst.happened(error=failure.strerror, errno=errno.errorcode.get(failure.errno or 0))
        elif "._start_serving(" in message and burst.within(_RETRY_SECONDS):
            pass  # asyncio's retries of those accepts, firing once the server has closed its socket
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        if not burst.within(_RETRY_SECONDS):  # else its retries, still pending, would each be logged
            loop.set_exception_handler(previous)


@contextlib.contextmanager
def listening(host: str, port: int) -> Iterator[socket.socket]:
    """A listening socket (port 0: a free one); a clear `ConfigError` when that is not possible."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    with sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {host}:{port}: the port is already in use (another hail-guard?). "
                    "Stop it or choose another port (--port, [http] port)."
                ) from exc
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        sock.setblocking(False)
        yield sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handling: signals are the caller's (the CLI's) business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: ASGIApp, settings: HttpSettings) -> uvicorn.Config:
    max_connections = connection_cap(settings.max_connections)
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
        http=_protocol(settings, max_connections),
        backlog=LISTEN_BACKLOG,
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=list(settings.trusted_proxies),
        # The protocol closes connections past the cap (and its probes'); requests on the ones it keeps pass.
        limit_concurrency=max_connections + PROBE_CONNECTIONS + 1,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_seconds),
    )


async def serve_app(
    app: ASGIApp,
    sock: socket.socket,
    *,
    settings: HttpSettings | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `app` on a listening socket until cancelled, then shut down gracefully.

    In-flight requests get `shutdown_grace_seconds` to finish; then they are cancelled (a send Hail may
    have is recorded `unknown`, shielded and bounded, by the guard) and the app's lifespan ends.
    """
    started, stopped = anyio.Event(), anyio.Event()
    server = _Uvicorn(_config(_signalling_startup(app, started), settings or HttpSettings()))
    name, port = sock.getsockname()[:2]
    url = f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/"

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):  # stopped by should_exit below, so it shuts down cleanly
                await server.serve(sockets=[sock])
                await _finished(server.server_state.tasks)
        finally:
            stopped.set()
            started.set()

    with _accept_errors_logged_once(asyncio.get_running_loop()):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                await started.wait()
                if not stopped.is_set():
                    log.info("http_listening", mcp=f"{url}mcp", sse=f"{url}sse")
                    task_status.started(url)
                    await stopped.wait()
            finally:
                server.should_exit = True
    if not server.started:
        raise HailGuardError(f"the HTTP server at {url} stopped while starting; see the log above")
    log.info("http_stopped", url=url)


FINAL_WRITES_SECONDS = 10.0
"""How long requests cancelled at shutdown may take for their final, shielded ledger writes."""


async def _finished(tasks: set[asyncio.Task[None]]) -> None:
    """Wait (bounded) for the requests uvicorn cancelled at shutdown: a send cut off there records what is known
    of it (`unknown`) in a shielded write, which must land before the ledger is closed. uvicorn does not wait."""
    pending = [task for task in tasks if not task.done()]
    if pending:
        await asyncio.wait(pending, timeout=FINAL_WRITES_SECONDS)


def _signalling_startup(app: ASGIApp, started: anyio.Event) -> ASGIApp:
    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def lifespan_send(message: Message) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                started.set()

        await app(scope, receive, lifespan_send)

    return wrapper
