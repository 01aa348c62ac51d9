"""Signing in to an upstream that uses OAuth on the command line: `login`, `logout`, and the sign-in `status` shows."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from hail_guard.cli.parsing import Commands, whole_number
from hail_guard.config import Settings
from hail_guard.errors import ConfigError

if TYPE_CHECKING:
    from hail_guard import oauth


def add_commands(commands: Commands) -> None:
    login = commands.add("login", help="sign in to an upstream that uses OAuth (hosted Hail): no API key", run=_login)
    login.add_argument("--upstream", metavar="URL", help="the upstream to sign in to (default: [upstream] url)")
    login.add_argument("--no-browser", action="store_true", help="only print the address to open; open no browser")
    login.add_argument(
        "--port",
        type=whole_number("--port", 0, 65535),
        help="receive the browser's redirect on 127.0.0.1:PORT (default: any)",
    )
    logout = commands.add("logout", help="forget the sign-in (and revoke it where the upstream allows)", run=_logout)
    logout.add_argument("--upstream", metavar="URL", help="the upstream to sign out of (default: [upstream] url)")


def _signin_store(upstream: str | None, settings: Settings) -> oauth.TokenStore:
    from hail_guard import oauth

    url = upstream or (settings.upstream.url if settings.upstream.kind == "http" else None)
    if not url:
        raise ConfigError(
            "which upstream? Pass --upstream URL (hosted Hail: https://mcp.hail.so) or set [upstream] url"
        )
    return oauth.TokenStore(url, settings.upstream.signin_dir)


async def _login(args: argparse.Namespace, settings: Settings) -> int:
    from hail_guard import oauth

    store = _signin_store(args.upstream, settings)

    async def show(address: str) -> None:
        print(f"To sign in to {store.key}, open this address in a browser:\n\n    {address}\n", file=sys.stderr)
        sys.stderr.flush()
        if not args.no_browser and _has_display():
            import webbrowser  # here: only a sign-in opens a browser

            await anyio.to_thread.run_sync(webbrowser.open, address)

    record = await oauth.login(store, show=show, port=args.port)
    print(f"signed in: {signin_line(_signed_in(record))}")
    return 0


async def _logout(args: argparse.Namespace, settings: Settings) -> int:
    from hail_guard import oauth

    print(await oauth.logout(_signin_store(args.upstream, settings)))
    return 0


def _has_display() -> bool:
    """Whether a browser can be shown (without one, a console browser would take the terminal over)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


async def signin_report(settings: Settings) -> dict[str, Any]:
    """How hail-guard authenticates to the upstream: an API key, a sign-in (who, until when), or nothing."""
    upstream = settings.upstream
    if upstream.kind == "sandbox":
        return {"method": "none", "note": "the built-in sandbox needs no sign-in"}
    if upstream.token() is not None:
        return {"method": "api_key", "note": f"an API key from ${upstream.token_env}"}
    if upstream.kind != "http":
        return {"method": "none", "note": f"no API key in ${upstream.token_env}"}
    store = _signin_store(None, settings)
    try:
        record = await anyio.to_thread.run_sync(store.load)
    except ConfigError as exc:
        return {"method": "none", "upstream": store.key, "note": str(exc)}
    if record is None:
        hint = f"not signed in to {store.key}: run `hail-guard login` (or set ${upstream.token_env})"
        return {"method": "none", "upstream": store.key, "note": hint}
    return _signed_in(record)


def _signed_in(record: oauth.SignInRecord) -> dict[str, Any]:
    from hail_guard.oauth import upstream_key

    until = datetime.fromtimestamp(record.expires_at, UTC) if record.expires_at is not None else None
    return {
        "method": "oauth",
        "upstream": upstream_key(record.upstream),
        "account": record.account,
        "signed_in_at": record.signed_in_at.isoformat(),
        "renewed_at": record.renewed_at.isoformat() if record.renewed_at else None,
        "access_until": until.isoformat() if until else None,
    }


def signin_line(report: dict[str, Any]) -> str:
    if report["method"] != "oauth":
        return str(report["note"])
    who = report["account"] or "an account it does not name"
    since = datetime.fromisoformat(report["signed_in_at"]).strftime("%Y-%m-%d %H:%M")
    until = report["access_until"]
    expiry = f"access until {datetime.fromisoformat(until):%Y-%m-%d %H:%M} UTC" if until else "no stated expiry"
    return f"{who} at {report['upstream']}, since {since} UTC; {expiry}, renewed automatically"
