"""What every console handler needs (`Console`), and how times are shown (UTC, and ages)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from hail_guard.console import reads
from hail_guard.console.auth import SESSION_COOKIE, Operators, Session
from hail_guard.server import Proxy

MOUNT = "/console"
HTMX = "htmx-2.0.11.min.js"
"""Vendored (static/, with its licence): nothing is loaded from elsewhere."""


@dataclass
class Console:
    """What every handler needs: the proxy (ledger, guard, upstream), the sign-ins and the templates."""

    proxy: Proxy
    operators: Operators
    templates: jinja2.Environment
    base: str = MOUNT

    def render(
        self, request: Request, name: str, session: Session | None, *, fragment: bool = False, **context: Any
    ) -> HTMLResponse:
        """`name` rendered; a `fragment` (a part htmx swaps in) leaves the session's notices for the next page."""
        page = self.templates.get_template(name).render(
            base=self.base,
            htmx=HTMX,
            session=session,
            notices=session.take_notices() if session is not None and not fragment else [],
            path=request.url.path,
            **context,
        )
        return HTMLResponse(page)

    def signed_in(self, request: Request) -> Session | None:
        return self.operators.find(request.cookies.get(SESSION_COOKIE))

    def to_sign_in(self) -> Response:
        return RedirectResponse(f"{self.base}/login", status_code=303)


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def when(moment: datetime | None) -> str:
    return "-" if moment is None else reads.when(moment)


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
