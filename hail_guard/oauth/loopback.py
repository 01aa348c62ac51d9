"""The loopback redirect of `hail-guard login` (RFC 8252): a one-time receiver for the browser's return.

    async with receiving(port, required=False) as callback:   # listens on 127.0.0.1 while the block runs
        callback.redirect_uri                                  # http://127.0.0.1:PORT/callback
        callback.showing(show)                                 # the SDK's redirect handler: learns the state
        await callback.result()                                # the SDK's callback handler: code, state, iss

The answer is the first request to `/callback` that brings back the `state` of the authorization address
this sign-in showed (compared in constant time), shown a short page. Any other process on the machine can
reach 127.0.0.1: a callback with another state, or none, gets an error page, is logged, and the receiver
waits on; it cannot abort the sign-in. The state is never shown or logged. Anything else gets 404. HTTP
is read with h11; a connection that says nothing useful (a probe, a closed tab) is dropped.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import h11
import structlog
from mcp.client.auth import AuthorizationCodeResult

from hail_guard import sockets
from hail_guard.errors import HailGuardError

log = structlog.get_logger(__name__)

CALLBACK_PATH = "/callback"
_PAGE = "<!doctype html><meta charset=utf-8><title>hail-guard</title><p>{}</p>"
_DONE_PAGE = _PAGE.format("hail-guard is signed in. You can close this window.")
_REFUSED_PAGE = _PAGE.format("The sign-in was not completed; see the terminal.")
_FOREIGN_PAGE = _PAGE.format(
    "This is not the sign-in hail-guard is waiting for (its state differs). Use the address the terminal shows."
)

Show = Callable[[str], Awaitable[None]]


@dataclass
class Callback:
    """The loopback redirect's receiver: the first request to `CALLBACK_PATH` with this sign-in's state."""

    redirect_uri: str
    done: anyio.Event = field(default_factory=anyio.Event)
    answer: dict[str, str] = field(default_factory=dict)
    state: str | None = field(default=None, repr=False)
    """The `state` of the authorization address shown (None until it is): the one a callback must bring."""

    def showing(self, show: Show) -> Show:
        """`show` as the SDK's redirect handler, learning first the state the authorization address carries."""

        async def redirect(address: str) -> None:
            self.state = parse_qs(urlsplit(address).query).get("state", [None])[0]
            await show(address)

        return redirect

    def _ours(self, state: str | None) -> bool:
        return self.state is not None and state is not None and hmac.compare_digest(state.encode(), self.state.encode())

    async def result(self) -> AuthorizationCodeResult:
        """The SDK's callback handler: the code and state the browser brought back."""
        await self.done.wait()
        if "code" not in self.answer:
            error = "".join(c for c in self.answer.get("error", "no code") if c.isalnum() or c in "_-")[:64]
            raise HailGuardError(f"the sign-in was not completed: the authorization server answered {error!r}")
        return AuthorizationCodeResult(
            code=self.answer["code"], state=self.answer.get("state"), iss=self.answer.get("iss")
        )

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        """Answer one connection (`sockets.serve` closes it)."""
        try:
            await self._answer(stream)
        except (h11.ProtocolError, anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError, OSError) as exc:
            log.debug("signin_callback_unreadable", error=type(exc).__name__)  # a probe, a closed tab...

    async def _answer(self, stream: anyio.abc.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        with anyio.fail_after(10):
            event = connection.next_event()
            while event is h11.NEED_DATA:
                connection.receive_data(await stream.receive())
                event = connection.next_event()
        if not isinstance(event, h11.Request):
            return
        path, _, query = event.target.decode("ascii", "replace").partition("?")
        if path != CALLBACK_PATH or self.done.is_set():
            await _respond(stream, connection, 404, _PAGE.format("Not found."))
            return
        answer = {name: values[0] for name, values in parse_qs(query).items()}
        if not self._ours(answer.get("state")):
            log.warning("signin_callback_ignored", reason="it does not bring back this sign-in's state")
            await _respond(stream, connection, 400, _FOREIGN_PAGE)
            return
        self.answer = answer
        self.done.set()
        done = "code" in self.answer
        await _respond(stream, connection, 200 if done else 400, _DONE_PAGE if done else _REFUSED_PAGE)


async def _respond(stream: anyio.abc.SocketStream, connection: h11.Connection, status: int, page: str) -> None:
    body = page.encode()
    headers = [
        ("content-type", "text/html; charset=utf-8"),
        ("content-length", str(len(body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
    ]
    response = connection.send(h11.Response(status_code=status, headers=headers)) or b""
    await stream.send(
        response + (connection.send(h11.Data(data=body)) or b"") + (connection.send(h11.EndOfMessage()) or b"")
    )


@asynccontextmanager
async def receiving(port: int, *, required: bool) -> AsyncIterator[Callback]:
    """Listen on 127.0.0.1 for the browser's redirect while the block runs: at `port` (0: any), or at any
    port when that one is taken, unless it is `required`."""
    try:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    except OSError as exc:
        if required or not port:
            raise HailGuardError(f"cannot receive the sign-in on 127.0.0.1:{port}: {exc.strerror or exc}") from None
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)  # noqa: S610  (anyio's attributes, not Django's)
    callback = Callback(f"http://127.0.0.1:{bound}{CALLBACK_PATH}")
    try:
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(sockets.serve, listener, callback.handle)
            try:
                yield callback
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the server never fails, so this is the block's own error
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
