"""Case 1, overhead per call: the same MCP client calling through hail-guard vs straight to the sandbox.

Both paths are in process over the SDK's in-memory streams, so the transport costs the same:

    direct:   client -> sandbox
    guarded:  client -> hail-guard (ledger) -> sandbox

Calls alternate between the two paths (and which goes first), so machine noise lands on both.
Each guarded send is a new lead: recorded, forwarded, recorded again. The read (`get_email`)
passes straight through.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp import Client, types

from bench.figures import Figure, median, ms, percentile
from bench.workload import direct_email, lead_email, open_guarded
from hail_guard.sandbox import Sandbox
from hail_guard.server import build_server

ADDED_P50_TARGET_MS = 2.0
RATIO_TARGET = 1.08
RATIO_TARGET_LATENCY_MS = 20
ADDED_P99_TARGET_MS = 5.0
"""At 0 ms upstream: a send must not stall behind the disk (issue 28)."""


async def measure(
    ledger: str, ledger_url: str, latency_ms: int, iterations: int, warmup: int, commit_ms: float | None = None
) -> list[Figure]:
    """The figures of both paths; `commit_ms`, one fsync'd commit on this disk now (limits' probe), names the floor
    a guarded send stands on: two such commits and the MCP hop that the pass-through read shows."""
    direct_sandbox = Sandbox(latency_seconds=latency_ms / 1000)
    guarded_sandbox = Sandbox(latency_seconds=latency_ms / 1000)
    sends: dict[str, list[float]] = {"direct": [], "guarded": []}
    reads: dict[str, list[float]] = {"direct": [], "guarded": []}
    async with (
        open_guarded(ledger_url, guarded_sandbox) as proxy,
        Client(build_server(proxy), mode="legacy") as guarded,
        Client(direct_sandbox.server(), mode="legacy") as direct,
    ):
        for n in range(warmup + iterations):
            paths = [("direct", direct, direct_email(n)), ("guarded", guarded, lead_email(n))]
            for path, client, arguments in paths if n % 2 == 0 else reversed(paths):
                sent = await _timed(client.call_tool, "send_email", arguments)
                read = await _timed(client.call_tool, "get_email", {"email_id": _id_of(sent.result)})
                if n >= warmup:
                    sends[path].append(sent.seconds)
                    reads[path].append(read.seconds)
    hop = median(ms(reads["guarded"])) - median(ms(reads["direct"]))
    floor = f"; floor: two fsync'd commits {2 * commit_ms:.2f} ms + the MCP hop {hop:.2f} ms" if commit_ms else ""
    return [
        _figure("send_email (guarded)", ledger, latency_ms, sends, send=True, floor=floor),
        _figure("get_email (pass-through)", ledger, latency_ms, reads, send=False),
    ]


class _Timed:
    def __init__(self, result: types.CallToolResult, seconds: float) -> None:
        self.result, self.seconds = result, seconds


async def _timed(call: Callable[..., Awaitable[types.CallToolResult]], *args: Any) -> _Timed:
    started = time.perf_counter()
    result = await call(*args)
    seconds = time.perf_counter() - started
    if result.is_error:
        raise RuntimeError(f"the benchmark call {args[0]} failed: {result.content}")
    return _Timed(result, seconds)


def _id_of(result: types.CallToolResult) -> str:
    data = result.structured_content
    message_id = data.get("id") if isinstance(data, dict) else None
    if not isinstance(message_id, str):
        raise RuntimeError(f"send_email answered without an id: {data}")  # noqa: TRY004  (a failed run, not a type)
    return message_id


def _figure(
    name: str, ledger: str, latency_ms: int, samples: dict[str, list[float]], *, send: bool, floor: str = ""
) -> Figure:
    guarded, direct = ms(samples["guarded"]), ms(samples["direct"])
    p50, base = median(guarded), median(direct)
    added = p50 - base
    added_p99 = percentile(guarded, 0.99) - percentile(direct, 0.99)
    ratio = p50 / base
    target, met = "", None
    if send:
        if latency_ms == RATIO_TARGET_LATENCY_MS:
            target = f"ratio <= {RATIO_TARGET}"
            met = ratio <= RATIO_TARGET
        else:
            target = f"added p50 <= {ADDED_P50_TARGET_MS:g} ms; added p99 <= {ADDED_P99_TARGET_MS:g} ms"
            met = added <= ADDED_P50_TARGET_MS and added_p99 <= ADDED_P99_TARGET_MS
    note = (
        f"added p50 {added:.2f} ms, p99 {added_p99:.2f} ms; "
        f"direct p99 {percentile(direct, 0.99):.2f} ms; n={len(guarded)}{floor}"
    )
    return Figure(
        case="overhead",
        name=f"{name}, upstream {latency_ms} ms",
        ledger=ledger,
        unit="ms",
        median=p50,
        p99=percentile(guarded, 0.99),
        baseline=base,
        ratio=ratio,
        target=target,
        met=met,
        note=note,
    )
