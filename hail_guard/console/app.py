"""The console as an ASGI app: its routes, its templates, and the checks every request passes.

`build_console(proxy, ...)` returns a Starlette app that `web` mounts at `/console` beside `/mcp`,
and that `hail-guard console` serves alone. Every response carries a strict Content-Security-Policy
(`default-src 'self'`, no inline script or style, `frame-ancestors 'none'`) and is never cached;
every request passes the Host and Origin checks of the MCP routes (`gate.browser_refusal`). Pages
are Jinja2 templates with autoescape on: everything from the ledger is an agent's text.
"""

from __future__ import annotations

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hail_guard.config import ConsoleSettings, HttpSettings
from hail_guard.console import actions, chart, pages
from hail_guard.console.auth import Operators
from hail_guard.console.context import MOUNT, Console, age, breakable, readable_times, when
from hail_guard.gate import allowed_hosts, browser_refusal
from hail_guard.ledger import Ledger
from hail_guard.server import Proxy

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make a form post's Origin "null"
    "Cross-Origin-Opener-Policy": "same-origin",
}


def build_console(ledger: Ledger, proxy: Proxy, settings: ConsoleSettings, http: HttpSettings) -> Starlette:
    """The console app over `ledger` and `proxy` (its guard, batches and upstream), to be mounted at `/console`;
    `http` gives the allowed hosts and origins."""
    templates = jinja2.Environment(
        loader=jinja2.PackageLoader("hail_guard.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    templates.filters["when"] = when
    templates.filters["age"] = age
    templates.filters["readable"] = readable_times
    templates.filters["breakable"] = breakable
    operators = Operators(settings, ledger, agent_token=http.bearer_token())
    routes = [
        *pages.ROUTES,
        *actions.ROUTES,
        Route("/static/states.css", _state_colours),
        Mount("/static", app=StaticFiles(packages=[("hail_guard.console", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, middleware=[])
    app.state.console = Console(ledger, proxy, operators, templates)
    return app


async def _state_colours(request: Request) -> Response:
    """Each state's colour, from its row in `lifecycle.STATES` (a new state brings its colour with it)."""
    return Response(chart.STATE_CSS, media_type="text/css")


def protected(app: ASGIApp, http: HttpSettings) -> ASGIApp:
    """`app` behind the console's checks (see `BrowserChecks`)."""
    return BrowserChecks(app, hosts=allowed_hosts(http), origins=tuple(http.allowed_origins))


class BrowserChecks:
    """ASGI middleware: 403 for a Host or Origin the MCP routes would refuse; security headers on every answer."""

    def __init__(self, app: ASGIApp, *, hosts: tuple[str, ...], origins: tuple[str, ...]) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = browser_refusal(Headers(scope=scope), self.hosts, self.origins)
        if refusal is not None:
            await _with_headers(HTMLResponse(f"<p>Refused: {refusal}.</p>", status_code=403))(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers[name] = value
                if not scope["path"].startswith(f"{scope.get('root_path', '')}/static/"):
                    headers["Cache-Control"] = "no-store"
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _with_headers(response: Response) -> Response:
    response.headers.update({**_HEADERS, "Cache-Control": "no-store"})
    return response


def console_routes(ledger: Ledger, proxy: Proxy, settings: ConsoleSettings, http: HttpSettings) -> Mount:
    """The console mounted at `/console`, behind its checks: what `web` adds beside `/mcp`."""
    return Mount(MOUNT, app=protected(build_console(ledger, proxy, settings, http), http))
