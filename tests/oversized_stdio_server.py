"""A raw stdio MCP server for tests/end_to_end/test_answer_cap.py: `echo` echoes; `echo_big` answers with a line of SIZE
bytes, written a chunk at a time, and after each chunk the bytes written so far go to the file WRITTEN (so a
test learns how much its reader took before it stopped reading).

    python oversized_stdio_server.py WRITTEN SIZE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

CHUNK = b"x" * 65536
TOOLS = [{"name": name, "inputSchema": {"type": "object"}} for name in ("echo", "echo_big")]


def answer(request: dict[str, Any]) -> dict[str, Any] | None:
    method, params = request.get("method"), request.get("params") or {}
    if "id" not in request:
        return None  # a notification
    if method == "initialize":
        info = {"name": "oversized", "version": "0"}
        result = {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        echoed = {"echo": params.get("arguments") or {}}
        result = {"content": [{"type": "text", "text": "ok"}], "structuredContent": echoed}
    else:
        result = {}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def oversized(request_id: Any, written_file: Path, size: int) -> None:
    head = b'{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"' % json.dumps(request_id).encode()
    written = os.write(1, head)
    while written < size:
        written += os.write(1, CHUNK)
        written_file.write_text(str(written))


def main() -> None:
    written_file, size = Path(sys.argv[1]), int(sys.argv[2])
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if request.get("method") == "tools/call" and request["params"]["name"] == "echo_big":
            oversized(request["id"], written_file, size)
        elif (reply := answer(request)) is not None:
            os.write(1, json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    main()
