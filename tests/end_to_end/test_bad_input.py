"""Bad input: hypothesis-made arguments for every tool, and malformed MCP messages on stdio and HTTP.

Whatever an agent sends, hail-guard answers with a clear result (never the crash text), records
nothing for a refused call, and leaves no operation half-written (`sending`). A malformed
message on either transport gets a protocol error (or, unparseable, nothing) and the server
goes on serving.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx2
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import types
from structlog.testing import capture_logs

from hail_guard.models import State
from hail_guard.server import Proxy
from tests.conftest import Harness, email, open_harness, text
from tests.end_to_end.test_web import INITIALIZE, MCP_HEADERS, TOKEN, TOOL_CALL, http_settings, running
from tests.end_to_end.test_webhooks import SECRET, SECRET_ENV, receiving

CRASH_TEXT = "failed unexpectedly"
GUARDED = ("send_email", "send_sms", "place_call")
PASS_THROUGH = (
    "get_email",
    "get_sms",
    "get_call",
    "list_emails",
    "list_sms",
    "list_calls",
    "get_email_events",
    "get_events",
    "whoami",
    "create_contact",
)
OWN = ("reconcile", "get_operation", "list_operations", "plan_batch", "run_batch", "batch_status", "record_opt_out")
REVIEW = ("review_list", "review_resolve", "review_resend")
EVERY_TOOL = GUARDED + PASS_THROUGH + OWN + REVIEW
EXAMPLES_PER_TOOL = 60

# --- values ------------------------------------------------------------------------------------

ODD_CHARACTERS = st.sampled_from(
    ["\x00", "\u202e", "\u200f", "\u200b", "\ufeff", "\U0001f600", "\U00010348", "e\u0301", "\n", '"', "\\", "%s", "'"]
)
ODD_TEXT = st.lists(st.one_of(ODD_CHARACTERS, st.text(max_size=5)), max_size=20).map("".join)
HUGE_TEXT = st.tuples(st.sampled_from(["a", "\U0001f600", "\u202e", "\x00", "+1"]), st.integers(1_000, 100_000)).map(
    lambda pair: pair[0] * (pair[1] // len(pair[0]))
)
ODD_NUMBERS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
    st.floats(),
    st.sampled_from([0, -1, 2**63, -(2**63) - 1, 2**64, 10**100]),
    st.integers(4301, 5000).map(lambda digits: 10**digits),  # past int-to-str limit (repr fails)
    st.integers(),
)


def nested(depth: int, leaf: Any, kind: str) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


DEEP = st.builds(
    nested, st.integers(50, 200), st.one_of(st.none(), ODD_TEXT, ODD_NUMBERS), st.sampled_from(["list", "dict"])
)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), ODD_NUMBERS, ODD_TEXT)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(ODD_TEXT, inner, max_size=4)),
    max_leaves=12,
)
WRONG = st.one_of(JSON_VALUES, HUGE_TEXT, DEEP)
"""Anything at all, in place of a field's value."""


def _of_type(kind: str, schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    if kind == "string":
        bounded = st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
        return st.one_of(bounded, ODD_TEXT, st.sampled_from(["lead@example.com", "+14155551234", "+1"]))
    if kind == "integer":
        return st.integers(schema.get("minimum", -5), schema.get("maximum", 600))
    if kind == "number":
        return st.floats(allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = schema.get("items", {})
        return st.lists(shaped(items, depth + 1) if depth < 3 else JSON_LEAVES, min_size=0, max_size=3)
    if kind == "object":
        return shaped_object(schema, depth + 1) if depth < 3 and "properties" in schema else JSON_VALUES
    return JSON_VALUES


def shaped(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """A value that mostly fits `schema` (sometimes it does not at all)."""
    if "enum" in schema:
        fitting: st.SearchStrategy[Any] = st.sampled_from(schema["enum"])
    else:
        kinds = schema.get("type", "string")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        fitting = st.one_of(*(_of_type(kind, schema, depth) for kind in kinds))
    return st.one_of(fitting, fitting, fitting, WRONG)


@st.composite
def shaped_object(draw: st.DrawFn, schema: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """Schema-shaped arguments: each field present or dropped (required ones too), values mutated, extras added."""
    properties: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))
    arguments: dict[str, Any] = {}
    for name, field_schema in properties.items():
        keep = draw(st.integers(0, 9)) < (9 if name in required else 5)
        if keep:
            arguments[name] = draw(shaped(field_schema, depth))
    if draw(st.integers(0, 4)) == 0:
        arguments.update(draw(st.dictionaries(ODD_TEXT, WRONG, min_size=1, max_size=3)))
    return arguments


def batch_sends(proxy: Proxy) -> st.SearchStrategy[Any]:
    """plan_batch's sends: items for the guarded tools with their own mutated arguments, or junk."""
    item = st.sampled_from(GUARDED).flatmap(
        lambda tool: st.fixed_dictionaries(
            {"tool": st.one_of(st.just(tool), st.just(tool), ODD_TEXT), "arguments": arguments_for(proxy, tool)}
        )
    )
    return st.one_of(st.lists(item, min_size=1, max_size=3), st.lists(item, max_size=0), WRONG)


VALID: dict[str, dict[str, Any]] = {
    "send_email": email(),
    "send_sms": {"to": "+14155551234", "body": "Hi", "recipient_consent": True},
    "place_call": {"to": "+14155551234", "system_prompt": "Say hello.", "recipient_consent": True},
    "record_opt_out": {"recipient": "lead@example.com", "reason": "asked to stop"},
    "review_resolve": {"operation_id": "op", "state": "failed", "reason": "checked"},
    "review_resend": {"operation_id": "op", "reason": "checked"},
    "run_batch": {"batch_id": "b"},
    "batch_status": {"batch_id": "b"},
    "get_email": {"email_id": "e"},
}
"""A correct call per tool (where one needs fields): mutating one field of it reaches deep past validation."""


@st.composite
def one_field_off(draw: st.DrawFn, valid: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """`valid` with one field (or one inside metadata) replaced by anything, dropped, or added."""
    arguments: dict[str, Any] = json.loads(json.dumps(valid))
    names = sorted(set(schema.get("properties", {})) | set(arguments))
    name = draw(st.one_of(st.sampled_from(names), ODD_TEXT))
    target = arguments
    if isinstance(arguments.get("metadata"), dict) and draw(st.booleans()):
        target = arguments["metadata"]
    if name in target and draw(st.integers(0, 3)) == 0:
        del target[name]
    else:
        target[name] = draw(WRONG)
    return arguments


def arguments_for(proxy: Proxy, tool: str) -> st.SearchStrategy[dict[str, Any]]:
    schema = proxy.input_schema(tool)
    assert schema is not None, tool
    choices = [shaped_object(schema)]
    if tool in VALID:
        choices.append(one_field_off(VALID[tool], schema))
    if tool == "plan_batch":
        name = shaped(schema["properties"]["name"])
        choices.append(st.fixed_dictionaries({"sends": batch_sends(proxy)}, optional={"name": name}))
    return st.one_of(*choices)


# --- the proxy ---------------------------------------------------------------------------------


@asynccontextmanager
async def open_review_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """The whole proxy over the sandbox, with the review queue exposed so its tools are attacked too."""
    async with open_harness(tmp_path) as opened:
        proxy = Proxy(opened.ledger, opened.proxy.upstream, opened.settings, expose_review=True)
        await proxy.refresh_tools()
        yield Harness(opened.sandbox, opened.ledger, proxy, opened.settings)


async def operation_count(harness: Harness) -> int:
    return sum((await harness.ledger.count_by_state()).values())


async def check_one_call(
    harness: Harness, tool: str, arguments: dict[str, Any], result: types.CallToolResult, before: int
) -> None:
    assert isinstance(result, types.CallToolResult)
    if result.is_error:
        message = text(result)
        assert message.strip(), (tool, arguments)
        assert CRASH_TEXT not in message, (tool, message)
        structured = result.structured_content or {}
        if "hail_guard" not in structured:  # a refusal, not a recorded send's state
            assert await operation_count(harness) == before, (tool, message)
    counts = await harness.ledger.count_by_state()
    assert not counts.get(State.SENDING), (tool, counts)


async def test_every_listed_tool_is_attacked(tmp_path: Path) -> None:
    async with open_review_harness(tmp_path) as harness:
        assert {tool.name for tool in harness.proxy.listed_tools()} == set(EVERY_TOOL)


@pytest.mark.parametrize("tool", EVERY_TOOL)
async def test_bad_arguments_get_a_clear_answer_and_record_nothing_half_written(tmp_path: Path, tool: str) -> None:
    async with open_review_harness(tmp_path) as harness:
        await attack(harness, tool)


async def attack(harness: Harness, tool: str) -> None:
    strategy = arguments_for(harness.proxy, tool)
    seen: list[int] = []

    @settings(
        max_examples=EXAMPLES_PER_TOOL,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(strategy)
    def examples(arguments: dict[str, Any]) -> None:
        seen.append(1)
        anyio.from_thread.run(one, arguments)

    async def one(arguments: dict[str, Any]) -> None:
        before = await operation_count(harness)
        result = await harness.proxy.call(tool, arguments)
        await check_one_call(harness, tool, arguments, result, before)

    await anyio.to_thread.run_sync(examples)
    assert len(seen) >= EXAMPLES_PER_TOOL // 2


async def test_an_integer_too_long_to_print_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Minimal case hypothesis found: json.dumps refuses ints past 4300 digits, inside canonical_json."""
    async with open_review_harness(tmp_path) as harness:
        result = await harness.proxy.call("send_email", {**email(), "extra": 10**4301})
        await check_one_call(harness, "send_email", {}, result, 0)
        assert result.is_error


@pytest.mark.parametrize("name", ["x" * 100_000, "evil\x1b]8;;http://x\x07\u202ename"], ids=["100 KB", "escapes"])
async def test_an_unknown_tool_name_is_answered_cut_and_escaped(tmp_path: Path, name: str) -> None:
    async with open_harness(tmp_path) as harness:
        answer = await harness.call(name, {})
    said = text(answer)
    assert answer.is_error
    assert said.startswith("unknown tool '")
    assert len(said) < 200  # 100 KB in, a line out
    assert all(character.isprintable() for character in said)  # an escape, a bidi override: shown as escapes


async def test_bad_arguments_through_a_real_mcp_client_get_a_clear_answer(tmp_path: Path) -> None:
    async with open_review_harness(tmp_path) as harness, harness.client() as client:
        calls = st.sampled_from(EVERY_TOOL).flatmap(
            lambda tool: st.tuples(st.just(tool), arguments_for(harness.proxy, tool))
        )
        seen: list[str] = []

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(calls)
        def examples(call: tuple[str, dict[str, Any]]) -> None:
            seen.append(call[0])
            anyio.from_thread.run(one, *call)

        async def one(tool: str, arguments: dict[str, Any]) -> None:
            before = await operation_count(harness)
            result = await client.call_tool(tool, arguments)
            await check_one_call(harness, tool, arguments, result, before)

        await anyio.to_thread.run_sync(examples)
        assert len(seen) >= 10


# --- malformed MCP messages --------------------------------------------------------------------

SEND_WITH_HUGE_NUMBER = (
    b'{"jsonrpc":"2.0","id":14,"method":"tools/call","params":{"name":"send_email","arguments":'
    b'{"to":["a@example.com"],"subject":"s","body_text":"b","recipient_consent":true,"x":1' + b"0" * 5000 + b"}}}"
)
MALFORMED: dict[str, bytes] = {
    "invalid JSON": b"{not json",
    "wrong jsonrpc version": b'{"jsonrpc":"1.0","id":10,"method":"tools/list"}',
    "no method": b'{"jsonrpc":"2.0","id":11}',
    "unknown method": b'{"jsonrpc":"2.0","id":12,"method":"no/such"}',
    "params a string": b'{"jsonrpc":"2.0","id":13,"method":"tools/call","params":"x"}',
    "arguments a string": b'{"jsonrpc":"2.0","id":16,"method":"tools/call","params":{"name":"whoami","arguments":"x"}}',
    "a number past the parser's range": SEND_WITH_HUGE_NUMBER,
    "a JSON array": b"[1,2]",
    "JSON null": b"null",
    "not UTF-8": b"\xff\xfe",
    "a ~1 MB line": b'{"jsonrpc":"2.0","id":15,"method":"tools/list","pad":"' + b"a" * 1_000_000 + b'"}',
}
ANSWERED = {"unknown method": -32601, "arguments a string": -32602}
"""What the SDK answers with an error over stdio; everything else malformed it drops without a word."""
HUGE_BUT_VALID = "a ~1 MB line"
"""An extra field on a valid request: it is served."""


async def read_message(stdout: BufferedByteReceiveStream) -> dict[str, Any]:
    line = await stdout.receive_until(b"\n", 4_000_000)
    message: dict[str, Any] = json.loads(line)
    return message


async def exchange(
    process: Process, stdout: BufferedByteReceiveStream, message: dict[str, Any]
) -> list[dict[str, Any]]:
    """Send `message`; the messages read up to and including its answer."""
    assert process.stdin is not None
    await process.stdin.send(json.dumps(message).encode() + b"\n")
    seen: list[dict[str, Any]] = []
    with anyio.fail_after(15):
        while not seen or seen[-1].get("id") != message["id"]:
            seen.append(await read_message(stdout))
    return seen


def config_file(tmp_path: Path) -> Path:
    config = tmp_path / "hail-guard.toml"
    ledger, outbox = tmp_path / "ledger.db", tmp_path / "outbox.jsonl"
    config.write_text(f'[ledger]\nurl = "sqlite:///{ledger}"\n[upstream]\nsandbox_outbox = "{outbox}"\n')
    return config


async def test_malformed_messages_on_stdio_get_an_error_or_nothing_and_the_server_keeps_serving(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "hail_guard", "--config", str(config_file(tmp_path)), "serve"]
    async with await anyio.open_process(args, stderr=None) as process:
        assert process.stdin is not None
        assert process.stdout is not None
        stdout = BufferedByteReceiveStream(process.stdout)
        [answer] = await exchange(process, stdout, INITIALIZE)
        assert "result" in answer
        await process.stdin.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        try:
            for number, (case, line) in enumerate(MALFORMED.items()):
                await process.stdin.send(line + b"\n")
                *before, listed = await exchange(
                    process, stdout, {"jsonrpc": "2.0", "id": 100 + number, "method": "tools/list"}
                )
                assert len(listed["result"]["tools"]) == len(EVERY_TOOL) - len(REVIEW), case
                if case == HUGE_BUT_VALID:
                    assert [message["id"] for message in before if "result" in message] == [15]
                    continue
                assert all("error" in message for message in before), (case, before)
                codes = [message["error"]["code"] for message in before]
                assert codes == ([ANSWERED[case]] if case in ANSWERED else []), case
            assert process.returncode is None
        finally:
            process.terminate()
            with anyio.move_on_after(5):
                await process.wait()


async def test_malformed_messages_over_http_get_a_json_rpc_error_and_the_server_keeps_serving(tmp_path: Path) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient(timeout=15) as http:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        started = await http.post(f"{web.url}mcp", json=INITIALIZE, headers=headers)
        assert started.status_code == 200
        headers["mcp-session-id"] = started.headers["mcp-session-id"]
        await http.post(
            f"{web.url}mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers
        )
        for case, body in {**MALFORMED, "empty body": b""}.items():
            answer = await http.post(f"{web.url}mcp", content=body, headers=headers)
            assert answer.status_code < 500, case
            if answer.status_code >= 400:
                assert answer.status_code == 400, case
                assert "error" in answer.json(), case
            else:
                assert ('"result":' in answer.text) == (case == HUGE_BUT_VALID), case
            listed = await http.post(
                f"{web.url}mcp", json={"jsonrpc": "2.0", "id": 99, "method": "tools/list"}, headers=headers
            )
            assert listed.status_code == 200, case
            assert '"tools":' in listed.text, case


# --- deep JSON, spoofed proxy headers, slow clients --------------------------------------------


def nested_text(depth: int) -> str:
    """JSON text nesting objects `depth` deep (json.dumps itself cannot write that deep)."""
    return '{"a": ' * depth + "1" + "}" * depth


SEND_HEAD = '{"jsonrpc": "2.0", "id": 30, "method": "tools/call", "params": {"name": "send_email", "arguments": '
DEEP_BODIES = {
    "20,000 [ (40 kB)": b"[" * 20_000,
    "a tool call whose metadata nests 1,000 deep": (
        SEND_HEAD + json.dumps(email())[:-1] + ', "metadata": ' + nested_text(1_000) + "}}}"
    ).encode(),
}


@pytest.mark.parametrize("path", ["mcp", "messages/?session_id=00"])
@pytest.mark.parametrize("case", list(DEEP_BODIES))
async def test_deeply_nested_json_over_http_gets_400_before_it_is_parsed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], path: str, case: str
) -> None:
    async with running(tmp_path) as web, httpx2.AsyncClient(timeout=15) as http:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        answer = await http.post(f"{web.url}{path}", content=DEEP_BODIES[case], headers=headers)
        assert (await http.get(f"{web.url}healthz")).status_code == 200
        assert await operation_count(web.harness) == 0
    assert answer.status_code == 400
    assert "nests deeper than 64 levels" in answer.json()["error"]["message"]
    assert web.harness.sandbox.outbox == []
    assert "Traceback" not in capfd.readouterr().err


async def test_a_signed_webhook_nested_5000_deep_gets_400_and_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    async with receiving(tmp_path) as receiver:
        deep = ('{"type": "email.bounced", "data": ' + nested_text(5_000) + "}").encode()
        answer = await receiver.post("", {}, delivery_id="deep-1", body=deep)
        again = await receiver.post("", {}, delivery_id="deep-1", body=b'{"type": "email.bounced", "data": {}}')
    assert answer.status_code == 400
    assert "nests deeper than 64 levels" in answer.json()["message"]
    assert again.json()["status"] == "ignored"  # not "duplicate": the refused one recorded nothing


@pytest.mark.parametrize("tool", ["send_email", "plan_batch", "get_operation"])
async def test_tool_arguments_nested_too_deep_are_refused_clearly_and_record_nothing(tmp_path: Path, tool: str) -> None:
    deep = nested(1_000, "x", "dict")
    arguments = {
        "send_email": {**email(), "metadata": deep},
        "plan_batch": {"sends": [{"tool": "send_email", "arguments": {**email(), "metadata": deep}}]},
        "get_operation": {"operation_id": "op", "extra": deep},
    }[tool]
    async with open_review_harness(tmp_path) as harness:
        result = await harness.proxy.call(tool, arguments)
        await check_one_call(harness, tool, {}, result, 0)
    assert result.is_error
    assert f"the arguments for {tool} nest deeper than 64 levels" in text(result)
    assert harness.sandbox.outbox == []


async def test_a_spoofed_x_forwarded_for_does_not_escape_the_rate_limit(tmp_path: Path) -> None:
    """60 calls, each claiming another client address, at a limit of 30: the real peer's bucket counts them all."""
    async with running(tmp_path, http=http_settings(rate_limit_per_minute=30)) as web:
        with capture_logs() as logs:
            statuses = await spoofed_calls(web.url, 60)
    assert statuses.count(429) == 31  # `initialize` took one of the 30
    refusals = [entry for entry in logs if entry["event"] == "http_refused"]
    assert {entry["client"] for entry in refusals} == {"127.0.0.1"}


async def test_x_forwarded_for_names_the_client_only_behind_a_trusted_proxy(tmp_path: Path) -> None:
    http = http_settings(rate_limit_per_minute=30, trusted_proxies=["127.0.0.1"])
    async with running(tmp_path, http=http) as web:
        statuses = await spoofed_calls(web.url, 60)
    assert 429 not in statuses  # each forwarded client has its own bucket


async def spoofed_calls(url: str, count: int) -> list[int]:
    """One session, then `count` tool calls, each with a different `X-Forwarded-For`; the statuses."""
    async with httpx2.AsyncClient(timeout=15) as http:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {TOKEN}"}
        started = await http.post(f"{url}mcp", json=INITIALIZE, headers=headers)
        headers["mcp-session-id"] = started.headers["mcp-session-id"]
        statuses = []
        for number in range(count):
            spoofed = {**headers, "X-Forwarded-For": f"203.0.113.{number}"}
            call = {**TOOL_CALL, "id": 100 + number}
            statuses.append((await http.post(f"{url}mcp", json=call, headers=spoofed)).status_code)
    return statuses


async def test_a_client_sending_its_headers_slowly_is_disconnected(tmp_path: Path) -> None:
    async with running(tmp_path, http=http_settings(header_timeout_seconds=0.5)) as web:
        async with await anyio.connect_tcp("127.0.0.1", port_of(web.url)) as slow:
            await slow.send(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and never the rest
            with anyio.fail_after(10):
                assert await receive_all(slow) == b""  # closed by the server, unanswered
        async with httpx2.AsyncClient() as http:
            assert (await http.get(f"{web.url}healthz")).status_code == 200


@pytest.mark.parametrize("path", ["/mcp", "/webhooks/hail"])
async def test_a_client_sending_its_body_slowly_gets_408_and_is_disconnected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.setenv("HAIL_WEBHOOK_SECRET", SECRET)
    http = http_settings(header_timeout_seconds=0.5, body_timeout_seconds=0.5)
    async with running(tmp_path, http=http) as web, await anyio.connect_tcp("127.0.0.1", port_of(web.url)) as slow:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        await slow.send(f"{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
        await slow.send(b'{"jsonrpc": "2.0", ')  # ... and never the rest
        with anyio.fail_after(10):
            answer = await receive_all(slow)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert b"connection: close" in rest.lower()
    assert b"did not arrive within 0.5 s" in rest


def port_of(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


async def receive_all(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while True:
        try:
            received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return received
