"""What every console handler needs (`Console`), and how text is shown: times (UTC, and ages), times inside
someone's sentence (`readable_times`), ids, keys and addresses that may wrap at their separators (`breakable`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jinja2
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from hail_guard.console import reads
from hail_guard.console.auth import NOTICE_COOKIE, SESSION_COOKIE, Operators, Session, read_notices
from hail_guard.ledger import Ledger
from hail_guard.server import Proxy

MOUNT = "/console"
HTMX = "htmx-2.0.11.min.js"
"""Vendored (static/, with its licence): nothing is loaded from elsewhere."""


@dataclass
class Console:
    """What every handler needs: the ledger, the proxy (its guard, batches and upstream), the sign-ins and the
    templates."""

    ledger: Ledger
    proxy: Proxy
    operators: Operators
    templates: jinja2.Environment
    base: str = MOUNT

    def render(
        self, request: Request, name: str, session: Session | None, *, fragment: bool = False, **context: Any
    ) -> HTMLResponse:
        """`name` rendered; a `fragment` (a part htmx swaps in) leaves the session's notices for the next page."""
        notices = session.take_notices() if session is not None and not fragment else []
        page = self.templates.get_template(name).render(
            base=self.base, htmx=HTMX, session=session, notices=notices, path=request.url.path, **context
        )
        response = HTMLResponse(page)
        if not fragment and NOTICE_COOKIE in request.cookies:
            response.delete_cookie(NOTICE_COOKIE, path=self.base)  # shown once
        return response

    async def signed_in(self, request: Request) -> Session | None:
        """The session the request's cookie names (kept in the ledger), with the notices its last action left."""
        session = await self.operators.find(request.cookies.get(SESSION_COOKIE))
        if session is not None:
            session.notices = read_notices(session, request.cookies.get(NOTICE_COOKIE))
        return session

    def to_sign_in(self) -> Response:
        return RedirectResponse(f"{self.base}/login", status_code=303)


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def when(moment: datetime | None) -> str:
    return "-" if moment is None else reads.when(moment)


_ISO_TIME = re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?")
_SEPARATOR = re.compile(r"([:@./_+\-])")


def readable_times(text: str | None) -> str:
    """`text` with the times in it (ISO 8601, as a review reason carries them) shown as `when` shows a time."""
    return _ISO_TIME.sub(_readable_time, text or "")


def _readable_time(found: re.Match[str]) -> str:
    try:
        moment = datetime.fromisoformat(found.group())
    except ValueError:
        return found.group()
    return reads.when(moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC))


def breakable(text: object) -> Markup:
    """An id, a key or an address, escaped, that may wrap after its separators (`:`, `@`, `.`, `-`...) rather than
    anywhere: a line break opportunity (`<wbr>`) after each."""
    pieces = _SEPARATOR.split("" if text is None else str(text))  # text, separator, text, ...
    return Markup("").join(escape(piece) + (Markup("<wbr>") if n % 2 else "") for n, piece in enumerate(pieces))


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """How long ago, in the two largest units (`3 h 5 min`, `2 d 4 h`, `40 s`)."""
    if moment is None:
        return "-"
    seconds = max(0, int(((now or datetime.now(UTC)) - moment).total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "min"), (seconds, "s")]
    shown = [f"{value} {unit}" for value, unit in parts if value][:2]
    return " ".join(shown) or "0 s"
