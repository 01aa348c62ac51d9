"""The sandbox over Streamable HTTP, like the real Hail: MCP at `/`, `GET /healthz`, bearer auth.

With an `AuthorizationServer` (`oauth.py`), like hosted Hail: its endpoints are served beside MCP, and
every request to `/` needs an access token it issued (else 401 with `WWW-Authenticate`); no static token.

With a token, a POST whose JSON-RPC messages are all `initialize`, `ping`, `tools/list`,
`server/discover` or notifications is served without it; any other request (`tools/call`
above all) needs `Authorization: Bearer <token>` or gets HTTP 401. The gate reads the body to
see the method (a batch needs the token if any message in it does); GET and DELETE on `/` carry
no call and pass. DNS-rebinding protection is off: the sandbox is often reached by a container
name.

`drop_after_accept` over HTTP: the handler sets the event this layer put in the request's ASGI
scope; the response is then abandoned unfinished (its headers are sent first if need be), and
uvicorn closes the connection, logging "ASGI callable returned without completing response".
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio
import anyio.abc
import uvicorn
from mcp.server.transport_security import TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hail_guard.sandbox.server import DROP_SCOPE_KEY

if TYPE_CHECKING:
    from mcp.server import Server
    from starlette.applications import Starlette

    from hail_guard.sandbox.oauth import AuthorizationServer

log = logging.getLogger(__name__)

PUBLIC_METHODS: Final = frozenset({"initialize", "ping", "tools/list", "server/discover"})
"""JSON-RPC methods served without a token (notifications are too)."""

MAX_BODY_BYTES: Final = 4 * 1024 * 1024
SHUTDOWN_GRACE_SECONDS: Final = 3


class Served(Protocol):
    """A fake served over HTTP: the sandbox, or a generic fake (`hail_guard.fake.FakeUpstream`)."""

    def server(self) -> Server[Any]: ...


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def build_http_app(sandbox: Served, token: str | None, oauth: AuthorizationServer | None = None) -> Starlette:
    routes = [Route("/healthz", _healthz, methods=["GET"]), *(oauth.routes() if oauth is not None else [])]
    app = sandbox.server().streamable_http_app(
        streamable_http_path="/",
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        custom_starlette_routes=routes,
    )
    app.add_middleware(_Gate, token=token, oauth=oauth)
    return app


def _needs_token(body: bytes) -> bool:
    try:
        parsed = json.loads(body)
    except ValueError:
        return True
    messages = parsed if isinstance(parsed, list) else [parsed]
    for message in messages:
        if not isinstance(message, dict):
            return True
        method = message.get("method")
        if isinstance(method, str) and method not in PUBLIC_METHODS and not method.startswith("notifications/"):
            return True
    return False


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if it is larger than MAX_BODY_BYTES."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class _Gate:
    """Bearer check for calls (with OAuth: for every request), and the abortable response `drop_after_accept` needs."""

    def __init__(self, app: ASGIApp, token: str | None, oauth: AuthorizationServer | None = None) -> None:
        self.app = app
        self.expected = None if token is None else f"Bearer {token}".encode()
        self.oauth = oauth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/":
            await self.app(scope, receive, send)
            return
        if self.oauth is not None:
            request = Request(scope)
            if not self.oauth.accepts(request.headers.get("authorization", ""), str(request.base_url)):
                log.info("sandbox_unauthorised_call")
                await self.oauth.challenge(request)(scope, receive, send)
                return
        if self.expected is not None and scope["method"] == "POST" and not self._authorised(scope):
            body = await _read_body(receive)
            if body is None:
                await JSONResponse({"error": "request body too large"}, status_code=413)(scope, receive, send)
                return
            if _needs_token(body):
                log.info("sandbox_unauthorised_call")
                response = JSONResponse({"error": "a valid bearer token is required"}, status_code=401)
                await response(scope, receive, send)
                return
            receive = _replaying(body, receive)
        await _abortable(self.app, scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").encode()
        return self.expected is not None and hmac.compare_digest(given, self.expected)


async def _abortable(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app`; if a handler sets the scope's drop event, abandon the response unfinished."""
    drop = anyio.Event()
    scope[DROP_SCOPE_KEY] = drop
    started = dropped = False

    async def tracking_send(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal dropped
            await drop.wait()
            dropped = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await app(scope, receive, tracking_send)
        tg.cancel_scope.cancel()
    if dropped:
        log.info("sandbox_dropped_connection")
        if not started:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})


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


async def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = (await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handling: signals are the caller's (the CLI's) business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


async def serve_http(
    sandbox: Served,
    host: str,
    port: int,
    token: str | None,
    *,
    oauth: AuthorizationServer | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `sandbox` (`build_http_app`) until cancelled; `tg.start(serve_http, ...)` returns the URL once it
    listens. Port 0 picks a free port."""
    auth = "oauth" if oauth is not None else "bearer" if token else "none"
    await serve_app(build_http_app(sandbox, token, oauth), host, port, auth=auth, task_status=task_status)


async def serve_app(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    auth: str = "none",
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake's ASGI `app` until cancelled; `tg.start(serve_app, ...)` returns the URL once it listens.

    Port 0 picks a free port. On cancellation uvicorn shuts down gracefully (bounded); signals are
    left alone (the CLI handles them).
    """
    started = anyio.Event()
    config = uvicorn.Config(
        _signalling_startup(app, started),
        log_config=None,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )
    server = _Uvicorn(config)
    sock = await _listen(host, port)
    url = _url(sock)
    stopped = anyio.Event()

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):  # stopped by should_exit below, so it shuts down cleanly
                await server.serve(sockets=[sock])
        finally:
            stopped.set()
            started.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                await started.wait()
                if stopped.is_set():
                    raise RuntimeError(f"the sandbox HTTP server at {url} stopped while starting")
                log.info("sandbox_listening url=%s auth=%s", url, auth)
                task_status.started(url)
                await stopped.wait()
            finally:
                server.should_exit = True
    finally:
        sock.close()
