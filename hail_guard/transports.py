"""How much of an upstream's answer hail-guard reads: at most `MAX_ANSWER_BYTES` of each, on every transport.

    Streamable HTTP, a JSON answer    `CappedBody` (`upstream` wraps a POST's JSON body in it): read up to the
                                      cap, then `AnswerTooLarge`, which the SDK turns into an error for that
                                      request alone
    Streamable HTTP and SSE, events   the SDK's event reader, given the same cap (`max_sse_event_size`; the SSE
                                      transport's default is the same 1 MiB)
    stdio, a line                     `capped_stdio`: the server's stdout read a line at a time up to the cap;
                                      a longer line ends the connection, as if the server had died

Reading stops at the cap, so memory stays bounded whatever the upstream sends; nothing over the cap is parsed
or kept. A call whose answer is refused so gets no answer: the upstream reports it as lost (it may have been
sent), and the guard records the send `unknown`.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import TextIO

import anyio
import anyio.abc
import httpx2
import mcp.types as types
import structlog
from mcp import StdioServerParameters
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE
from mcp.os.posix.utilities import terminate_posix_process_tree
from mcp.shared.message import SessionMessage

log = structlog.get_logger(__name__)

MAX_ANSWER_BYTES = DEFAULT_MAX_SSE_EVENT_SIZE
"""The one cap (1 MiB): a JSON body, an event, a stdio line. The MCP SDK's own cap on an event."""
EXIT_SECONDS = 2.0
"""After its stdin closes, how long a stdio server may take to exit before its process group is ended
(the SDK's own stdio client waits as long)."""


class AnswerTooLarge(httpx2.StreamError):
    """An answer over the cap, refused while it was read. A `StreamError` because that is what the SDK turns
    into an error for the one request whose body could not be read (`-32700`), leaving the connection up."""


class CappedBody(httpx2.AsyncByteStream):
    """A response body read up to `limit` bytes: past it, `AnswerTooLarge` (and nothing more is read)."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int = MAX_ANSWER_BYTES) -> None:
        self._inner, self._limit = inner, limit
        self.read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._inner:
            self.read += len(part)
            if self.read > self._limit:
                _refused(self._limit, self.read, "http")
                raise AnswerTooLarge(f"the answer is larger than hail-guard's cap of {self._limit} bytes; not read on")
            yield part

    async def aclose(self) -> None:
        await self._inner.aclose()


def _refused(limit: int, read: int, transport: str) -> None:
    log.warning("upstream_answer_too_large", transport=transport, limit_bytes=limit, read_bytes=read)


Streams = tuple[anyio.abc.ObjectReceiveStream[SessionMessage | Exception], anyio.abc.ObjectSendStream[SessionMessage]]


@asynccontextmanager
async def capped_stdio(
    params: StdioServerParameters, limit: int = MAX_ANSWER_BYTES, errlog: TextIO = sys.stderr
) -> AsyncIterator[Streams]:
    """The SDK's stdio client transport (the same process, environment, stderr and messages), reading each
    line of the server's stdout up to `limit` bytes. On leaving: stdin closed, `EXIT_SECONDS` to exit, then
    its process group ended (the server runs in a session of its own)."""
    process = await anyio.open_process(
        [params.command, *params.args],
        env=get_default_environment() | (params.env or {}),
        stderr=errlog,
        cwd=params.cwd,
        start_new_session=sys.platform != "win32",
    )
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        assert process.stdout is not None
        async with to_session:
            async for line in _lines(process.stdout, limit):
                await to_session.send(_message(line))

    async def write() -> None:
        assert process.stdin is not None
        async with from_session:
            async for message in from_session:
                text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                await process.stdin.send(text.encode() + b"\n")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_ended_by_the_server, read)
            tg.start_soon(_ended_by_the_server, write)
            try:
                yield from_server, to_server
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(process)


async def _ended_by_the_server(pipe: Callable[[], Awaitable[None]]) -> None:
    """Run one pipe's task; the server closing its end (it died) just ends it: the session sees the end."""
    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError):
        await pipe()


async def _lines(stdout: anyio.abc.ByteReceiveStream, limit: int) -> AsyncIterator[bytes]:
    """Each line, without its newline, until the stream ends or a line runs past `limit` bytes (logged)."""
    pending = b""
    while True:
        try:
            data = pending + await stdout.receive()
        except anyio.EndOfStream:
            return
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            yield data[start:end]
            start = end + 1
        pending = data[start:]
        if len(pending) > limit:
            _refused(limit, len(pending), "stdio")
            return


def _message(line: bytes) -> SessionMessage | Exception:
    """A line as the SDK reads it: a message, or the parse error for the session to report."""
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


async def _stop(process: anyio.abc.Process) -> None:
    if process.stdin is not None:
        with anyio.move_on_after(EXIT_SECONDS):
            await process.stdin.aclose()
    with anyio.move_on_after(EXIT_SECONDS):
        while process.returncode is None:  # noqa: ASYNC110  (`wait()` also waits for its pipes, which may never end)
            await anyio.sleep(0.01)
    if process.returncode is None:
        if sys.platform == "win32":
            process.kill()
        else:
            await terminate_posix_process_tree(process, EXIT_SECONDS)
    with anyio.move_on_after(EXIT_SECONDS):  # a process that outlived its group's kill is left behind, not waited on
        await process.aclose()
