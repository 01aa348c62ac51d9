"""The PostgreSQL ledger going away: at startup, while the proxy runs, and between a commit and its answer.

Each test has its own database. It is made unreachable by refusing new connections to it and ending
the ones open (the server and every other test's database stay up), or reached through a TCP hop
that drops the answer to a write the server has carried out: a statement that commits on its own (the
send path's), or the COMMIT of a transaction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream
from structlog.testing import capture_logs

from hail_guard.cli import main
from hail_guard.errors import LedgerUnavailable, RefusedByPolicy
from hail_guard.ledger import open_ledger
from hail_guard.models import State
from hail_guard.policy import LEDGER_UNAVAILABLE
from tests.conftest import data, email, missing, open_harness, text
from tests.ledger.test_ledger_contract import batch_intents
from tests.ledger.test_ledger_postgres import closed_port
from tests.postgres import PostgresServer

try:
    import asyncpg  # noqa: F401
except ImportError:
    missing("the PostgreSQL ledger needs the `postgres` extra: pip install -e '.[dev,postgres]'", module=True)


def lead(number: int) -> dict[str, Any]:
    return email(
        to=[f"lead{number}@example.com"],
        body_text=f"Hello lead {number}",
        metadata={"campaign_id": "c1", "lead_id": f"l{number}", "message_id": "intro"},
    )


@asynccontextmanager
async def unavailable(server: PostgresServer, url: str) -> AsyncIterator[None]:
    """The database at `url` refuses connections and loses the ones it had, until the block ends."""
    name = url.rsplit("/", 1)[-1]
    await server.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
    try:
        await server.execute(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' "
            "AND pid <> pg_backend_pid()"
        )
        yield
    finally:
        await server.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


class Hop:
    """A TCP hop to PostgreSQL that can lose the answer to a write: the server commits, the client never learns.

    `lose_answer(marker, nth)`: the nth message from now that carries `marker` (a COMMIT, or the text of a
    statement that commits on its own, which a connection sends the first time it runs it) goes through and is
    carried out; its answer is dropped and that connection cut, so the ledger sees a broken connection in the
    middle of committing. A statement's text is sent to prepare it; it runs in the client's next message, so
    that is the one whose answer is lost.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._marker = b"COMMIT;"
        self._until_lost = 0

    def lose_answer(self, marker: bytes = b"COMMIT;", nth: int = 1) -> None:
        self._marker, self._until_lost = marker, nth

    async def pipe(self, client: SocketStream) -> None:
        async with client, await anyio.connect_tcp(self.host, self.port) as server, anyio.create_task_group() as tg:
            committing, prepared = anyio.Event(), None

            async def to_server() -> None:
                nonlocal prepared
                async for chunk in client:
                    if prepared is not None and prepared in _bound(chunk):  # the marked statement runs now
                        committing.set()
                    elif self._until_lost and self._marker in chunk:
                        self._until_lost -= 1
                        if self._until_lost == 0:
                            prepared = _parsed(chunk, self._marker)
                            if prepared is None:  # not a statement being prepared: this is the write itself
                                committing.set()
                    await server.send(chunk)
                tg.cancel_scope.cancel()

            async def to_client() -> None:
                async for chunk in server:
                    if committing.is_set():  # the client waits for nothing else: this is the COMMIT's answer
                        break
                    await client.send(chunk)
                tg.cancel_scope.cancel()

            tg.start_soon(to_server)
            tg.start_soon(to_client)


def _messages(chunk: bytes) -> list[tuple[bytes, bytes]]:
    """The frontend messages in `chunk`: (type, body), each `type, int32 length, body`."""
    found, at = [], 0
    while at + 5 <= len(chunk):
        length = int.from_bytes(chunk[at + 1 : at + 5], "big")
        found.append((chunk[at : at + 1], chunk[at + 5 : at + 1 + length]))
        at += 1 + length
    return found


def _parsed(chunk: bytes, marker: bytes) -> bytes | None:
    """The name of the statement a Parse message in `chunk` prepares with `marker` in its text (None: no Parse)."""
    for kind, body in _messages(chunk):
        if kind == b"P" and marker in body:
            return body.split(b"\0", 1)[0]
    return None


def _bound(chunk: bytes) -> list[bytes]:
    """The statements the Bind messages in `chunk` run (a Bind names its portal, then its statement)."""
    return [body.split(b"\0", 2)[1] for kind, body in _messages(chunk) if kind == b"B"]


@asynccontextmanager
async def open_hop(url: str) -> AsyncIterator[tuple[Hop, str]]:
    """A hop to the database at `url`; yields it and the URL that goes through it (no TLS, to see the writes)."""
    parts = urlsplit(url)
    hop = Hop(parts.hostname or "127.0.0.1", parts.port or 5432)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)  # noqa: S610  (anyio's typed attribute, not Django's)
    user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hop.pipe)
        try:
            yield hop, urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}", query="sslmode=disable"))
        finally:
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["status"]])
def test_an_unreachable_database_at_startup_exits_1_with_one_line_and_no_password(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = closed_port()
    monkeypatch.delenv("HAIL_GUARD_CONFIG", raising=False)
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", f"postgresql://hg:s3cret-pw@127.0.0.1:{port}/ledger")
    code = main(command)
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    [line] = err.splitlines()
    assert line.startswith(f"hail-guard: cannot reach the PostgreSQL ledger at postgresql://127.0.0.1:{port}/ledger:")
    assert line.endswith("check that the server is running and the host and port in the ledger URL")
    assert "s3cret-pw" not in err


async def test_a_lost_database_refuses_sends_before_forwarding_and_recovers_when_it_returns(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    async with postgres_server.database() as url, open_harness(tmp_path, ledger_url=url) as harness:
        first = await harness.call("send_email", lead(1))
        operation_id = data(first)["hail_guard"]["operation_id"]
        async with unavailable(postgres_server, url):
            with capture_logs() as logs:
                refused = await harness.call("send_email", lead(2))
            assert refused.is_error
            assert text(refused) == LEDGER_UNAVAILABLE  # no host, user or database for the agent...
            [failed] = [entry for entry in logs if entry["event"] == "call_failed"]
            assert "PostgreSQL ledger at postgresql://127.0.0.1:" in failed["error"]  # ...the operator has them
            assert harness.sandbox.calls("send_email") == 1

            for tool, arguments in [
                ("get_operation", {"operation_id": operation_id}),
                ("list_operations", {}),
                ("reconcile", {}),
            ]:
                read = await harness.call(tool, arguments)
                assert (read.is_error, text(read)) == (True, LEDGER_UNAVAILABLE), tool

        again = await harness.call("send_email", lead(2))
        assert (data(again)["hail_guard"]["state"], data(again)["hail_guard"]["replayed"]) == ("accepted", False)
        assert [line["to"] for line in harness.sandbox.outbox] == [["lead1@example.com"], ["lead2@example.com"]]
        history = data(await harness.call("get_operation", {"operation_id": operation_id}))["history"]
        assert [event["to_state"] for event in history] == ["sending", "accepted"]


async def test_a_send_whose_intent_commit_answer_is_lost_is_not_forwarded_and_reconcile_sends_it_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    async with (
        postgres_server.database() as url,
        open_hop(url) as (hop, hopped),
        open_harness(tmp_path, ledger_url=hopped, lease_seconds=1.0) as harness,
    ):
        hop.lose_answer(b"hg_begin_send(")  # the intent's statement: it commits on its own
        lost = await harness.call("send_email", lead(1))
        assert lost.is_error
        assert text(lost) == LEDGER_UNAVAILABLE  # "retrying is safe": the retry finds the intent committed
        assert harness.sandbox.calls("send_email") == 0

        again = await harness.call("send_email", lead(1))  # the intent was committed after all
        assert data(again)["hail_guard"]["state"] == "sending"
        assert harness.sandbox.calls("send_email") == 0
        with anyio.fail_after(15):
            # The lost caller's lease runs out on the database clock; until then reconcile finds nothing.
            while not (settled := data(await harness.call("reconcile", {}))["reconciled"]):  # noqa: ASYNC110
                await anyio.sleep(0.1)
        assert [view["state"] for view in settled] == ["accepted"]
        assert [line["to"] for line in harness.sandbox.outbox] == [["lead1@example.com"]]


async def test_an_outcome_whose_commit_answer_is_lost_is_kept_and_the_send_is_not_repeated(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    async with (
        postgres_server.database() as url,
        open_hop(url) as (hop, hopped),
        open_harness(tmp_path, ledger_url=hopped) as harness,
    ):
        hop.lose_answer(b"before_state")  # the intent goes through; the outcome's statement's answer is lost
        sent = await harness.call("send_email", lead(1))
        assert data(sent)["hail_guard"]["state"] == "accepted"
        again = await harness.call("send_email", lead(1))
        assert data(again)["hail_guard"]["replayed"] is True
        history = data(await harness.call("get_operation", {"idempotency_key": "c1:l1:email:intro"}))["history"]
        assert [event["to_state"] for event in history] == ["sending", "accepted"]
        assert harness.sandbox.calls("send_email") == 1


async def test_a_batch_whose_commit_answer_is_lost_is_refused_when_planned_again_and_nothing_doubles(
    postgres_url: str,
) -> None:
    async with open_hop(postgres_url) as (hop, hopped), open_ledger(hopped) as ledger:
        hop.lose_answer()  # a batch is planned in one transaction: its COMMIT
        with pytest.raises(LedgerUnavailable, match="PostgreSQL ledger"):
            await ledger.plan_batch(batch_id="B1", name=None, intents=batch_intents(3), state=State.READY, actor="op")
        with pytest.raises(RefusedByPolicy, match=r"3 send\(s\) already exist in the ledger"):
            await ledger.plan_batch(batch_id="B2", name=None, intents=batch_intents(3), state=State.READY, actor="op")
        assert (await ledger.batch_status("B1")).counts == {State.READY: 3}
        assert await ledger.count_by_state() == {State.READY: 3}
