"""The operator console over a real proxy (the harness: ledger + sandbox), for the fast tests and the browser.

`console_client` speaks to the console in process (httpx over ASGI); `signed_in` signs in the way a
browser does (load the form, post it with its CSRF token); `served_console` runs it on a real
uvicorn for Chromium.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
from pydantic import SecretStr
from starlette.applications import Starlette

from hail_guard.config import ConsoleSettings, HttpSettings
from hail_guard.console.app import console_routes
from hail_guard.console.context import Console
from hail_guard.listener import listening, serve_app
from hail_guard.models import Operation, Outcome, State
from tests.conftest import Harness, email

OPERATOR_TOKEN = "operator-token-0123456789abcdef0123"
AGENT_TOKEN = "agent-token-0123456789abcdef0123456"
OPERATOR_ENV = "HAIL_GUARD_TEST_OPERATOR_TOKEN"
BASE = "http://127.0.0.1"


async def in_review(harness: Harness, **changes: Any) -> Operation:
    """A send whose outcome stayed unclear (Hail never got it: the sandbox has nothing)."""
    schema = dict(harness.proxy.tools["send_email"].input_schema)
    metadata = {"campaign_id": "c1", "lead_id": "l9", "message_id": "review"}
    intent, _ = harness.proxy.guard.prepare("send_email", email(**{"metadata": metadata, **changes}), schema)
    begin = await harness.ledger.begin_send(intent, owner="w1", lease_seconds=60)
    unclear = Outcome(state=State.NEEDS_REVIEW, reason="replays stayed unclear", review_reason="replays stayed unclear")
    return await harness.ledger.record_outcome(begin.operation.id, owner="w1", outcome=unclear, actor="w1")


def console_site(harness: Harness, **console: object) -> Starlette:
    """What `serve --transport http` mounts, alone: the console at /console, agents' token configured."""
    settings = ConsoleSettings.model_validate({"token_env": OPERATOR_ENV, **console})
    http = HttpSettings(token=SecretStr(AGENT_TOKEN), token_env="HAIL_GUARD_TEST_NO_SUCH_VARIABLE")
    return Starlette(routes=[console_routes(harness.ledger, harness.proxy, settings, http)])


def console_state(site: Starlette) -> Console:
    mount = site.routes[0]
    inner = mount.app.app  # type: ignore[attr-defined]  # the console behind its checks
    console: Console = inner.state.console
    return console


@asynccontextmanager
async def console_client(site: Starlette) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=site)
    async with httpx2.AsyncClient(transport=transport, base_url=BASE, follow_redirects=False) as client:
        yield client


def unbroken(page: str) -> str:
    """A page with its line-break opportunities (`<wbr>`, after the separators of ids and keys) taken out."""
    return page.replace("<wbr>", "")


def hidden_csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, "the page has no CSRF field"
    return found.group(1)


async def signed_in(client: httpx2.AsyncClient, name: str = "Ada Operator", token: str = OPERATOR_TOKEN) -> str:
    """Sign in as a browser does; returns the session's CSRF token (from the overview's forms)."""
    form = await client.get("/console/login")
    answer = await client.post("/console/login", data={"csrf": hidden_csrf(form.text), "name": name, "token": token})
    assert answer.status_code == 303, answer.text
    overview = await client.get("/console/")
    assert overview.status_code == 200
    return hidden_csrf(overview.text)


@asynccontextmanager
async def served_console(site: Starlette) -> AsyncIterator[str]:
    """The console on a real uvicorn on 127.0.0.1 (a free port); yields the base URL."""
    with listening("127.0.0.1", 0) as sock:
        async with anyio.create_task_group() as tg:
            url: str = await tg.start(serve_app, site, sock)
            try:
                yield url.rstrip("/")
            finally:
                tg.cancel_scope.cancel()
