"""The only code that talks to the upstream (Hail, or what the profile names): one shared MCP connection, kept
alive, its failures translated.

`connect_upstream` runs a supervisor task holding one legacy-era MCP `Client` (Streamable HTTP, SSE, stdio
or in-process); it reconnects with bounded backoff and yields even when Hail is down. Calls share the
connection and wait (up to the connect timeout) for a fresh one. `map_error`, the one place foreign errors
become ours, sorts them by "could the request have left?":

    MCPError -32001 (the SDK's timeout), -32000 (connection closed), any other MCPError  -> UpstreamLost
    MCPError marked by _NotSentTransport: no usable sign-in (refused, revoked, none)      -> SignInRequired
    MCPError marked by _NotSentTransport: failed connect, HTTP 401/403, HTTP 404 to our session
      id (Hail restarted); httpx2 ConnectError/ConnectTimeout/PoolTimeout, ConnectionRefusedError,
      FileNotFoundError, PermissionError, socket.gaierror                                 -> UpstreamUnavailable
    anything else (other OSError/httpx2 errors, anyio Closed/Broken/EndOfStream, TimeoutError,
      RuntimeError, pydantic ValidationError); a group unless every leaf is Unavailable   -> UpstreamLost

Messages name the upstream by `UpstreamTarget.name` (the profile's display name) at `UpstreamTarget.display`,
and mask its `secrets` (the token, a password in the URL, the values of `[upstream.env]` that are not URLs)
wherever a foreign message repeats them; such a message is not chained. A stdio command gets only the SDK's
safe variables (PATH, HOME...), the key in its variable and `[upstream.env]`; its stderr is copied to ours,
and its last lines say why it could not be started ("the upstream (Resend) could not be started: ...").
A JSON-RPC error Hail itself sends to `tools/call` becomes `CallToolResult(is_error=True)`: Hail answered.
`ClientSession.send_request` skips the SDK's output-schema check (a RuntimeError plus a hidden `tools/list`):
an upstream schema bug reaches the caller as the answer Hail gave. On Streamable HTTP the SDK lets a failed
connect kill the connection and reports only "Connection closed"; `_NotSentTransport` prevents that.
With `Credentials` (a sign-in, `hail_guard.oauth`) the same transport asks them for the bearer token of
each request and, after a 401 (Hail refused it unread), for another, then sends the request once more.
Cancellation is never caught: the SDK then sends `notifications/cancelled` upstream.
Every answer is read up to one cap, on every transport (`transports`): a larger one is lost, never kept.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import anyio
import httpx2
import mcp.types as types
import pydantic
import structlog
from anyio.abc import TaskStatus
from mcp import Client, ClientSession, MCPError, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.dispatcher import ProgressFnT

from hail_guard.errors import ConfigError, SignInRequired, UpstreamError, UpstreamLost, UpstreamUnavailable
from hail_guard.spawned import STDERR_LINES, env_secrets, spawned
from hail_guard.transports import MAX_ANSWER_BYTES, CappedBody
from hail_guard.urls import masked, parse_url

log = structlog.get_logger(__name__)

ProgressCallback = Callable[[float, float | None, str | None], Awaitable[None]]
_R = TypeVar("_R", bound=pydantic.BaseModel)
BACKOFF_MIN_SECONDS = 0.25
BACKOFF_MAX_SECONDS = 15.0
HTTP_READ_SECONDS = 300.0
MAX_TOOL_PAGES = 100
STREAM_END_SECONDS = 0.05
"""How long a closed event stream is read on for its end (see `_ReadToTheEnd`)."""
KEEP_ALIVE = httpx2.Limits(max_connections=100, max_keepalive_connections=100)
"""Every connection to Hail is kept for the next request (httpx keeps 20: a drain at concurrency 32 would
close and reopen the others)."""
_NOT_SENT_CODE = -32090  # in JSON-RPC's implementation-defined range; the mark below tells it is ours
_NOT_SENT_MARK = "hail_guard_not_sent"
_REFUSALS = ("connect", "auth", "session", "signin")
_CONNECT_FAILURES = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
_UNAVAILABLE = (*_CONNECT_FAILURES, ConnectionRefusedError, FileNotFoundError, PermissionError, socket.gaierror)
# Codes the SDK makes up itself: timeout, closed, unreadable body, HTTP error status, HTTP 404/202/redirect.
_SDK_CODES = {types.REQUEST_TIMEOUT, types.CONNECTION_CLOSED, types.PARSE_ERROR, types.INTERNAL_ERROR,
              types.INVALID_REQUEST, _NOT_SENT_CODE}  # fmt: skip


class Credentials(Protocol):
    """Bearer tokens that change (a sign-in: `hail_guard.oauth.SignIn`), asked for before each HTTP request."""

    @property
    def problem(self) -> str | None:
        """Why nothing can be sent until an operator signs in again; None while the credentials work."""

    async def bearer(self) -> str | None:
        """The token for the next request; None: send it without one. Raises `UpstreamUnavailable`."""

    async def renew(self, rejected: str | None) -> str:
        """Another token after Hail refused `rejected` with a 401. Raises `UpstreamUnavailable`."""

    def refused(self, token: str) -> str:
        """Hail refused the renewed `token` too: record that, and say what an operator must do."""


@dataclass(frozen=True, repr=False)
class UpstreamTarget:
    """Where the upstream is, and its `name` for every text (the profile's display name). `token` goes out as
    a bearer header (http/sse) or, to a stdio command, in the variable it came from (`token_env`:
    HAIL_API_KEY, RESEND_API_KEY...), beside `env` (`[upstream.env]`); `credentials` (http only) are asked
    for a token per request instead."""

    kind: Literal["http", "sse", "stdio", "inprocess"]
    url: str | None = None
    command: tuple[str, ...] = ()
    server: Any = field(default=None, compare=False)
    token: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    credentials: Credentials | None = field(default=None, compare=False, repr=False)
    token_env: str = "HAIL_API_KEY"  # noqa: S105  (the name of a variable, not a secret)
    """The variable `token` came from: what a refusal of the credentials tells an operator to fix."""
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """More variables for a stdio command (`[upstream.env]`, filled in)."""
    name: str = "Hail"
    """How texts name the upstream: the profile's display name."""

    def __post_init__(self) -> None:
        needs = {"http": "url", "sse": "url", "stdio": "command", "inprocess": "server"}[self.kind]
        if not getattr(self, needs):
            raise ConfigError(f"an upstream of kind {self.kind!r} needs a {needs}")
        if self.url is not None and not self.display.startswith(("http://", "https://")):
            raise ConfigError(f"the upstream url must start with http:// or https://, not {self.display!r}")

    @property
    def display(self) -> str:
        """Where the upstream is, safe to log: no userinfo, query, token or arguments."""
        if self.kind in ("http", "sse"):
            return str(httpx2.URL(self.url or "").copy_with(userinfo=b"", query=None, fragment=None))
        return f"stdio command {self.command[0]!r}" if self.kind == "stdio" else "the in-process server"

    @property
    def secrets(self) -> frozenset[str]:
        """What no message or log may show: the token, every spelling of a password the URL carries, and the
        values of `env` that are not URLs (and the passwords of those that are)."""
        found = {self.token, *(parse_url(self.url).secrets if self.url else ()), *env_secrets(self.env)}
        return frozenset(secret for secret in found if secret)

    def __repr__(self) -> str:
        return f"UpstreamTarget(kind={self.kind!r}, at={self.display!r})"


def map_error(
    exc: BaseException,
    *,
    target: str,
    timeout_seconds: float,
    token_env: str = "HAIL_API_KEY",  # noqa: S107
    secrets: Collection[str] = (),
    name: str = "Hail",
) -> UpstreamUnavailable | UpstreamLost:
    """Translate a foreign failure: `UpstreamUnavailable` only when nothing can have been sent. `secrets`
    (`UpstreamTarget.secrets`) are masked wherever the foreign message repeats them; `name` is the upstream's."""
    mapped = _mapped(exc, target=f"{name} at {target}", timeout_seconds=timeout_seconds, token_env=token_env, name=name)
    said = masked(str(mapped), secrets)
    return mapped if said == str(mapped) else type(mapped)(said)


def _mapped(
    exc: BaseException, *, target: str, timeout_seconds: float, token_env: str, name: str
) -> UpstreamUnavailable | UpstreamLost:
    if isinstance(exc, BaseExceptionGroup):
        mapped = [
            _mapped(e, target=target, timeout_seconds=timeout_seconds, token_env=token_env, name=name)
            for e in exc.exceptions
        ]
        return next((e for e in mapped if isinstance(e, UpstreamLost)), mapped[0])
    refusal, why = _refusal(exc), _describe(exc)
    if isinstance(exc, MCPError) and exc.code == types.REQUEST_TIMEOUT:
        return UpstreamLost(f"no answer from {target} within {timeout_seconds:g} s; it may have been sent")
    if refusal == "signin":
        return SignInRequired(why)
    if refusal == "auth":
        return UpstreamUnavailable(f"{target} refused hail-guard's token ({why}), so nothing was sent: an "
                                   f"operator must set {token_env} to a valid {name} token")  # fmt: skip
    if refusal == "connect" or isinstance(exc, _UNAVAILABLE):
        return UpstreamUnavailable(f"could not connect to {target} ({why}); nothing was sent")
    if refusal == "session":
        return UpstreamUnavailable(f"{target} no longer knows this session (restarted?); nothing was "
                                   "processed. hail-guard reconnects: try again.")  # fmt: skip
    return UpstreamLost(f"no usable answer from {target} ({why}); the request may have been sent")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.message if exc.code == _NOT_SENT_CODE else f"MCP error {exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _refusal(exc: BaseException) -> Literal["connect", "auth", "session", "signin"] | None:
    """Why a request surely did not reach Hail's tools, if `exc` is one `_NotSentTransport` made."""
    if not isinstance(exc, MCPError) or exc.code != _NOT_SENT_CODE or not isinstance(exc.data, dict):
        return None
    mark = exc.data.get(_NOT_SENT_MARK)
    return mark if mark in _REFUSALS else None


def _breaks_connection(exc: BaseException) -> bool:
    if isinstance(exc, MCPError):
        return exc.code == types.CONNECTION_CLOSED or _refusal(exc) in ("connect", "session")
    return not isinstance(exc, pydantic.ValidationError)


def _progress_fn(callback: ProgressCallback) -> ProgressFnT:
    async def forward(progress: float, total: float | None, message: str | None) -> None:
        await callback(progress, total, message)

    return forward


def _not_sent(request: httpx2.Request, reason: str, message: str) -> httpx2.Response:
    error = {"code": _NOT_SENT_CODE, "message": message, "data": {_NOT_SENT_MARK: reason}}
    return httpx2.Response(503, json={"jsonrpc": "2.0", "id": None, "error": error}, request=request)


class _NotSentTransport(httpx2.AsyncBaseTransport):
    """Answers what surely did not reach Hail's tools with a marked JSON-RPC error (see module doc)."""

    def __init__(self, credentials: Credentials | None = None) -> None:
        self._inner = httpx2.AsyncHTTPTransport(limits=KEEP_ALIVE)
        self._credentials = credentials

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        credentials = self._credentials
        try:
            token = await credentials.bearer() if credentials is not None else None
            response = await self._send(request, token)
            if response.status_code == 401 and credentials is not None:  # refused unread: safe to send again
                await response.aclose()
                token = await credentials.renew(token)
                response = await self._send(request, token)
                if response.status_code == 401:
                    await response.aclose()
                    return _not_sent(request, "signin", credentials.refused(token))
        except SignInRequired as exc:
            return _not_sent(request, "signin", str(exc))
        except UpstreamUnavailable as exc:
            return _not_sent(request, "connect", str(exc))
        except _CONNECT_FAILURES as exc:
            return _not_sent(request, "connect", _describe(exc))
        status = response.status_code
        if _is_event_stream(request, response) and isinstance(response.stream, httpx2.AsyncByteStream):
            response.stream = _ReadToTheEnd(response.stream)
        elif _is_json(response) and isinstance(response.stream, httpx2.AsyncByteStream):
            response.stream = CappedBody(response.stream)
        if status in (401, 403):
            reason = "auth"
        elif status == 404 and "mcp-session-id" in request.headers:  # the spec: an unknown session, not processed
            reason = "session"
        else:
            return response
        await response.aclose()
        return _not_sent(request, reason, f"HTTP {status}")

    async def _send(self, request: httpx2.Request, token: str | None) -> httpx2.Response:
        if token is not None:
            request.headers["Authorization"] = f"Bearer {token}"
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _is_event_stream(request: httpx2.Request, response: httpx2.Response) -> bool:
    """A call's answer as an event stream (a POST's), not the session's standing GET stream."""
    return request.method == "POST" and response.headers.get("content-type", "").startswith("text/event-stream")


def _is_json(response: httpx2.Response) -> bool:
    """A JSON answer: read up to `transports.MAX_ANSWER_BYTES` (events are capped by the SDK's reader)."""
    return response.headers.get("content-type", "").lower().startswith("application/json")


class _ReadToTheEnd(httpx2.AsyncByteStream):
    """A POST's event stream that, when the SDK client closes it after the answer, first reads what is left.

    The client closes the stream as soon as the answer's event arrives, before the server's end of the
    stream, and httpcore then closes the connection: every call opened a new one (a TCP and a TLS
    handshake). The server ends the stream right after the answer, so reading on briefly keeps the
    connection for the next call; a stream that goes on is closed as before once the wait is over."""

    def __init__(self, inner: httpx2.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._inner:
            yield part

    async def aclose(self) -> None:
        try:
            with anyio.move_on_after(STREAM_END_SECONDS):
                async for _ in self._inner:
                    pass
        finally:
            await self._inner.aclose()


class Upstream:
    """One shared, self-healing connection to Hail; made by `connect_upstream`."""

    def __init__(self, target: UpstreamTarget, timeout: float, connect_timeout: float, heartbeat: float | None):
        self.target, self._timeout, self._connect_timeout = target, timeout, connect_timeout
        self._heartbeat = heartbeat
        self._session: ClientSession | None = None
        self._broken = anyio.Event()  # set: the supervisor drops this connection and makes a new one
        self._attempt_done = anyio.Event()  # set (and replaced) whenever a connection attempt ends
        self._wake = anyio.Event()  # set: a caller is waiting, so cut the backoff short
        self._backoff = BACKOFF_MIN_SECONDS
        self._last_error = "not connected yet"
        self._start_failed = target.kind == "stdio"  # a command that has not (yet, again) got as far as answering
        self._stderr: deque[str] = deque(maxlen=STDERR_LINES)  # a command's last words on stderr
        self.server_name: str | None = None
        """The name the upstream server gave when it connected (its `serverInfo`)."""

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def sign_in_problem(self) -> str | None:
        """Why an operator must sign in again (`hail-guard login`) before anything is sent; None: no need."""
        credentials = self.target.credentials
        return credentials.problem if credentials is not None else None

    async def wait_connected(self) -> None:
        """Return once connected; `UpstreamUnavailable` when no connection came within the connect timeout."""
        await self._live_session()

    async def list_tools(self) -> list[types.Tool]:
        """Every tool Hail lists, all pages, asked fresh (there is no cache)."""
        session, tools, cursor = await self._live_session(), list[types.Tool](), None
        for _ in range(MAX_TOOL_PAGES):
            request = types.ListToolsRequest(params=types.PaginatedRequestParams(cursor=cursor))
            page = await self._send(session, request, types.ListToolsResult, self._timeout)
            tools.extend(page.tools)
            if (cursor := page.next_cursor) is None:
                return tools
        target = self.target
        raise UpstreamLost(f"tools/list from {target.name} at {target.display} went on past {MAX_TOOL_PAGES} pages")

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        timeout_seconds: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> types.CallToolResult:
        """Forward one `tools/call`; Hail's answer comes back verbatim, failures as our errors."""
        session = await self._live_session()
        request = types.CallToolRequest(params=types.CallToolRequestParams(name=name, arguments=arguments))

        def answered(error: MCPError) -> types.CallToolResult:
            text = f"{self.target.name} answered tools/call {name} with JSON-RPC error {error.code}: {error.message}"
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)

        seconds = self._timeout if timeout_seconds is None else timeout_seconds
        return await self._send(session, request, types.CallToolResult, seconds, progress, answered)

    async def _send(
        self,
        session: ClientSession,
        request: types.ClientRequest | types.Request[Any, Any],
        result_type: type[_R],
        timeout_seconds: float,
        progress: ProgressCallback | None = None,
        answered: Callable[[MCPError], _R] | None = None,
    ) -> _R:
        """Send one request; `answered` turns a JSON-RPC error that Hail sent into a result."""
        on_progress = _progress_fn(progress) if progress else None
        try:
            return await session.send_request(request, result_type, timeout_seconds, progress_callback=on_progress)
        except Exception as exc:  # the boundary: every foreign failure is mapped here; cancellation passes
            if answered is not None and isinstance(exc, MCPError) and exc.code not in _SDK_CODES:
                log.info("upstream_error_answer", target=self.target.display, code=exc.code)
                return answered(exc)
            target, said = self.target, self._said(exc)
            error = map_error(exc, target=target.display, timeout_seconds=timeout_seconds,
                              token_env=target.token_env, secrets=target.secrets, name=target.name)  # fmt: skip
            log.warning("upstream_request_failed", target=target.display, method=request.method,
                        outcome=type(error).__name__, error=said)  # fmt: skip
            if _breaks_connection(exc):
                self._mark_broken(session, said)
            raise error from (exc if said == _describe(exc) else None)  # a chain that repeats a secret stays out

    def _said(self, exc: BaseException) -> str:
        """A foreign failure in words, as a log or an error may show it."""
        return masked(_describe(exc), self.target.secrets)

    async def _live_session(self) -> ClientSession:
        credentials = self.target.credentials
        if credentials is not None and credentials.problem is not None:
            await credentials.bearer()  # `SignInRequired`, unless an operator has signed in again since
        if self._session is None:
            attempt = self._attempt_done
            self._wake.set()
            with anyio.move_on_after(self._connect_timeout):
                await attempt.wait()
        if self._session is None:
            raise UpstreamUnavailable(self.problem)
        return self._session

    @property
    def problem(self) -> str:
        """Why nothing can be sent now (while not connected), in words an agent and an operator read."""
        target = self.target
        if self._start_failed:
            return f"the upstream ({target.name}) could not be started: {self._last_error}; nothing was sent"
        return (
            f"{target.name} at {target.display} is not reachable ({self._last_error}); nothing was sent. "
            f"hail-guard keeps reconnecting: check that {target.name} runs and that its address and token are "
            "right, then try again."
        )

    def _mark_broken(self, session: ClientSession, reason: str) -> None:
        if self._session is session:
            self._session, self._last_error = None, reason
            self._broken.set()
            log.warning("upstream_connection_broken", target=self.target.display, reason=reason)

    def _finish_attempt(self) -> None:
        done, self._attempt_done = self._attempt_done, anyio.Event()
        done.set()

    async def _supervise(self) -> None:
        while True:
            self._wake = anyio.Event()
            await self._attempt()
            with anyio.move_on_after(self._backoff):
                await self._wake.wait()
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_SECONDS)

    async def _attempt(self) -> None:
        """Connect and hold the connection until it breaks; failures are logged, never raised."""
        connected = False
        try:
            async with anyio.create_task_group() as tg:
                with anyio.fail_after(self._connect_timeout):
                    await tg.start(self._hold)
                connected = True
        except Exception as exc:  # the supervisor outlives every failure of one connection
            self._last_error = self._said(exc) if connected or not self._stderr else self._exited()
            event = "upstream_connection_lost" if connected else "upstream_connect_failed"
            log.warning(event, target=self.target.display, error=self._last_error, retry_seconds=self._backoff)
        if not connected:
            self._start_failed = self.target.kind == "stdio"
            self._finish_attempt()

    async def _hold(self, *, task_status: TaskStatus[None]) -> None:
        async with Client(self._client_target(), mode="legacy", cache=None) as client:
            self._session, self._broken = client.session, anyio.Event()
            info = client.server_info
            self.server_name = info.name if info is not None else None
            self._start_failed = False
            self._backoff = BACKOFF_MIN_SECONDS
            log.info("upstream_connected", target=self.target.display, protocol_version=client.protocol_version)
            self._finish_attempt()
            task_status.started()
            try:
                await self._watch(client.session)
            finally:
                self._session = None

    async def _watch(self, session: ClientSession) -> None:
        """Wait until the connection is found broken, pinging every heartbeat to find out sooner."""
        while not self._broken.is_set():
            with anyio.move_on_after(self._heartbeat or float("inf")):
                await self._broken.wait()
            if not self._broken.is_set():
                try:
                    await self._send(session, types.PingRequest(), types.EmptyResult, self._connect_timeout)
                except UpstreamError as error:
                    self._mark_broken(session, f"heartbeat failed: {error}")

    def _exited(self) -> str:
        """A command that stopped before it answered, in its own last words (secrets masked)."""
        said = masked(" ".join(" ".join(self._stderr).split()), self.target.secrets)
        return f"it stopped, saying: {said[-300:]}"

    def _client_target(self) -> Any:
        target = self.target
        if target.kind == "inprocess":
            return target.server
        if target.kind == "stdio":
            key = {target.token_env: target.token} if target.token else {}  # in the variable it came from
            command = StdioServerParameters(
                command=target.command[0], args=list(target.command[1:]), env={**key, **target.env}
            )
            return spawned(command, self._stderr)
        headers = dict(target.headers) | ({"Authorization": f"Bearer {target.token}"} if target.token else {})
        if target.kind == "sse":
            return sse_client(target.url or "", headers=headers, timeout=self._connect_timeout)
        return self._http_transport(target.url or "", headers, target.credentials)

    @asynccontextmanager
    async def _http_transport(
        self, url: str, headers: dict[str, str], credentials: Credentials | None
    ) -> AsyncIterator[Any]:
        timeout = httpx2.Timeout(self._connect_timeout, read=max(HTTP_READ_SECONDS, self._timeout + 30))
        http = httpx2.AsyncClient(headers=headers, timeout=timeout, transport=_NotSentTransport(credentials))
        async with http, streamable_http_client(url, http_client=http, max_sse_event_size=MAX_ANSWER_BYTES) as streams:
            yield streams


@asynccontextmanager
async def connect_upstream(
    target: UpstreamTarget,
    *,
    timeout_seconds: float = 45.0,
    connect_timeout_seconds: float = 10.0,
    heartbeat_seconds: float | None = 15.0,
) -> AsyncIterator[Upstream]:
    """Yield an `Upstream` once the first connection attempt has ended, whether or not Hail is up."""
    upstream = Upstream(target, timeout_seconds, connect_timeout_seconds, heartbeat_seconds)
    first_attempt = upstream._attempt_done
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream._supervise)
            with anyio.move_on_after(connect_timeout_seconds):
                await first_attempt.wait()
            try:
                yield upstream
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the supervisor never fails, so this is the caller's own error
        if len(group.exceptions) == 1:
            raise group.exceptions[0]  # noqa: B904  (re-raised as the caller raised it)
        raise
