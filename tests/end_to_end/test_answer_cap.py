"""One cap on the size of an upstream's answer, on every transport: Streamable HTTP (a JSON body, an event),
the SSE transport and stdio. Reading stops at the cap (memory stays bounded: the bytes read and the bytes the
upstream got to send are counted); a send whose answer is too large is `unknown`, its answer never stored."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import uvicorn
from anyio.abc import TaskStatus
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from structlog.testing import capture_logs

from hail_guard.errors import UpstreamLost
from hail_guard.guard import GuardSettings
from hail_guard.ledger import open_ledger
from hail_guard.models import State
from hail_guard.sandbox import Sandbox
from hail_guard.sandbox.http import build_http_app
from hail_guard.server import Proxy
from hail_guard.transports import MAX_ANSWER_BYTES
from hail_guard.upstream import Upstream, UpstreamTarget, connect_upstream
from tests.conftest import Harness, data, email
from tests.end_to_end.test_upstream import Seen, echo, free_socket, make_upstream, sse_app

NOMINAL_BYTES = 200 * 1024 * 1024
"""What the upstream would send if it were let: 200 MB (it once took 1.3 GB to read)."""
CHUNK = b"x" * 65536
READ_AHEAD_BYTES = 65536
"""How far past the cap one read may reach (one chunk of a socket or a pipe)."""
OVERSIZED_SERVER = Path(__file__).parents[1] / "oversized_stdio_server.py"


class Oversized:
    """ASGI around an upstream: a `tools/call` of `tool` is handled by the upstream (a send is made), and its
    answer replaced by a JSON-RPC result of `NOMINAL_BYTES`, streamed a chunk at a time until the client goes
    away: as the POST's JSON body (`json`), as one event of the POST's stream (`event`), or as one event of the
    session's GET stream, where the SSE transport's answers go (`stream`). `sent` counts what the client took
    (the server's socket buffer is small)."""

    def __init__(self, app: ASGIApp, tool: str, *, mode: str = "json") -> None:
        self.app, self.tool, self.mode = app, tool, mode
        self.calls: set[Any] = set()
        self.sent = 0
        self.finished = anyio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, self._swapping(receive, send) if self.mode == "stream" else send)
            return
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        call, replayed = json.loads(body), _replaying(body, receive)
        if call.get("method") != "tools/call" or call["params"]["name"] != self.tool:
            await self.app(scope, replayed, send)
        elif self.mode == "stream":
            self.calls.add(call["id"])
            await self.app(scope, replayed, send)
        else:
            await self.app(scope, replayed, _ignored)
            kind = b"text/event-stream" if self.mode == "event" else b"application/json"
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
            await self._answer(call["id"], receive, send)

    def _swapping(self, receive: Receive, send: Send) -> Send:
        async def swap(message: Message) -> None:
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            for line in body.splitlines():
                answered = json.loads(line[6:]) if line.startswith(b"data: {") else {}
                if answered.get("id") in self.calls and "result" in answered:
                    self.calls.discard(answered["id"])  # a new session counts its ids from the start again
                    await self._answer(answered["id"], receive, send)
                    return
            await send(message)

        return swap

    async def _answer(self, request_id: Any, receive: Receive, send: Send) -> None:
        head = (
            b'{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"' % json.dumps(request_id).encode()
        )
        gone = anyio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                part = (b"" if self.mode == "json" else b"event: message\r\ndata: ") + head
                while self.sent < NOMINAL_BYTES and not gone.is_set():
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    self.sent += len(part)
                    part = CHUNK
                    await anyio.lowlevel.checkpoint()  # a send to a client that left returns at once
                tg.cancel_scope.cancel()
        finally:  # the SSE transport's stream is cancelled when its client leaves
            self.finished.set()


async def _ignored(message: Message) -> None:
    pass


def _replaying(body: bytes, receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _serve(app: ASGIApp, sock: socket.socket, *, task_status: TaskStatus[uvicorn.Server]) -> None:
    config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=0, lifespan="on")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    task_status.started(server)
    await server.main_loop()
    await server.shutdown(sockets=[sock])


@asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[int]:
    """`app` on a free port, with a small send buffer (so what it sent is what the client took); its port."""
    sock = free_socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # the connections accepted inherit it
    async with anyio.create_task_group() as tg:
        server = await tg.start(_serve, app, sock)
        yield sock.getsockname()[1]
        server.should_exit = True


def read_bytes(logs: Sequence[Mapping[str, Any]]) -> int:
    [refused] = [entry for entry in logs if entry["event"] == "upstream_answer_too_large"]
    assert refused["limit_bytes"] == MAX_ANSWER_BYTES
    return int(refused["read_bytes"])


async def lost_and_still_connected(upstream: Upstream, tool: str) -> str:
    with pytest.raises(UpstreamLost) as lost:
        await upstream.call_tool(tool, {})
    await upstream.wait_connected()
    assert await echo(upstream, after=1) == {"echo": {"after": 1}}  # the next call is answered
    return str(lost.value)


@pytest.mark.parametrize(("kind", "mode"), [("http", "json"), ("http", "event"), ("sse", "stream")])
async def test_an_answer_over_the_cap_is_lost_after_reading_no_more_than_the_cap(kind: str, mode: str) -> None:
    seen = Seen()
    inner = make_upstream(seen).streamable_http_app(streamable_http_path="/") if kind == "http" else sse_app(seen)
    app = Oversized(inner, "echo_big", mode=mode)
    with anyio.fail_after(30), capture_logs() as logs:
        async with served(app) as port:
            url = f"http://127.0.0.1:{port}/" + ("sse" if kind == "sse" else "")
            async with connect_upstream(UpstreamTarget(kind, url=url), heartbeat_seconds=None) as upstream:  # type: ignore[arg-type]
                said = await lost_and_still_connected(upstream, "echo_big")
            await app.finished.wait()
    assert "may have been sent" in said
    assert app.sent < NOMINAL_BYTES // 8  # it stopped at the cap: it never took the 200 MB
    if mode == "json":  # hail-guard's own count (an event is refused by the SDK's reader, at the same cap)
        assert MAX_ANSWER_BYTES < read_bytes(logs) <= MAX_ANSWER_BYTES + READ_AHEAD_BYTES
        assert f"larger than hail-guard's cap of {MAX_ANSWER_BYTES} bytes" in said


async def test_a_stdio_answer_over_the_cap_is_lost_after_reading_no_more_than_the_cap(tmp_path: Path) -> None:
    written = tmp_path / "written"
    command = (sys.executable, str(OVERSIZED_SERVER), str(written), str(NOMINAL_BYTES))
    with anyio.fail_after(30), capture_logs() as logs:
        async with connect_upstream(UpstreamTarget("stdio", command=command), heartbeat_seconds=None) as upstream:
            said = await lost_and_still_connected(upstream, "echo_big")
    assert "may have been sent" in said
    assert MAX_ANSWER_BYTES < read_bytes(logs) <= MAX_ANSWER_BYTES + READ_AHEAD_BYTES
    unread = 65536 + 2 * 65536  # what the pipe holds, and asyncio's buffer before it stops reading the pipe
    assert int(written.read_text()) <= MAX_ANSWER_BYTES + READ_AHEAD_BYTES + unread + len(CHUNK)


async def test_a_send_whose_answer_is_over_the_cap_is_unknown_and_its_answer_is_not_stored(tmp_path: Path) -> None:
    sandbox = Sandbox()
    app = Oversized(build_http_app(sandbox, token=None), "send_email")
    settings = GuardSettings(timeout_seconds=10)
    with anyio.fail_after(30):
        async with (
            served(app) as port,
            open_ledger(str(tmp_path / "ledger.db")) as ledger,
            connect_upstream(UpstreamTarget("http", url=f"http://127.0.0.1:{port}/"), heartbeat_seconds=None) as up,
        ):
            proxy = Proxy(ledger, up, settings)
            await proxy.refresh_tools()
            harness = Harness(sandbox, ledger, proxy, settings)
            answer = data(await harness.call("send_email", email()))
            [operation] = await ledger.search_operations()
    assert answer["hail_guard"]["state"] == "unknown"
    assert len(sandbox.outbox) == 1  # it was sent: only its answer was too large
    assert (operation.state, operation.result) == (State.UNKNOWN, None)
    assert f"larger than hail-guard's cap of {MAX_ANSWER_BYTES} bytes" in (operation.last_error or "")
    assert app.sent < NOMINAL_BYTES // 8
