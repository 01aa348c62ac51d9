"""Shared fixtures: a real ledger file per test, and a whole proxy over the in-process sandbox."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
from mcp import Client, types

from hail_guard import recipients, same_send
from hail_guard.app import Opened
from hail_guard.guard import GuardSettings
from hail_guard.ledger import Ledger, open_ledger
from hail_guard.lifecycle import is_legal
from hail_guard.logs import configure_logging
from hail_guard.sandbox import Sandbox, parse_fault
from hail_guard.server import Proxy, build_server
from hail_guard.upstream import UpstreamTarget, connect_upstream
from tests import postgres
from tests.postgres import PostgresServer

configure_logging("debug")
E = TypeVar("E", bound=BaseException)


@pytest.fixture(autouse=True)
def _all_log_levels() -> None:
    """Commands run in process reconfigure logging; every test starts from all levels again."""
    configure_logging("debug")


@pytest.fixture(autouse=True)
def _recipients_read_afresh() -> None:
    """Every test reads its recipients afresh: a normal form another test left kept would answer without the code
    that makes it running (mutation testing forks each mutant's run from a process whose caches are warm)."""
    recipients.forget_normal_forms()
    same_send.forget_recipient_keys()


@pytest.fixture(params=["sqlite", "postgres"])
async def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each backend in turn: the URL of a fresh ledger (a new file in `tmp_path`; a new PostgreSQL database) that
    every process and connection of the test can share."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    async with server.database() as url:
        yield url


@pytest.fixture
async def ledger(ledger_url: str) -> AsyncIterator[Ledger]:
    """Each backend in turn, open on a fresh ledger (`ledger_url`). After the test, every event the ledger recorded
    must be a move of the state machine (`hail_guard.lifecycle`)."""
    async with open_ledger(ledger_url) as opened:
        yield opened
        await _every_event_is_a_legal_move(opened)


async def _every_event_is_a_legal_move(ledger: Ledger) -> None:
    for operation in await ledger.list_operations(limit=100_000):
        for event in await ledger.events(operation.id):
            assert is_legal(event.from_state, event.to_state), f"{operation.id}: {event.from_state} -> {event.to_state}"


def missing(reason: str, *, module: bool = False) -> NoReturn:
    """What a test needs is not on this machine: skipped, saying why; under CI (`CI` set) a failure, since
    `.ci/run` installs everything the tests need. `module`: said while a test module is imported."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI must run this: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (see tests/postgres.py). Missing: skipped, but under CI a failure."""
    if reason := postgres.missing_reason():
        missing(f"the PostgreSQL leg: {reason}")
    with postgres.postgres_server() as server:
        yield server


@pytest.fixture
async def postgres_url(postgres_server: PostgresServer) -> AsyncIterator[str]:
    """A new, empty PostgreSQL database for this test."""
    async with postgres_server.database(migrated=False) as url:
        yield url


def email(**changes: Any) -> dict[str, Any]:
    """A valid send_email request (no key: hail-guard derives one)."""
    base: dict[str, Any] = {
        "to": ["lead@example.com"],
        "subject": "Hello",
        "body_text": "Nice to meet you.",
        "recipient_consent": True,
        "metadata": {"campaign_id": "c1", "lead_id": "l1", "message_id": "intro"},
    }
    return {**base, **changes}


def data(result: types.CallToolResult) -> dict[str, Any]:
    if isinstance(result.structured_content, dict):
        return result.structured_content
    value: dict[str, Any] = json.loads(result.content[0].text)  # type: ignore[union-attr]
    return value


def subclasses(root: type[E]) -> list[type[E]]:
    """`root` and every class below it that is loaded now (what a boundary's mapping test walks)."""
    return [root, *(cls for child in root.__subclasses__() for cls in subclasses(child))]


def text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


@dataclass
class Harness:
    """An agent's MCP client -> hail-guard -> the sandbox, all in process."""

    sandbox: Sandbox
    ledger: Ledger
    proxy: Proxy
    settings: GuardSettings

    def client(self, mode: str = "legacy") -> Client:
        """An agent's MCP client (a new session; use it with `async with`)."""
        return Client(build_server(self.proxy), mode=mode)

    async def call(self, tool: str, arguments: dict[str, Any], mode: str = "legacy") -> types.CallToolResult:
        async with self.client(mode) as client:
            return await client.call_tool(tool, arguments)

    def opened(self) -> Opened:
        """The harness's parts as `app.open_proxy` gives them to the edge."""
        return Opened(self.ledger, self.proxy.upstream, self.proxy)


@asynccontextmanager
async def open_harness(
    tmp_path: Path, *faults: str, sandbox: Sandbox | None = None, ledger_url: str | None = None, **settings: Any
) -> AsyncIterator[Harness]:
    """The sandbox (given, or one with `faults`), a ledger (`ledger_url`, else a file in `tmp_path`), and
    hail-guard between."""
    sandbox = sandbox or Sandbox(faults=[parse_fault(f) for f in faults])
    guard_settings = GuardSettings(**{"timeout_seconds": 2.0, **settings})
    target = UpstreamTarget(kind="inprocess", server=sandbox.server())
    async with (
        open_ledger(ledger_url or f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        connect_upstream(target, timeout_seconds=guard_settings.timeout_seconds, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream, guard_settings)
        await proxy.refresh_tools()
        yield Harness(sandbox, ledger, proxy, guard_settings)
