"""The upstream client against real MCP servers: in-process, Streamable HTTP, SSE and stdio."""

from __future__ import annotations

import inspect
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp.types as types
import pydantic
import pytest
import uvicorn
from anyio.abc import TaskStatus
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.sse import SseServerTransport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send
from structlog.testing import capture_logs

from hail_guard.errors import ConfigError, SignInRequired, UpstreamLost, UpstreamUnavailable
from hail_guard.upstream import Upstream, UpstreamTarget, connect_upstream, map_error
from tests.conftest import subclasses

TOKEN = "s3cret-token-value"
ECHO_SERVER = Path(__file__).parents[1] / "upstream_echo_server.py"
CONTENT = [types.TextContent(type="text", text="ok")]


@dataclass
class Seen:
    """What the fake upstream observed."""

    authorization: list[str | None] = field(default_factory=list)
    cancelled: anyio.Event = field(default_factory=anyio.Event)
    connections: int = 0


def make_upstream(seen: Seen) -> Server[Any]:
    @asynccontextmanager
    async def lifespan(_server: Server[Any]) -> AsyncIterator[None]:
        seen.connections += 1
        yield

    async def on_list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        if params is None or params.cursor is None:
            return types.ListToolsResult(
                tools=[types.Tool(name="echo", input_schema={"type": "object"})], next_cursor="2"
            )
        return types.ListToolsResult(tools=[types.Tool(name="hang", input_schema={"type": "object"})])

    async def on_call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if isinstance(ctx.request, Request):
            seen.authorization.append(ctx.request.headers.get("authorization"))
        if params.name == "hang":
            try:
                await anyio.sleep_forever()
            finally:
                seen.cancelled.set()
        if params.name == "refuse":
            raise MCPError(types.INVALID_PARAMS, "to: not an address")
        if params.name == "progress":
            await ctx.session.report_progress(1, 2, "half")
        structured = {"echo": params.arguments}
        return types.CallToolResult(content=CONTENT, structured_content=structured)

    return Server("fake-hail", lifespan=lifespan, on_list_tools=on_list_tools, on_call_tool=on_call_tool)


def free_socket(port: int = 0) -> socket.socket:
    """A bound socket that refuses connections until a server listens on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


async def serve(app: ASGIApp, sock: socket.socket, *, task_status: TaskStatus[uvicorn.Server]) -> None:
    """Run uvicorn on `sock`; started once it listens."""
    config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=0, lifespan="on")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    task_status.started(server)
    await server.main_loop()
    await server.shutdown(sockets=[sock])


@asynccontextmanager
async def running(app: ASGIApp, sock: socket.socket) -> AsyncIterator[None]:
    """An HTTP upstream that listens inside the block and has stopped (socket closed) after it."""
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve, app, sock)
        yield
        server.should_exit = True


def http_app(seen: Seen, *, refuse: Callable[[], bool] = lambda: False) -> ASGIApp:
    app = make_upstream(seen).streamable_http_app(streamable_http_path="/")

    async def maybe_refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and refuse():
            await Response("no", status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    return maybe_refuse


def sse_app(seen: Seen) -> Starlette:
    server, transport = make_upstream(seen), SseServerTransport("/messages/")

    async def handle_sse(request: Request) -> Response:
        async with transport.connect_sse(request.scope, request.receive, request._send) as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return Response()

    routes = [Route("/sse", handle_sse, methods=["GET"]), Mount("/messages/", app=transport.handle_post_message)]
    return Starlette(routes=routes)


async def eventually(call: Callable[[], Awaitable[types.CallToolResult]]) -> types.CallToolResult:
    """Retry `call` while the upstream is unavailable (only where no event says it came back)."""
    while True:
        try:
            return await call()
        except UpstreamUnavailable:
            await anyio.sleep(0.05)


async def echo(upstream: Upstream, **arguments: Any) -> dict[str, Any]:
    result = await upstream.call_tool("echo", arguments)
    assert not result.is_error
    assert isinstance(result.structured_content, dict)
    return dict(result.structured_content)


async def test_a_tool_call_returns_the_answer_and_tools_come_from_every_page() -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(seen))) as upstream:
            assert upstream.connected
            assert [tool.name for tool in await upstream.list_tools()] == ["echo", "hang"]
            assert await echo(upstream, to="a@b.c") == {"echo": {"to": "a@b.c"}}


async def test_an_error_inside_the_block_reaches_the_caller_as_raised() -> None:
    with anyio.fail_after(5), pytest.raises(UpstreamLost, match=r"^mine$"):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(Seen()))):
            raise UpstreamLost("mine")


async def test_concurrent_calls_share_one_connection() -> None:
    seen = Seen()
    answers: list[dict[str, Any]] = []

    async def one(upstream: Upstream, n: int) -> None:
        answers.append(await echo(upstream, n=n))

    with anyio.fail_after(5):
        target = UpstreamTarget("inprocess", server=make_upstream(seen))
        async with connect_upstream(target) as upstream, anyio.create_task_group() as tg:
            for n in range(10):
                tg.start_soon(one, upstream, n)
    assert len(answers) == 10
    assert seen.connections == 1


async def test_a_call_without_an_answer_in_time_is_lost_and_cancelled_upstream() -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(seen))) as upstream:
            with pytest.raises(UpstreamLost, match=r"within 0.2 s; it may have been sent"):
                await upstream.call_tool("hang", {}, timeout_seconds=0.2)
            await seen.cancelled.wait()
            assert upstream.connected
            await echo(upstream)


async def test_cancelling_the_caller_cancels_the_upstream_call() -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(seen))) as upstream:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(upstream.call_tool, "hang", {})
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
            assert scope.cancelled_caught
            await seen.cancelled.wait()
            await echo(upstream)


async def test_a_json_rpc_error_from_the_upstream_is_an_error_result() -> None:
    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(Seen()))) as upstream:
            result = await upstream.call_tool("refuse", {})
    assert result.is_error
    assert result.content == [
        types.TextContent(
            type="text", text="Hail answered tools/call refuse with JSON-RPC error -32602: to: not an address"
        )
    ]


async def test_an_answer_that_breaks_its_own_output_schema_is_passed_through() -> None:
    seen = Seen()
    server = make_upstream(seen)
    strict = types.Tool(
        name="echo", input_schema={"type": "object"}, output_schema={"type": "object", "required": ["id"]}
    )

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[strict])

    server.add_request_handler("tools/list", types.PaginatedRequestParams, on_list_tools)
    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=server)) as upstream:
            assert await upstream.list_tools() == [strict]
            assert await echo(upstream, x=1) == {"echo": {"x": 1}}


async def test_progress_from_the_upstream_reaches_the_caller() -> None:
    reports: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        reports.append((done, total, message))

    with anyio.fail_after(5):
        async with connect_upstream(UpstreamTarget("inprocess", server=make_upstream(Seen()))) as upstream:
            await upstream.call_tool("progress", {}, progress=progress)
    assert reports == [(1, 2, "half")]


async def test_http_sends_the_bearer_token_and_never_shows_it() -> None:
    seen, sock = Seen(), free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/?key=abc"
    target = UpstreamTarget("http", url=url, token=TOKEN, headers={"X-Extra": "1"})
    with capture_logs() as logs, anyio.fail_after(10):
        async with running(http_app(seen), sock), connect_upstream(target) as upstream:
            await echo(upstream)
            with pytest.raises(UpstreamLost) as lost:
                await upstream.call_tool("hang", {}, timeout_seconds=0.1)
    assert seen.authorization == [f"Bearer {TOKEN}", f"Bearer {TOKEN}"]
    shown = [repr(target), str(target), str(lost.value), repr(logs)]
    assert not [text for text in shown if TOKEN in text or "abc" in text]
    assert target.display == url.removesuffix("?key=abc")


def test_a_target_shows_no_credentials_from_its_url() -> None:
    target = UpstreamTarget("sse", url="https://user:pw@hail.test:8081/sse?token=abc#x", token=TOKEN)
    assert repr(target) == "UpstreamTarget(kind='sse', at='https://hail.test:8081/sse')"


async def test_http_upstream_down_at_startup_is_unavailable_until_it_comes_up() -> None:
    seen, sock = Seen(), free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    with anyio.fail_after(10):
        async with connect_upstream(UpstreamTarget("http", url=url), connect_timeout_seconds=1) as upstream:
            assert not upstream.connected
            with pytest.raises(UpstreamUnavailable, match=rf"Hail at {url} is not reachable .*nothing was sent"):
                await upstream.call_tool("echo", {})
            async with running(http_app(seen), sock):
                await eventually(lambda: upstream.call_tool("echo", {}))
                assert upstream.connected


async def test_http_upstream_stopped_is_unavailable_and_the_next_call_after_its_restart_reconnects() -> None:
    seen, sock = Seen(), free_socket()
    port = sock.getsockname()[1]
    target = UpstreamTarget("http", url=f"http://127.0.0.1:{port}/")
    with anyio.fail_after(10):
        async with connect_upstream(target, heartbeat_seconds=None) as upstream:
            async with running(http_app(seen), sock):
                await eventually(lambda: upstream.call_tool("echo", {}))
            with pytest.raises(UpstreamUnavailable, match=r"could not connect .* nothing was sent"):
                await upstream.call_tool("echo", {})
            assert not upstream.connected
            async with running(http_app(seen), free_socket(port)):
                await eventually(lambda: upstream.call_tool("echo", {}))
    assert seen.authorization == [None, None]


async def test_http_upstream_restarted_between_calls_is_unavailable_then_reconnects() -> None:
    seen, sock = Seen(), free_socket()
    port = sock.getsockname()[1]
    target = UpstreamTarget("http", url=f"http://127.0.0.1:{port}/")
    with anyio.fail_after(10):
        async with connect_upstream(target, heartbeat_seconds=None) as upstream:
            async with running(http_app(seen), sock):
                await eventually(lambda: upstream.call_tool("echo", {}))
            async with running(http_app(seen), free_socket(port)):
                with pytest.raises(UpstreamUnavailable, match="no longer knows this session"):
                    await upstream.call_tool("echo", {})
                await upstream.wait_connected()
                await echo(upstream)
    assert seen.authorization == [None, None]


async def test_http_401_is_unavailable_and_keeps_the_connection() -> None:
    seen, sock, refusing = Seen(), free_socket(), [False]
    target = UpstreamTarget("http", url=f"http://127.0.0.1:{sock.getsockname()[1]}/")
    with anyio.fail_after(10):
        async with running(http_app(seen, refuse=lambda: refusing[0]), sock), connect_upstream(target) as upstream:
            refusing[0] = True
            with pytest.raises(
                UpstreamUnavailable,
                match=r"refused hail-guard's token \(HTTP 401\), so nothing was sent: an operator must set HAIL_API",
            ):
                await upstream.call_tool("echo", {})
            assert upstream.connected
            refusing[0] = False
            await echo(upstream)


async def test_sse_target_calls_tools_with_the_bearer_token() -> None:
    seen, sock = Seen(), free_socket()
    target = UpstreamTarget("sse", url=f"http://127.0.0.1:{sock.getsockname()[1]}/sse", token=TOKEN)
    with anyio.fail_after(10):
        async with running(sse_app(seen), sock), connect_upstream(target) as upstream:
            assert await echo(upstream, a=1) == {"echo": {"a": 1}}
    assert seen.authorization == [f"Bearer {TOKEN}"]


async def test_stdio_target_gets_the_token_in_its_environment_and_is_restarted_after_a_crash() -> None:
    target = UpstreamTarget("stdio", command=(sys.executable, str(ECHO_SERVER)), token=TOKEN)
    with anyio.fail_after(15):
        async with connect_upstream(target) as upstream:
            first = await echo(upstream, a=1)
            assert first["token"] == TOKEN
            with pytest.raises(UpstreamLost, match="may have been sent"):
                await upstream.call_tool("crash", {})
            second = await echo(upstream, a=2)
            assert second["pid"] != first["pid"]


async def test_a_stdio_target_gets_the_token_in_the_variable_it_was_read_from() -> None:
    target = UpstreamTarget(
        "stdio", command=(sys.executable, str(ECHO_SERVER)), token=TOKEN, token_env="RESEND_API_KEY"
    )
    with anyio.fail_after(15):
        async with connect_upstream(target) as upstream:
            answer = await echo(upstream)
    assert answer["token"] == TOKEN
    assert "RESEND_API_KEY" in answer["variables"]
    assert "HAIL_API_KEY" not in answer["variables"]


async def test_the_heartbeat_replaces_an_upstream_that_died_between_calls() -> None:
    target = UpstreamTarget("stdio", command=(sys.executable, str(ECHO_SERVER)))
    with anyio.fail_after(15):
        async with connect_upstream(target, heartbeat_seconds=0.1) as upstream:
            first = await echo(upstream)
            await upstream.call_tool("exit_soon", {})
            while upstream.connected:  # noqa: ASYNC110  (no event tells when the process is gone)
                await anyio.sleep(0.05)
            await upstream.wait_connected()
            assert (await echo(upstream))["pid"] != first["pid"]


async def test_a_missing_stdio_command_is_unavailable() -> None:
    target = UpstreamTarget("stdio", command=("/nonexistent/hail-mcp",))
    with anyio.fail_after(5):
        async with connect_upstream(target, connect_timeout_seconds=1) as upstream:
            with pytest.raises(UpstreamUnavailable, match="FileNotFoundError"):
                await upstream.list_tools()


def test_a_target_without_its_address_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs a url"):
        UpstreamTarget("http", token=TOKEN)


def _validation_error() -> pydantic.ValidationError:
    try:
        types.CallToolResult.model_validate({"content": 1})
    except pydantic.ValidationError as error:
        return error
    raise AssertionError("unreachable")


def _marked(reason: str) -> MCPError:
    return MCPError(-32090, "could not connect", {"hail_guard_not_sent": reason})


REQUEST = httpx2.Request("POST", "http://hail.test/")
FOREIGN: list[tuple[BaseException, type[Exception]]] = [
    (MCPError(types.REQUEST_TIMEOUT, "Request 'tools/call' timed out"), UpstreamLost),
    (MCPError(types.CONNECTION_CLOSED, "Connection closed"), UpstreamLost),
    (MCPError(types.INVALID_REQUEST, "Session terminated"), UpstreamLost),
    (_marked("session"), UpstreamUnavailable),
    (MCPError(types.INVALID_REQUEST, "server answered a request with 202 Accepted"), UpstreamLost),
    (MCPError(types.INTERNAL_ERROR, "Server returned an error response"), UpstreamLost),
    (MCPError(types.PARSE_ERROR, "Failed to parse JSON response"), UpstreamLost),
    (MCPError(types.METHOD_NOT_FOUND, "Method not found"), UpstreamLost),
    (_marked("connect"), UpstreamUnavailable),
    (_marked("auth"), UpstreamUnavailable),
    (MCPError(-32090, "not signed in to Hail at http://hail.test/", {"hail_guard_not_sent": "signin"}), SignInRequired),
    (MCPError(-32090, "lookalike from the server"), UpstreamLost),
    (httpx2.ConnectError("refused", request=REQUEST), UpstreamUnavailable),
    (httpx2.ConnectTimeout("slow", request=REQUEST), UpstreamUnavailable),
    (httpx2.PoolTimeout("busy", request=REQUEST), UpstreamUnavailable),
    (httpx2.ReadTimeout("slow", request=REQUEST), UpstreamLost),
    (httpx2.WriteError("broken", request=REQUEST), UpstreamLost),
    (httpx2.RemoteProtocolError("dropped", request=REQUEST), UpstreamLost),
    (ConnectionRefusedError(111, "refused"), UpstreamUnavailable),
    (socket.gaierror(-2, "Name or service not known"), UpstreamUnavailable),
    (FileNotFoundError(2, "No such file", "hail-mcp"), UpstreamUnavailable),
    (ConnectionResetError(104, "reset"), UpstreamLost),
    (BrokenPipeError(32, "broken pipe"), UpstreamLost),
    (anyio.ClosedResourceError(), UpstreamLost),
    (anyio.BrokenResourceError(), UpstreamLost),
    (anyio.EndOfStream(), UpstreamLost),
    (TimeoutError(), UpstreamLost),
    (RuntimeError("Invalid structured content returned by tool send_email"), UpstreamLost),
    (_validation_error(), UpstreamLost),
    (ValueError("anything else"), UpstreamLost),
    (ExceptionGroup("all refused", [ConnectionRefusedError(), httpx2.ConnectError("x")]), UpstreamUnavailable),
    (ExceptionGroup("mixed", [ConnectionRefusedError(), anyio.BrokenResourceError()]), UpstreamLost),
]


SECRET = "tok-SECRET-1234"
NOT_SENT = (
    httpx2.ConnectError,
    httpx2.ConnectTimeout,
    httpx2.PoolTimeout,
    ConnectionRefusedError,
    FileNotFoundError,
    PermissionError,
    socket.gaierror,
)
"""The foreign failures that prove nothing left (besides the MCPErrors `_NotSentTransport` marks)."""


def _made(cls: type[Exception], message: str) -> Exception:
    """An instance of `cls` carrying `message` where its constructor takes one."""
    response = httpx2.Response(502, request=REQUEST)
    for attempt in (
        lambda: cls(message, request=REQUEST, response=response),  # type: ignore[call-arg]
        lambda: cls(message, request=REQUEST),  # type: ignore[call-arg]
        lambda: cls(5, message) if issubclass(cls, OSError) else cls(message),
        cls,
    ):
        try:
            return attempt()
        except TypeError:
            continue
    raise AssertionError(f"cannot make a {cls.__name__}")


def every_foreign_failure(message: str) -> list[Exception]:
    """What the upstream can meet: every httpx2 and anyio exception class (walked below each one the
    library names), every built-in, socket and ssl OSError, the MCP SDK's errors, pydantic's, and the
    plain ones a transport raises."""
    named = [cls for library in (httpx2, anyio) for _, cls in inspect.getmembers(library, inspect.isclass)]
    classes = {sub for cls in named if issubclass(cls, Exception) for sub in subclasses(cls)}
    classes.discard(anyio.BrokenWorkerInterpreter)  # raised only by subinterpreter workers; hail-guard runs none
    classes |= {cls for cls in subclasses(OSError) if cls.__module__ in ("builtins", "socket", "ssl")}
    made = [_made(cls, message) for cls in classes | {RuntimeError, ValueError, TimeoutError}]
    codes = (types.REQUEST_TIMEOUT, types.CONNECTION_CLOSED, types.PARSE_ERROR, types.INTERNAL_ERROR, -32602, -1)
    return [*made, *(MCPError(code, message) for code in codes), _validation_error()]


def test_every_foreign_failure_the_upstream_can_meet_is_mapped_naming_hail_and_never_the_token() -> None:
    unavailable: set[type[Exception]] = set()
    for foreign in every_foreign_failure(f"boom, sent with Bearer {SECRET}"):
        mapped = map_error(foreign, target="http://hail.test/", timeout_seconds=45, secrets={SECRET})
        assert isinstance(mapped, UpstreamUnavailable | UpstreamLost), foreign
        assert "http://hail.test/" in str(mapped)
        assert SECRET not in str(mapped)
        if isinstance(mapped, UpstreamUnavailable):
            unavailable.add(type(foreign))
    assert unavailable == set(NOT_SENT)  # "nothing was sent" only where nothing can have left


def test_a_targets_secrets_are_its_token_and_every_spelling_of_its_password() -> None:
    target = UpstreamTarget("http", url="https://hg:p%40ss@hail.test/mcp?password=other", token=SECRET)
    assert target.secrets == {SECRET, "p%40ss", "p@ss", "other"}
    assert UpstreamTarget("http", url="https://hail.test/mcp").secrets == frozenset()


@pytest.mark.parametrize(("foreign", "expected"), FOREIGN, ids=lambda v: type(v).__name__)
def test_every_foreign_failure_maps_to_unavailable_or_lost(foreign: BaseException, expected: type[Exception]) -> None:
    mapped = map_error(foreign, target="http://hail.test/", timeout_seconds=45)
    assert type(mapped) is expected
    assert "http://hail.test/" in str(mapped)
