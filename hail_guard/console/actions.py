"""The console's decisions (POST): sign-in and out, review resolve and resend, batch approve and cancel,
opt-outs, accepting changed upstream tools.

Each goes through the same function the CLI and the agent's tools use (`Ledger.resolve_review`,
`review.resend`, `Ledger.approve_batch`, `Ledger.add_suppression` with `normalise_recipient` at the
edge, `Ledger.accept_tools`...), recorded as decided by the signed-in operator's name. Every form
carries the session's CSRF token: without it, or without a session, nothing happens (403 / 401).
An action answers with a redirect to the page it came from, which shows what it did (or why not).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

import structlog
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from hail_guard import review
from hail_guard.console.auth import (
    LOGIN_COOKIE,
    NOTICE_COOKIE,
    SESSION_COOKIE,
    Session,
    notices_cookie,
    operator_name,
    same_token,
)
from hail_guard.console.context import Console, console_of
from hail_guard.console.pages import sign_in_form, signed_in_response
from hail_guard.errors import HailGuardError
from hail_guard.models import SUPPRESSION_CHANNELS, State, Suppression
from hail_guard.recipients import normalise_recipient

log = structlog.get_logger(__name__)

Action = Callable[[Console, Session, FormData, Request], Awaitable[str]]
"""Does the decision and notes what happened in the session; returns the page to go to next."""


def operator_action(back: str) -> Callable[[Action], Callable[[Request], Awaitable[Response]]]:
    """An operator's decision; a refusal of ours is noted and the browser goes `back` (a path in the console,
    `{name}` filled from the route) to read it."""

    def decorate(action: Action) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await _decide(request, action, back.format(**request.path_params))

        return handle

    return decorate


async def _decide(request: Request, action: Action, back: str) -> Response:
    """Signed in, with the form's CSRF token, or nothing happens; then the action, its refusal noted (in a cookie
    signed for the session: the page that shows it may come from another `serve`)."""
    console = console_of(request)
    session = await console.signed_in(request)
    if session is None:
        return _refused(console, request, 401, "sign in first: nothing was done")
    form = await request.form()
    if not same_token(str(form.get("csrf", "")), session.csrf):
        return _refused(console, request, 403, "this form has no valid CSRF token: nothing was done")
    following = f"{console.base}{back}"
    try:
        following = await action(console, session, form, request)
    except HailGuardError as exc:
        session.notice("error", str(exc))
    response = RedirectResponse(following, status_code=303)
    if session.notices:
        secure = request.url.scheme == "https"
        cookie = notices_cookie(session)
        response.set_cookie(NOTICE_COOKIE, cookie, httponly=True, samesite="strict", secure=secure, path=console.base)
    return response


def _refused(console: Console, request: Request, status: int, message: str) -> Response:
    response = console.render(request, "refused.html", None, message=message)
    response.status_code = status
    return response


def _text(form: FormData, name: str) -> str:
    value = form.get(name, "")
    return value.strip() if isinstance(value, str) else ""


async def sign_in(request: Request) -> Response:
    """A sign-in; what is wrong is said on the sign-in form itself, ready for another try."""
    console = console_of(request)
    client = request.client.host if request.client else "unknown"
    bound = request.cookies.get(LOGIN_COOKIE, "")
    if console.operators.limiter.take(f"sign-in {client}"):
        problem = "too many sign-in attempts from this address: wait a minute"
        return sign_in_form(console, request, problem, 429, csrf=bound)
    form = await request.form()
    if not same_token(_text(form, "csrf"), bound):
        return sign_in_form(console, request, "the sign-in form had expired or came from elsewhere: sign in again", 403)
    name = operator_name(_text(form, "name"))
    if not console.operators.token_accepted(_text(form, "token")):
        problem = "that is not the operators' token (an agent's token never signs in): try again"
        return sign_in_form(console, request, problem, 401, csrf=bound)
    if name is None:
        problem = "give your name (1 to 64 printable characters): decisions carry it"
        return sign_in_form(console, request, problem, 400, csrf=bound)
    return await signed_in_response(console, request, name)


async def sign_out(request: Request) -> Response:
    """Ends the session the cookie names, in the ledger (so on every `serve`), with or without the form's token:
    signing out only takes access away, and a page of another site never gets here (the Origin check)."""
    console = console_of(request)
    await console.operators.end(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse(f"{console.base}/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=console.base)
    response.delete_cookie(NOTICE_COOKIE, path=console.base)
    return response


@operator_action(back="/review")
async def resolve(console: Console, session: Session, form: FormData, request: Request) -> str:
    operation_id = request.path_params["operation_id"]
    chosen = _text(form, "state")
    if chosen not in {state.value for state in State}:
        session.notice("error", "choose what became of it: accepted, failed or cancelled; nothing changed")
        return f"{console.base}/review"
    resolved = await console.ledger.resolve_review(
        operation_id,
        state=State(chosen),
        reason=_text(form, "reason"),
        actor=session.name,
        provider_id=_text(form, "provider_id") or None,
    )
    session.notice("done", f"{resolved.id} resolved as {resolved.state.value} by {session.name}")
    return f"{console.base}/review"


@operator_action(back="/review")
async def resend(console: Console, session: Session, form: FormData, request: Request) -> str:
    operation_id = request.path_params["operation_id"]
    if _text(form, "confirm") != "yes":
        session.notice("error", "a resend must be confirmed: tick the box that names who gets it; nothing was sent")
        return f"{console.base}/review/{operation_id}/resend"
    resent = await review.resend(
        console.ledger, console.proxy.guard, operation_id, reason=_text(form, "reason"), actor=session.name
    )
    session.notice("done", f"{operation_id} resent as {resent.id} (key {resent.idempotency_key}): {resent.state.value}")
    return f"{console.base}/operations/{resent.id}"


@operator_action(back="/campaigns/{batch_id}")
async def approve(console: Console, session: Session, form: FormData, request: Request) -> str:
    batch_id = request.path_params["batch_id"]
    approved = await console.ledger.approve_batch(batch_id, actor=session.name)
    session.notice("done", f"approved {approved} planned send(s) of {batch_id}")
    return f"{console.base}/campaigns/{batch_id}"


@operator_action(back="/campaigns/{batch_id}")
async def cancel_unsent(console: Console, session: Session, form: FormData, request: Request) -> str:
    batch_id = request.path_params["batch_id"]
    cancelled = await console.ledger.cancel_batch(batch_id, reason=_text(form, "reason"), actor=session.name)
    session.notice("done", f"cancelled {len(cancelled)} unsent send(s) of {batch_id}")
    return f"{console.base}/campaigns/{batch_id}"


@operator_action(back="/opt-outs")
async def add_opt_out(console: Console, session: Session, form: FormData, request: Request) -> str:
    channel = _text(form, "channel") if _text(form, "channel") in SUPPRESSION_CHANNELS else "all"
    region = console.proxy.region
    shown = normalise_recipient(_text(form, "recipient"), channel, region=region)  # refuses a non-recipient
    reason = _text(form, "reason")
    if not reason:
        session.notice("error", "an opt-out needs a reason; nothing was recorded")
        return f"{console.base}/opt-outs"
    opt_out = Suppression(recipient=shown, channel=channel, reason=reason, source=f"console {session.name}")
    cancelled = await console.ledger.add_suppression(opt_out, actor=session.name)
    session.notice("done", f"suppressed {shown} on {channel}; cancelled {len(cancelled)} send(s)")
    return f"{console.base}/opt-outs?{urlencode({'q': shown})}"


@operator_action(back="/opt-outs")
async def remove_opt_out(console: Console, session: Session, form: FormData, request: Request) -> str:
    recipient, channel = _text(form, "recipient"), _text(form, "channel")
    if not _text(form, "reason"):
        session.notice("error", "taking an opt-out back needs a reason (the recipient asked?); nothing changed")
    elif await console.ledger.remove_suppression(recipient, channel):
        log.info("opt_out_removed", recipient=recipient, channel=channel, by=session.name, reason=_text(form, "reason"))
        session.notice("done", f"removed the opt-out of {recipient} on {channel} ({_text(form, 'reason')})")
    else:
        session.notice("error", f"{recipient} has no opt-out on {channel}")
    return f"{console.base}/opt-outs"


@operator_action(back="/tools")
async def accept_tools(console: Console, session: Session, form: FormData, request: Request) -> str:
    names = [str(name) for name in form.getlist("tool")]
    accepted = await console.ledger.accept_tools(names or None)
    session.notice("done", f"accepted {len(accepted)} changed tool(s): {', '.join(accepted) or 'none'}")
    return f"{console.base}/tools"


ROUTES = [
    Route("/login", sign_in, methods=["POST"]),
    Route("/logout", sign_out, methods=["POST"]),
    Route("/review/{operation_id}/resolve", resolve, methods=["POST"]),
    Route("/review/{operation_id}/resend", resend, methods=["POST"]),
    Route("/campaigns/{batch_id}/approve", approve, methods=["POST"]),
    Route("/campaigns/{batch_id}/cancel", cancel_unsent, methods=["POST"]),
    Route("/opt-outs", add_opt_out, methods=["POST"]),
    Route("/opt-outs/remove", remove_opt_out, methods=["POST"]),
    Route("/tools/accept", accept_tools, methods=["POST"]),
]
