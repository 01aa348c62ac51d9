"""The real thing: `hail-guard serve` over stdio, chained to `hail-guard sandbox` over HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx2
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp import Client, StdioServerParameters, stdio_client

from tests.conftest import data, email, text

KEY = "c1:l1:email:intro"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def running_sandbox(tmp_path: Path, *faults: str) -> AsyncIterator[tuple[str, Path]]:
    """`hail-guard sandbox` in its own process; yields its URL and outbox file."""
    port, outbox = free_port(), tmp_path / "outbox.jsonl"
    args = [sys.executable, "-m", "hail_guard", "sandbox", "--port", str(port), "--outbox", str(outbox)]
    for fault in faults:
        args += ["--fault", fault]
    async with await anyio.open_process(args, stdout=None, stderr=None) as process:
        url = f"http://127.0.0.1:{port}/"
        async with httpx2.AsyncClient() as http:
            with anyio.fail_after(15):
                while True:  # an external process: its health endpoint is the only readiness signal
                    try:
                        if (await http.get(f"{url}healthz")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        await anyio.sleep(0.05)
        try:
            yield url, outbox
        finally:
            process.terminate()
            with anyio.move_on_after(5):
                await process.wait()


def serve_params(tmp_path: Path, upstream_url: str, timeout: float = 1.0, **guard: Any) -> StdioServerParameters:
    config = tmp_path / "hail-guard.toml"
    lines = [
        "[ledger]",
        f'url = "sqlite:///{tmp_path / "ledger.db"}"',
        "[upstream]",
        f'url = "{upstream_url}"',
        f"timeout_seconds = {timeout}",
        "[guard]",
        *(f"{name} = {value}" for name, value in guard.items()),
    ]
    config.write_text("\n".join(lines) + "\n")
    return StdioServerParameters(
        command=sys.executable, args=["-m", "hail_guard", "--config", str(config), "serve"], cwd=str(tmp_path)
    )


def outbox_lines(outbox: Path) -> list[dict[str, Any]]:
    if not outbox.exists():
        return []
    return [json.loads(line) for line in outbox.read_text().splitlines() if line.strip()]


async def test_a_send_over_stdio_reaches_the_outbox_once(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path) as (url, outbox), Client(serve_params(tmp_path, url), mode="legacy") as agent:
        names = {tool.name for tool in (await agent.list_tools()).tools}
        assert {"send_email", "reconcile", "get_operation", "list_operations"} <= names
        first = await agent.call_tool("send_email", email())
        again = await agent.call_tool("send_email", email())
        assert not first.is_error
        assert data(again)["hail_guard"]["replayed"] is True
        assert [line["idempotency_key"] for line in outbox_lines(outbox)] == [KEY]


async def test_a_hang_after_acceptance_over_stdio_is_unknown_then_reconciled(tmp_path: Path) -> None:
    async with (
        running_sandbox(tmp_path, "send_email:1:hang_after_accept") as (url, outbox),
        Client(serve_params(tmp_path, url), mode="auto") as agent,
    ):
        first = await agent.call_tool("send_email", email())
        assert first.is_error
        assert "call `reconcile`" in text(first)
        operation_id = data(first)["hail_guard"]["operation_id"]
        again = await agent.call_tool("send_email", email())
        assert data(again)["hail_guard"]["state"] == "unknown"
        settled = await agent.call_tool("reconcile", {"operation_id": operation_id})
        [view] = data(settled)["reconciled"]
        assert view["state"] == "accepted"
        assert [line["id"] for line in outbox_lines(outbox)] == [view["provider_id"]]


async def test_serve_takes_its_config_after_the_command_and_warns_that_the_token_is_missing(tmp_path: Path) -> None:
    """`hail-guard serve --config FILE`, as client configs are written; no HAIL_API_KEY in its environment."""
    async with running_sandbox(tmp_path) as (url, outbox):
        params = serve_params(tmp_path, url)
        config = str(tmp_path / "hail-guard.toml")
        params = params.model_copy(update={"args": ["-m", "hail_guard", "serve", "--config", config]})
        with (tmp_path / "serve.log").open("w") as errlog:
            async with Client(stdio_client(params, errlog=errlog), mode="legacy") as agent:
                sent = await agent.call_tool("send_email", email())
        assert data(sent)["hail_guard"]["state"] == "accepted"
        assert [line["idempotency_key"] for line in outbox_lines(outbox)] == [KEY]
    assert "HAIL_API_KEY is not set" in (tmp_path / "serve.log").read_text()


def pids_running(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "serve" in cmdline:
                found.append(int(entry.name))
    return found


async def test_the_proxy_killed_after_acceptance_recovers_the_send_on_restart(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path, "send_email:1:hang_after_accept") as (url, outbox):
        params = serve_params(tmp_path, url, lease_seconds=1.0)
        params = params.model_copy(update={"env": {"HAIL_GUARD_UPSTREAM_TIMEOUT_SECONDS": "30"}})
        async with Client(params, mode="legacy") as agent, anyio.create_task_group() as tg:
            tg.start_soon(agent.call_tool, "send_email", email())
            with anyio.fail_after(10):
                while not outbox_lines(outbox):  # noqa: ASYNC110  (another process's file: no event to wait on)
                    await anyio.sleep(0.02)
            [pid] = pids_running(str(tmp_path / "hail-guard.toml"))
            os.kill(pid, signal.SIGKILL)
            tg.cancel_scope.cancel()

        async with Client(serve_params(tmp_path, url, lease_seconds=1.0), mode="legacy") as agent:
            with anyio.fail_after(15):
                # The dead proxy's lease runs out on the database clock; until then reconcile finds nothing.
                while not (settled := data(await agent.call_tool("reconcile", {}))["reconciled"]):  # noqa: ASYNC110
                    await anyio.sleep(0.1)
            assert [view["state"] for view in settled] == ["accepted"]
            history = data(await agent.call_tool("get_operation", {"idempotency_key": KEY}))["history"]
            assert [event["to_state"] for event in history] == ["sending", "unknown", "accepted"]
        assert len(outbox_lines(outbox)) == 1


async def test_four_stdio_servers_on_one_ledger_lose_nothing(tmp_path: Path) -> None:
    """Desktop clients spawn one server each; all of them share the SQLite ledger."""
    from hail_guard.ledger import open_ledger
    from hail_guard.models import State

    async def agent(number: int, url: str) -> None:
        params = serve_params(tmp_path, url, timeout=20.0)  # a loaded machine must not turn sends unknown
        async with Client(params, mode="legacy") as client, anyio.create_task_group() as tg:
            for lead in range(25):
                arguments = email(
                    to=[f"p{number}-lead{lead}@example.com"],
                    metadata={"campaign_id": "c", "lead_id": f"p{number}-{lead}", "message_id": "intro"},
                )
                tg.start_soon(client.call_tool, "send_email", arguments)

    async with running_sandbox(tmp_path) as (url, outbox):
        serve_params(tmp_path, url, timeout=20.0)  # writes the shared config once before the servers start
        async with anyio.create_task_group() as tg:
            for number in range(4):
                tg.start_soon(agent, number, url)
        keys = [line["idempotency_key"] for line in outbox_lines(outbox)]
        assert len(keys) == len(set(keys)) == 100
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        assert await ledger.count_by_state() == {State.ACCEPTED: 100}
        operations = await ledger.list_operations(limit=200)
        assert [len(await ledger.events(op.id)) for op in operations] == [2] * 100


def jsonrpc_line(message: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_stops_stdio_serve_with_stdin_still_open_and_records_the_send_in_flight_unknown(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """`docker stop` (SIGTERM) or Ctrl-C (SIGINT) while the client keeps stdin open and a send hangs at Hail."""
    from hail_guard.ledger import open_ledger
    from hail_guard.models import State

    async with running_sandbox(tmp_path, "send_email:1:hang_after_accept") as (url, outbox):
        params = serve_params(tmp_path, url, timeout=600.0)  # only the signal ends the hanging send
        with (tmp_path / "serve.log").open("w") as errlog:
            async with await anyio.open_process([params.command, *params.args], cwd=tmp_path, stderr=errlog) as serve:
                assert serve.stdin is not None
                assert serve.stdout is not None
                replies = BufferedByteReceiveStream(serve.stdout)
                hello = {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                }
                await serve.stdin.send(jsonrpc_line({"id": 1, "method": "initialize", "params": hello}))
                with anyio.fail_after(15):
                    assert json.loads(await replies.receive_until(b"\n", 1 << 20))["id"] == 1
                await serve.stdin.send(jsonrpc_line({"method": "notifications/initialized"}))
                call = {"name": "send_email", "arguments": email()}
                await serve.stdin.send(jsonrpc_line({"id": 2, "method": "tools/call", "params": call}))
                with anyio.fail_after(15):
                    while not outbox_lines(outbox):  # noqa: ASYNC110  (another process's file: no event to wait on)
                        await anyio.sleep(0.02)
                serve.send_signal(signum)
                with anyio.fail_after(15):  # stdin stays open: only the signal can end it
                    assert await serve.wait() == 0
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        operation = await ledger.find_by_key(KEY)
        assert operation is not None
        assert operation.state is State.UNKNOWN
        assert operation.last_error == "the call was interrupted while Hail had the request"
        assert [event.to_state for event in await ledger.events(operation.id)] == [State.SENDING, State.UNKNOWN]
    assert f'"signal": "{signum.name}"' in (tmp_path / "serve.log").read_text()


async def test_stdin_read_when_readable_gives_the_lines_however_the_pipe_cuts_them(tmp_path: Path) -> None:
    from hail_guard.app import ReadableStdin

    read_end, write_end = os.pipe()
    with os.fdopen(read_end) as stream:
        stdin = ReadableStdin(stream)
        lines: list[str] = []

        async def read_all() -> None:
            async for line in stdin:
                lines.append(line)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all)
            for piece in (b'{"a"', b': "\xc3', b'\xa9"}\n{"b": 2}\n{"c"', b": 3}"):  # é cut in two, then no newline
                os.write(write_end, piece)
                await anyio.lowlevel.checkpoint()  # lets the reader take each piece as it comes
            os.close(write_end)
    assert lines == ['{"a": "é"}\n', '{"b": 2}\n', '{"c": 3}']
