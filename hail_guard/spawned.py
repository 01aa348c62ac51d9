"""A stdio upstream command, as `hail_guard.upstream` starts it: the variables it gets, and its stderr.

The MCP SDK gives a command only its safe variables (PATH, HOME...); `upstream` adds the key in its variable
and `[upstream.env]`, whose values are secrets (`env_secrets`: masked in every message that repeats them;
`env_shown`: how `status` shows them) unless they are URLs, shown through `urls.display_url`. `spawned`
starts the command with its stderr copied to ours, as it wrote it (where an operator has always read it),
and keeps its last lines, which say why a command that stopped before it answered could not be started.
"""

from __future__ import annotations

import os
import re
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from mcp import StdioServerParameters

from hail_guard.transports import capped_stdio
from hail_guard.urls import display_url, parse_url

STDERR_LINES = 5
"""How many of a command's last stderr lines are kept, to say why it could not be started."""
STDERR_END_SECONDS = 1.0
"""How long a command that stopped is given to finish writing its stderr."""
MIN_SECRET_CHARACTERS = 4
"""`[upstream.env]` values shorter than this are not scrubbed from foreign messages (they would garble them)."""
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def env_shown(env: Mapping[str, str]) -> dict[str, str]:
    """`[upstream.env]` as it may be shown (`status`): a URL through `urls.display_url`, anything else a secret."""
    return {name: display_url(value) if _URL.match(value) else "(secret)" for name, value in env.items()}


def env_secrets(env: Mapping[str, str]) -> set[str]:
    """What of `[upstream.env]` no message may repeat: every value but a URL, and the passwords a URL holds."""
    found: set[str] = set()
    for value in env.values():
        if _URL.match(value):
            found |= parse_url(value).secrets
        elif len(value) >= MIN_SECRET_CHARACTERS:
            found.add(value)
    return found


@asynccontextmanager
async def spawned(command: StdioServerParameters, said: deque[str]) -> AsyncIterator[Any]:
    """The command's stdio streams while the block runs; its stderr copied to ours, its last lines in `said`."""
    said.clear()
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    ended = anyio.Event()
    try:
        with os.fdopen(write_end, "w") as errlog:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_copy, read_end, said, ended)
                try:
                    async with capped_stdio(command, errlog=errlog) as streams:  # each answer capped
                        yield streams
                finally:
                    errlog.close()  # ours: the command's own copy ends with it
                    with anyio.move_on_after(STDERR_END_SECONDS, shield=True):
                        await ended.wait()
                    tg.cancel_scope.cancel()
    finally:
        os.close(read_end)


async def _copy(read_end: int, said: deque[str], ended: anyio.Event) -> None:
    partial = b""
    try:
        while chunk := await _read_some(read_end):
            _echo(chunk)
            *lines, partial = (partial + chunk).split(b"\n")
            said.extend(line.decode("utf-8", "replace") for line in lines if line.strip())
        if partial.strip():
            said.append(partial.decode("utf-8", "replace"))
    finally:
        ended.set()


def _echo(chunk: bytes) -> None:
    out = getattr(sys.stderr, "buffer", None)
    if out is not None:
        out.write(chunk)
    else:
        sys.stderr.write(chunk.decode("utf-8", "replace"))
    sys.stderr.flush()


async def _read_some(fd: int) -> bytes:
    """What a non-blocking pipe holds next; b"" at its end."""
    while True:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            await anyio.wait_readable(fd)
