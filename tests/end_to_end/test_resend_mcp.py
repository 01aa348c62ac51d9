"""hail-guard in front of the REAL `resend-mcp` (npm, 2.22.0, installed from `tests/vendors/resend` by `npm ci`),
as a user runs it: `hail-guard serve` over stdio with `profile = "resend"`, resend-mcp as its upstream command,
and resend-mcp calling a fake of Resend's REST API (`tests.resend_api`) that it finds through `[upstream.env]`
(`RESEND_BASE_URL = "${FAKE_RESEND_URL}"`). Whatever goes wrong, each recipient gets each email once, as the
fake API's outbox counts it. `profile init` and `profile check` run against the real server too.

Under CI (`CI=true`) a missing `node_modules` fails these tests (run `npm ci` in tests/vendors/resend); elsewhere
they are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters, types

from hail_guard.cli import main
from hail_guard.profiles import parse_profile
from tests.conftest import data, missing, text
from tests.resend_api import ResendApi, serving
from tests.unit.test_docs import doc_block

VENDOR = Path(__file__).parents[1] / "vendors" / "resend"
RESEND_MCP = VENDOR / "node_modules" / "resend-mcp" / "dist" / "index.js"
API_KEY = "re_test_0123456789abcdef"  # what the fake API takes; never a real key
ADA, BOB = "ada@example.com", "bob@example.com"
SENDER = "Acme <hello@acme.test>"
TIMEOUT_SECONDS = 30.0
"""hail-guard's upstream timeout where nothing is meant to hang: generous, for a loaded machine."""
HANG_SECONDS = 5.0
"""Where Resend's answer is meant never to come: how long hail-guard waits before it records `unknown`."""


@pytest.fixture
def resend_mcp() -> Path:
    if not RESEND_MCP.is_file():
        missing(f"the resend-mcp package is not installed: run `npm ci` in {VENDOR}")
    return RESEND_MCP


def email(to: str = ADA, **changes: Any) -> dict[str, Any]:
    return {"to": [to], "subject": "Intro", "text": "Hi, nice to meet you.", "from": SENDER, **changes}


def config(tmp_path: Path, server: Path, *, timeout: float = TIMEOUT_SECONDS) -> Path:
    path = tmp_path / "hail-guard.toml"
    path.write_text(
        "[ledger]\n"
        f'url = "sqlite:///{tmp_path / "ledger.db"}"\n'
        "[upstream]\n"
        f'command = ["node", {json.dumps(str(server))}]\n'
        'profile = "resend"\n'
        f"timeout_seconds = {timeout}\n"
        "[upstream.env]\n"
        'RESEND_BASE_URL = "${FAKE_RESEND_URL}"\n'
        "[delivery]\npoll = false\n"
    )
    return path


def environment(api_url: str) -> dict[str, str]:
    return {"RESEND_API_KEY": API_KEY, "FAKE_RESEND_URL": api_url, "PATH": os.environ["PATH"]}


@asynccontextmanager
async def agent(
    tmp_path: Path, server: Path, api: ResendApi, *, upstream_seconds: float = TIMEOUT_SECONDS
) -> AsyncIterator[Client]:
    """The fake API, and an agent's MCP client talking to `hail-guard serve` over stdio (which starts resend-mcp)."""
    async with serving(api) as url:
        args = ["-m", "hail_guard", "--config", str(config(tmp_path, server, timeout=upstream_seconds)), "serve"]
        params = StdioServerParameters(command=sys.executable, args=args, env=environment(url), cwd=str(tmp_path))
        async with Client(params, mode="legacy") as client:
            yield client


def guard(result: types.CallToolResult) -> dict[str, Any]:
    found: dict[str, Any] = data(result)["hail_guard"]
    return found


async def until(moment: str) -> None:
    """Wait until `moment` (ISO 8601): a `not_before` the upstream set. Time is what is waited for here."""
    wait = datetime.fromisoformat(moment) - datetime.now(UTC)
    await anyio.sleep(max(wait.total_seconds(), 0))


async def reconciled(client: Client, operation_id: str) -> dict[str, Any]:
    result = await client.call_tool("reconcile", {"operation_id": operation_id})
    [view] = data(result)["reconciled"]
    return dict(view)


async def test_a_repeated_send_email_reaches_each_recipient_once(tmp_path: Path, resend_mcp: Path) -> None:
    api = ResendApi()
    async with agent(tmp_path, resend_mcp, api) as client:
        first = await client.call_tool("send-email", email(cc=[BOB]))
        assert guard(first)["state"] == "accepted", text(first)
        assert data(first)["id"] == api.outbox[0]["id"]  # read from resend-mcp's words
        again = await client.call_tool("send-email", email(cc=[BOB]))
        assert guard(again)["replayed"] is True
    assert api.delivered() == {ADA: 1, BOB: 1}
    assert api.requests["emails"] == 1


async def test_a_regenerated_retry_recased_with_a_trailing_space_and_a_null_cc_is_the_same_send(
    tmp_path: Path, resend_mcp: Path
) -> None:
    api = ResendApi()
    async with agent(tmp_path, resend_mcp, api) as client:
        first = guard(await client.call_tool("send-email", email()))
        retry = await client.call_tool(
            "send-email", email(to="Ada@Example.COM", text="Hi, nice to meet you. ", cc=None)
        )
        assert not retry.is_error, text(retry)
        assert (guard(retry)["operation_id"], guard(retry)["replayed"]) == (first["operation_id"], True)
    assert api.delivered() == {ADA: 1}


async def test_a_send_that_hangs_after_resend_accepted_it_is_unknown_then_reconciled_once(
    tmp_path: Path, resend_mcp: Path
) -> None:
    api = ResendApi()
    api.fault("emails", 1, "hang_after_accept")
    async with agent(tmp_path, resend_mcp, api, upstream_seconds=HANG_SECONDS) as client:
        lost = await client.call_tool("send-email", email())
        assert guard(lost)["state"] == "unknown", text(lost)
        assert "Resend may already have sent this message" in text(lost)
        assert "reconcile" in text(lost)
        again = await client.call_tool("send-email", email())  # the agent retries anyway: answered from the ledger
        assert guard(again)["replayed"] is True
        settled = await reconciled(client, guard(lost)["operation_id"])
        assert settled["state"] == "accepted"
        assert settled["provider_id"] == api.outbox[0]["id"]
    assert api.delivered() == {ADA: 1}
    assert api.requests["emails"] == 2  # the replay, under the same key, got the saved answer


async def test_a_502_after_resend_accepted_is_unknown_and_a_replay_under_the_same_key_settles_it(
    tmp_path: Path, resend_mcp: Path
) -> None:
    api = ResendApi()
    api.fault("emails", 1, "error_after_accept")
    async with agent(tmp_path, resend_mcp, api) as client:
        gateway = await client.call_tool("send-email", email())
        assert guard(gateway)["state"] == "unknown", text(gateway)
        assert (await reconciled(client, guard(gateway)["operation_id"]))["state"] == "accepted"
    assert api.delivered() == {ADA: 1}


async def test_a_429_sends_nothing_and_the_same_call_later_sends_it_once(tmp_path: Path, resend_mcp: Path) -> None:
    api = ResendApi()
    api.fault("emails", 1, "rate_limit")
    async with agent(tmp_path, resend_mcp, api) as client:
        limited = await client.call_tool("send-email", email())
        assert guard(limited)["state"] == "ready", text(limited)
        assert "NOT SENT YET" in text(limited)
        assert api.outbox == []
        await until(guard(limited)["not_before"])  # the wait Resend asked for, not a guess
        sent = await client.call_tool("send-email", email())
        assert guard(sent)["state"] == "accepted", text(sent)
    assert api.delivered() == {ADA: 1}


async def test_a_repeated_send_batch_emails_sends_each_email_once(tmp_path: Path, resend_mcp: Path) -> None:
    api = ResendApi()
    batch = {"emails": [email(), email(to=BOB, subject="Welcome")]}
    async with agent(tmp_path, resend_mcp, api) as client:
        first = await client.call_tool("send-batch-emails", batch)
        assert guard(first)["state"] == "accepted", text(first)
        assert data(first)["id"] == api.outbox[0]["id"]
        again = await client.call_tool("send-batch-emails", batch)
        assert guard(again)["replayed"] is True
    assert api.delivered() == {ADA: 1, BOB: 1}
    assert api.requests["batch"] == 1


async def test_a_repeated_broadcast_and_a_repeated_event_are_each_sent_once(tmp_path: Path, resend_mcp: Path) -> None:
    api = ResendApi()
    broadcast = {"broadcastId": "b7f9c2e1-2f57-4d0e-9d1a-1c2b3d4e5f60"}
    event = {"event": "user.signed_up", "email": ADA}
    async with agent(tmp_path, resend_mcp, api) as client:
        sent = await client.call_tool("send-broadcast", broadcast)
        assert guard(sent)["state"] == "accepted", text(sent)
        assert data(sent)["id"] == broadcast["broadcastId"]  # read from resend-mcp's two text blocks
        assert guard(await client.call_tool("send-broadcast", broadcast))["replayed"] is True
        fired = await client.call_tool("send-event", event)
        assert guard(fired)["state"] == "accepted", text(fired)
        assert guard(await client.call_tool("send-event", event))["replayed"] is True
    assert api.broadcasts_sent == [broadcast["broadcastId"]]
    assert [sent["email"] for sent in api.events_sent] == [ADA]


async def test_a_batch_of_20_through_faults_reaches_each_lead_once(tmp_path: Path, resend_mcp: Path) -> None:
    api = ResendApi()
    api.fault("emails", 3, "hang_after_accept")
    api.fault("emails", 7, "error_after_accept")
    api.fault("emails", 11, "rate_limit")
    leads = [f"lead{n:02}@example.com" for n in range(20)]
    sends = [{"tool": "send-email", "arguments": email(to=lead, subject=f"Hello {n}")} for n, lead in enumerate(leads)]
    async with agent(tmp_path, resend_mcp, api, upstream_seconds=HANG_SECONDS) as client:
        planned = await client.call_tool("plan_batch", {"sends": sends, "name": "twenty"})
        batch_id = data(planned)["batch_id"]
        await client.call_tool("run_batch", {"batch_id": batch_id, "concurrency": 1})
        status = data(await client.call_tool("batch_status", {"batch_id": batch_id}))
        assert status["counts"].get("unknown") == 2, status
        await client.call_tool("reconcile", {})
        [limited] = data(await client.call_tool("list_operations", {"state": "ready"}))["operations"]
        await until(limited["not_before"])  # the wait Resend asked for, not a guess
        await client.call_tool("run_batch", {"batch_id": batch_id, "concurrency": 1})  # the rate-limited one
        status = data(await client.call_tool("batch_status", {"batch_id": batch_id}))
    assert status["counts"] == {"accepted": 20}, status
    assert api.delivered() == dict.fromkeys(leads, 1)


async def test_resend_mcp_killed_mid_call_is_unknown_restarted_and_reconciled_once(
    tmp_path: Path, resend_mcp: Path
) -> None:
    api = ResendApi()
    api.fault("emails", 1, "hang_after_accept")
    async with agent(tmp_path, resend_mcp, api) as client:
        answers: list[types.CallToolResult] = []

        async def send() -> None:
            answers.append(await client.call_tool("send-email", email()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.fail_after(15):
                await api.wait_for("emails", 1)  # Resend has it; resend-mcp waits for the answer
            os.kill(_resend_mcp_pid(resend_mcp), signal.SIGKILL)
        [lost] = answers
        assert guard(lost)["state"] == "unknown", text(lost)
        settled = await reconciled(client, guard(lost)["operation_id"])  # hail-guard starts resend-mcp again
        assert settled["state"] == "accepted"
    assert api.delivered() == {ADA: 1}


def _resend_mcp_pid(server: Path) -> int:
    """The node process running `server` that this test's hail-guard started (a descendant of this process)."""
    ours = {os.getpid()}
    found: list[int] = []
    for _ in range(3):  # this test -> hail-guard -> node
        children = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if parent in ours:
                children.append(int(entry.name))
                if str(server).encode() in command:
                    found.append(int(entry.name))
        ours = set(children)
    [pid] = found
    return pid


def test_profile_init_drafts_a_profile_for_the_real_resend_mcp_and_check_passes_it(
    tmp_path: Path, resend_mcp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `profile init` failed on resend-mcp ("Duplicate inline table key 'id'"), and neither command
    could start it without HAIL_GUARD_UPSTREAM_TOKEN_ENV (then said "Hail ... is not reachable")."""
    monkeypatch.setenv("RESEND_API_KEY", API_KEY)
    for name in ("HAIL_GUARD_CONFIG", "HAIL_GUARD_UPSTREAM_TOKEN_ENV", "HAIL_GUARD_UPSTREAM_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    source = f"node {resend_mcp}"
    drafted = tmp_path / "drafted.toml"
    assert main(["profile", "init", "--from", source, "--key-env", "RESEND_API_KEY", "--output", str(drafted)]) == 0
    profile = parse_profile(drafted.read_text(), "drafted")
    assert {"send-email", "send-batch-emails", "send-broadcast", "send-event"} <= set(profile.tools)
    assert profile.spec("send-batch-emails").recipients[0] == "/emails/*/to"
    assert "create-contact" in tomllib.loads(drafted.read_text())["profile"]["pass_through"]
    assert main(["profile", "check", str(drafted), "--from", source, "--key-env", "RESEND_API_KEY"]) == 0
    assert main(["profile", "check", "resend", "--from", source]) == 0  # the key variable is the profile's
    out = capsys.readouterr().out
    assert "ok: every pointer of resend exists in the schemas of Resend (stdio command 'node')" in out


def test_profile_check_against_resend_mcp_without_its_key_says_the_upstream_could_not_be_started(
    tmp_path: Path, resend_mcp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RESEND_API_KEY", raising=False)
    assert main(["profile", "check", "resend", "--from", f"node {resend_mcp}"]) == 1
    said = capsys.readouterr().err
    assert "the upstream (Resend) could not be started" in said
    assert "No API key" in said  # resend-mcp's own words, from its stderr
    assert "Hail" not in said


async def test_the_docs_resend_setup_serves_as_pasted_with_only_the_package_and_the_api_swapped(
    tmp_path: Path, resend_mcp: Path
) -> None:
    block = doc_block("docs/how-to/other-mcp-servers.md", "toml", "Resend's server over stdio, talking to Resend's API")
    assert 'command = ["npx", "-y", "resend-mcp@2.22.0"]' in block
    assert 'RESEND_BASE_URL = "https://api.resend.com"' in block
    api = ResendApi()
    async with serving(api) as url:
        pasted = block.replace('["npx", "-y", "resend-mcp@2.22.0"]', json.dumps(["node", str(resend_mcp)]))
        pasted = pasted.replace('"https://api.resend.com"', json.dumps(url))  # the fake, not production
        config = tmp_path / "hail-guard.toml"
        config.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[delivery]\npoll = false\n' + pasted)
        args = ["-m", "hail_guard", "--config", str(config), "serve"]
        env = {"RESEND_API_KEY": API_KEY, "PATH": os.environ["PATH"]}
        params = StdioServerParameters(command=sys.executable, args=args, env=env, cwd=str(tmp_path))
        async with Client(params, mode="legacy") as client:
            sent = await client.call_tool("send-email", email())
    assert guard(sent)["state"] == "accepted", text(sent)
    assert api.delivered() == {ADA: 1}
