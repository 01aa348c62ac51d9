"""A tiny stdio MCP server for tests/end_to_end/test_upstream.py: echoes, reports its token, can die."""

from __future__ import annotations

import os
import threading
from typing import Any

import anyio
import mcp.types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server

TOOLS = [types.Tool(name=name, input_schema={"type": "object"}) for name in ("echo", "crash", "exit_soon")]


async def on_list_tools(
    ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def on_call_tool(
    ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    if params.name == "crash":
        os._exit(3)
    if params.name == "exit_soon":
        threading.Timer(0.1, os._exit, args=(3,)).start()
    token = os.environ.get("HAIL_API_KEY") or os.environ.get("RESEND_API_KEY")
    answer = {"arguments": params.arguments, "token": token, "pid": os.getpid(), "variables": sorted(os.environ)}
    return types.CallToolResult(content=[types.TextContent(type="text", text="echo")], structured_content=answer)


async def main() -> None:
    server = Server("upstream-echo", on_list_tools=on_list_tools, on_call_tool=on_call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
