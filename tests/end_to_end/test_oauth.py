"""Signing in to an OAuth upstream: the sandbox's authorization server, `login`, renewal, revocation, logout.

Everything runs against the sandbox served over real HTTP with its `AuthorizationServer`; the sign-in is
driven without a person: the test's `show` fetches the authorization address itself and follows its
redirect to hail-guard's loopback receiver.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import httpx2
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp import Client, types
from structlog.testing import capture_logs

from hail_guard import app
from hail_guard.app import Opened
from hail_guard.cli import main
from hail_guard.config import load_settings
from hail_guard.errors import ConfigError, HailGuardError, SignInRequired
from hail_guard.guard import GuardSettings
from hail_guard.ledger import open_ledger
from hail_guard.models import State
from hail_guard.oauth import SignIn, TokenStore, login, logout
from hail_guard.sandbox import ManualClock, Sandbox, serve_http
from hail_guard.sandbox.oauth import AuthorizationServer
from hail_guard.server import Proxy, build_server
from hail_guard.upstream import Upstream, UpstreamTarget, connect_upstream
from hail_guard.web import build_http_app
from tests.conftest import data, email, text


class FakeTime:
    """hail-guard's clock for the expiry of tokens: real time plus what the test moved it on by."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class Hail:
    """The sandbox over HTTP, signing clients in like hosted Hail."""

    url: str
    auth: AuthorizationServer
    sandbox: Sandbox
    clock: ManualClock
    shown: list[str] = field(default_factory=list)

    async def show(self, address: str) -> None:
        """What a person does with the address: open it, approve (automatic here), land on the redirect."""
        self.shown.append(address)
        async with httpx2.AsyncClient(follow_redirects=True) as http:
            page = await http.get(address)
        assert page.status_code == 200, page.text


@asynccontextmanager
async def hosted_hail() -> AsyncIterator[Hail]:
    clock = ManualClock()
    auth, sandbox = AuthorizationServer(clock=clock), Sandbox()
    async with anyio.create_task_group() as tg:
        url = await tg.start(partial(serve_http, sandbox, "127.0.0.1", 0, None, oauth=auth))
        yield Hail(url, auth, sandbox, clock)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def upstream_signed_in(hail: Hail, sign_in: SignIn) -> AsyncIterator[Upstream]:
    target = UpstreamTarget(kind="http", url=hail.url, credentials=sign_in)
    async with connect_upstream(target, timeout_seconds=5, heartbeat_seconds=None) as upstream:
        yield upstream


@asynccontextmanager
async def proxy_signed_in(hail: Hail, sign_in: SignIn, tmp_path: Path) -> AsyncIterator[Opened]:
    async with (
        open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        upstream_signed_in(hail, sign_in) as upstream,
    ):
        proxy = Proxy(ledger, upstream, GuardSettings(timeout_seconds=5))
        await proxy.refresh_tools()
        yield Opened(ledger, upstream, proxy)


async def agent_call(proxy: Proxy, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
    async with Client(build_server(proxy), mode="legacy") as agent:
        return await agent.call_tool(tool, arguments)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_login_discovers_registers_and_signs_in_with_pkce_and_keeps_the_tokens_private(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path / "signin")
        record = await login(store, show=hail.show)
        again = await anyio.to_thread.run_sync(store.load)

    asked = parse_qs(urlsplit(hail.shown[0]).query)
    assert urlsplit(hail.shown[0]).path == "/authorize"
    assert {name: values[0] for name, values in asked.items() if name in ("code_challenge_method", "resource")} == {
        "code_challenge_method": "S256",
        "resource": hail.url,
    }
    assert len(asked["state"][0]) >= 32
    assert len(asked["code_challenge"][0]) >= 43
    assert urlsplit(asked["redirect_uri"][0]).hostname == "127.0.0.1"
    assert record.account == "agent@sandbox.hail.test (Hail Sandbox)"
    assert record.client.client_id.startswith("sbx-client-")
    assert record.tokens.refresh_token is not None
    assert again == record
    assert (mode(store.folder), mode(store.path), mode(store.lock_path)) == (0o700, 0o600, 0o600)
    assert record.tokens.access_token not in repr(record)


async def test_a_callback_without_this_sign_ins_state_is_refused_and_the_sign_in_waits_on(tmp_path: Path) -> None:
    """Any local process can reach the loopback receiver: it once took the first callback and printed the state."""
    forged: list[httpx2.Response] = []

    async def intruder_first(hail: Hail, address: str) -> None:
        redirect = parse_qs(urlsplit(address).query)["redirect_uri"][0]
        async with httpx2.AsyncClient() as http:
            for query in ("?code=stolen&state=forged", "?error=access_denied", "?code=stolen"):
                forged.append(await http.get(redirect + query))
        await hail.show(address)

    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        with capture_logs() as logs:
            record = await login(store, show=partial(intruder_first, hail))
    state = parse_qs(urlsplit(hail.shown[0]).query)["state"][0]
    assert record.tokens.access_token
    assert [answer.status_code for answer in forged] == [400, 400, 400]
    assert all("not the sign-in hail-guard is waiting for" in answer.text for answer in forged)
    assert [entry["event"] for entry in logs].count("signin_callback_ignored") == 3
    assert state not in repr(logs) + "".join(answer.text for answer in forged)


async def test_signing_in_again_keeps_the_registered_client(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        first = await login(store, show=hail.show)
        second = await login(store, show=hail.show)
    assert second.client.client_id == first.client.client_id
    assert second.tokens.access_token != first.tokens.access_token


async def test_a_denied_sign_in_is_a_clear_error_and_keeps_nothing(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        hail.auth.approving = False
        store = TokenStore(hail.url, tmp_path)
        with pytest.raises(HailGuardError, match=r"the sign-in was not completed: .*'access_denied'"):
            await login(store, show=partial(fetch_refusal, hail))
    assert not store.path.exists()


async def fetch_refusal(hail: Hail, address: str) -> None:
    async with httpx2.AsyncClient(follow_redirects=True) as http:
        page = await http.get(address)
    assert page.status_code == 400


async def test_login_to_an_upstream_that_asks_for_no_sign_in_says_so(tmp_path: Path) -> None:
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_http, Sandbox(), "127.0.0.1", 0, None)
        with pytest.raises(HailGuardError, match="answered without asking for a sign-in"):
            await login(TokenStore(url, tmp_path), show=pytest.fail)
        tg.cancel_scope.cancel()


async def test_tokens_are_renewed_shortly_before_they_expire(tmp_path: Path) -> None:
    now = FakeTime()
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        first = await login(store, show=hail.show, clock=now)
        async with upstream_signed_in(hail, SignIn(store, clock=now)) as upstream:
            await upstream.call_tool("whoami", {})
            assert hail.auth.refreshes == 0
            assert first.expires_at is not None
            now.offset = first.expires_at - time.time() - 60  # a minute left
            answer = await upstream.call_tool("whoami", {})
        renewed = await anyio.to_thread.run_sync(store.load)
    assert not answer.is_error
    assert hail.auth.refreshes == 1
    assert renewed is not None
    assert renewed.tokens.access_token != first.tokens.access_token
    assert renewed.tokens.refresh_token != first.tokens.refresh_token  # rotated, and kept
    assert renewed.renewed_at is not None
    assert renewed.account == first.account


async def test_a_401_is_renewed_once_and_the_send_goes_through_exactly_once(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path / "signin")
        await login(store, show=hail.show)
        async with proxy_signed_in(hail, SignIn(store), tmp_path) as signed:
            proxy = signed.proxy
            hail.clock.advance(31 * 24 * 3600)  # Hail's 30-day token is over; hail-guard's clock does not know
            sent = await agent_call(proxy, "send_email", email())
    assert data(sent)["hail_guard"]["state"] == "accepted"
    assert hail.auth.refreshes == 1
    assert len(hail.sandbox.outbox) == 1


async def test_a_revoked_grant_sends_nothing_and_names_the_fix_until_an_operator_signs_in_again(
    tmp_path: Path,
) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path / "signin")
        await login(store, show=hail.show)
        async with proxy_signed_in(hail, SignIn(store), tmp_path) as signed:
            proxy = signed.proxy
            hail.auth.revoke_all()
            first = await agent_call(proxy, "send_email", email())
            second = await agent_call(proxy, "send_email", email(to=["lead2@example.com"], metadata=lead("l2")))
            problem, ready = proxy.upstream.sign_in_problem, await readiness(signed)
            [operation] = await signed.ledger.list_operations()

            await login(store, show=hail.show)  # an operator signs in again; nothing is restarted
            third = await agent_call(proxy, "send_email", email(to=["lead3@example.com"], metadata=lead("l3")))
            ready_again = await readiness(signed)

    assert operation.state is State.READY  # recorded before the refusal; the worker sends it later
    assert data(first)["hail_guard"]["state"] == "ready"
    assert "an operator must run `hail-guard login`" in text(first)
    assert problem is not None
    assert problem.endswith("so nothing was sent: an operator must run `hail-guard login`")
    assert text(second) == problem  # refused before anything is recorded
    assert (ready.status_code, ready.json()["upstream"], ready.json()["detail"]) == (503, "sign_in_required", problem)
    assert data(third)["hail_guard"]["state"] == "accepted"
    assert [entry["request"]["metadata"]["lead_id"] for entry in hail.sandbox.outbox] == ["l3"]
    assert ready_again.status_code == 200


def lead(lead_id: str) -> dict[str, str]:
    return {"campaign_id": "c1", "lead_id": lead_id, "message_id": "intro"}


async def readiness(signed: Opened) -> httpx2.Response:
    app = build_http_app(signed.proxy, load_settings(environ={}).http, ledger=signed.ledger)
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        return await http.get("/readyz")


async def test_without_a_stored_sign_in_nothing_is_sent_and_the_fix_is_named(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        async with upstream_signed_in(hail, SignIn(store)) as upstream:
            with pytest.raises(SignInRequired, match=r"not signed in to Hail at .*: an operator must run `hail-guard"):
                await upstream.call_tool("whoami", {})
            await login(store, show=hail.show)
            answer = await upstream.call_tool("whoami", {})
    assert not answer.is_error


RENEWER = """
import sys, anyio
from hail_guard.logs import configure_logging
from hail_guard.oauth import SignIn, TokenStore

async def main() -> None:
    configure_logging("info")
    sign_in = SignIn(TokenStore(sys.argv[1], sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.readline()
    print(await sign_in.bearer(), flush=True)

anyio.run(main)
"""


async def test_two_processes_renewing_at_once_spend_the_refresh_token_once(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        record = await login(store, show=hail.show)
        store.save(record.model_copy(update={"expires_at": time.time() - 1}))  # as if a month had passed
        argv = [sys.executable, "-c", RENEWER, hail.url, str(tmp_path)]
        async with await anyio.open_process(argv) as one, await anyio.open_process(argv) as other:
            outputs = [BufferedByteReceiveStream(process.stdout) for process in (one, other)]  # type: ignore[arg-type]
            with anyio.fail_after(30):
                for output in outputs:
                    assert await output.receive_until(b"\n", 1000) == b"ready"
                for process in (one, other):  # both start at once; each finds the tokens due
                    await process.stdin.send(b"go\n")  # type: ignore[union-attr]
                tokens = [(await output.receive_until(b"\n", 1000)).decode() for output in outputs]
                assert [await process.wait() for process in (one, other)] == [0, 0]
        stored = store.load()
    assert stored is not None
    assert tokens == [stored.tokens.access_token] * 2
    assert (hail.auth.refreshes, hail.auth.reuses) == (1, 0)


async def test_logout_revokes_the_grant_and_forgets_the_tokens(tmp_path: Path) -> None:
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path)
        record = await login(store, show=hail.show)
        said = await logout(store)
        again = await logout(store)
        async with httpx2.AsyncClient() as http:
            refused = await http.post(hail.url, headers={"Authorization": f"Bearer {record.tokens.access_token}"})
    assert said == f"signed out of {store.key}: forgotten here; the authorization server revoked the grant"
    assert again == f"not signed in to {store.key}: nothing to forget"
    assert not store.path.exists()
    assert refused.status_code == 401


def test_a_sign_in_file_other_users_can_read_is_refused(tmp_path: Path) -> None:
    store = TokenStore("https://mcp.hail.test/", tmp_path)
    tmp_path.joinpath(store.path.name).write_text("{}")
    store.path.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by other users: delete it and run `hail-guard login` again"):
        store.load()


def test_an_unreadable_sign_in_file_is_refused_without_quoting_it(tmp_path: Path) -> None:
    store = TokenStore("https://mcp.hail.test/", tmp_path)
    secret = "sbx_at_must_not_be_quoted"
    descriptor = os.open(store.path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(descriptor, json.dumps({"upstream": "x", "tokens": {"access_token": secret}}).encode())
    os.close(descriptor)
    with pytest.raises(ConfigError, match="is not one hail-guard can read") as refused:
        store.load()
    assert secret not in str(refused.value)
    assert refused.value.__cause__ is None


def test_every_spelling_of_an_upstream_shares_one_sign_in(tmp_path: Path) -> None:
    spellings = ["https://MCP.hail.so", "https://mcp.hail.so/", "https://user:pw@mcp.hail.so:443/?x=1"]
    assert {TokenStore(url, tmp_path).path for url in spellings} == {TokenStore("https://mcp.hail.so", tmp_path).path}
    assert TokenStore("https://mcp.hail.so/other", tmp_path).path != TokenStore("https://mcp.hail.so", tmp_path).path


def write_config(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        f'[upstream]\nurl = "{url}"\nsignin_dir = "{tmp_path / "signin"}"\n[log]\nlevel = "debug"\n'
    )
    return config


async def run_command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`hail-guard ARGV` in process (on a worker thread: it runs its own event loop): exit code, stdout, stderr."""
    code = await anyio.to_thread.run_sync(main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_login_status_and_logout_from_the_command_line_against_the_sandbox_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HAIL_API_KEY", raising=False)
    sandbox = [sys.executable, "-m", "hail_guard", "sandbox", "--oauth", "--port", "0"]
    async with await anyio.open_process(sandbox) as hail:
        with anyio.fail_after(30):
            url = (await line_with(hail.stderr, b"sandbox_listening")).split("url=")[1].split()[0]
        monkeypatch.setenv("HAIL_GUARD_CONFIG", str(write_config(tmp_path, url)))
        login_command = [sys.executable, "-m", "hail_guard", "login", "--no-browser"]
        async with await anyio.open_process(login_command, env=dict(os.environ)) as process:
            assert process.stdout is not None
            with anyio.fail_after(30):
                address = (await line_with(process.stderr, b"/authorize?")).strip()
                async with httpx2.AsyncClient(follow_redirects=True) as http:  # the person's browser
                    landed = await http.get(address)
                assert await process.wait() == 0
                printed = b"".join([chunk async for chunk in process.stdout]).decode()
        capsys.readouterr()
        code, shown, _ = await run_command(capsys, "status")
        code_json, reported, _ = await run_command(capsys, "status", "--json")
        code_out, said, _ = await run_command(capsys, "logout")
        code_after, after, _ = await run_command(capsys, "status")
        hail.terminate()

    where = url.rstrip("/")
    assert "hail-guard is signed in" in landed.text
    assert printed.startswith(f"signed in: agent@sandbox.hail.test (Hail Sandbox) at {where}, since ")
    assert (code, code_json, code_out, code_after) == (0, 0, 0, 0)
    assert f"sign-in: agent@sandbox.hail.test (Hail Sandbox) at {where}, since " in shown
    assert "renewed automatically" in shown
    report = json.loads(reported)["signin"]
    assert (report["method"], report["upstream"]) == ("oauth", where)
    assert report["account"] == "agent@sandbox.hail.test (Hail Sandbox)"
    assert said.strip() == f"signed out of {where}: forgotten here; the authorization server revoked the grant"
    assert f"sign-in: not signed in to {where}: run `hail-guard login` (or set $HAIL_API_KEY)" in after


async def line_with(stream: Any, needle: bytes) -> str:
    """The first line of a process's output that holds `needle` (bound the wait with `anyio.fail_after`)."""
    lines = BufferedByteReceiveStream(stream)
    while needle not in (line := await lines.receive_until(b"\n", 65536)):
        pass
    return line.decode()


async def test_login_without_an_upstream_says_which_to_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HAIL_GUARD_CONFIG", raising=False)
    monkeypatch.delenv("HAIL_GUARD_UPSTREAM_URL", raising=False)
    code = await anyio.to_thread.run_sync(main, ["login", "--no-browser"])
    assert code == 1
    assert "which upstream? Pass --upstream URL (hosted Hail: https://mcp.hail.so)" in capsys.readouterr().err


def test_serving_without_an_api_key_uses_the_stored_sign_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(
        environ={"HAIL_GUARD_UPSTREAM_URL": "https://mcp.hail.test/", "HAIL_GUARD_UPSTREAM_SIGNIN_DIR": str(tmp_path)}
    )
    monkeypatch.delenv("HAIL_API_KEY", raising=False)
    signed_in = app.upstream_target(settings)
    monkeypatch.setenv("HAIL_API_KEY", "hail_static_key")
    keyed = app.upstream_target(settings)
    assert isinstance(signed_in.credentials, SignIn)
    assert (signed_in.token, signed_in.credentials.store.folder) == (None, tmp_path)
    assert (keyed.token, keyed.credentials) == ("hail_static_key", None)


async def test_no_token_appears_in_the_logs_the_ledger_or_an_export(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = FakeTime()
    async with hosted_hail() as hail:
        store = TokenStore(hail.url, tmp_path / "signin")
        record = await login(store, show=hail.show, clock=now)
        answers = []
        async with proxy_signed_in(hail, SignIn(store, clock=now), tmp_path) as signed:
            proxy = signed.proxy
            answers.append(await agent_call(proxy, "send_email", email()))
            assert record.expires_at is not None
            now.offset = record.expires_at - time.time()  # renewed before the next send
            answers.append(await agent_call(proxy, "send_email", email(to=["b@example.com"], metadata=lead("l2"))))
            hail.clock.advance(31 * 24 * 3600)  # renewed after a 401
            answers.append(await agent_call(proxy, "send_email", email(to=["c@example.com"], metadata=lead("l3"))))
            hail.auth.revoke_all()  # refused
            answers.append(await agent_call(proxy, "send_email", email(to=["d@example.com"], metadata=lead("l4"))))
            answers.append(await agent_call(proxy, "get_operation", {"idempotency_key": "c1:l4:email:intro"}))
        logged = capsys.readouterr().err
        monkeypatch.setenv("HAIL_GUARD_CONFIG", str(write_config(tmp_path, hail.url)))
        code, exported, more = await run_command(capsys, "ops", "export", "--format", "jsonl")
        code_csv, exported_csv, still_more = await run_command(capsys, "ops", "export", "--format", "csv")
        logged += more + still_more + caplog.text

    assert (code, code_csv) == (0, 0)
    assert (hail.auth.refreshes, len(hail.sandbox.outbox)) == (2, 3)
    assert len(exported.splitlines()) == 4
    assert "signin_renewed" in logged  # the logs did see all of it
    assert "signin_refused" in logged
    ledger = b"".join(path.read_bytes() for path in tmp_path.glob("ledger.db*"))
    seen = [logged, exported, exported_csv, ledger.decode("utf-8", "replace"), *(text(a) for a in answers)]
    assert len(hail.auth.issued) == 7  # a code, then access and refresh tokens at login and two renewals
    leaked = [secret for secret in hail.auth.issued if any(secret in where for where in seen)]
    assert leaked == []


async def test_login_can_be_told_its_redirect_port_and_says_so_when_it_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        async with hosted_hail() as hail:
            store = TokenStore(hail.url, tmp_path)
            with pytest.raises(HailGuardError, match=f"cannot receive the sign-in on 127.0.0.1:{busy}: "):
                await login(store, show=hail.show, port=busy)
            free = free_port()
            record = await login(store, show=hail.show, port=free)
    assert [str(uri) for uri in record.client.redirect_uris or []] == [f"http://127.0.0.1:{free}/callback"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_the_image_keeps_the_sign_in_on_its_data_volume() -> None:
    stage = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text().split("\nFROM ")[-1]
    assert "HAIL_GUARD_UPSTREAM_SIGNIN_DIR=/data/signin" in stage
    assert 'VOLUME ["/data"]' in stage
