"""Console sign-ins kept in the ledger: one `serve` signs in, another sharing the ledger serves the session, a
restart keeps it, signing out ends it everywhere; the ledger and the logs never hold the session id.

In process over ASGI (httpx), two consoles over one SQLite ledger file, as two `serve` processes would be.
The same over PostgreSQL, in a real browser: tests/browser/test_console_browser.py.
"""

from __future__ import annotations

import hashlib
import html
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import pytest
from structlog.testing import capture_logs

from hail_guard.console.auth import NOTICE_COOKIE, SESSION_COOKIE
from tests.conftest import open_harness
from tests.console_site import (
    OPERATOR_ENV,
    OPERATOR_TOKEN,
    console_client,
    console_site,
    hidden_csrf,
    in_review,
    signed_in,
)


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR_TOKEN)


@asynccontextmanager
async def serve(tmp_path: Path, name: str) -> AsyncIterator[httpx2.AsyncClient]:
    """A console over the ledger file in `tmp_path`, as one more `serve` sharing it (its own sandbox, upstream,
    proxy and process state); a browser's client for it."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with open_harness(tmp_path / name, ledger_url=ledger) as harness, console_client(console_site(harness)) as c:
        yield c


def carry(cookie: str, to: httpx2.AsyncClient, value: str) -> None:
    """What a browser does when a load balancer sends its next request to another `serve`."""
    to.cookies.set(cookie, value, domain="127.0.0.1", path="/console")


async def test_a_session_started_on_one_serve_is_served_by_another_and_kept_across_a_restart(tmp_path: Path) -> None:
    async with open_harness(tmp_path / "agent", ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}") as harness:
        op = await in_review(harness)
    async with serve(tmp_path, "a") as first, serve(tmp_path, "b") as second:
        await signed_in(first, name="Ada")
        session_id = first.cookies[SESSION_COOKIE]
        carry(SESSION_COOKIE, second, session_id)
        review = await second.get("/console/review")
        assert "signed in as <strong>Ada</strong>" in review.text
        decided = await second.post(
            f"/console/review/{op.id}/resolve",
            data={"csrf": hidden_csrf(review.text), "state": "failed", "reason": "Hail refused it"},
        )
        assert decided.status_code == 303
        carry(NOTICE_COOKIE, first, second.cookies[NOTICE_COOKIE])  # the page after the post, from the other serve
        assert f"{op.id} resolved as failed by Ada" in (await first.get("/console/review")).text
        assert "resolved as failed by Ada" not in (await first.get("/console/review")).text  # shown once
    async with serve(tmp_path, "restarted") as restarted:
        carry(SESSION_COOKIE, restarted, session_id)
        assert "signed in as <strong>Ada</strong>" in (await restarted.get("/console/")).text
        events = await _events_of(tmp_path, op.id)
    assert events[-1] == ("Ada", "failed")


async def _events_of(tmp_path: Path, operation_id: str) -> list[tuple[str, str]]:
    async with open_harness(tmp_path / "reader", ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}") as harness:
        return [(event.actor, event.to_state.value) for event in await harness.ledger.events(operation_id)]


async def test_the_ledger_keeps_only_a_hash_of_the_session_id_and_no_log_names_it(tmp_path: Path) -> None:
    with capture_logs() as logs:
        async with serve(tmp_path, "a") as client:
            csrf = await signed_in(client)
            session_id = client.cookies[SESSION_COOKIE]
            await client.get("/console/review")
            await client.post("/console/logout", data={"csrf": csrf})
            await signed_in(client)
            kept_id = client.cookies[SESSION_COOKIE]
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        rows = db.execute("SELECT * FROM console_sessions").fetchall()
        dump = "\n".join(db.iterdump())
    assert [row[0] for row in rows] == [hashlib.sha256(kept_id.encode()).hexdigest()]
    for secret in (session_id, kept_id, csrf):
        assert secret not in dump
        assert not any(secret in str(entry) for entry in logs)


async def test_signing_out_ends_the_session_on_every_serve_even_without_the_forms_token(tmp_path: Path) -> None:
    async with serve(tmp_path, "a") as first, serve(tmp_path, "b") as second:
        await signed_in(first)
        carry(SESSION_COOKIE, second, first.cookies[SESSION_COOKIE])
        assert (await second.get("/console/")).status_code == 200
        signed_out = await first.post("/console/logout", data={})  # no CSRF token: it ends the session all the same
        assert (signed_out.status_code, signed_out.headers["location"]) == (303, "/console/login")
        assert SESSION_COOKIE not in first.cookies
        assert (await second.get("/console/")).headers["location"] == "/console/login"


async def test_a_sign_out_posted_from_another_site_is_refused_and_the_session_goes_on(tmp_path: Path) -> None:
    async with serve(tmp_path, "a") as client:
        await signed_in(client)
        forged = await client.post("/console/logout", data={}, headers={"origin": "https://evil.example"})
        assert forged.status_code == 403
        assert (await client.get("/console/")).status_code == 200


async def test_a_wrong_token_shows_the_sign_in_form_again_saying_why(tmp_path: Path) -> None:
    async with serve(tmp_path, "a") as client:
        form = await client.get("/console/login")
        csrf = hidden_csrf(form.text)
        answer = await client.post("/console/login", data={"csrf": csrf, "name": "Ada", "token": "wrong"})
        assert answer.status_code == 401
        assert "that is not the operators' token" in html.unescape(answer.text)
        assert 'name="token"' in answer.text
        assert "Not done" not in answer.text
        again = await client.post(
            "/console/login", data={"csrf": hidden_csrf(answer.text), "name": "Ada", "token": OPERATOR_TOKEN}
        )
        assert again.status_code == 303


async def test_a_notice_from_another_session_or_forged_is_never_shown(tmp_path: Path) -> None:
    async with serve(tmp_path, "a") as first, serve(tmp_path, "b") as second:
        first_csrf = await signed_in(first, name="Ada")
        await signed_in(second, name="Bo")
        await first.post("/console/opt-outs", data={"csrf": first_csrf, "recipient": "x", "reason": ""})
        notice = first.cookies[NOTICE_COOKIE]
        carry(NOTICE_COOKIE, second, notice)
        page = (await second.get("/console/opt-outs")).text
        assert "an opt-out needs a reason" not in page
        carry(NOTICE_COOKIE, second, "W1siZG9uZSIsICJmb3JnZWQiXV0.0000")
        assert "forged" not in (await second.get("/console/opt-outs")).text
        assert "an opt-out needs a reason" in (await first.get("/console/opt-outs")).text
