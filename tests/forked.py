"""hail-guard commands in real processes, started fast: forked from a preloaded interpreter.

Starting Python and importing the MCP SDK takes over 1.5 s on two cores, and the crash campaign
starts hundreds of processes. `start` forks each one from a multiprocessing fork server that has
imported the third-party libraries once. It never imports `hail_guard`: a child imports it fresh,
after its environment is set, so `HAIL_GUARD_CRASH_AT` is read by the child's own import. The child
then runs `hail_guard.cli.main(argv)`, the body of the `hail-guard` console script: a real `serve`,
`worker` or `sandbox` process with its own pid, its stdin/stdout on a socket (`stdio=True`, for an
MCP client: `Command.mcp_client`) or in a file, and its stderr in a log file. SIGKILL is SIGKILL.

This module must not import `hail_guard` (nor `tests.conftest`): the fork server imports it to
reach `_child`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import mcp_types
from mcp import Client
from mcp.shared.message import SessionMessage

CRASH_VARIABLE = "HAIL_GUARD_CRASH_AT"
_PRELOAD = [
    "anyio",
    "mcp",
    "mcp.client.sse",
    "mcp.client.streamable_http",
    "mcp.server",
    "mcp.server.runner",
    "mcp.server.sse",
    "mcp.server.stdio",
    "mcp.server.streamable_http_manager",
    "pydantic",
    "structlog",
    "aiosqlite",
    "httpx2",
    "jsonschema",
    "uvicorn",
    "starlette.applications",
    "rich.console",
    "rich.progress",
    "rich.table",
    "prometheus_client",
    "platformdirs",
]
_context: multiprocessing.context.ForkServerContext | None = None


def _fork_server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        _context = context
    return _context


def _child(
    argv: list[str], env: dict[str, str], log_path: str, stdio: socket.socket | None, stdout_path: str | None
) -> None:
    """In the forked process: environment, standard streams, then the `hail-guard` console script."""
    os.environ.pop(CRASH_VARIABLE, None)  # only ever armed on purpose
    os.environ.update(env)
    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
    if stdio is not None:
        os.dup2(stdio.fileno(), 0)
        os.dup2(stdio.fileno(), 1)
        stdio.close()
    else:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(stdout_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  (the process's own stdin, for life)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    from hail_guard.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.exit(code)


@dataclass
class Command:
    """A running (or finished) `hail-guard` process."""

    process: multiprocessing.process.BaseProcess
    log_path: Path
    stdout_path: Path | None
    stdio: socket.socket | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def log(self, last: int | None = 4000) -> str:
        """Its stderr: the end (`last` characters, for failure messages), or all of it."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-last:] if last is not None else text

    def stdout(self) -> str:
        assert self.stdout_path is not None
        return self.stdout_path.read_text()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it."""
        return self.process.exitcode

    async def wait(self, seconds: float) -> int:
        """Its exit code (-9: SIGKILL), within `seconds` (else TimeoutError)."""
        with anyio.fail_after(seconds):
            while self.process.exitcode is None:
                await anyio.wait_readable(self.process.sentinel)
                self.process.join(0)
        code = self.process.exitcode
        assert code is not None
        return code

    def kill(self) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, signal.SIGTERM)

    async def stop(self, seconds: float = 20.0) -> int:
        """SIGTERM, then wait (SIGKILL past `seconds`)."""
        self.terminate()
        try:
            return await self.wait(seconds)
        except TimeoutError:
            self.kill()
            return await self.wait(5)

    def close(self) -> None:
        if self.stdio is not None:
            self.stdio.close()
            self.stdio = None
        if self.process.exitcode is not None:
            self.process.close()

    @asynccontextmanager
    async def mcp_client(self) -> AsyncIterator[Client]:
        """An MCP client on its stdin/stdout (started with `stdio=True`)."""
        assert self.stdio is not None, "start it with stdio=True"
        sock, self.stdio = self.stdio, None
        async with Client(_socket_transport(sock), mode="legacy") as client:
            yield client


def start(
    argv: Sequence[str],
    *,
    logs: Path,
    env: Mapping[str, str] | None = None,
    stdio: bool = False,
    name: str = "hail-guard",
) -> Command:
    """Fork `hail-guard ARGV...`; its stderr goes to a new file in `logs` (and its stdout too, unless `stdio`)."""
    logs.mkdir(parents=True, exist_ok=True)
    number = len(list(logs.glob("*.log")))
    log_path = logs / f"{number:03d}-{name}.log"
    stdout_path = None if stdio else logs / f"{number:03d}-{name}.out"
    ours, theirs = socket.socketpair() if stdio else (None, None)
    process = _fork_server().Process(
        target=_child,
        args=(list(argv), dict(env or {}), str(log_path), theirs, str(stdout_path) if stdout_path else None),
        name=name,
        daemon=False,
    )
    process.start()
    if theirs is not None:
        theirs.close()
    return Command(process, log_path, stdout_path, ours)


@asynccontextmanager
async def _socket_transport(sock: socket.socket) -> AsyncIterator[Any]:
    """An MCP client transport over a connected socket: JSON-RPC messages, one per line."""
    stream = await anyio.abc.SocketStream.from_socket(sock)
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        buffer = b""
        async with to_session:
            try:
                async for chunk in stream:
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                            await to_session.send(SessionMessage(message))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                return  # the process died under us: the session sees the connection close

    async def write() -> None:
        async with from_session:
            async for message in from_session:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                try:
                    await stream.send(data.encode())
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                    return

    async with stream, anyio.create_task_group() as tg:
        tg.start_soon(read)
        tg.start_soon(write)
        try:
            yield from_server, to_server
        finally:
            tg.cancel_scope.cancel()
