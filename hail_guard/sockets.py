"""Serving a TCP listener so that no connection is lost to a cancel.

    async with anyio.create_task_group() as tg:
        tg.start_soon(sockets.serve, listener, handle)   # handle(stream); cancel the group to stop

anyio's `Listener.serve` awaits each accept, and asyncio's `sock_accept` can take a connection from the
kernel and then be cancelled before its socket has an owner: the socket is left to the garbage collector
(a ResourceWarning). Here a connection is taken only once the listener is readable, with no await between
the kernel's accept and its owner, and one whose handler never got to run is closed when serving ends.
Imports nothing of ours: any module may use it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc

Handler = Callable[[anyio.abc.SocketStream], Coroutine[Any, Any, None]]


async def serve(listener: anyio.abc.Listener[anyio.abc.SocketStream], handle: Handler) -> None:
    """Accept on `listener` (a TCP listener of one socket) until cancelled; each connection's stream goes to
    `handle` in a task of its own and is closed when that returns."""
    raw = listener.extra(anyio.abc.SocketAttribute.raw_socket)  # noqa: S610  (anyio's attributes, not Django's)
    waiting: set[anyio.abc.SocketStream] = set()  # accepted, their handler not yet begun

    async def run(stream: anyio.abc.SocketStream) -> None:
        waiting.discard(stream)
        async with stream:
            await handle(stream)

    try:
        async with anyio.create_task_group() as tg:
            while True:
                stream = await _accept(raw)
                if stream is not None:
                    waiting.add(stream)
                    tg.start_soon(run, stream)
    finally:
        with anyio.CancelScope(shield=True):
            for stream in waiting:
                await stream.aclose()


async def _accept(raw: socket.socket) -> anyio.abc.SocketStream | None:
    """The next connection once `raw` is readable, or None when the client left before it was taken."""
    await anyio.wait_readable(raw)
    try:
        accepted, _ = raw.accept()
    except BlockingIOError:
        return None
    try:
        accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return await anyio.abc.SocketStream.from_socket(accepted)
    except BaseException:
        accepted.close()
        raise
