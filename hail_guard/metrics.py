"""Prometheus metrics: tool calls, ledger and upstream latency, and the ledger's operations by state.

Each `Metrics` owns its own `CollectorRegistry` (never the global one), so several servers, or
several tests, live in one process. The series:

    hail_guard_tool_calls_total{tool, outcome}   calls served; outcome is a send's state, `replayed`,
                                                 `ok`, `error` or `cancelled` (unlisted tools: tool="unknown")
    hail_guard_tool_call_seconds{tool}           time to answer a tool call
    hail_guard_upstream_seconds{method}          time of each request to Hail (`call_tool`, `list_tools`, ...)
    hail_guard_ledger_seconds{method}            time of each ledger operation (`begin_send`, ...)
    hail_guard_operations{state}                 operations in the ledger, read at scrape time
    hail_guard_unknown_operations                operations whose outcome is unknown (`reconcile` settles them)
    hail_guard_review_operations                 operations waiting for a human (`needs_review`)
    hail_guard_http_refusals_total{status}       requests refused at the HTTP edge (401, 403, 413, 429)
    hail_guard_webhooks_total{outcome}           Hail webhooks received: applied, opted_out, unknown_operation,
                                                 ignored, duplicate, replayed, refused, too_large,
                                                 not_configured, unrecorded

`Metrics` is the proxy's `CallObserver`; `Metrics.timed` wraps a ledger or an upstream so that
every coroutine method is timed, and is otherwise transparent.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any, Literal, TypeVar, cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hail_guard.ledger import Overview
from hail_guard.models import State

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_T = TypeVar("_T")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.tool_calls = Counter(
            "hail_guard_tool_calls", "Tool calls served, by tool and outcome.", ["tool", "outcome"], registry=registry
        )
        self.tool_seconds = Histogram(
            "hail_guard_tool_call_seconds",
            "Time to answer a tool call.",
            ["tool"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.latency = {
            kind: Histogram(
                f"hail_guard_{kind}_seconds",
                f"Time of each {kind} operation, by method.",
                ["method"],
                buckets=_SECONDS_BUCKETS,
                registry=registry,
            )
            for kind in ("upstream", "ledger")
        }
        self.operations = Gauge(
            "hail_guard_operations", "Operations in the ledger, by state.", ["state"], registry=registry
        )
        self.unknown = Gauge("hail_guard_unknown_operations", "Operations whose outcome is unknown.", registry=registry)
        self.review = Gauge("hail_guard_review_operations", "Operations waiting for a human.", registry=registry)
        self.refusals = Counter(
            "hail_guard_http_refusals", "Requests refused at the HTTP edge, by status.", ["status"], registry=registry
        )
        self.webhooks = Counter(
            "hail_guard_webhooks", "Hail webhooks received, by outcome.", ["outcome"], registry=registry
        )

    def webhook(self, outcome: str) -> None:
        self.webhooks.labels(outcome=outcome).inc()

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None:
        self.tool_calls.labels(tool=tool, outcome=outcome).inc()
        self.tool_seconds.labels(tool=tool).observe(seconds)

    def refused(self, status: int) -> None:
        self.refusals.labels(status=str(status)).inc()

    def timed(self, target: _T, kind: Literal["upstream", "ledger"]) -> _T:
        """`target`, with every coroutine method timed into `hail_guard_<kind>_seconds`."""
        return cast(_T, _Timed(target, self.latency[kind]))

    async def count_operations(self, ledger: Overview) -> None:
        """Read the operations per state from the ledger (at scrape time)."""
        counts = await ledger.count_by_state()
        for state in State:
            self.operations.labels(state=state.value).set(counts.get(state, 0))
        self.unknown.set(counts.get(State.UNKNOWN, 0))
        self.review.set(counts.get(State.NEEDS_REVIEW, 0))

    def render(self) -> bytes:
        """Everything, in the Prometheus text format."""
        return generate_latest(self.registry)


class _Timed:
    """Times every coroutine method of the wrapped object; other attributes pass through unchanged."""

    def __init__(self, target: object, histogram: Histogram) -> None:
        self._target = target
        self._histogram = histogram

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not inspect.iscoroutinefunction(value):
            return value
        observe = self._histogram.labels(method=name).observe

        @functools.wraps(value)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await value(*args, **kwargs)
            finally:
                observe(time.perf_counter() - started)

        return timed
