"""The console's pages (GET): overview, review queue, campaigns, operations, opt-outs, upstream tools.

Each is server-rendered HTML that reads well without JavaScript; htmx only refreshes a campaign's
progress bar. Every page but the sign-in needs a session; an error of ours (an unknown id, a
refusal) is a page that says what happened, with the status it deserves.
"""

from __future__ import annotations

import csv
import io
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from hail_guard import keys, policy, views
from hail_guard.console import chart, reads
from hail_guard.console.auth import LOGIN_COOKIE, SESSION_COOKIE, Session
from hail_guard.console.context import Console, console_of
from hail_guard.errors import BadInput, HailGuardError, NotFound, UpstreamError
from hail_guard.models import SUPPRESSION_CHANNELS, State

PAGE = 25
EXPORT_PAGE = 500
Handler = Callable[[Request, Console, Session], Awaitable[Response]]


def operator_page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A page for a signed-in operator (else the sign-in form); our errors shown as a page."""

    async def page(request: Request) -> Response:
        console = console_of(request)
        session = await console.signed_in(request)
        if session is None:
            return console.to_sign_in()
        try:
            return await handler(request, console, session)
        except HailGuardError as exc:
            response = console.render(request, "refused.html", session, message=str(exc))
            response.status_code = next((code for kind, code in _STATUSES if isinstance(exc, kind)), 409)
            return response

    return page


_STATUSES = ((NotFound, 404), (BadInput, 400), (UpstreamError, 503))
"""The status of a page that shows one of our errors; any other (a refusal) is 409."""


async def sign_in_page(request: Request) -> Response:
    console = console_of(request)
    once = request.query_params.get("once")
    if once is not None:
        name = console.operators.redeem_link(once)
        if name is None:
            return sign_in_form(console, request, "this sign-in link was used already or has expired", 401)
        return await signed_in_response(console, request, name)
    return sign_in_form(console, request, None, 200)


def sign_in_form(
    console: Console, request: Request, problem: str | None, status: int, *, csrf: str | None = None
) -> Response:
    """The sign-in form, with what went wrong the last time, if anything; its CSRF token (bound to this browser by a
    cookie) is `csrf` when the browser's was good, else a new one."""
    csrf = csrf or secrets.token_urlsafe(32)
    response = console.render(
        request, "login.html", None, csrf=csrf, problem=problem, has_token=console.operators.token is not None
    )
    response.status_code = status
    response.set_cookie(LOGIN_COOKIE, csrf, httponly=True, samesite="strict", secure=_https(request), path=console.base)
    return response


async def signed_in_response(console: Console, request: Request, name: str) -> Response:
    session_id, _ = await console.operators.start(name)
    response = RedirectResponse(f"{console.base}/", status_code=303)
    seconds = int(console.operators.session_seconds)
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=seconds,
        httponly=True,
        samesite="strict",
        secure=_https(request),
        path=console.base,
    )
    response.delete_cookie(LOGIN_COOKIE, path=console.base)
    return response


def _https(request: Request) -> bool:
    return request.url.scheme == "https"


@operator_page
async def overview(request: Request, console: Console, session: Session) -> Response:
    data = await reads.overview(console.ledger, console.proxy.upstream)
    return console.render(
        request,
        "overview.html",
        session,
        day_chart=chart.bars(data["day"]),
        week_chart=chart.bars(data["week"]),
        **data,
    )


@operator_page
async def review_queue(request: Request, console: Console, session: Session) -> Response:
    ledger = console.ledger
    await ledger.expire_leases()
    after = request.query_params.get("after")
    waiting = await ledger.search_operations(state=State.NEEDS_REVIEW, after=after, limit=PAGE)
    items = [{"op": op, "summary": reads.summary(op), "history": await reads.timeline(ledger, op)} for op in waiting]
    return console.render(
        request,
        "review.html",
        session,
        items=items,
        resolutions=[state.value for state in policy.REVIEW_RESOLUTIONS],
        next_after=waiting[-1].id if len(waiting) == PAGE else None,
    )


@operator_page
async def resend_confirmation(request: Request, console: Console, session: Session) -> Response:
    """Names the recipient and the new key, and what a look in Hail found, before anything is sent."""
    operation = await console.ledger.get(request.path_params["operation_id"])
    if operation.state is not State.NEEDS_REVIEW:
        raise policy.not_in_review(operation, "resent")
    guard = console.proxy.guard
    await guard.wait_connected()
    seen = await guard.look_for(operation)
    return console.render(
        request,
        "resend.html",
        session,
        op=operation,
        summary=reads.summary(operation),
        new_key=keys.resend_key(operation.idempotency_key),
        seen=seen,
    )


@operator_page
async def campaigns(request: Request, console: Console, session: Session) -> Response:
    batches = await console.ledger.list_batches(after=request.query_params.get("after"), limit=PAGE)
    shown = [(batch, chart.stacked(batch.counts, width=240)) for batch in batches]
    next_after = batches[-1].batch_id if len(batches) == PAGE else None
    return console.render(request, "campaigns.html", session, batches=shown, next_after=next_after)


@operator_page
async def campaign(request: Request, console: Console, session: Session) -> Response:
    return console.render(request, "campaign.html", session, **await _campaign(console, request))


@operator_page
async def campaign_progress(request: Request, console: Console, session: Session) -> Response:
    """The progress part of a campaign's page alone: what htmx swaps in every few seconds."""
    return console.render(request, "progress.html", session, fragment=True, **await _campaign(console, request))


async def _campaign(console: Console, request: Request) -> dict[str, Any]:
    ledger = console.ledger
    await ledger.expire_leases()
    status = await console.proxy.batches.status(request.path_params["batch_id"])
    live = bool(status.counts.get(State.READY) or status.counts.get(State.SENDING))
    now = await ledger.now()
    return {
        "status": status,
        "segments": chart.stacked(status.counts),
        "order": [state.value for state in chart.PROGRESS_ORDER],
        "live": live,
        "unsent": status.counts.get(State.PLANNED, 0) + status.counts.get(State.READY, 0),
        "now": now,
        "senders": await reads.senders(ledger, now, status.batch_id),
    }


def _filters(request: Request) -> dict[str, Any]:
    """The search form's fields as `Ledger.search_operations` filters (empty fields: not filtered on)."""
    given = {name: (request.query_params.get(name) or "").strip() for name in _FILTERS}
    return {
        "key_prefix": given["key"] or None,
        "recipient": given["recipient"] or None,
        "campaign_id": given["campaign"] or None,
        "batch_id": given["batch"] or None,
        "state": _state(given["state"]) if given["state"] else None,
        "since": _moment(given["since"]) if given["since"] else None,
    }


_FILTERS = ("key", "recipient", "campaign", "batch", "state", "since")


def _state(text: str) -> State:
    try:
        return State(text)
    except ValueError:
        raise BadInput(f"no state {text!r}: choose one of {', '.join(s.value for s in State)}") from None


def _moment(text: str) -> datetime:
    """A date or a date and time (UTC unless it names its offset)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"{text!r} is not a date: give one such as 2026-12-01 or 2026-12-01T09:30 (UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


@operator_page
async def operations(request: Request, console: Console, session: Session) -> Response:
    ledger = console.ledger
    await ledger.expire_leases()
    filters = _filters(request)
    found = await ledger.search_operations(**filters, after=request.query_params.get("after"), limit=PAGE)
    given = {name: request.query_params.get(name, "") for name in _FILTERS}
    return console.render(
        request,
        "operations.html",
        session,
        found=found,
        given=given,
        query=urlencode({name: value for name, value in given.items() if value}),
        states=[state.value for state in State],
        next_after=found[-1].id if len(found) == PAGE else None,
    )


@operator_page
async def export(request: Request, console: Console, session: Session) -> Response:
    """The current filter, every page of it, streamed: CSV (one row per operation) or JSON Lines."""
    kind = request.path_params["kind"]
    if kind not in ("csv", "jsonl"):
        raise NotFound(f"no export as {kind}: choose csv or jsonl")
    ledger, filters = console.ledger, _filters(request)

    async def rows() -> AsyncIterator[str]:
        after: str | None = None
        first = True
        while page := await ledger.search_operations(**filters, after=after, limit=EXPORT_PAGE):
            shown = [views.operation_view(op) for op in page]
            yield _csv(shown, header=first) if kind == "csv" else "".join(json.dumps(v) + "\n" for v in shown)
            first, after = False, page[-1].id

    media = "text/csv" if kind == "csv" else "application/x-ndjson"
    disposition = {"Content-Disposition": f'attachment; filename="operations.{kind}"'}
    return StreamingResponse(rows(), media_type=media, headers=disposition)


def _csv(shown: list[dict[str, Any]], *, header: bool) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(shown[0]), extrasaction="ignore")
    if header:
        writer.writeheader()
    for view in shown:
        writer.writerow({name: views.csv_cell(value) for name, value in view.items()})
    return out.getvalue()


@operator_page
async def operation(request: Request, console: Console, session: Session) -> Response:
    ledger = console.ledger
    await ledger.expire_leases()
    found = await ledger.get(request.path_params["operation_id"])
    return console.render(
        request,
        "operation.html",
        session,
        op=found,
        view=views.operation_view(found),
        error=reads.current_error(found),
        summary=reads.summary(found),
        stored=json.dumps(views.request_view(found), indent=2, sort_keys=True, ensure_ascii=False),
        timeline=await reads.timeline(ledger, found),
    )


@operator_page
async def opt_outs(request: Request, console: Console, session: Session) -> Response:
    ledger = console.ledger
    search = (request.query_params.get("q") or "").strip()
    after_recipient, _, after_channel = (request.query_params.get("after") or "").partition("\n")
    after = (after_recipient, after_channel) if after_recipient else None
    listed = await ledger.search_suppressions(prefix=search or None, after=after, limit=PAGE)
    rows = [(item, await ledger.opt_out_cancellations(item.recipient, item.channel, limit=5)) for item in listed]
    last = listed[-1] if len(listed) == PAGE else None
    return console.render(
        request,
        "optouts.html",
        session,
        rows=rows,
        search=search,
        channels=SUPPRESSION_CHANNELS,
        next_after=f"{last.recipient}\n{last.channel}" if last is not None else None,
    )


@operator_page
async def tools(request: Request, console: Console, session: Session) -> Response:
    proxy = console.proxy
    changes = await reads.tool_changes(console.ledger)
    return console.render(
        request,
        "tools.html",
        session,
        changes=changes,
        connected=proxy.upstream.connected,
        profile=proxy.profile.name,
        guarded=sorted(proxy.guarded),
    )


ROUTES = [
    Route("/login", sign_in_page, methods=["GET"]),
    Route("/", overview, methods=["GET"]),
    Route("/review", review_queue, methods=["GET"]),
    Route("/review/{operation_id}/resend", resend_confirmation, methods=["GET"]),
    Route("/campaigns", campaigns, methods=["GET"]),
    Route("/campaigns/{batch_id}", campaign, methods=["GET"]),
    Route("/campaigns/{batch_id}/progress", campaign_progress, methods=["GET"]),
    Route("/operations", operations, methods=["GET"]),
    Route("/operations/export.{kind}", export, methods=["GET"]),
    Route("/operations/{operation_id}", operation, methods=["GET"]),
    Route("/opt-outs", opt_outs, methods=["GET"]),
    Route("/tools", tools, methods=["GET"]),
]
