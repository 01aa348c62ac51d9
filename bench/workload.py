"""What the benchmarks send, and hail-guard opened in process in front of a sandbox.

Every send is a distinct lead (its own address, body and metadata ids), so no send is answered
from the ledger or refused as a probable duplicate: each one is recorded and forwarded. Logging
runs at hail-guard's default level (info), rendered as JSON as in production, into /dev/null.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from hail_guard.guard import Guard, GuardSettings
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
async def open_guarded(ledger_url: str, sandbox: Sandbox) -> AsyncIterator[Proxy]:
    """hail-guard over `ledger_url`, chained to `sandbox` in process, with its default settings."""
    settings = GuardSettings()
    target = UpstreamTarget(kind="inprocess", server=sandbox.server())
    async with (
        open_ledger(ledger_url) as ledger,
        connect_upstream(target, timeout_seconds=settings.timeout_seconds, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(Guard(ledger, upstream, settings), upstream)
        await proxy.refresh_tools()
        yield proxy
