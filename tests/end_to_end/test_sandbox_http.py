"""The sandbox over real Streamable HTTP on 127.0.0.1, and its command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp.types as types
import pytest
from anyio.streams.text import TextReceiveStream
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from hail_guard.sandbox import Fault, ManualClock, Sandbox, add_arguments, parse_fault, run_from_args, serve_http

TOKEN = "sandbox-test-token"
CALL_WHOAMI = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "whoami", "arguments": {}}}
LIST_TOOLS = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
JSON_RPC_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
COMMAND = (
    "import argparse, sys\n"
    "from hail_guard.sandbox import add_arguments, run_from_args\n"
    "parser = argparse.ArgumentParser()\n"
    "add_arguments(parser)\n"
    "sys.exit(run_from_args(parser.parse_args()))\n"
)


def email(**changes: Any) -> dict[str, Any]:
    return {"to": ["lead@example.com"], "subject": "Hello", "body_text": "Hi!", "recipient_consent": True} | changes


@pytest.fixture(params=["legacy", "auto"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def serving(sandbox: Sandbox, token: str | None = None) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            url = await tg.start(serve_http, sandbox, "127.0.0.1", 0, token)
        yield url
        tg.cancel_scope.cancel()


@asynccontextmanager
async def authorised_client(url: str, mode: str, token: str = TOKEN) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


async def test_healthz_answers_ok_without_a_token() -> None:
    async with serving(Sandbox(), TOKEN) as url, httpx2.AsyncClient() as http:
        with anyio.fail_after(5):
            response = await http.get(f"{url}healthz")

    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_without_the_token_tools_can_be_listed_but_not_called(mode: str) -> None:
    sandbox = Sandbox()
    async with serving(sandbox, TOKEN) as url:
        async with Client(url, mode=mode) as client:
            with anyio.fail_after(5):
                tools = (await client.list_tools()).tools
            with pytest.raises(MCPError), anyio.fail_after(5):
                await client.call_tool("whoami", {})
        async with httpx2.AsyncClient(headers=JSON_RPC_HEADERS) as http:
            with anyio.fail_after(5):
                call = await http.post(url, json=CALL_WHOAMI)
                wrong_token = await http.post(url, json=CALL_WHOAMI, headers={"Authorization": "Bearer nope"})
                listing = await http.post(url, json=LIST_TOOLS)

    assert "send_email" in {tool.name for tool in tools}
    assert (call.status_code, wrong_token.status_code) == (401, 401)
    assert listing.status_code != 401
    assert sandbox.calls("whoami") == 0


async def test_with_the_token_sends_work_over_http(mode: str) -> None:
    clock = ManualClock()
    sandbox = Sandbox(clock=clock, sleep=clock.sleep)
    async with serving(sandbox, TOKEN) as url, authorised_client(url, mode) as client:
        with anyio.fail_after(5):
            sent = await client.call_tool("send_email", email(idempotency_key="k"))
            replayed = await client.call_tool("send_email", email(idempotency_key="k"))

    assert sent.is_error is False
    assert sent.structured_content is not None
    assert replayed.structured_content == sent.structured_content
    assert isinstance(sent.content[0], types.TextContent)
    assert json.loads(sent.content[0].text) == sent.structured_content
    assert len(sandbox.outbox) == 1


async def test_without_a_configured_token_calls_need_none(mode: str) -> None:
    async with serving(Sandbox()) as url, Client(url, mode=mode) as client:
        with anyio.fail_after(5):
            me = await client.call_tool("whoami", {})

    assert me.structured_content is not None
    assert me.structured_content["sandbox"] is True


async def test_drop_after_accept_over_http_ends_the_stream_without_an_answer(mode: str) -> None:
    sandbox = Sandbox(faults=[Fault("send_email", 1, "drop_after_accept")])
    async with serving(sandbox, TOKEN) as url, authorised_client(url, mode) as client:
        with pytest.raises(MCPError) as dropped, anyio.fail_after(5):
            await client.call_tool("send_email", email(idempotency_key="k"))
        with anyio.fail_after(5):
            replayed = await client.call_tool("send_email", email(idempotency_key="k"))

    assert dropped.value.code == types.CONNECTION_CLOSED
    assert replayed.structured_content is not None
    assert replayed.structured_content["id"] == sandbox.outbox[0]["id"]
    assert len(sandbox.outbox) == 1


def test_add_arguments_reads_the_options_and_repeatable_faults() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    faults = ["--fault", "send_email:2:drop_after_accept", "--fault", "send_sms:*:delay:50"]
    ns = parser.parse_args(["--port", "0", *faults, "--outbox", "out.jsonl", "--latency-ms", "25", "--token-env", "T"])

    assert ns.fault == [parse_fault("send_email:2:drop_after_accept"), parse_fault("send_sms:*:delay:50")]
    assert (ns.host, ns.port, ns.outbox, ns.latency_ms, ns.token_env) == ("127.0.0.1", 0, "out.jsonl", 25.0, "T")


def test_a_bad_fault_on_the_command_line_is_a_usage_error_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--fault", "send_email:1:explode"])

    assert exited.value.code == 2
    assert "unknown fault kind 'explode'" in capsys.readouterr().err


def test_a_token_variable_that_is_not_set_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HAIL_SANDBOX_UNSET_TOKEN", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    assert run_from_args(parser.parse_args(["--port", "0", "--token-env", "HAIL_SANDBOX_UNSET_TOKEN"])) == 2


async def test_the_command_serves_until_interrupted_and_appends_the_outbox_file(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox.jsonl"
    env = os.environ | {"SANDBOX_TOKEN": TOKEN}
    argv = [sys.executable, "-c", COMMAND, "--port", "0", "--token-env", "SANDBOX_TOKEN", "--outbox", str(outbox)]
    logged: list[str] = []
    async with await anyio.open_process(argv, env=env, stdin=subprocess.DEVNULL) as process:
        assert process.stderr is not None
        assert process.stdout is not None
        lines = TextReceiveStream(process.stderr)
        with anyio.fail_after(20):
            async for chunk in lines:
                logged.append(chunk)
                if "sandbox_listening" in "".join(logged):
                    break
        url = "".join(logged).split("sandbox_listening url=")[1].split()[0]
        async with authorised_client(url, "legacy") as client:
            with anyio.fail_after(5):
                await client.call_tool("send_email", email(idempotency_key="k"))
                await client.call_tool("send_email", email(idempotency_key="k"))
        written = outbox.read_text().splitlines()
        process.send_signal(signal.SIGINT)
        with anyio.fail_after(10):
            async for chunk in lines:
                logged.append(chunk)
            code = await process.wait()
            printed = [chunk async for chunk in process.stdout]

    assert (code, printed) == (0, [])
    assert [json.loads(line)["idempotency_key"] for line in written] == ["k"]
    assert "sandbox_stopped" in "".join(logged)
    assert TOKEN not in "".join(logged)
