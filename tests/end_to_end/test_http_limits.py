"""The HTTP server's limits: connections, sessions, probes' Host check, tokens, and accept errors."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, suppress
from pathlib import Path

import anyio
import anyio.abc
import httpx2
import pytest

from hail_guard.app import serve_http
from hail_guard.config import HttpSettings
from hail_guard.errors import ConfigError
from hail_guard.listener import PROBE_CONNECTIONS
from tests.end_to_end.test_bad_input import port_of, receive_all
from tests.end_to_end.test_web import INITIALIZE, MCP_HEADERS, TOKEN, http_settings, running, settings_in

LONG_TOKEN = "t" * 32


async def test_a_connection_past_the_cap_is_answered_503_and_closed_while_the_others_are_served(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, http=http_settings(max_connections=3)) as web:
        port = port_of(web.url)
        async with AsyncExitStack() as held:
            held_open = [await held.enter_async_context(await anyio.connect_tcp("127.0.0.1", port)) for _ in "abc"]
            for _ in range(PROBE_CONNECTIONS):  # kept for the health probe: they wait for a request
                await held.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
            async with await anyio.connect_tcp("127.0.0.1", port) as one_too_many:
                with anyio.fail_after(10):
                    refused = await receive_all(one_too_many)
            await held_open[0].send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            served = await held_open[0].receive()
        async with httpx2.AsyncClient() as http:  # the held ones closed: there is room again
            assert (await http.get(f"{web.url}healthz")).status_code == 200
    assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"too many connections" in refused
    assert served.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_health_is_answered_when_every_connection_is_taken_and_nothing_else_is(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(max_connections=2)) as web, AsyncExitStack() as held:
        port = port_of(web.url)
        for _ in "ab":
            await held.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
        with anyio.fail_after(10):
            health = [await asked(port, "GET /healthz") for _ in range(PROBE_CONNECTIONS + 1)]
            other = await asked(port, f"POST /mcp HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 0")
    assert all(answer.startswith(b"HTTP/1.1 200 OK\r\n") for answer in health)
    assert all(b"connection: close" in answer.lower() for answer in health)  # nothing lingers on a probe's place
    assert other.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"too many connections" in other


async def asked(port: int, request: str) -> bytes:
    """Everything answered to one request (`METHOD /path` and any headers) on a connection of its own."""
    if "HTTP/1.1" not in request:
        request += " HTTP/1.1"
    async with await anyio.connect_tcp("127.0.0.1", port) as connection:
        await connection.send(f"{request}\r\nHost: 127.0.0.1\r\n\r\n".encode())
        return await receive_all(connection)


async def open_stream(held: AsyncExitStack, port: int, path: str = "/sse", **headers: str) -> bytes:
    """`GET path` (with `headers`, `_` for `-`) on a connection kept open in `held`; the answer's status line."""
    connection = await held.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
    extra = "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
    await connection.send(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Accept: text/event-stream\r\n{extra}\r\n".encode()
    )
    with anyio.fail_after(10):
        return (await connection.receive()).partition(b"\r\n")[0]


async def session_id(url: str) -> str:
    """A new Streamable HTTP session's id."""
    async with httpx2.AsyncClient(timeout=10) as http:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        answer = await http.post(f"{url}mcp", json=INITIALIZE, headers=headers)
    return answer.headers["mcp-session-id"]


async def still_served(url: str) -> dict[str, int]:
    """The status of `/healthz`, a new MCP session and the console, each on a new connection."""
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
    async with httpx2.AsyncClient(timeout=10) as http:
        return {
            "healthz": (await http.get(f"{url}healthz")).status_code,
            "mcp": (await http.post(f"{url}mcp", json=INITIALIZE, headers=headers)).status_code,
            "console": (await http.get(f"{url}console/login")).status_code,
        }


async def test_streams_past_a_clients_cap_get_429_and_everything_else_is_still_served(tmp_path: Path) -> None:
    http = http_settings(max_connections=8, max_streams_per_client=2)
    async with running(tmp_path, http=http) as web, AsyncExitStack() as held:
        session = await session_id(web.url)
        port = port_of(web.url)
        opened = [await open_stream(held, port), await open_stream(held, port, "/mcp", mcp_session_id=session)]
        opened.append(await open_stream(held, port))
        served = await still_served(web.url)
    assert opened == [b"HTTP/1.1 200 OK"] * 2 + [b"HTTP/1.1 429 Too Many Requests"]
    assert served == {"healthz": 200, "mcp": 200, "console": 200}


async def test_streams_never_take_every_connection_whoever_opens_them(tmp_path: Path) -> None:
    """100 streams once held all 100 connections: `/mcp`, `/console` and `/healthz` answered 503."""
    http = http_settings(max_connections=6, trusted_proxies=["127.0.0.1"])
    async with running(tmp_path, http=http) as web, AsyncExitStack() as held:
        opened = [await open_stream(held, port_of(web.url), x_forwarded_for=f"10.0.0.{n}") for n in range(6)]
        served = await still_served(web.url)
    assert opened == [b"HTTP/1.1 200 OK"] * 3 + [b"HTTP/1.1 503 Service Unavailable"] * 3  # half the connections
    assert served == {"healthz": 200, "mcp": 200, "console": 200}


async def test_opening_sse_streams_counts_against_the_rate_limit(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(rate_limit_per_minute=2)) as web:
        opened = []
        for _ in range(3):
            async with AsyncExitStack() as held:
                opened.append(await open_stream(held, port_of(web.url)))
    assert opened == [b"HTTP/1.1 200 OK"] * 2 + [b"HTTP/1.1 429 Too Many Requests"]


async def test_sessions_past_the_cap_get_503_and_an_idle_session_ends(tmp_path: Path) -> None:
    http = http_settings(max_sessions=2, session_idle_seconds=0.5)
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
    async with running(tmp_path, http=http) as web, httpx2.AsyncClient(timeout=10) as client:
        with session_ends() as ended:
            sessions = [await client.post(f"{web.url}mcp", json=INITIALIZE, headers=headers) for _ in range(3)]
            assert [answer.status_code for answer in sessions] == [200, 200, 503]
            with anyio.fail_after(10):
                await ended.wait()  # the SDK closed an idle session
        first = {**headers, "mcp-session-id": sessions[0].headers["mcp-session-id"]}
        listed = await client.post(
            f"{web.url}mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=first
        )
        again = await client.post(f"{web.url}mcp", json=INITIALIZE, headers=headers)
    assert listed.status_code == 404  # the client starts a new session...
    assert again.status_code == 200  # ...and there is room for it


async def test_session_starts_past_the_rate_limit_get_429(tmp_path: Path) -> None:
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
    async with running(tmp_path, http=http_settings(rate_limit_per_minute=5)) as web, httpx2.AsyncClient() as client:
        answers = [await client.post(f"{web.url}mcp", json=INITIALIZE, headers=headers) for _ in range(7)]
    assert [answer.status_code for answer in answers] == [200] * 5 + [429] * 2


@contextmanager
def session_ends() -> Iterator[anyio.Event]:
    """An event set when the SDK's session manager logs that it closed an idle session."""
    ended, logger = anyio.Event(), logging.getLogger("mcp.server.streamable_http_manager")

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "idle timeout" in record.getMessage():
                ended.set()

    watch, level = Watch(), logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.INFO)
    try:
        yield ended
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


@pytest.mark.parametrize("path", ["metrics", "readyz"])
async def test_metrics_and_readiness_refuse_a_foreign_host_but_health_answers_any(tmp_path: Path, path: str) -> None:
    http = http_settings(allowed_hosts=["hail-guard.internal"])
    async with running(tmp_path, http=http) as web, httpx2.AsyncClient() as client:
        rebinding = await client.get(f"{web.url}{path}", headers={"Host": "attacker.example"})
        listed = await client.get(f"{web.url}{path}", headers={"Host": "hail-guard.internal:8765"})
        loopback = await client.get(f"{web.url}{path}")
        health = await client.get(f"{web.url}healthz", headers={"Host": "attacker.example"})
    assert rebinding.status_code == 403
    assert "hail_guard_" not in rebinding.text
    assert (listed.status_code, loopback.status_code, health.status_code) == (200, 200, 200)


@pytest.mark.parametrize(
    ("token", "host", "problem"),
    [
        (None, "0.0.0.0", "agents on other hosts could send without a token"),  # noqa: S104
        ("short-token", "0.0.0.0", "with a 11-character token: off loopback it must have at least 32"),  # noqa: S104
        ("é" * 40, "127.0.0.1", "must be printable ASCII without spaces"),
        ("with space " * 4, "10.0.0.5", "must be printable ASCII without spaces"),
        (None, "127.0.0.1", None),
        ("short", "127.0.0.1", None),
        (LONG_TOKEN, "0.0.0.0", None),  # noqa: S104
    ],
)
def test_the_token_must_be_long_off_loopback_and_ascii_everywhere(
    token: str | None, host: str, problem: str | None
) -> None:
    settings = HttpSettings(host=host, token=token, token_env="HAIL_GUARD_LIMITS_TEST_UNSET")
    found = settings.token_problem(loopback=host == "127.0.0.1")
    assert found == problem if problem is None else problem in (found or "")


async def test_a_short_token_off_loopback_refuses_to_start_before_anything_is_opened(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 32"):
        await serve_http(settings_in(tmp_path, token="x"), host="0.0.0.0", port=0)  # noqa: S104
    assert not (tmp_path / "ledger.db").exists()


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    assert HttpSettings(trusted_proxies=[" 10.0.0.5", "10.0.0.0/8", "::1"]).trusted_proxies == [
        "10.0.0.5",
        "10.0.0.0/8",
        "::1",
    ]
    for wrong in (["proxy.internal"], ["10.0.0.1/8"], ["*", "10.0.0.5"]):
        with pytest.raises(ValueError, match="not an address or a network"):
            HttpSettings(trusted_proxies=wrong)


# --- out of file descriptors --------------------------------------------------------------------

FILE_LIMIT = 96
"""Open files the server may have: hail-guard then caps itself at 64 connections (96 less 32 reserved)..."""
HELD_ELSEWHERE = 40
"""...but this many are taken before it starts, so its accept() fails (EMFILE) before the cap is reached."""
CONNECTIONS = 120
"""Held by the test: more than the server can open, fewer than the listen backlog (128), so every one connects."""
WITH_FEW_FILES = (
    "import os, resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
    "held = [os.open(os.devnull, os.O_RDONLY) for _ in range({held})]; "
    "sys.argv = ['hail-guard', *sys.argv[1:]]; runpy.run_module('hail_guard', run_name='__main__')"
)


async def test_out_of_file_descriptors_the_accept_error_is_logged_once_and_the_server_recovers(
    tmp_path: Path,
) -> None:
    async with served_with_few_files(tmp_path) as (url, stderr), AsyncExitStack() as held:
        for _ in range(CONNECTIONS):
            await held.enter_async_context(await anyio.connect_tcp("127.0.0.1", port_of(url)))
        with anyio.fail_after(60):
            health = await healthy(url)  # the silent connections are dropped; new ones are served again
    assert health == 200
    lines = b"".join(stderr).decode().splitlines()
    events = [json.loads(line)["event"] for line in lines]  # every line is JSON: no raw traceback
    assert events.count("http_connections_limited") == 1  # said at start: the open-file limit caps it
    assert 1 <= events.count("http_accept_failed") <= 2  # once per burst, not once per attempt
    assert len(lines) < 100


async def healthy(url: str) -> int:
    async with httpx2.AsyncClient(timeout=5) as http:
        while True:
            try:
                return (await http.get(f"{url}healthz")).status_code
            except httpx2.TransportError:
                continue  # not accepted in time: the server's descriptors were still held


@asynccontextmanager
async def served_with_few_files(tmp_path: Path) -> AsyncIterator[tuple[str, list[bytes]]]:
    """`hail-guard serve --transport http` in a process of its own with at most `FILE_LIMIT` open files:
    its URL, and its stderr (read all along, so that it never blocks; whole once the block ends)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HAIL_GUARD_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
        "HAIL_GUARD_HTTP_HEADER_TIMEOUT_SECONDS": "1",
        "HAIL_GUARD_DELIVERY_POLL": "false",
    }
    wrapper = WITH_FEW_FILES.format(limit=FILE_LIMIT, held=HELD_ELSEWHERE)
    command = [sys.executable, "-c", wrapper, "serve", "--transport", "http"]
    stderr: list[bytes] = []
    listening = anyio.Event()

    async def read(stream: anyio.abc.ByteReceiveStream) -> None:
        with suppress(anyio.EndOfStream):
            while True:
                stderr.append(await stream.receive())
                if b'"http_listening"' in b"".join(stderr).rpartition(b"\n")[0]:  # in a whole line
                    listening.set()

    async with (
        await anyio.open_process([*command, "--port", "0"], env=env, stdout=None) as process,
        anyio.create_task_group() as tg,
    ):
        assert process.stderr is not None
        tg.start_soon(read, process.stderr)
        with anyio.fail_after(30):
            await listening.wait()
        [line] = [line for line in b"".join(stderr).splitlines() if b'"http_listening"' in line]
        try:
            yield json.loads(line)["mcp"].removesuffix("mcp"), stderr
        finally:
            process.terminate()
            with anyio.fail_after(20):
                await process.wait()
