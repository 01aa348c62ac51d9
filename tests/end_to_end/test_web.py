"""hail-guard over HTTP: both transports on a real uvicorn, every refusal, health, metrics, shutdown."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import structlog
from mcp import Client, MCPError, types
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from starlette.types import Receive, Scope, Send

from hail_guard.app import Opened, serve_http, serve_http_until_signalled
from hail_guard.config import HttpSettings, LedgerSettings, Settings, UpstreamSettings
from hail_guard.errors import ConfigError
from hail_guard.ledger import open_ledger
from hail_guard.listener import listening, serve_app
from hail_guard.logs import REDACTED, redact_secrets
from hail_guard.metrics import Metrics
from hail_guard.models import State
from hail_guard.sandbox import Sandbox
from hail_guard.sandbox.http import build_http_app as build_sandbox_app
from hail_guard.server import Proxy
from hail_guard.upstream import UpstreamTarget, connect_upstream
from hail_guard.web import build_http_app
from tests.conftest import Harness, data, email, open_harness

TOKEN = "agent-token-0123456789abcdef"
TOKEN_ENV = "HAIL_GUARD_WEB_TEST_TOKEN"
KEY = "c1:l1:email:intro"
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}
TOOL_CALL = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_operations", "arguments": {}}}


@pytest.fixture(autouse=True)
def _no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def http_settings(**changes: Any) -> HttpSettings:
    base: dict[str, Any] = {"token": SecretStr(TOKEN), "token_env": TOKEN_ENV, "shutdown_grace_seconds": 0}
    return HttpSettings(**{**base, **changes})


@dataclass
class Web:
    url: str
    harness: Harness
    metrics: Metrics
    _scope: anyio.CancelScope
    _stopped: anyio.Event

    async def stop(self) -> None:
        """Shut the server down (as a cancelled `serve_http` does) and wait until it has."""
        self._scope.cancel()
        await self._stopped.wait()


async def instrumented(harness: Harness, metrics: Metrics, wrap_upstream: Callable[[Any], Any] | None) -> Opened:
    """The harness's ledger and upstream, and a proxy over them, reporting to `metrics` as `open_proxy(metrics=...)`
    wires them."""
    upstream = wrap_upstream(harness.proxy.upstream) if wrap_upstream is not None else harness.proxy.upstream
    ledger, upstream = metrics.timed(harness.ledger, "ledger"), metrics.timed(upstream, "upstream")
    wired = Proxy(ledger, upstream, harness.settings, observer=metrics)
    await wired.refresh_tools()
    return Opened(ledger, upstream, wired)


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path,
    *faults: str,
    http: HttpSettings | None = None,
    wrap_upstream: Callable[[Any], Any] | None = None,
    **guard: Any,
) -> AsyncIterator[Web]:
    """A real uvicorn on 127.0.0.1 (a free port) serving hail-guard over the in-process sandbox."""
    http = http or http_settings()
    async with open_harness(tmp_path, *faults, **guard) as harness, anyio.create_task_group() as tg:
        metrics = Metrics()
        opened = await instrumented(harness, metrics, wrap_upstream)
        app = build_http_app(opened.proxy, http, ledger=opened.ledger, metrics=metrics)
        scope, stopped = anyio.CancelScope(), anyio.Event()

        async def serve(*, task_status: anyio.abc.TaskStatus[str]) -> None:
            with scope, listening("127.0.0.1", 0) as sock:
                await serve_app(app, sock, settings=http, task_status=task_status)
            stopped.set()

        url = await tg.start(serve)
        web = Web(url, harness, metrics, scope, stopped)
        yield web
        await web.stop()


@contextlib.asynccontextmanager
async def over_http(url: str, mode: str = "legacy", token: str = TOKEN) -> AsyncIterator[Client]:
    timeout = httpx2.Timeout(10, read=30)
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=timeout) as http,
        Client(streamable_http_client(f"{url}mcp", http_client=http), mode=mode) as client,
    ):
        yield client


def over_sse(url: str) -> Client:
    return Client(sse_client(f"{url}sse", headers={"Authorization": f"Bearer {TOKEN}"}), mode="legacy")


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    return 0.0


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_send_over_streamable_http_reaches_hail_once_and_the_repeat_is_answered_from_the_ledger(
    tmp_path: Path, mode: str
) -> None:
    async with running(tmp_path) as web, over_http(web.url, mode) as agent:
        names = {tool.name for tool in (await agent.list_tools()).tools}
        assert {"send_email", "reconcile", "get_operation", "list_operations"} <= names
        first = await agent.call_tool("send_email", email())
        again = await agent.call_tool("send_email", email())
        assert not first.is_error
        assert data(first)["hail_guard"]["state"] == "accepted"
        assert data(again)["hail_guard"]["replayed"] is True
        assert [entry["idempotency_key"] for entry in web.harness.sandbox.outbox] == [KEY]


async def test_sse_sessions_share_one_ledger_and_upstream_with_streamable_http(tmp_path: Path) -> None:
    async with running(tmp_path) as web:
        async with over_http(web.url) as agent:
            first = await agent.call_tool("send_email", email())
        async with over_sse(web.url) as agent:
            assert "send_email" in {tool.name for tool in (await agent.list_tools()).tools}
            again = await agent.call_tool("send_email", email())
        assert data(again)["hail_guard"] == {**data(first)["hail_guard"], "replayed": True}
        assert len(web.harness.sandbox.outbox) == 1


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "mcp"), ("GET", "mcp"), ("GET", "sse"), ("POST", "messages/?session_id=00")]
)
async def test_every_mcp_path_without_a_token_gets_401_with_a_bearer_challenge(
    tmp_path: Path, method: str, path: str
) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient() as http:
        response = await http.request(method, f"{web.url}{path}", json=INITIALIZE, headers=MCP_HEADERS)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer ")
    assert "bearer token is required" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "authorization", [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", f"Token {TOKEN}", "Bearer"]
)
async def test_a_wrong_token_gets_401(tmp_path: Path, authorization: str) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient() as http:
        headers = {**MCP_HEADERS, "Authorization": authorization}
        response = await http.post(f"{web.url}mcp", json=INITIALIZE, headers=headers)
    assert response.status_code == 401
    assert "Bearer" in response.headers["WWW-Authenticate"]


async def test_an_mcp_client_with_a_wrong_token_is_refused(tmp_path: Path) -> None:
    async with running(tmp_path) as web:
        refused = pytest.RaisesGroup(pytest.RaisesExc(MCPError, match="HTTP 401: "), flatten_subgroups=True)
        with refused, anyio.fail_after(10):
            async with over_http(web.url, token="not-the-token") as agent:
                await agent.list_tools()
        assert web.harness.sandbox.outbox == []


async def test_a_foreign_origin_gets_403_and_loopback_or_listed_origins_pass(tmp_path: Path) -> None:
    http = http_settings(allowed_origins=["https://console.example.com"])
    async with running(tmp_path, http=http) as web, httpx2.AsyncClient() as client:

        async def status(origin: str) -> int:
            headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}", "Origin": origin}
            return (await client.post(f"{web.url}mcp", json=INITIALIZE, headers=headers)).status_code

        assert await status("http://attacker.example") == 403
        assert await status("https://console.example.com.attacker.example") == 403
        assert await status("null") == 403
        assert await status("https://console.example.com") == 200
        assert await status("http://localhost:3000") == 200


async def test_a_foreign_host_gets_403_even_with_the_token(tmp_path: Path) -> None:
    http = http_settings(allowed_hosts=["hail-guard.internal"])
    async with running(tmp_path, http=http) as web, httpx2.AsyncClient() as client:

        async def status(host: str) -> int:
            headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}", "Host": host}
            return (await client.post(f"{web.url}mcp", json=INITIALIZE, headers=headers)).status_code

        assert await status("attacker.example:8765") == 403  # DNS rebinding: a name that points at us
        assert await status("hail-guard.internal:8765") == 200
        assert await status("localhost") == 200


@pytest.mark.parametrize(
    "host", ["127.0.0.1:1@evil.com", "localhost:80@evil.com", "[::1]:1@evil.com", "127.0.0.1:99999", "localhost:+80"]
)
async def test_a_loopback_host_whose_port_is_not_a_port_gets_403(tmp_path: Path, host: str) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient() as client:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        as_host = await client.post(f"{web.url}mcp", json=INITIALIZE, headers={**headers, "Host": host})
        as_origin = await client.post(f"{web.url}mcp", json=INITIALIZE, headers={**headers, "Origin": f"http://{host}"})
        console = await client.get(f"{web.url}console/login", headers={"Host": host})
    assert (as_host.status_code, as_origin.status_code, console.status_code) == (403, 403, 403)


async def test_an_oversized_body_gets_413_whether_declared_or_streamed(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(max_body_bytes=1024)) as web, httpx2.AsyncClient() as http:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        declared = await http.post(f"{web.url}mcp", content=b" " * 2048, headers=headers)

        async def chunks() -> AsyncIterator[bytes]:
            yield b" " * 800
            yield b" " * 800

        streamed = await http.post(f"{web.url}messages/?session_id=00", content=chunks(), headers=headers)
    assert (declared.status_code, streamed.status_code) == (413, 413)


async def test_tool_calls_and_session_starts_over_the_rate_limit_get_429_with_retry_after(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(rate_limit_per_minute=3)) as web:
        async with over_http(web.url) as agent:  # `initialize` takes one
            for _ in range(2):
                assert not (await agent.call_tool("list_operations", {})).is_error
            with pytest.raises(MCPError, match="rate limit"):
                await agent.call_tool("list_operations", {})
            assert (await agent.list_tools()).tools  # only tool calls and session starts are limited
        async with httpx2.AsyncClient() as http:
            headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
            response = await http.post(f"{web.url}mcp", json=TOOL_CALL, headers=headers)
        assert response.status_code == 429
        assert 1 <= int(response.headers["Retry-After"]) <= 30
        assert response.json()["error"]["data"] == {"retry_after_seconds": int(response.headers["Retry-After"])}


async def test_without_a_token_on_loopback_mcp_requests_pass(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(token=None)) as web, httpx2.AsyncClient() as http:
        response = await http.post(f"{web.url}mcp", json=INITIALIZE, headers=MCP_HEADERS)
    assert response.status_code == 200


def settings_in(tmp_path: Path, **http: Any) -> Settings:
    return Settings(
        ledger=LedgerSettings(url=f"sqlite:///{tmp_path / 'ledger.db'}"),
        upstream=UpstreamSettings(sandbox_outbox=str(tmp_path / "outbox.jsonl"), timeout_seconds=5),
        http=http_settings(**http),
    )


async def test_a_non_loopback_address_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"refusing to listen on 0\.0\.0\.0.*HAIL_GUARD_WEB_TEST_TOKEN"):
        await serve_http(settings_in(tmp_path, token=None), host="0.0.0.0", port=0)  # noqa: S104
    assert not (tmp_path / "ledger.db").exists()  # refused before anything was opened


async def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with listening("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: the port is already in use"):
            await serve_http_until_signalled(settings_in(tmp_path), port=port)  # as the CLI runs it: unwrapped
    assert not (tmp_path / "ledger.db").exists()


async def test_sigterm_shuts_the_server_down_gracefully(tmp_path: Path) -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            url = await tg.start(partial(serve_http_until_signalled, settings_in(tmp_path), port=0))
            async with over_http(url) as agent:
                assert not (await agent.call_tool("send_email", email())).is_error
            os.kill(os.getpid(), signal.SIGTERM)  # its receiver is installed before `started`
    async with httpx2.AsyncClient() as http:
        with pytest.raises(httpx2.ConnectError):
            await http.get(f"{url}healthz")


async def test_serve_http_from_settings_serves_until_cancelled(tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        url = await tg.start(partial(serve_http, settings_in(tmp_path), port=0))
        assert url.startswith("http://127.0.0.1:")
        async with over_http(url) as agent:
            first = await agent.call_tool("send_email", email())
        async with httpx2.AsyncClient() as http:
            ready = await http.get(f"{url}readyz")
            metrics = (await http.get(f"{url}metrics")).text
        tg.cancel_scope.cancel()
    assert data(first)["hail_guard"]["state"] == "accepted"
    assert ready.status_code == 200
    assert sample(metrics, "hail_guard_tool_calls_total", tool="send_email", outcome="accepted") == 1
    assert len((tmp_path / "outbox.jsonl").read_text().splitlines()) == 1


async def test_readiness_says_when_hail_has_a_url_but_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a token a Hail that checks tokens refuses every send: shown, not failed (a self-hosted
    Hail may not check)."""
    from hail_guard.sandbox import serve_http as serve_sandbox

    monkeypatch.delenv("HAIL_API_KEY", raising=False)
    async with anyio.create_task_group() as tg:
        hail = await tg.start(serve_sandbox, Sandbox(), "127.0.0.1", 0, None)
        settings = settings_in(tmp_path).model_copy(update={"upstream": UpstreamSettings(url=hail)})
        url = await tg.start(partial(serve_http, settings, port=0))
        async with httpx2.AsyncClient() as http:
            ready = await http.get(f"{url}readyz")
        tg.cancel_scope.cancel()
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    [warning] = ready.json()["warnings"]
    assert warning.startswith("HAIL_API_KEY is not set")


async def test_health_and_readiness_need_no_token(tmp_path: Path) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient() as http:
        health = await http.get(f"{web.url}healthz")
        ready = await http.get(f"{web.url}readyz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready", "ledger": "ok", "upstream": "ok"})


async def test_readiness_is_503_naming_the_part_that_is_down(tmp_path: Path) -> None:
    with listening("127.0.0.1", 0) as closed:
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/mcp"
    target = UpstreamTarget(kind="http", url=dead)
    async with (
        open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        connect_upstream(target, connect_timeout_seconds=2, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream)
        app = build_http_app(proxy, http_settings(), ledger=ledger)
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            ready = await http.get("/readyz")
            await ledger.aclose()  # as if its disk went away
            broken = await http.get("/readyz")
    assert ready.status_code == 503
    assert ready.json() == {"status": "not_ready", "ledger": "ok", "upstream": "unreachable"}
    assert (broken.status_code, broken.json()["ledger"]) == (503, "unavailable")


async def test_metrics_count_calls_operations_and_latency(tmp_path: Path) -> None:
    async with running(tmp_path) as web:
        async with over_http(web.url) as agent:
            await agent.call_tool("send_email", email())
            await agent.call_tool("send_email", email())
            await agent.call_tool("no_such_tool", {})
        async with httpx2.AsyncClient() as http:
            await http.post(f"{web.url}mcp", json=INITIALIZE, headers=MCP_HEADERS)  # no token: refused
            response = await http.get(f"{web.url}metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert sample(text, "hail_guard_tool_calls_total", tool="send_email", outcome="accepted") == 1
    assert sample(text, "hail_guard_tool_calls_total", tool="send_email", outcome="replayed") == 1
    assert sample(text, "hail_guard_tool_calls_total", tool="unknown", outcome="error") == 1
    assert sample(text, "hail_guard_tool_call_seconds_count", tool="send_email") == 2
    assert sample(text, "hail_guard_operations", state="accepted") == 1
    assert sample(text, "hail_guard_operations", state="unknown") == 0
    assert sample(text, "hail_guard_unknown_operations") == 0
    assert sample(text, "hail_guard_review_operations") == 0
    assert sample(text, "hail_guard_upstream_seconds_count", method="call_tool") == 1
    assert sample(text, "hail_guard_ledger_seconds_count", method="begin_send") == 2
    assert sample(text, "hail_guard_http_refusals_total", status="401") == 1


def connect(url: str, transport: str) -> contextlib.AbstractAsyncContextManager[Client]:
    """An agent over `transport`: "sse", or Streamable HTTP in client mode "legacy" / "auto"."""
    return over_sse(url) if transport == "sse" else over_http(url, transport)


# The SDK's SSE server transport closes a session's streams only when its response ends normally: cut by
# the shutdown, it leaves them to the garbage collector. The test collects them itself, so that the
# warning lands here, about this known leak, rather than in whichever test runs next.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function MemoryObject:pytest.PytestUnraisableExceptionWarning"
)
@pytest.mark.parametrize("transport", ["legacy", "auto", "sse"])
async def test_shutdown_with_a_send_in_flight_records_it_unknown_within_a_bound(tmp_path: Path, transport: str) -> None:
    async with running(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=30) as web:
        async with anyio.create_task_group() as agents:

            async def agent_sends() -> None:
                with contextlib.suppress(Exception):  # its connection is cut by the shutdown
                    async with connect(web.url, transport) as agent:
                        await agent.call_tool("send_email", email())

            agents.start_soon(agent_sends)
            await web.harness.sandbox.wait_for_outbox(1)  # Hail has it; the answer never comes
            with anyio.fail_after(10):  # the bound: grace (0 here) + the guard's shielded final write
                await web.stop()
            agents.cancel_scope.cancel()
        operation = await web.harness.ledger.find_by_key(KEY)
    assert operation is not None
    assert operation.state is State.UNKNOWN
    assert len(web.harness.sandbox.outbox) == 1
    gc.collect()


class _Entered:
    """The upstream, telling the test when a call has reached it (a probe, not a fake)."""

    def __init__(self, upstream: Any) -> None:
        self.upstream, self.entered = upstream, anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.upstream, name)

    async def call_tool(self, name: str, arguments: dict[str, Any], **options: Any) -> types.CallToolResult:
        self.entered.set()
        result: types.CallToolResult = await self.upstream.call_tool(name, arguments, **options)
        return result


async def test_shutdown_lets_a_send_in_flight_finish_within_the_grace(tmp_path: Path) -> None:
    answers: list[types.CallToolResult] = []
    probes: list[_Entered] = []

    def probe(upstream: Any) -> _Entered:
        probes.append(_Entered(upstream))
        return probes[-1]

    http = http_settings(shutdown_grace_seconds=5)
    async with (
        running(tmp_path, "send_email:1:delay:300", http=http, wrap_upstream=probe) as web,
        anyio.create_task_group() as agents,
    ):

        async def agent_sends() -> None:
            with contextlib.suppress(Exception):  # closing the session fails: the server no longer listens
                async with over_http(web.url) as agent:
                    await agent.list_tools()  # else the client lists them after the answer, to check it
                    answers.append(await agent.call_tool("send_email", email()))

        agents.start_soon(agent_sends)
        await probes[0].entered.wait()  # the send is on its way to Hail (which takes 300 ms)
        with anyio.fail_after(5):
            await web.stop()
    [answer] = answers
    assert data(answer)["hail_guard"]["state"] == "accepted"
    assert len(web.harness.sandbox.outbox) == 1


async def test_the_agent_token_reaches_neither_hail_nor_the_logs(tmp_path: Path) -> None:
    seen: list[str] = []
    sandbox = Sandbox()
    upstream_app = build_sandbox_app(sandbox, "upstream-token")

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.extend(value.decode() for name, value in scope["headers"] if name == b"authorization")
        await upstream_app(scope, receive, send)

    with listening("127.0.0.1", 0) as sock:
        async with anyio.create_task_group() as tg:
            hail_url = await tg.start(
                partial(serve_app, recording, sock, settings=HttpSettings(shutdown_grace_seconds=0))
            )
            target = UpstreamTarget(kind="http", url=hail_url, token="upstream-token")
            with structlog.testing.capture_logs() as logs:
                async with (
                    connect_upstream(target, heartbeat_seconds=None) as upstream,
                    running(tmp_path, wrap_upstream=lambda _: upstream) as web,
                    httpx2.AsyncClient() as http,
                ):
                    async with over_http(web.url) as agent:
                        sent = await agent.call_tool("send_email", email())
                    wrong = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}x"}  # refusals are logged too
                    assert (await http.post(f"{web.url}mcp", json=INITIALIZE, headers=wrong)).status_code == 401
            tg.cancel_scope.cancel()
    assert data(sent)["hail_guard"]["state"] == "accepted"
    assert [entry["idempotency_key"] for entry in sandbox.outbox] == [KEY]
    assert seen
    assert set(seen) == {"Bearer upstream-token"}
    assert TOKEN not in repr(logs)


def test_redaction_masks_secrets_at_any_depth_and_in_text() -> None:
    event = redact_secrets(
        None,
        "info",
        {
            "event": "request",
            "headers": {"Authorization": f"Bearer {TOKEN}", "X-Api-Key": "k-123", "Accept": "text/plain"},
            "url": f"https://hail.example/mcp?token={TOKEN}&page=2",
            "error": f"401 for Authorization: Bearer {TOKEN}",
            "items": [{"api_key": "k-456"}, f"bearer {TOKEN}"],
            "token": None,
            "key": KEY,
        },
    )
    assert TOKEN not in repr(event)
    assert "k-123" not in repr(event)
    assert "k-456" not in repr(event)
    assert event["headers"] == {"Authorization": REDACTED, "X-Api-Key": REDACTED, "Accept": "text/plain"}
    assert event["url"] == f"https://hail.example/mcp?token={REDACTED}&page=2"
    assert event["key"] == KEY  # idempotency keys are what logs are for
    assert event["token"] is None
