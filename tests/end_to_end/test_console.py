"""The operator console without a browser: sign-in, sessions and their refusals, every page, every decision.

In process over ASGI (httpx), against a real ledger and the sandbox through the real proxy. The flows a
person clicks through are in tests/browser/test_console_browser.py.
"""

from __future__ import annotations

import csv
import getpass
import io
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import types

from hail_guard.config import ConsoleSettings, HttpSettings
from hail_guard.console.auth import Operators
from hail_guard.errors import ConfigError
from hail_guard.ledger import open_ledger
from hail_guard.models import State, Suppression
from tests.conftest import email, open_harness
from tests.console_site import (
    AGENT_TOKEN,
    OPERATOR_ENV,
    OPERATOR_TOKEN,
    console_client,
    console_site,
    console_state,
    hidden_csrf,
    in_review,
    signed_in,
    unbroken,
)

HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR_TOKEN)


async def test_signing_in_sets_a_strict_http_only_session_cookie_and_names_the_operator(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        assert (await client.get("/console/")).headers["location"] == "/console/login"
        form = await client.get("/console/login")
        answer = await client.post(
            "/console/login", data={"csrf": hidden_csrf(form.text), "name": "Ada", "token": OPERATOR_TOKEN}
        )
        assert answer.status_code == 303
        cookie = answer.headers["set-cookie"].lower()
        assert "hg_console=" in cookie
        for flag in ("httponly", "samesite=strict", "path=/console"):
            assert flag in cookie
        assert "secure" not in cookie  # plain http on loopback; Secure behind https
        page = await client.get("/console/")
        assert "signed in as <strong>Ada</strong>" in page.text


@pytest.mark.parametrize(
    ("token", "status"), [("wrong", 401), (AGENT_TOKEN, 401), ("", 401)], ids=["wrong", "the agents' token", "none"]
)
async def test_only_the_operators_token_signs_in(tmp_path: Path, token: str, status: int) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        form = await client.get("/console/login")
        answer = await client.post("/console/login", data={"csrf": hidden_csrf(form.text), "name": "A", "token": token})
        assert answer.status_code == status
        assert "set-cookie" not in answer.headers or "hg_console=" not in answer.headers["set-cookie"]
        assert (await client.get("/console/")).status_code == 303


async def test_a_sign_in_without_its_forms_token_is_refused(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        token = OPERATOR_TOKEN
        answer = await client.post("/console/login", data={"csrf": "forged", "name": "A", "token": token})
        assert answer.status_code == 403


async def test_sign_in_attempts_are_rate_limited(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness, sign_ins_per_minute=3)) as c:
        form = await c.get("/console/login")
        codes = [
            (
                await c.post("/console/login", data={"csrf": hidden_csrf(form.text), "name": "A", "token": "x"})
            ).status_code
            for _ in range(5)
        ]
        assert codes == [401, 401, 401, 429, 429]


async def test_a_one_time_link_signs_in_once(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        site = console_site(harness)
        link = console_state(site).operators.issue_link("ada")
        async with console_client(site) as client:
            first = await client.get(f"/console/login?once={link}")
            assert first.status_code == 303
            assert "signed in as <strong>ada</strong>" in (await client.get("/console/")).text
        async with console_client(site) as other:
            assert (await other.get(f"/console/login?once={link}")).status_code == 401


async def test_an_operator_token_equal_to_the_agents_token_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPERATOR_ENV, AGENT_TOKEN)
    agents = HttpSettings(token=AGENT_TOKEN).bearer_token()
    async with open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        with pytest.raises(ConfigError, match="equals the agents' token"):
            Operators(ConsoleSettings(token_env=OPERATOR_ENV), ledger, agent_token=agents)


async def test_every_page_has_a_strict_policy_and_renders_for_an_operator(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        await harness.call("send_email", email())
        op = await in_review(harness, to=["bo@example.com"], subject="Other")
        await signed_in(client)
        for path in ("/", "/review", "/campaigns", "/operations", f"/operations/{op.id}", "/opt-outs", "/tools"):
            page = await client.get(f"/console{path}")
            assert page.status_code == 200, path
            policy = page.headers["content-security-policy"]
            assert "default-src 'self'" in policy
            assert "frame-ancestors 'none'" in policy
            assert "unsafe-inline" not in policy
            assert page.headers["cache-control"] == "no-store"
            assert "<script>" not in page.text.replace('<script src="/console/static/', "")
        assert (await client.get("/console/static/htmx-2.0.11.min.js")).status_code == 200


async def test_a_foreign_host_or_origin_is_refused_before_anything_is_read_or_done(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        op = await in_review(harness)
        csrf = await signed_in(client)
        assert (await client.get("/console/", headers={"host": "evil.example"})).status_code == 403
        refused = await client.post(
            f"/console/review/{op.id}/resolve",
            data={"csrf": csrf, "state": "failed", "reason": "x"},
            headers={"origin": "https://evil.example"},
        )
        assert refused.status_code == 403
        assert (await harness.ledger.get(op.id)).state is State.NEEDS_REVIEW


async def test_a_decision_without_the_csrf_token_or_with_the_agents_token_changes_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        op = await in_review(harness)
        path, decision = f"/console/review/{op.id}/resolve", {"state": "failed", "reason": "x"}
        as_agent = await client.post(path, data=decision, headers={"authorization": f"Bearer {AGENT_TOKEN}"})
        assert as_agent.status_code == 401
        await signed_in(client)
        assert (await client.post(path, data=decision)).status_code == 403
        assert (await client.post(path, data={**decision, "csrf": "forged"})).status_code == 403
        assert (await harness.ledger.get(op.id)).state is State.NEEDS_REVIEW


async def test_resolving_a_review_is_recorded_as_the_signed_in_operator(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        op = await in_review(harness)
        csrf = await signed_in(client, name="Ada Lovelace")
        answer = await client.post(
            f"/console/review/{op.id}/resolve",
            data={"csrf": csrf, "state": "accepted", "reason": "found in Hail's console", "provider_id": "e-42"},
        )
        assert (answer.status_code, answer.headers["location"]) == (303, "/console/review")
        resolved = await harness.ledger.get(op.id)
        assert (resolved.state, resolved.provider_id) == (State.ACCEPTED, "e-42")
        decision = (await harness.ledger.events(op.id))[-1]
        assert (decision.actor, decision.from_state) == ("Ada Lovelace", State.NEEDS_REVIEW)
        assert "resolved as accepted by Ada Lovelace" in (await client.get("/console/review")).text
        again = await client.post(
            f"/console/review/{op.id}/resolve", data={"csrf": csrf, "state": "failed", "reason": "x"}
        )
        assert again.status_code == 303
        assert "not in review" in (await client.get("/console/review")).text


async def test_hostile_text_from_the_ledger_is_shown_as_text(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        op = await in_review(harness, subject=HOSTILE, idempotency_key=HOSTILE)
        await harness.ledger.add_suppression(
            Suppression(recipient=HOSTILE, channel="sms", reason=HOSTILE, source="webhook"), actor="webhook"
        )
        await signed_in(client)
        for path in ("/review", f"/operations/{op.id}", "/opt-outs", f"/operations?key={HOSTILE}"):
            page = (await client.get(f"/console{path}")).text
            assert HOSTILE not in page, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page, path


async def test_a_resend_is_confirmed_first_then_sent_once_under_the_new_key(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        op = await in_review(harness)
        csrf = await signed_in(client)
        confirm = await client.get(f"/console/review/{op.id}/resend")
        assert "lead@example.com" in confirm.text
        assert f"{op.idempotency_key}:resend:1" in confirm.text
        assert "no such message" in confirm.text
        unconfirmed = await client.post(f"/console/review/{op.id}/resend", data={"csrf": csrf, "reason": "lost"})
        assert unconfirmed.status_code == 303
        assert harness.sandbox.outbox == []
        done = await client.post(
            f"/console/review/{op.id}/resend", data={"csrf": csrf, "reason": "Hail has no record", "confirm": "yes"}
        )
        assert done.status_code == 303
        [sent] = harness.sandbox.outbox
        assert sent["idempotency_key"] == f"{op.idempotency_key}:resend:1"
        assert (await harness.ledger.get(op.id)).state is State.CANCELLED
        again = await client.get(f"/console/review/{op.id}/resend")
        assert again.status_code == 409


async def test_a_batch_is_approved_cancelled_and_shown_with_its_progress(tmp_path: Path) -> None:
    async with (
        open_harness(tmp_path) as harness,
        console_client(console_site(harness)) as client,
    ):
        harness.proxy.batches.require_approval = True
        sends = [
            {
                "tool": "send_email",
                "arguments": email(
                    to=[f"l{n}@example.com"],
                    body_text=f"Hello {n}",
                    metadata={"campaign_id": "c2", "lead_id": f"l{n}", "message_id": "m"},
                ),
            }
            for n in range(4)
        ]
        async with harness.client() as agent:
            planned = await agent.call_tool("plan_batch", {"sends": sends, "name": HOSTILE})
        assert not planned.is_error, planned.content
        batch_id = planned.structured_content["batch_id"]
        csrf = await signed_in(client, name="Bo")
        listing = await client.get("/console/campaigns")
        assert batch_id in listing.text
        assert HOSTILE not in listing.text
        await client.post(f"/console/campaigns/{batch_id}/approve", data={"csrf": csrf})
        assert (await harness.ledger.batch_status(batch_id)).counts == {State.READY: 4}
        await client.post(f"/console/campaigns/{batch_id}/cancel", data={"csrf": csrf, "reason": "wrong list"})
        status = await harness.ledger.batch_status(batch_id)
        assert status.counts == {State.CANCELLED: 4}
        assert {
            e.actor
            for op in await harness.ledger.search_operations(batch_id=batch_id)
            for e in await harness.ledger.events(op.id)
        } >= {"Bo"}
        progress = await client.get(f"/console/campaigns/{batch_id}/progress")
        assert 'data-state="cancelled">4<' in progress.text
        assert "hx-trigger" not in progress.text  # nothing left to watch


async def test_an_opt_out_added_in_the_console_cancels_pending_sends_and_shows_them(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        sends = [{"tool": "send_email", "arguments": email(to=["Ada+news@Example.com"], metadata={})}]
        harness.proxy.batches.require_approval = True
        async with harness.client() as agent:
            await agent.call_tool("plan_batch", {"sends": sends})
        csrf = await signed_in(client)
        refused = await client.post(
            "/console/opt-outs", data={"csrf": csrf, "recipient": "not an address", "channel": "email", "reason": "x"}
        )
        assert refused.status_code == 303
        assert "is not an email address" in (await client.get("/console/opt-outs")).text
        assert await harness.ledger.search_suppressions() == []
        added = await client.post(
            "/console/opt-outs",
            data={"csrf": csrf, "recipient": " ADA@example.com ", "channel": "email", "reason": "STOP"},
        )
        assert added.status_code == 303
        page = (await client.get(added.headers["location"])).text
        assert "cancelled 1 send(s)" in page
        [op] = await harness.ledger.search_operations()
        assert op.state is State.CANCELLED
        assert op.idempotency_key in unbroken(page)
        removed = await client.post(
            "/console/opt-outs/remove",
            data={"csrf": csrf, "recipient": "ada@example.com", "channel": "email", "reason": "asked"},
        )
        assert removed.status_code == 303
        assert await harness.ledger.search_suppressions() == []


async def test_a_search_exports_as_csv_and_json_lines(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        for n in range(3):
            await harness.call(
                "send_email",
                email(to=[f"p{n}@example.com"], metadata={"campaign_id": "c9", "lead_id": f"l{n}", "message_id": "m"}),
            )
        await signed_in(client)
        found = await client.get("/console/operations?campaign=c9&recipient=P1@EXAMPLE.COM")
        assert "c9:l1:email:m" in unbroken(found.text)
        assert "c9:l0:email:m" not in unbroken(found.text)
        rows = list(csv.DictReader(io.StringIO((await client.get("/console/operations/export.csv?campaign=c9")).text)))
        assert sorted(row["idempotency_key"] for row in rows) == ["c9:l0:email:m", "c9:l1:email:m", "c9:l2:email:m"]
        lines = (await client.get("/console/operations/export.jsonl?key=c9:l2")).text.splitlines()
        assert [json.loads(line)["state"] for line in lines] == ["accepted"]


async def test_a_csv_export_shows_formula_like_cells_as_text(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        metadata = {"campaign_id": "+c9", "lead_id": "@l1", "message_id": "m"}
        sent = await harness.call(
            "send_email", email(to=["-x@example.com"], idempotency_key="=cmd|'/C:calc'!A0", metadata=metadata)
        )
        assert not sent.is_error, sent
        await signed_in(client)
        [row] = list(csv.DictReader(io.StringIO((await client.get("/console/operations/export.csv")).text)))
        assert row["idempotency_key"] == "'=cmd|'/C:calc'!A0"
        assert row["recipients"] == "'-x@example.com"
        assert row["state"] == "accepted"


@pytest.mark.parametrize(
    ("query", "said"),
    [("state=sent", "choose one of planned, ready"), ("since=yesterday", "is not a date: give one such as 2026-12-01")],
    ids=["a state", "a time"],
)
async def test_a_search_by_a_value_that_cannot_be_read_says_what_to_give(tmp_path: Path, query: str, said: str) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        await signed_in(client)
        for path in ("/console/operations", "/console/operations/export.csv"):
            answer = await client.get(f"{path}?{query}")
            assert answer.status_code == 400, path
            assert said in answer.text


async def test_a_changed_upstream_tool_is_shown_as_a_diff_until_accepted(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        tool = harness.proxy.tools["send_email"]
        changed: types.Tool = tool.model_copy(update={"description": f"Send an email. {HOSTILE}"})
        await harness.proxy._observe({**harness.proxy.tools, "send_email": changed})
        csrf = await signed_in(client)
        assert "changed and waiting: send_email" in (await client.get("/console/")).text
        page = (await client.get("/console/tools")).text
        assert '<span class="add">+' in page
        assert "&lt;script&gt;" in page
        assert HOSTILE not in page
        await client.post("/console/tools/accept", data={"csrf": csrf, "tool": "send_email"})
        assert not any(pin.changed for pin in await harness.ledger.tool_pins())


async def test_every_page_renders_on_a_postgresql_ledger(tmp_path: Path, postgres_url: str) -> None:
    async with open_harness(tmp_path, ledger_url=postgres_url) as harness, console_client(console_site(harness)) as c:
        await harness.call("send_email", email())
        op = await in_review(harness, subject=HOSTILE)
        await signed_in(c)
        for path in ("/", "/review", "/campaigns", "/operations?recipient=LEAD@example.com", f"/operations/{op.id}"):
            page = await c.get(f"/console{path}")
            assert page.status_code == 200, path
            assert HOSTILE not in page.text
        assert "c1:l1:email:intro" in unbroken((await c.get("/console/operations?key=c1:")).text)
        for path in ("/opt-outs", "/tools", "/operations/export.csv"):
            assert (await c.get(f"/console{path}")).status_code == 200, path


async def test_the_console_command_serves_alone_on_loopback_and_prints_a_one_time_link(tmp_path: Path) -> None:
    config = tmp_path / "hail-guard.toml"
    config.write_text(f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n[log]\nlevel = "warning"\n')
    command = [sys.executable, "-m", "hail_guard", "--config", str(config), "console", "--port", "0"]
    process = await anyio.open_process(command, stderr=subprocess.PIPE)
    try:
        printed = ""
        assert process.stderr is not None
        with anyio.fail_after(30):
            async for chunk in process.stderr:
                printed += chunk.decode()
                if found := re.search(r"http://127\.0\.0\.1:\d+/console/login\?once=\S+", printed):
                    break
        assert found is not None
        link = found.group(0)
        async with httpx2.AsyncClient() as browser:
            signed = await browser.get(link)
            assert (signed.status_code, signed.headers["location"]) == (303, "/console/")
            overview = await browser.get(link.split("/console/")[0] + "/console/")
            assert f"signed in as <strong>{getpass.getuser()}</strong>" in overview.text
            assert (await browser.get(link)).status_code == 401  # once only
    finally:
        process.send_signal(signal.SIGINT)
        with anyio.fail_after(30):
            assert await process.wait() == 0


async def test_a_calls_llm_key_is_never_shown_by_any_page_or_export(tmp_path: Path) -> None:
    llm_key = "sk-live-0123456789-SECRET"
    call = {"to": "+14155550100", "llm": {"base_url": "https://llm.example/v1", "api_key": llm_key, "model": "m1"}}
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        placed = (await harness.call("place_call", {**call, "recipient_consent": True})).structured_content
        operation_id = placed["hail_guard"]["operation_id"]
        await signed_in(client)
        shown = ""
        for path in (
            f"/operations/{operation_id}",
            "/operations",
            "/operations/export.jsonl",
            "/operations/export.csv",
        ):
            page = await client.get(f"/console{path}")
            assert page.status_code == 200, path
            shown += page.text
        assert llm_key not in shown
        assert "[redacted]" in shown
