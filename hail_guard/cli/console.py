"""`hail-guard console [--port P] [--open]`: the console alone, on loopback, for stdio users (the edge: it opens
the proxy and serves; the console's pages are `hail_guard.console`'s).

Claude Desktop and Cursor start `hail-guard serve` over stdio, so nothing serves HTTP; this command
serves the console on 127.0.0.1 over the same ledger (and the same upstream, for a resend's look
and send), and prints a one-time sign-in link on stderr, as Jupyter does. The link signs in once,
within 15 minutes, as this machine's user; `HAIL_GUARD_OPERATOR_TOKEN`, when set, signs in too.
"""

from __future__ import annotations

import argparse
import getpass
import signal
import sys
from functools import partial

import anyio
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route

from hail_guard import app
from hail_guard.config import Settings
from hail_guard.console.app import build_console, protected
from hail_guard.console.context import MOUNT, Console
from hail_guard.listener import listening, serve_app

log = structlog.get_logger(__name__)
HOST = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help="port on 127.0.0.1 (default: [console] port, 8766; 0: any free one)")
    parser.add_argument("--open", action="store_true", help="open the sign-in link in a browser")
    parser.set_defaults(run=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM."""
    port = settings.console.port if args.port is None else args.port
    http = settings.http.model_copy(update={"host": HOST, "port": port})
    with listening(HOST, port) as sock, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with app.open_proxy(settings) as opened, anyio.create_task_group() as tg:
            console_app = build_console(opened.ledger, opened.proxy, settings.console, http)
            console: Console = console_app.state.console
            site = Starlette(routes=[Route("/", _to_console), Mount(MOUNT, app=protected(console_app, http))])
            url = await tg.start(partial(serve_app, site, sock, settings=http))
            link = f"{url.rstrip('/')}{MOUNT}/login?once={console.operators.issue_link(getpass.getuser())}"
            _announce(link, opened=args.open)
            if args.open:
                import webbrowser  # here: only --open opens a browser

                await anyio.to_thread.run_sync(webbrowser.open, link)
            async for signum in signals:
                log.info("console_stopping", signal=signal.Signals(signum).name)
                break
            tg.cancel_scope.cancel()
    return 0


def _announce(link: str, *, opened: bool) -> None:
    print(
        f"The hail-guard console is running. {'Opening' if opened else 'Open'} this one-time sign-in link "
        f"(it signs in once, within 15 minutes, as {getpass.getuser()}):\n\n    {link}\n\nStop it with Ctrl-C.",
        file=sys.stderr,
        flush=True,
    )


async def _to_console(request: Request) -> Response:
    return RedirectResponse(f"{MOUNT}/", status_code=303)
