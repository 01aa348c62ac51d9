"""Case 6, the operator console on a big ledger: the overview, the review queue and searches, rendered.

The ledger is filled in bulk as the growth case fills it (`growth.fill`: accepted sends two events
each, 0.5 s apart, so a million span the last six days; ready and unknown rows; opt-outs), plus
sends in review through the real `Ledger`. The console is the real app (`build_console` behind its
checks) over the real proxy and the in-process sandbox; pages are fetched over ASGI (httpx), signed
in, so each figure is one whole page: the ledger reads, the template and the checks.

The overview is timed on its first view after start as well as on later ones: it keeps nothing between
views (the week's sends per hour are one read of the counts the ledger keeps, `sends_by_hour`), so the
first costs what the others do.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import httpx2
from starlette.applications import Starlette

from bench.figures import Figure, median, ms, percentile
from bench.growth import Shape, fill
from hail_guard.config import ConsoleSettings, HttpSettings
from hail_guard.console.app import console_routes
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.models import Outcome, State
from hail_guard.sandbox import Sandbox
from hail_guard.server import Proxy
from hail_guard.upstream import UpstreamTarget, connect_upstream

TARGET_MS = 200.0
IN_REVIEW = 40
TOKEN_ENV = "HAIL_GUARD_BENCH_OPERATOR_TOKEN"  # noqa: S105  (the name of a variable)
PAGES = (
    ("overview", "/console/"),
    ("review queue", "/console/review"),
    ("search: a recipient", "/console/operations?recipient=Lead{n}@Example.com"),
    ("search: a key prefix", "/console/operations?key=hist:lead{n}:"),
    ("search: accepted, newest first", "/console/operations?state=accepted"),
)


@dataclass
class Rendered:
    rows: int
    first_overview: float
    samples: dict[str, list[float]]
    fill_seconds: float


async def measure(url: str, rows: int, views: int) -> Rendered:
    filled = await fill(url, Shape(history=rows, work=300))
    os.environ[TOKEN_ENV] = "bench-operator-token-0123456789abcdef"
    target = UpstreamTarget(kind="inprocess", server=Sandbox().server())
    async with (
        open_ledger(url) as ledger,
        connect_upstream(target, timeout_seconds=10, heartbeat_seconds=None) as upstream,
    ):
        await _put_in_review(ledger, IN_REVIEW)
        proxy = Proxy(ledger, upstream)
        await proxy.refresh_tools()
        site = Starlette(routes=[console_routes(ledger, proxy, ConsoleSettings(token_env=TOKEN_ENV), HttpSettings())])
        transport = httpx2.ASGITransport(app=site)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            await _sign_in(client, os.environ[TOKEN_ENV])
            first = await _timed(client, "/console/")
            samples: dict[str, list[float]] = {name: [] for name, _ in PAGES}
            for n in range(views):
                for name, path in PAGES:
                    samples[name].append(await _timed(client, path.format(n=1 + n * 7919 % rows)))
    return Rendered(rows, first, samples, filled)


async def _put_in_review(ledger: Ledger, count: int) -> None:
    from bench.growth import new_intents

    unclear = Outcome(state=State.NEEDS_REVIEW, reason="bench", review_reason="replays stayed unclear")
    for intent in new_intents(count, "review"):
        begin = await ledger.begin_send(intent, owner="bench", lease_seconds=60)
        await ledger.record_outcome(begin.operation.id, owner="bench", outcome=unclear, actor="bench")


async def _sign_in(client: httpx2.AsyncClient, token: str) -> None:
    form = (await client.get("/console/login")).text
    found = re.search(r'name="csrf" value="([^"]+)"', form)
    assert found is not None
    answer = await client.post("/console/login", data={"csrf": found.group(1), "name": "bench", "token": token})
    if answer.status_code != 303:
        raise RuntimeError(f"the bench could not sign in to the console: {answer.status_code}")


async def _timed(client: httpx2.AsyncClient, path: str) -> float:
    started = time.perf_counter()
    answer = await client.get(path)
    took = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"{path} answered {answer.status_code}")
    return took


def figures(ledger: str, rendered: Rendered) -> list[Figure]:
    found = [
        Figure(
            case="console",
            name=f"overview, first view, {rendered.rows:,} operations",
            ledger=ledger,
            median=rendered.first_overview * 1000.0,
            target=f"<= {TARGET_MS:.0f} ms",
            met=rendered.first_overview * 1000.0 <= TARGET_MS,
            note=f"nothing kept from an earlier view; fill {rendered.fill_seconds:.0f} s",
        )
    ]
    for name, samples in rendered.samples.items():
        timed = ms(samples)
        found.append(
            Figure(
                case="console",
                name=f"{name}, {rendered.rows:,} operations",
                ledger=ledger,
                median=median(timed),
                p99=percentile(timed, 0.99),
                target=f"<= {TARGET_MS:.0f} ms",
                met=median(timed) <= TARGET_MS,
                note=f"n={len(timed)}; {IN_REVIEW} in review",
            )
        )
    return found
