"""The sandbox as an MCP server (low-level `mcp.server.Server`), named `hail` like the real one.

Every result is the same dict twice: structured content and JSON text; every tool declares the
output schema `{"type": "object", "additionalProperties": true}`. Schema refusals are isError.

How a withheld answer is carried out:

* hang: the handler waits until it is cancelled (caller timeout, cancel, disconnect, shutdown).
* drop, over Streamable HTTP: the handler sets an event the HTTP layer put in the request's ASGI
  scope (`DROP_SCOPE_KEY`); `http.py` then aborts that HTTP response, so the client's stream ends
  without an answer (the SDK client raises MCPError -32000 "SSE stream ended without a response").
* drop, in process with `mode="legacy"` (and over any stream transport that calls `Server.run`):
  `run` gives each connection a `Link` whose `cut` closes both of the connection's streams; the
  client fails the call, and every later call on that connection, with MCPError -32000
  "Connection closed". A new connection works again.
* drop, in process with `mode="auto"` (the SDK's direct dispatcher, no streams): the handler raises
  `MCPError(CONNECTION_CLOSED, "Connection closed")`, exactly what the client raises when the
  dispatcher is closed; the next call works, as each modern request stands alone.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

import anyio
import mcp.types as types
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.runner import serve_dual_era_loop

from hail_guard.sandbox.answers import Answer, Answering, Refusal, Reply
from hail_guard.sandbox.tools import input_schema, tool_list

if TYPE_CHECKING:
    from mcp.server.models import InitializationOptions
    from mcp.shared._stream_protocols import ReadStream, WriteStream  # the SDK exports no public alias
    from mcp.shared.message import SessionMessage

SERVER_NAME: Final = "hail"
SERVER_VERSION: Final = "sandbox"
DROP_SCOPE_KEY: Final = "hail_guard.sandbox.drop"
"""ASGI scope key of the `anyio.Event` a handler sets to have its HTTP response aborted."""

_INSTRUCTIONS: Final = "Hail sandbox: a fake Hail. Nothing is really sent; see the outbox."


@dataclass(frozen=True)
class Link:
    """The connection a handler answers on, as far as dropping it goes."""

    cut: Callable[[], Awaitable[None]] | None = None


@asynccontextmanager
async def _no_link(_server: Server[Link]) -> AsyncIterator[Link]:
    yield Link()


class _SandboxServer(Server[Link]):
    """A `Server` whose stream connections can be cut by a handler (for `drop_after_accept`)."""

    async def run(
        self,
        read_stream: ReadStream[SessionMessage | Exception],
        write_stream: WriteStream[SessionMessage],
        initialization_options: InitializationOptions,
        raise_exceptions: bool = False,
    ) -> None:
        async def cut() -> None:
            await write_stream.aclose()
            await read_stream.aclose()

        await serve_dual_era_loop(
            self,
            read_stream,
            write_stream,
            lifespan_state=Link(cut),
            init_options=initialization_options,
            raise_exceptions=raise_exceptions,
        )


def _result(result: dict[str, Any]) -> types.CallToolResult:
    text = json.dumps(result, indent=2, ensure_ascii=False)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=result, is_error=False
    )


def _worded(text: str) -> types.CallToolResult:
    """A result in words only (no structured content), as some servers answer."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=False)


def _refusal(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def _drop(ctx: ServerRequestContext[Link, Any]) -> NoReturn:
    scope = getattr(ctx.request, "scope", None)
    event = scope.get(DROP_SCOPE_KEY) if isinstance(scope, dict) else None
    if isinstance(event, anyio.Event):
        event.set()
        await anyio.sleep_forever()
    if ctx.lifespan_context.cut is not None:
        await ctx.lifespan_context.cut()
        await anyio.sleep_forever()
    raise MCPError(code=types.CONNECTION_CLOSED, message="Connection closed")


def build_server(sandbox: Answering) -> Server[Link]:
    return serve_tools(sandbox.invoke, tool_list(), input_schema, name=SERVER_NAME, instructions=_INSTRUCTIONS)


Invoke = Callable[[str, Mapping[str, Any] | None], Awaitable[Answer]]


def serve_tools(
    invoke: Invoke,
    tools: list[types.Tool],
    schema_of: Callable[[str], dict[str, Any] | None],
    *,
    name: str,
    instructions: str,
    version: str = SERVER_VERSION,
) -> Server[Link]:
    """A low-level MCP server whose calls `invoke` answers (a `Reply`, a `Refusal` or a `Withheld` answer,
    carried out as the module docstring says): the sandbox's, and every generic fake's (`hail_guard.fake`)."""

    async def on_list_tools(
        ctx: ServerRequestContext[Link, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(
        ctx: ServerRequestContext[Link, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        answer = await invoke(params.name, params.arguments)
        if isinstance(answer, Reply):
            return _result(answer.result) if answer.text is None else _worded(answer.text)
        if isinstance(answer, Refusal):
            return _refusal(answer.text)
        if answer.how == "drop":
            await _drop(ctx)
        await anyio.sleep_forever()
        raise AssertionError("unreachable: sleep_forever returns only by cancellation")

    return _SandboxServer(
        name,
        version=version,
        instructions=instructions,
        lifespan=_no_link,
        get_tool_input_schema=schema_of,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )
