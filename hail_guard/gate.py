"""The HTTP edge's checks, in order: Host and Origin, bearer token, body (size, time, depth), rate limit.

    403  a Host header not allowed (loopback names, the bound address, `[http] allowed_hosts`; its port,
         if any, a number up to 65535), or a browser Origin not allowed (loopback origins,
         `[http] allowed_origins`): DNS rebinding.
         Checked on the MCP paths and on `/readyz` and `/metrics` (a rebinding page must not read
         them); `/healthz` stays open for container probes
    401  a missing or wrong `Authorization: Bearer` token (compared in constant time), with
         `WWW-Authenticate`; no check when no token is configured (loopback only, see `web`)
    413  a body over `[http] max_body_bytes` (declared or streamed)
    408  a body that has not all arrived within `[http] body_timeout_seconds` (a slow client)
    400  a JSON body nesting deeper than `nesting.MAX_DEPTH`, refused before anything parses it
    429  `tools/call` and `initialize` messages, and SSE sessions opened, over `[http] rate_limit_per_minute`
         per client address (the connection's, or a trusted proxy's `X-Forwarded-For`), with `Retry-After`
    429  a stream (`GET /sse`, `GET /mcp`) past `[http] max_streams_per_client` open from one client
    503  a stream past the streams open in all (`HttpSettings.stream_cap`: with the agents' one token, the
         cap per token), so streams never hold every connection; `/healthz` is never behind these caps

Refusals are JSON-RPC error bodies, so an MCP client shows the reason. The token is never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import re
import time
from typing import Any
from urllib.parse import urlsplit

import anyio
import structlog
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hail_guard import nesting
from hail_guard.config import HttpSettings
from hail_guard.metrics import Metrics

log = structlog.get_logger(__name__)

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_PORT = 65535
_MAX_CLIENTS = 10_000
"""Rate-limit buckets kept before idle ones are forgotten."""


class Gate:
    """ASGI middleware: checks requests to `paths` (prefixes) and the Host of `probes` (prefixes);
    everything else passes untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        paths: tuple[str, ...],
        probes: tuple[str, ...] = (),
        streams: tuple[str, ...] = (),
        sessions: tuple[str, ...] = (),
        settings: HttpSettings,
        metrics: Metrics,
    ) -> None:
        """`streams`: the paths (exact) whose GET opens a stream that lasts as long as its connection; among
        them, `sessions`: those whose GET starts a session too (rate-limited as an `initialize`)."""
        self.app, self.paths, self.probes, self.metrics = app, paths, probes, metrics
        self.streams, self.sessions = streams, sessions
        self.token = settings.bearer_token()
        self.hosts, self.origins = allowed_hosts(settings), tuple(settings.allowed_origins)
        self.max_body_bytes, self.body_timeout_seconds = settings.max_body_bytes, settings.body_timeout_seconds
        self.limiter = RateLimiter(settings.rate_limit_per_minute)
        self.open_streams = StreamCaps(settings.max_streams_per_client, settings.stream_cap())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.paths + self.probes):
            await self.app(scope, receive, send)
            return
        path, client = scope["path"], _client(scope)
        headers = Headers(scope=scope)
        refusal = self._check_origin(headers)
        stream = refusal is None and scope["method"] == "GET" and path in self.streams
        if refusal is None and path.startswith(self.paths):
            refusal = self._check_token(headers)
            if refusal is None and stream:
                refusal = self._limit(client, int(path in self.sessions)) or self.open_streams.take(client)
            elif refusal is None and scope["method"] == "POST":
                try:
                    body = await read_body(receive, headers, self.max_body_bytes, self.body_timeout_seconds)
                    refusal = _depth_refusal(body) or self._limit(client, _limited_calls(body))
                    receive = _replaying(body, receive)
                except BodyRefused as exc:
                    refusal = _refused(exc.status, exc.reason, {"Connection": "close"})
        if refusal is None:
            try:
                await self.app(scope, receive, send)
            finally:
                if stream:
                    self.open_streams.release(client)
            return
        self.metrics.refused(refusal.status_code)
        log.info("http_refused", status=refusal.status_code, path=path, client=client)
        await refusal(scope, receive, send)

    def _check_origin(self, headers: Headers) -> Response | None:
        if not _host_allowed(headers.get("host"), self.hosts):
            return _refused(403, "this Host is not allowed; add it to [http] allowed_hosts")
        if not _origin_allowed(headers.get("origin"), self.origins):
            return _refused(403, "this Origin is not allowed; add it to [http] allowed_origins")
        return None

    def _check_token(self, headers: Headers) -> Response | None:
        if self.token is None:
            return None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if not given:
            return _refused(401, "a bearer token is required", {"WWW-Authenticate": 'Bearer realm="hail-guard"'})
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            challenge = 'Bearer realm="hail-guard", error="invalid_token"'
            return _refused(401, "the bearer token is not valid", {"WWW-Authenticate": challenge})
        return None

    def _limit(self, client: str, calls: int) -> Response | None:
        wait = self.limiter.take(client, calls) if calls else 0.0
        if not wait:
            return None
        seconds = max(1, math.ceil(wait))
        message = f"rate limit: too many tool calls or new sessions from this client; retry after {seconds} s"
        return _refused(429, message, {"Retry-After": str(seconds)}, {"retry_after_seconds": seconds})


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


STREAM_RETRY_SECONDS = 5


class StreamCaps:
    """Streams open at once (each holds a connection for as long as it lasts), per client address and in all:
    `take` counts one in or says why not (429 for the client, 503 in all), `release` counts it out."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self.by_client: dict[str, int] = {}
        self.count = 0

    def take(self, client: str) -> Response | None:
        retry = {"Retry-After": str(STREAM_RETRY_SECONDS), "Connection": "close"}
        if self.by_client.get(client, 0) >= self.per_client:
            message = f"too many open streams from this client ({self.per_client}); close one, or retry later"
            return _refused(429, message, retry, {"retry_after_seconds": STREAM_RETRY_SECONDS})
        if self.count >= self.total:
            return _refused(503, f"too many open streams ({self.total}); retry later", retry)
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self.count += 1
        return None

    def release(self, client: str) -> None:
        self.count -= 1
        left = self.by_client.pop(client) - 1
        if left:
            self.by_client[client] = left


def _depth_refusal(body: bytes) -> Response | None:
    if not nesting.too_deep(body):
        return None
    return _refused(400, f"the JSON body nests deeper than {nesting.MAX_DEPTH} levels of arrays and objects")


def _refused(status: int, message: str, headers: dict[str, str] | None = None, data: Any = None) -> Response:
    error: dict[str, Any] = {"code": -32600, "message": f"HTTP {status}: {message}"}
    if data is not None:
        error["data"] = data
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": error}, status_code=status, headers=headers)


class RateLimiter:
    """A token bucket per client: `per_minute` calls in a burst, refilled evenly; 0: no limit."""

    def __init__(self, per_minute: int) -> None:
        self.capacity, self.per_second = float(per_minute), per_minute / 60.0
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def take(self, client: str, count: int = 1) -> float:
        """0 when `count` calls may go now (and takes them), else the seconds to wait."""
        if not self.capacity:
            return 0.0
        now = time.monotonic()
        tokens, at = self.buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - at) * self.per_second)
        if tokens < count:
            self.buckets[client] = (tokens, now)
            return (min(count, self.capacity) - tokens) / self.per_second
        self.buckets[client] = (tokens - count, now)
        if len(self.buckets) > _MAX_CLIENTS:
            horizon = now - self.capacity / self.per_second
            self.buckets = {key: value for key, value in self.buckets.items() if value[1] > horizon}
        return 0.0


_LIMITED_METHODS = frozenset({"tools/call", "initialize"})
"""What the rate limit counts: tool calls, and the start of a session (each one costs a server)."""


def _limited_calls(body: bytes) -> int:
    try:
        parsed = json.loads(body)
    except ValueError:
        return 0
    messages = parsed if isinstance(parsed, list) else [parsed]
    return sum(1 for message in messages if isinstance(message, dict) and message.get("method") in _LIMITED_METHODS)


class BodyRefused(Exception):
    """A request body not taken: over the size cap (413) or too slow (408)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


async def read_body(receive: Receive, headers: Headers, limit: int, timeout_seconds: float) -> bytes:
    """The whole body, or `BodyRefused`: 413 when it is (or says it is) over `limit` bytes, 408 when
    it has not all arrived within `timeout_seconds`."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, f"the request body is larger than {limit} bytes")
    with anyio.move_on_after(timeout_seconds):
        return await _whole_body(receive, limit)
    raise BodyRefused(408, f"the request body did not arrive within {timeout_seconds:g} s; send it at once")


async def _whole_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyRefused(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _split_host(value: str) -> tuple[str, str]:
    """`name:port` (or `[v6]:port`) as (name, port); the port may be empty."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value.partition("]")
        return f"{name}]", rest.removeprefix(":")
    name, _, port = value.partition(":")
    return name, port


def _host_matches(value: str, entries: tuple[str, ...]) -> bool:
    """`value` (`name[:port]`) is one of `entries`; never when its port is not a port (`127.0.0.1:1@evil.com`)."""
    name, port = _split_host(value)
    if port and not (_PORT.fullmatch(port) and int(port) <= MAX_PORT):
        return False
    for entry in entries:
        allowed_name, allowed_port = _split_host(entry)
        if entry == "*" or (allowed_name == name and allowed_port in ("", "*", port)):
            return True
    return False


def allowed_hosts(settings: HttpSettings) -> tuple[str, ...]:
    """Host names accepted: loopback, the bound address (unless a wildcard) and `[http] allowed_hosts`."""
    bound = f"[{settings.host}]" if ":" in settings.host else settings.host
    unspecified = bound in ("0.0.0.0", "[::]", "")  # noqa: S104  (compared, not bound)
    return (*LOOPBACK_NAMES, *(() if unspecified else (bound,)), *settings.allowed_hosts)


def _host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    return bool(host) and _host_matches(host or "", allowed)


def _origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a browser) passes; a browser's must be loopback or listed (`scheme://host[:port]`)."""
    if origin is None:
        return True
    parts = urlsplit(origin.strip().lower())
    if parts.scheme in ("http", "https") and _host_matches(parts.netloc, LOOPBACK_NAMES):
        return True
    for entry in allowed:
        wanted = urlsplit(entry.strip().lower())
        if entry == "*" or (wanted.scheme == parts.scheme and _host_matches(parts.netloc, (wanted.netloc,))):
            return True
    return False


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def browser_refusal(headers: Headers, hosts: tuple[str, ...], origins: tuple[str, ...]) -> str | None:
    """Why a request's Host or Origin is refused (DNS rebinding, another site's page), else None: the MCP
    routes' check, for routes that are not behind the gate (the operator console)."""
    if not _host_allowed(headers.get("host"), hosts):
        return "this Host is not allowed; add it to [http] allowed_hosts"
    if not _origin_allowed(headers.get("origin"), origins):
        return "this Origin is not allowed; add it to [http] allowed_origins"
    return None
