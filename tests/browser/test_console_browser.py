"""The operator console in a real headless Chromium: the flows a person clicks through, on SQLite.

The console runs on a real uvicorn over the real proxy, ledger and sandbox; Chromium (Debian's, no
download) signs in, reads and decides. Each test saves a screenshot (`tests/browser/chromium.py`; with
HAIL_GUARD_CONSOLE_SCREENSHOTS=docs they refresh the pictures in docs/). Without Chromium the module
is skipped and says why; under CI that is a failure (`.ci/run` installs it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from hail_guard.batch import drain
from hail_guard.listener import listening, serve_app
from hail_guard.models import DeliveryObservation, DeliveryState, State, Suppression
from tests.browser import chromium
from tests.browser.chromium import Browser
from tests.conftest import Harness, data, email, missing, open_harness
from tests.console_site import AGENT_TOKEN, OPERATOR_ENV, OPERATOR_TOKEN, console_site, in_review, served_console

HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    if reason := chromium.missing_reason():
        missing(f"the browser tests: {reason}")
    with chromium.chromium() as opened:
        yield opened


@pytest.fixture
def browser(driver: webdriver.Chrome, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Browser:
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR_TOKEN)
    driver.execute_cdp_cmd("Network.clearBrowserCookies", {})  # a new server per test, one browser for all
    return Browser(driver, tmp_path)


async def sign_in(browser: Browser, url: str, name: str = "Ada Operator") -> None:
    await browser.open(f"{url}/console/login")
    await browser.fill("main form", name=name, token=OPERATOR_TOKEN)
    await browser.click("main form button[type=submit]")
    await browser.wait_for_text(f"signed in as {name}", "header")


async def plan(harness: Harness, count: int, *, to: str = "lead{n}@example.com", name: str = "spring") -> str:
    harness.proxy.batches.require_approval = True
    sends = [
        {
            "tool": "send_email",
            "arguments": email(
                to=[to.format(n=n)],
                body_text=f"Hello {n}",
                metadata={"campaign_id": name, "lead_id": f"lead{n:03}", "message_id": "intro"},
            ),
        }
        for n in range(count)
    ]
    async with harness.client() as agent:
        planned = data(await agent.call_tool("plan_batch", {"sends": sends, "name": name}))
    batch_id: str = planned["batch_id"]
    return batch_id


async def test_an_operator_signs_in_sees_a_review_item_and_resolves_it(tmp_path: Path, browser: Browser) -> None:
    async with open_harness(tmp_path) as harness:
        for n in range(3):
            metadata = {"campaign_id": "spring", "lead_id": f"walk{n}", "message_id": "intro"}
            await harness.call("send_email", email(to=[f"walk{n}@example.com"], metadata=metadata))
        await plan(harness, 5)
        op = await in_review(harness, to=["ada@example.com"], subject="Your quote")
        async with served_console(console_site(harness)) as url:
            await sign_in(browser, url)
            await browser.wait_for_text("oldest in review")
            await browser.screenshot("overview")
            await browser.click('nav a[href="/console/review"]')
            await browser.wait_for_text("replays stayed unclear", f"#op-{op.id}")
            await browser.screenshot("review")
            await browser.fill(f"#op-{op.id} form", state="failed", reason="Hail's console shows it refused")
            await browser.click(f"#op-{op.id} form button[type=submit]")
            await browser.wait_for_text("resolved as failed by Ada Operator", ".notice")
            assert "Nothing waits for review" in await browser.text("main")
        resolved = await harness.ledger.get(op.id)
        assert (resolved.state, resolved.may_have_left) == (State.FAILED, True)
        decision = (await harness.ledger.events(op.id))[-1]
        assert (decision.from_state, decision.actor) == (State.NEEDS_REVIEW, "Ada Operator")
        assert "Hail's console shows it refused" in decision.reason


async def test_a_resend_is_confirmed_and_the_outbox_gets_exactly_one_new_message(
    tmp_path: Path, browser: Browser
) -> None:
    async with open_harness(tmp_path) as harness:
        op = await in_review(harness, to=["ada@example.com"], subject="Your quote")
        before = len(harness.sandbox.outbox)
        async with served_console(console_site(harness)) as url:
            await sign_in(browser, url)
            await browser.open(f"{url}/console/review")
            await browser.click(f"#op-{op.id} a.button")
            await browser.wait_for_text(f"{op.idempotency_key}:resend:1", ".confirm")
            assert "no such message" in await browser.text("main")
            await browser.fill(".confirm", reason="Hail has no record of it")
            await browser.click('.confirm input[name="confirm"]')
            await browser.click(".confirm button[type=submit]")
            await browser.wait_for_text("resent as", ".notice")
            [new] = [o for o in await harness.ledger.search_operations() if o.resend_of == op.id]
            await harness.ledger.record_delivery(
                new.id, [DeliveryObservation(state=DeliveryState.DELIVERED, source="poll")]
            )
            await browser.open(f"{url}/console/operations/{op.id}")
            await browser.wait_for_text("superseded by resend")
            await browser.open(f"{url}/console/operations/{new.id}")
            await browser.wait_for_text("delivery: delivered", "table.history")
            await browser.screenshot("operation")
        assert len(harness.sandbox.outbox) == before + 1
        assert harness.sandbox.outbox[-1]["idempotency_key"] == f"{op.idempotency_key}:resend:1"
        assert (new.state, (await harness.ledger.get(new.id)).state) == (State.ACCEPTED, State.ACCEPTED)


async def test_an_approved_batch_drains_while_its_progress_bar_updates_in_place(
    tmp_path: Path, browser: Browser
) -> None:
    async with open_harness(tmp_path, "send_email:*:delay:250") as harness:
        batch_id = await plan(harness, 8)
        async with served_console(console_site(harness)) as url, anyio.create_task_group() as tg:
            await sign_in(browser, url, name="Bo")
            await browser.open(f"{url}/console/campaigns/{batch_id}")
            await browser.wait_for_text("planned 8")
            await browser.click('form[action$="/approve"] button')
            await browser.wait_for_text("approved 8 planned send(s)", ".notice")
            await browser.script("window.stillThisPage = true")
            tg.start_soon(lambda: drain(harness.proxy.guard, concurrency=1, batch_id=batch_id))
            await browser.wait_for_text("accepted 8", "#progress")
            assert await browser.script("return window.stillThisPage === true")  # htmx swapped the bar in
            assert await browser.script("return document.querySelector('#progress').dataset.live") == "no"
            await browser.screenshot("campaign")
        status = await harness.ledger.batch_status(batch_id)
        assert status.counts == {State.ACCEPTED: 8}
        approvals = [
            event
            for op in await harness.ledger.search_operations(batch_id=batch_id)
            for event in await harness.ledger.events(op.id)
            if event.to_state is State.READY
        ]
        assert {event.actor for event in approvals} == {"Bo"}
        assert len(harness.sandbox.outbox) == 8


async def test_an_opt_out_added_in_the_browser_cancels_the_pending_sends_it_covers(
    tmp_path: Path, browser: Browser
) -> None:
    async with open_harness(tmp_path) as harness:
        batch_id = await plan(harness, 3, to="ada+{n}@example.com")
        other = await plan(harness, 1, to="bo@example.com", name="autumn")
        async with served_console(console_site(harness)) as url:
            await sign_in(browser, url)
            await browser.open(f"{url}/console/opt-outs")
            await browser.fill('main form[method="post"]', recipient="  ADA@Example.com ", reason="replied STOP")
            await browser.fill('main form[method="post"]', channel="email")
            await browser.click('main form[method="post"] button')
            await browser.wait_for_text("cancelled 3 send(s)", ".notice")
            listed = await browser.text("table.list")
            assert "ada@example.com" in listed
            assert "spring:lead000:email:intro" in listed
            await browser.screenshot("opt-outs")
        assert (await harness.ledger.batch_status(batch_id)).counts == {State.CANCELLED: 3}
        assert (await harness.ledger.batch_status(other)).counts == {State.PLANNED: 1}


async def test_a_hostile_subject_and_recipient_render_as_text_and_run_nothing(tmp_path: Path, browser: Browser) -> None:
    async with open_harness(tmp_path) as harness:
        op = await in_review(harness, subject=HOSTILE, idempotency_key=f"k-{HOSTILE}")
        opt_out = Suppression(recipient=HOSTILE, channel="sms", reason="STOP", source="webhook")
        await harness.ledger.add_suppression(opt_out, actor="webhook")  # a webhook's sender is kept as given
        async with served_console(console_site(harness)) as url:
            await sign_in(browser, url)
            for path in ("/review", f"/operations/{op.id}", "/opt-outs"):
                await browser.open(f"{url}/console{path}")
                assert HOSTILE in await browser.text("main"), path
                with pytest.raises(NoAlertPresentException):
                    await browser.run(lambda: browser.driver.switch_to.alert.text)
                scripts = await browser.script("return Array.from(document.scripts).map(s => s.src)")
                assert scripts == [f"{url}/console/static/htmx-2.0.11.min.js"], path
            await browser.screenshot("hostile-text")


@asynccontextmanager
async def foreign_site(target: str) -> AsyncIterator[str]:
    """Another origin (127.0.0.2: loopback, but not a name the console allows) with a form posting to `target`."""

    async def page(request: Request) -> HTMLResponse:
        fields = '<input name="state" value="failed"><input name="reason" value="x">'
        return HTMLResponse(f'<!doctype html><form method="post" action="{target}">{fields}<button>go</button></form>')

    with listening("127.0.0.2", 0) as sock:
        async with anyio.create_task_group() as tg:
            url: str = await tg.start(serve_app, Starlette(routes=[Route("/", page)]), sock)
            yield url
            tg.cancel_scope.cancel()


async def test_a_post_without_csrf_with_the_agents_token_or_from_another_origin_is_refused(
    tmp_path: Path, browser: Browser
) -> None:
    async with open_harness(tmp_path) as harness:
        op = await in_review(harness)
        async with served_console(console_site(harness)) as url:
            resolve = f"{url}/console/review/{op.id}/resolve"
            await sign_in(browser, url)
            await browser.open(f"{url}/console/review")
            await browser.script(f"document.querySelector('#op-{op.id} form input[name=csrf]').remove()")
            await browser.fill(f"#op-{op.id} form", state="failed", reason="no token")
            await browser.click(f"#op-{op.id} form button[type=submit]")
            await browser.wait_for_text("no valid CSRF token")
            await browser.screenshot("refused")
            as_agent = await browser.script(
                "return fetch(arguments[0], {method: 'POST', credentials: 'omit', headers: {Authorization: "
                "'Bearer ' + arguments[1]}, body: new URLSearchParams({state: 'failed', reason: 'agent'})})"
                ".then(answer => answer.status)",
                resolve,
                AGENT_TOKEN,
            )
            assert as_agent == 401
            async with foreign_site(resolve) as elsewhere:
                await browser.open(elsewhere)
                await browser.click("button")
                await browser.wait_for_text("Origin is not allowed")
        assert (await harness.ledger.get(op.id)).state is State.NEEDS_REVIEW


async def test_a_session_started_on_one_serve_works_on_another_over_one_postgresql_ledger_until_signed_out(
    tmp_path: Path, browser: Browser, postgres_url: str
) -> None:
    """Two `serve` processes behind a load balancer, as two consoles on two ports over one PostgreSQL ledger: the
    browser signs in on one, decides on the other, and signing out on the first ends it on both."""
    async with (
        open_harness(tmp_path / "first", ledger_url=postgres_url) as first,
        open_harness(tmp_path / "second", ledger_url=postgres_url) as second,
        served_console(console_site(first)) as one,
        served_console(console_site(second)) as other,
    ):
        op = await in_review(first, to=["ada@example.com"], subject="Your quote")
        await sign_in(browser, one, name="Ada Operator")
        await browser.open(f"{other}/console/review")
        await browser.wait_for_text("signed in as Ada Operator", "header")
        await browser.fill(f"#op-{op.id} form", state="failed", reason="Hail's console shows it refused")
        await browser.click(f"#op-{op.id} form button[type=submit]")
        await browser.wait_for_text("resolved as failed by Ada Operator", ".notice")
        await browser.screenshot("second-serve")
        await browser.open(f"{one}/console/")
        await browser.wait_for_text("signed in as Ada Operator", "header")
        await browser.click("header form.who button")
        await browser.wait_for_text("Sign in to the console")
        for url in (one, other):
            await browser.open(f"{url}/console/review")
            await browser.wait_for_text("Sign in to the console")
        decision = (await second.ledger.events(op.id))[-1]
        assert (decision.actor, decision.to_state) == ("Ada Operator", State.FAILED)


async def test_tables_wrap_keys_and_addresses_at_their_separators_and_never_cut_a_word(
    tmp_path: Path, browser: Browser
) -> None:
    async with open_harness(tmp_path) as harness:
        for n in range(4):
            lead = f"lead_{n:09d}_from_the_spring_fair"
            metadata = {"campaign_id": "campaign_2026_spring_outreach", "lead_id": lead, "message_id": "introduction"}
            to = [f"first.last+campaign-{n}-followup@very-long-subdomain.example-company.com"]
            await harness.call("send_email", email(to=to, body_text=f"Hello {n}", metadata=metadata))
        async with served_console(console_site(harness)) as url:
            await sign_in(browser, url)
            await browser.run(lambda: browser.driver.set_window_size(640, 900))
            try:
                await browser.open(f"{url}/console/operations")
                await browser.wait_for_text("campaign_2026_spring_outreach", "table.list")
                await browser.screenshot("narrow-table")
                overflow = await browser.script("return document.documentElement.scrollWidth - window.innerWidth")
                cut = await browser.script(
                    "return Array.from(document.querySelectorAll('table.list td')).filter(td => {"
                    "  const word = td.innerText.trim(); if (!word || /\\s/.test(word)) return false;"
                    "  if (td.querySelector('wbr')) return false;"
                    "  const range = document.createRange(); range.selectNodeContents(td);"
                    "  return new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top))).size > 1;"
                    "}).map(td => td.innerText)"
                )
            finally:
                await browser.run(lambda: browser.driver.set_window_size(1280, 900))
        assert overflow <= 0
        assert cut == []
