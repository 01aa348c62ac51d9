"""What the benchmarks send, and hail-guard opened in front of a sandbox: in process, or in a process of its own.

Every send is a distinct lead (its own address, body and metadata ids), so no send is answered
from the ledger or refused as a probable duplicate: each one is recorded and forwarded. Logging
runs at hail-guard's default level (info), rendered as JSON as in production, into /dev/null.
`sandbox_process` runs the fake Hail as real Hail runs: another process, over Streamable HTTP, so
that it does not share hail-guard's event loop.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import httpx2

from hail_guard.guard import GuardSettings
from hail_guard.ledger import open_ledger
from hail_guard.logs import configure_logging
from hail_guard.sandbox import Sandbox
from hail_guard.server import Proxy
from hail_guard.upstream import UpstreamTarget, connect_upstream

LOG_LEVEL = "info"
"""hail-guard's default `[log] level`."""


def lead_email(n: int, tag: str = "g") -> dict[str, Any]:
    """A valid send_email to lead `n`, distinct in recipient, body and metadata ids (no key given)."""
    return {
        "to": [f"lead{n}.{tag}@example.com"],
        "subject": "Hello",
        "body_text": f"Hi lead {n}, nice to meet you.",
        "recipient_consent": True,
        "metadata": {"campaign_id": f"bench-{tag}", "lead_id": f"lead{n:07d}", "message_id": "intro"},
    }


def direct_email(n: int, tag: str = "d") -> dict[str, Any]:
    """The same call sent straight to the sandbox, carrying the key hail-guard would derive."""
    arguments = lead_email(n, tag)
    arguments["idempotency_key"] = f"bench-{tag}:lead{n:07d}:email:intro"
    return arguments


@contextmanager
def quiet_logs() -> Iterator[None]:
    """hail-guard logs at its default level, but into /dev/null (the table owns the terminal)."""
    configure_logging(LOG_LEVEL)
    saved = sys.stderr
    with open(os.devnull, "w", encoding="utf-8") as sink:
        sys.stderr = sink
        try:
            yield
        finally:
            sys.stderr = saved


@asynccontextmanager
async def sandbox_process(latency_ms: float) -> AsyncIterator[str]:
    """`hail-guard sandbox` in a process of its own, answering after `latency_ms`; yields its URL once it serves."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "hail_guard", "sandbox", "--port", str(port), "--latency-ms", str(latency_ms)]
    url = f"http://127.0.0.1:{port}/"
    async with await anyio.open_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:
        try:
            async with httpx2.AsyncClient() as http:
                with anyio.fail_after(30):
                    while True:  # another process: its health endpoint is the readiness signal
                        try:
                            if (await http.get(f"{url}healthz")).status_code == 200:
                                break
                        except httpx2.TransportError:
                            await anyio.sleep(0.05)
            yield url
        finally:
            process.terminate()


@asynccontextmanager
async def open_guarded(ledger_url: str, sandbox: Sandbox | str) -> AsyncIterator[Proxy]:
    """hail-guard over `ledger_url`, chained to `sandbox` (in process, or the URL of `sandbox_process`), with
    its default settings."""
    settings = GuardSettings()
    target = upstream_of(sandbox)
    async with (
        open_ledger(ledger_url) as ledger,
        connect_upstream(target, timeout_seconds=settings.timeout_seconds, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream, settings)
        await proxy.refresh_tools()
        yield proxy


def upstream_of(sandbox: Sandbox | str) -> UpstreamTarget:
    """The upstream a benchmark talks to: a sandbox in process, or one over HTTP at this URL."""
    if isinstance(sandbox, str):
        return UpstreamTarget(kind="http", url=sandbox)
    return UpstreamTarget(kind="inprocess", server=sandbox.server())
