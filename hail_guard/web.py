"""hail-guard over HTTP: Streamable HTTP at `/mcp` and SSE at `/sse` (+ `/messages/`) from one app.

Every session shares ONE `Proxy` (one upstream connection, one ledger). The MCP paths sit behind
`gate.Gate` (Host/Origin 403, bearer token 401, body size 413, slow body 408, nesting 400, rate of
tool calls, new sessions and streams 429; streams open per client 429 and in all 503); Streamable HTTP
sessions are capped (`[http] max_sessions`, 503 past it) and end after `[http] session_idle_seconds`
without a request. `GET /healthz` (alive),
`/readyz` (ledger writable and Hail connected, else 503 naming the part) and `/metrics`
(Prometheus) need no token; the last two pass the Host/Origin check first. The agents' token is
only compared, never logged, never forwarded: the upstream connection has its own credentials.
`POST /webhooks/hail` takes Hail's webhooks: not behind the agents' token, each request is signed
with Hail's secret (`webhooks`); 401 for a forged, stale or replayed one, 413 over the body size
cap, 408 for a slow body, 400 for one nested too deep, 503 when no secret is configured or the
ledger cannot record it (Hail retries), 422 for an SMS opt-out whose sender cannot be read (kept for
review, logged as an error: nobody could be suppressed), else 200 with what it did.

`build_http_app` builds the app over a proxy; the process that serves it (the listener, the proxy's
lifetime, signals) is the edge's: `app.serve_http`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import anyio
import anyio.abc
import anyio.to_thread
import structlog
from mcp.server.sse import SseServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hail_guard import webhooks
from hail_guard.config import ConsoleSettings, HttpSettings, WebhookSettings
from hail_guard.console.app import console_routes
from hail_guard.errors import HailGuardError, WebhookRefused
from hail_guard.gate import BodyRefused, Gate, read_body
from hail_guard.ledger import Ledger, Tracking, Upkeep
from hail_guard.metrics import CONTENT_TYPE, Metrics
from hail_guard.models import WebhookOutcome
from hail_guard.server import Proxy, build_server

log = structlog.get_logger(__name__)

MCP_PATH, SSE_PATH, MESSAGES_PATH, WEBHOOK_PATH = "/mcp", "/sse", "/messages/", "/webhooks/hail"
PROBED_PATHS = ("/readyz", "/metrics")
"""Need no token, but pass the Host/Origin check (a DNS-rebinding page must not read them); `/healthz`
stays open to any Host for container probes."""
READY_PROBE_SECONDS = 5.0


def build_http_app(
    proxy: Proxy,
    settings: HttpSettings,
    *,
    ledger: Ledger,
    metrics: Metrics | None = None,
    hooks: WebhookSettings | None = None,
    warnings: Sequence[str] = (),
    console: ConsoleSettings | None = None,
) -> Starlette:
    """The ASGI app over `proxy` and the `ledger` it was given (the webhooks, the probes and the console use it);
    `metrics` is the one `proxy` reports to (see `open_proxy`), else a fresh one.
    `warnings` (a missing Hail token) are shown by `/readyz`; they do not make it fail. The operator
    console is mounted at `/console` (`hail_guard.console`), with its own sign-in and checks."""
    metrics = metrics or Metrics()
    hooks = hooks or WebhookSettings()
    server = build_server(proxy)
    checks_off = TransportSecuritySettings(enable_dns_rebinding_protection=False)  # the gate checks (403 for both)
    manager = StreamableHTTPSessionManager(
        app=server,
        security_settings=checks_off,
        max_request_body_size=settings.max_body_bytes,
        max_sessions=settings.max_sessions,
        session_idle_timeout=settings.session_idle_seconds,
    )
    sse = SseServerTransport(MESSAGES_PATH, security_settings=checks_off, max_request_body_size=settings.max_body_bytes)

    async def sse_session(scope: Scope, receive: Receive, send: Send) -> None:
        async with sse.connect_sse(scope, receive, send) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    async def readyz(request: Request) -> Response:
        checks = {
            "ledger": await _ledger_check(ledger),
            "upstream": "ok" if proxy.upstream.connected else "unreachable",
        }
        if (problem := proxy.upstream.sign_in_problem) is not None:  # connected or not, nothing can be sent
            checks |= {"upstream": "sign_in_required", "detail": problem}
        ready = all(value == "ok" for value in checks.values())
        body = {
            "status": "ready" if ready else "not_ready",
            **checks,
            **({"warnings": list(warnings)} if warnings else {}),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics_page(request: Request) -> Response:
        try:
            await metrics.count_operations(ledger)
        except HailGuardError as exc:
            log.warning("metrics_ledger_unavailable", error=str(exc))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with manager.run():  # its end cancels the sessions' calls: the guard records them `unknown`
            yield

    mcp_paths = (MCP_PATH, SSE_PATH, MESSAGES_PATH.rstrip("/"))
    streams = (SSE_PATH, MCP_PATH)
    gate = Middleware(
        Gate,
        paths=mcp_paths,
        probes=PROBED_PATHS,
        streams=streams,
        sessions=(SSE_PATH,),
        settings=settings,
        metrics=metrics,
    )
    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route(WEBHOOK_PATH, _webhook_endpoint(ledger, settings, hooks, metrics), methods=["POST"]),
        Route(MCP_PATH, StreamableHTTPASGIApp(manager)),
        Route(SSE_PATH, _Asgi(sse_session), methods=["GET"]),
        Mount(MESSAGES_PATH, app=sse.handle_post_message),
        console_routes(ledger, proxy, console or ConsoleSettings(), settings),
    ]
    if settings.bearer_token() is None:
        log.warning("http_auth_disabled", message="MCP requests are not authenticated: set a token (loopback only)")
    if hooks.secret() is None:
        log.info("webhooks_off", message=f"{WEBHOOK_PATH} answers 503 until {hooks.secret_env} is set")
    return Starlette(routes=routes, middleware=[gate], lifespan=lifespan)


Endpoint = Callable[[Request], Awaitable[Response]]


def _webhook_endpoint(ledger: Tracking, http: HttpSettings, hooks: WebhookSettings, metrics: Metrics) -> Endpoint:
    """`POST /webhooks/hail`: verify, record once, answer (see the module docstring)."""

    def answer(status: int, outcome: str, message: str, *, close: bool = False) -> Response:
        metrics.webhook(outcome)
        headers = {"Connection": "close"} if close else None  # the rest of the body is not read
        return JSONResponse({"status": outcome, "message": message}, status_code=status, headers=headers)

    async def kept_for_review(refused: webhooks.UnreadableOptOut) -> Response:
        """An opt-out nobody can be suppressed by: kept (without it), logged as an error, refused (422)."""
        try:
            await ledger.record_webhook(refused.webhook)
        except HailGuardError as exc:
            log.error("webhook_not_recorded", error=str(exc))
            return answer(503, "unrecorded", "the ledger could not record it; retry later")
        log.error("webhook_opt_out_unreadable", delivery_id=refused.webhook.delivery_id, reason=str(refused))
        return answer(refused.status, "refused", str(refused))

    async def receive(request: Request) -> Response:
        secret = hooks.secret()
        if secret is None:
            return answer(503, "not_configured", f"webhooks are not configured: set {hooks.secret_env}")
        try:
            body = await read_body(request.receive, request.headers, http.max_body_bytes, http.body_timeout_seconds)
        except BodyRefused as exc:
            return answer(exc.status, "too_large" if exc.status == 413 else "too_slow", exc.reason, close=True)
        try:
            hook = webhooks.receive(
                secret, body, request.headers, now=time.time(), tolerance_seconds=hooks.tolerance_seconds
            )
            outcome = await ledger.record_webhook(hook)
        except webhooks.UnreadableOptOut as exc:
            return await kept_for_review(exc)
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


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _ledger_check(ledger: Upkeep) -> str:
    """`ok` when the ledger answers and takes a write (expiring leases is one), else why not."""
    try:
        with anyio.fail_after(READY_PROBE_SECONDS):
            await ledger.now()
            await ledger.expire_leases()
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
