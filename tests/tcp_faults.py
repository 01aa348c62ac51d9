"""A fault-injecting TCP proxy for the tests: hail-guard's upstream client -> `FaultProxy` -> the sandbox.

The proxy relays bytes both ways and reads just enough HTTP/1.1 to see each request (its method and
body, and the JSON-RPC message in the body). For every request it asks `decide` for a `Fault`:

    phase "before"  the request is not forwarded: `drop` swallows it and never answers, `reset` cuts the
                    connection with a TCP reset (SO_LINGER 0, then close), `half_close` sends a FIN and
                    nothing else, `delay` forwards it late (`seconds`, or once `release` is set).
    phase "after"   the request is forwarded, and once the sandbox has answered it in full (the JSON-RPC
                    response with the request's id has come back) the answer is swallowed (`drop`), cut
                    by a reset (`reset`) or a FIN (`half_close`), or held back (`delay`).

So an "after" fault always hits a request the sandbox has handled: the send was made, its answer is lost
or late. `cut_link()` closes every connection and refuses new ones until `restore_link()`. Everything the
proxy saw is in `seen`, in order, with the fault it applied.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from hail_guard import sockets

Kind = Literal["drop", "reset", "half_close", "delay"]
Phase = Literal["before", "after"]
KINDS: tuple[Kind, ...] = ("drop", "reset", "half_close", "delay")
PHASES: tuple[Phase, ...] = ("before", "after")
MAX_HEAD_BYTES = 64 * 1024
_DATA_LINE = re.compile(rb"^data: ?(.*?)\r?$", re.MULTILINE)
_BROKEN = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, anyio.IncompleteRead)


@dataclass(frozen=True)
class Fault:
    kind: Kind
    phase: Phase
    seconds: float = 0.0
    """For `delay`: how long the request (before) or its answer (after) is held."""
    release: anyio.Event | None = field(default=None, compare=False)
    """For `delay`: hold until this is set instead (then `seconds` is ignored)."""

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.phase}"


@dataclass(frozen=True)
class Request:
    """One HTTP request as it crossed the proxy."""

    method: str
    body: bytes

    @property
    def message(self) -> dict[str, Any] | None:
        """The JSON-RPC message in the body (the first of a batch), or None."""
        try:
            parsed = json.loads(self.body) if self.body else None
        except ValueError:
            return None
        if isinstance(parsed, list):
            parsed = parsed[0] if parsed else None
        return parsed if isinstance(parsed, dict) else None

    @property
    def tool(self) -> str | None:
        """The tool of a `tools/call`, else None."""
        message = self.message or {}
        params = message.get("params")
        if message.get("method") != "tools/call" or not isinstance(params, dict):
            return None
        name = params.get("name")
        return name if isinstance(name, str) else None

    @property
    def key(self) -> str | None:
        """The idempotency key a `tools/call` carries, else None."""
        params = (self.message or {}).get("params") or {}
        arguments = params.get("arguments") if isinstance(params, dict) else None
        key = arguments.get("idempotency_key") if isinstance(arguments, dict) else None
        return key if isinstance(key, str) else None


@dataclass(frozen=True, eq=False)
class Seen:
    request: Request
    fault: Fault | None
    answered: anyio.Event = field(default_factory=anyio.Event, compare=False)
    """Set once the sandbox's whole answer to this request came back to the proxy (whatever then became of it)."""


Decide = Callable[[Request], Fault | None]


def no_faults(request: Request) -> Fault | None:
    return None


class FaultProxy:
    """Listens on 127.0.0.1 (a free port) and relays to `host:port`; run it with `tg.start(proxy.run)`."""

    def __init__(self, host: str, port: int, decide: Decide = no_faults) -> None:
        self.host, self.port = host, port
        self.decide = decide
        self.seen: list[Seen] = []
        self._listen_port = 0
        self._link_up = anyio.Event()
        self._link_up.set()
        self._connections: set[anyio.CancelScope] = set()
        self.connections_made = 0
        """Client connections accepted so far."""
        self._listener_scope: anyio.CancelScope | None = None
        self._pending: set[Seen] = set()
        self._changed = anyio.Event()
        self._arrived = anyio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listen_port}/"

    def calls(self, tool: str) -> list[Seen]:
        """The `tools/call` requests of `tool` that reached the proxy, faulted or not."""
        return [seen for seen in self.seen if seen.request.tool == tool]

    async def next_call(self, tool: str, number: int = 1) -> Seen:
        """Wait until the `number`-th `tools/call` of `tool` has reached the proxy; return it."""
        while len(self.calls(tool)) < number:
            await self._arrived.wait()
        return self.calls(tool)[number - 1]

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `tg.start` returns the proxy's URL once it listens."""
        started = False
        while True:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self._listen_port)
            async with listener:
                self._listen_port = listener.extra(SocketAttribute.local_port)  # noqa: S610  (anyio, not Django)
                if not started:
                    task_status.started(self.url)
                    started = True
                with anyio.CancelScope() as self._listener_scope:
                    await sockets.serve(listener, self._relay)  # a cut link's cancel loses no accepted socket
            await self._link_up.wait()

    async def cut_link(self) -> None:
        """Close every connection and stop listening: new connections are refused until `restore_link`."""
        self._link_up = anyio.Event()
        if self._listener_scope is not None:
            self._listener_scope.cancel()
        for scope in list(self._connections):
            scope.cancel()
        await anyio.lowlevel.checkpoint()

    def restore_link(self) -> None:
        self._link_up.set()

    async def wait_quiet(self) -> None:
        """Return once every request on its way to the sandbox (held by a delay, or forwarded) has been
        answered, or its connection is gone: nothing more will reach the sandbox unless sent anew."""
        while self._pending:
            await self._changed.wait()

    def _arrive(self, seen: Seen) -> None:
        self.seen.append(seen)
        arrived, self._arrived = self._arrived, anyio.Event()
        arrived.set()

    def _expect(self, seen: Seen) -> None:
        self._pending.add(seen)

    def _done(self, seen: Seen | None) -> None:
        if seen is not None and seen in self._pending:
            self._pending.discard(seen)
            changed, self._changed = self._changed, anyio.Event()
            changed.set()

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        self.connections_made += 1
        with anyio.CancelScope() as scope:
            self._connections.add(scope)
            try:
                upstream = await anyio.connect_tcp(self.host, self.port)
                async with upstream:
                    await _Connection(self, client, upstream).run()
            except _BROKEN:
                pass  # either side went away: this connection is over
            finally:
                self._connections.discard(scope)


class _Connection:
    """One client connection and its upstream twin: requests one at a time (HTTP/1.1, no pipelining)."""

    def __init__(self, proxy: FaultProxy, client: anyio.abc.SocketStream, upstream: anyio.abc.SocketStream) -> None:
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.current: Seen | None = None
        """The JSON-RPC request forwarded (or held to be) whose answer has not come back yet."""
        self.swallow = False

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_until_broken, self._answers, tg.cancel_scope)
                await _until_broken(self._requests, tg.cancel_scope)
        finally:
            self.proxy._done(self.current)

    async def _requests(self) -> None:
        reader = BufferedByteReceiveStream(self.client)
        while True:
            try:
                head = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
            except anyio.IncompleteRead:
                return  # the client closed between requests
            length = _content_length(head)
            body = await reader.receive_exactly(length) if length else b""
            request = Request(head.split(b" ", 1)[0].decode("ascii", "replace"), body)
            seen = Seen(request, self.proxy.decide(request))
            self.proxy._arrive(seen)
            forwarded = seen.fault is None or seen.fault.phase == "after" or seen.fault.kind == "delay"
            if forwarded and (request.message or {}).get("id") is not None:
                self.current = seen
                self.proxy._expect(seen)
            if seen.fault is not None and seen.fault.phase == "before" and not await self._before(seen.fault, reader):
                return
            await self.upstream.send(head + b"\r\n\r\n" + body)

    async def _before(self, fault: Fault, reader: BufferedByteReceiveStream) -> bool:
        """Act on a request not yet forwarded; True when it is to be forwarded after all (a delay)."""
        if fault.kind == "delay":
            await _hold(fault)
            return True
        if fault.kind == "reset":
            await reset(self.client)
            return False
        if fault.kind == "half_close":
            await self.client.send_eof()
        await _drain(reader)  # drop, half_close: swallow whatever else comes until the client gives up
        return False

    async def _answers(self) -> None:
        held = b""
        while True:
            try:
                chunk = await self.upstream.receive()
            except anyio.EndOfStream:
                return
            current = self.current
            if self.swallow or current is None:
                if not self.swallow:
                    await self.client.send(chunk)
                continue
            held += chunk
            fault = current.fault if current.fault is not None and current.fault.phase == "after" else None
            done = answered(held, (current.request.message or {}).get("id"))
            if fault is None:
                await self.client.send(chunk)
            if done:
                self.current, answer, held = None, held, b""
                current.answered.set()
                self.proxy._done(current)
                if fault is not None and not await self._after(fault, answer):
                    return

    async def _after(self, fault: Fault, answer: bytes) -> bool:
        """Act on a whole answer from the sandbox; False when the connection is over."""
        if fault.kind == "delay":
            await _hold(fault)
            await self.client.send(answer)
        elif fault.kind == "reset":
            await reset(self.client)
            return False
        elif fault.kind == "half_close":
            await self.client.send_eof()
            self.swallow = True
        else:
            self.swallow = True
        return True


async def _until_broken(pump: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
    """Run one direction of a connection; when it ends (or either side breaks), end the other too."""
    try:
        await pump()
    except _BROKEN:
        pass
    finally:
        scope.cancel()


async def reset(stream: anyio.abc.SocketStream) -> None:
    """Close with a TCP RST instead of a FIN: SO_LINGER on with a zero timeout, then close."""
    raw = stream.extra(SocketAttribute.raw_socket)  # noqa: S610  (anyio's typed attribute, not Django's)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()


def answered(response: bytes, request_id: Any) -> bool:
    """Has the sandbox's whole answer to JSON-RPC request `request_id` arrived in `response` (SSE or JSON)?"""
    head, _, body = response.partition(b"\r\n\r\n")
    if not _:
        return False
    candidates = [match.group(1) for match in _DATA_LINE.finditer(body)]
    length = _content_length(head)
    if length is not None and len(body) >= length:
        candidates.append(body[:length])
        if not head.startswith(b"HTTP/1.1 2"):
            return True  # an HTTP error answer is whole once its body is
    for candidate in candidates:
        try:
            message = json.loads(candidate)
        except ValueError:
            continue
        if (
            isinstance(message, dict)
            and message.get("id") == request_id
            and ("result" in message or "error" in message)
        ):
            return True
    return False


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
        if name.strip().lower() == b"transfer-encoding" and head.startswith(b"POST"):
            raise AssertionError("the proxy reads requests with a Content-Length only")
    return None


async def _hold(fault: Fault) -> None:
    if fault.release is not None:
        await fault.release.wait()
    else:
        await anyio.sleep(fault.seconds)


async def _drain(reader: BufferedByteReceiveStream) -> None:
    while True:
        try:
            await reader.receive()
        except anyio.EndOfStream:
            return
