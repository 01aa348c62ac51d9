"""hail-guard over HTTP: Streamable HTTP at `/mcp` and SSE at `/sse` (+ `/messages/`) from one app.

Every session shares ONE `Proxy` (one upstream connection, one ledger). The MCP paths sit behind
`gate.Gate` (Host/Origin 403, bearer token 401, body size 413, tool-call rate 429); `GET /healthz`
(alive), `/readyz` (ledger writable and Hail connected, else 503 naming the part) and `/metrics`
(Prometheus) need no token. The agents' token is only compared, never logged, never forwarded:
the upstream connection has its own credentials. `POST /webhooks/hail` takes Hail's webhooks: not
behind the agents' token, each request is signed with Hail's secret (`webhooks`); 401 for a forged,
stale or replayed one, 413 over the body size cap, 503 when no secret is configured or the ledger
cannot record it (Hail retries), else 200 with what it did.

    await tg.start(serve_http, settings)          # -> "http://127.0.0.1:8765/" once listening

`serve_http` refuses (`ConfigError`) to start on a non-loopback address without a token, and a
port in use, before it opens the ledger or the upstream. Cancelling it shuts down gracefully:
in-flight requests get `[http] shutdown_grace_seconds`, then are cancelled, and a send Hail may
have is recorded `unknown` by the guard (shielded, bounded). Signals are the caller's business.
"""

from __future__ import annotations

import contextlib
import errno
import math
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import anyio.abc
import structlog
import uvicorn
from mcp.server.sse import SseServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hail_guard import webhooks
from hail_guard.app import open_proxy, tracking
from hail_guard.config import HttpSettings, Settings, WebhookSettings
from hail_guard.errors import ConfigError, HailGuardError, WebhookRefused
from hail_guard.gate import Gate, is_loopback
from hail_guard.metrics import CONTENT_TYPE, Metrics
from hail_guard.models import WebhookOutcome
from hail_guard.server import Proxy, build_server

log = structlog.get_logger(__name__)

MCP_PATH, SSE_PATH, MESSAGES_PATH, WEBHOOK_PATH = "/mcp", "/sse", "/messages/", "/webhooks/hail"
READY_PROBE_SECONDS = 5.0


def build_http_app(
    proxy: Proxy, settings: HttpSettings, *, metrics: Metrics | None = None, hooks: WebhookSettings | None = None
) -> Starlette:
    """The ASGI app; `metrics` is the one `proxy` reports to (see `open_proxy`), else a fresh one."""
    metrics = metrics or Metrics()
    hooks = hooks or WebhookSettings()
    server = build_server(proxy)
    checks_off = TransportSecuritySettings(enable_dns_rebinding_protection=False)  # the gate checks (403 for both)
    manager = StreamableHTTPSessionManager(
        app=server, security_settings=checks_off, max_request_body_size=settings.max_body_bytes
    )
    sse = SseServerTransport(MESSAGES_PATH, security_settings=checks_off, max_request_body_size=settings.max_body_bytes)

    async def sse_session(scope: Scope, receive: Receive, send: Send) -> None:
        async with sse.connect_sse(scope, receive, send) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    async def readyz(request: Request) -> Response:
        checks = {"ledger": await _ledger_check(proxy), "upstream": "ok" if proxy.upstream.connected else "unreachable"}
        if (problem := proxy.upstream.sign_in_problem) is not None:  # connected or not, nothing can be sent
            checks |= {"upstream": "sign_in_required", "detail": problem}
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse({"status": "ready" if ready else "not_ready", **checks}, status_code=200 if ready else 503)

    async def metrics_page(request: Request) -> Response:
        try:
            await metrics.count_operations(proxy.guard.ledger)
        except HailGuardError as exc:
            log.warning("metrics_ledger_unavailable", error=str(exc))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with manager.run():  # its end cancels the sessions' calls: the guard records them `unknown`
            yield

    gate = Middleware(Gate, paths=(MCP_PATH, SSE_PATH, MESSAGES_PATH.rstrip("/")), settings=settings, metrics=metrics)
    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route(WEBHOOK_PATH, _webhook_endpoint(proxy, settings, hooks, metrics), methods=["POST"]),
        Route(MCP_PATH, StreamableHTTPASGIApp(manager)),
        Route(SSE_PATH, _Asgi(sse_session), methods=["GET"]),
        Mount(MESSAGES_PATH, app=sse.handle_post_message),
    ]
    if settings.bearer_token() is None:
        log.warning("http_auth_disabled", message="no token: MCP requests are not authenticated (loopback only)")
    if hooks.secret() is None:
        log.info("webhooks_off", message=f"no {hooks.secret_env}: {WEBHOOK_PATH} answers 503")
    return Starlette(routes=routes, middleware=[gate], lifespan=lifespan)


Endpoint = Callable[[Request], Awaitable[Response]]


def _webhook_endpoint(proxy: Proxy, http: HttpSettings, hooks: WebhookSettings, metrics: Metrics) -> Endpoint:
    """`POST /webhooks/hail`: verify, record once, answer (see the module docstring)."""

    def answer(status: int, outcome: str, message: str) -> Response:
        metrics.webhook(outcome)
        return JSONResponse({"status": outcome, "message": message}, status_code=status)

    async def receive(request: Request) -> Response:
        secret = hooks.secret()
        if secret is None:
            return answer(503, "not_configured", f"webhooks are not configured: set {hooks.secret_env}")
        body = await _capped_body(request, http.max_body_bytes)
        if body is None:
            return answer(413, "too_large", f"the body is larger than {http.max_body_bytes} bytes")
        try:
            hook = webhooks.receive(
                secret, body, request.headers, now=time.time(), tolerance_seconds=hooks.tolerance_seconds
            )
            outcome = await proxy.guard.ledger.record_webhook(hook)
        except WebhookRefused as exc:
            log.warning("webhook_refused", status=exc.status, reason=str(exc))
            return answer(exc.status, "refused", str(exc))
        except HailGuardError as exc:
            log.error("webhook_not_recorded", error=str(exc))
            return answer(503, "unrecorded", "the ledger could not record it; retry later")
        if outcome is WebhookOutcome.REPLAYED:
            log.warning("webhook_refused", status=401, reason="replayed", delivery_id=hook.delivery_id)
            return answer(401, outcome.value, "this signed request was already received")
        log.info(
            "webhook_received",
            delivery_id=hook.delivery_id,
            type=hook.event_type,
            provider_id=hook.provider_id,
            outcome=outcome.value,
        )
        return answer(200, outcome.value, "ok")

    return receive


async def _capped_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None when it is (or says it is) over `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _ledger_check(proxy: Proxy) -> str:
    """`ok` when the ledger answers and takes a write (expiring leases is one), else why not."""
    try:
        with anyio.fail_after(READY_PROBE_SECONDS):
            await proxy.guard.ledger.now()
            await proxy.guard.ledger.expire_leases()
    except TimeoutError:
        return "timeout"
    except Exception as exc:  # a probe's boundary: any failure means "not ready", logged
        log.warning("ready_check_failed", part="ledger", error=str(exc))
        return "unavailable"
    return "ok"


class _Asgi:
    """A plain ASGI callable as a Starlette route endpoint (not wrapped as request -> response)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


async def serve_http(
    settings: Settings,
    *,
    host: str | None = None,
    port: int | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `await tg.start(serve_http, settings)` returns the base URL once listening.

    `host`/`port` override `[http]`; port 0 picks a free port. Refuses (`ConfigError`) a non-loopback
    address without a token and a port in use, before the ledger or the upstream is opened.
    """
    overrides = {"host": host, "port": port}
    http = settings.http.model_copy(update={name: value for name, value in overrides.items() if value is not None})
    if http.bearer_token() is None and not is_loopback(http.host):
        raise ConfigError(
            f"refusing to listen on {http.host}: agents on other hosts could send without a token. Set "
            f"{http.token_env} (or [http] token), or listen on 127.0.0.1 and put a proxy in front."
        )
    metrics = Metrics()
    with listening(http.host, http.port) as sock:
        async with open_proxy(settings, metrics=metrics) as proxy, tracking(settings, proxy):
            app = build_http_app(proxy, http, metrics=metrics, hooks=settings.webhooks)
            await serve_app(app, sock, grace_seconds=http.shutdown_grace_seconds, task_status=task_status)


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
            sock.listen(128)
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


async def serve_app(
    app: ASGIApp,
    sock: socket.socket,
    *,
    grace_seconds: float = 10.0,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `app` on a listening socket until cancelled, then shut down gracefully.

    In-flight requests get `grace_seconds` to finish; then they are cancelled (a send Hail may have
    is recorded `unknown`, shielded and bounded, by the guard) and the app's lifespan ends.
    """
    started, stopped = anyio.Event(), anyio.Event()
    config = uvicorn.Config(
        _signalling_startup(app, started),
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=math.ceil(grace_seconds),
    )
    server = _Uvicorn(config)
    name, port = sock.getsockname()[:2]
    url = f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/"

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):  # stopped by should_exit below, so it shuts down cleanly
                await server.serve(sockets=[sock])
        finally:
            stopped.set()
            started.set()

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


async def serve_http_until_signalled(
    settings: Settings,
    *,
    host: str | None = None,
    port: int | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """`serve_http` until SIGINT or SIGTERM, then shut down gracefully (the CLI's entry point).

    Errors come out as raised (`ConfigError` for a port in use...), not wrapped in a group.
    """
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        log.info("http_stopping", signal=signal.Signals(signum).name)
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                await serve_http(settings, host=host, port=port, task_status=task_status)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and isinstance(group.exceptions[0], HailGuardError):
                raise group.exceptions[0] from None
            raise


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
