"""Running and looking after hail-guard: `serve`, `status`, `migrate`, `upstream accept`, `backup`, `prune`."""

from __future__ import annotations

import argparse
from datetime import datetime
from functools import partial
from typing import Any

import anyio
from rich.text import Text

from hail_guard import app, policy
from hail_guard.batch import STALE_SECONDS, sender_name
from hail_guard.cli.clients import TOKEN_PLACEHOLDER
from hail_guard.cli.parsing import Commands, whole_number
from hail_guard.cli.signin import signin_line, signin_report
from hail_guard.cli.terminal import TIME_FORMAT, json_text, labelled, say, terminal_text
from hail_guard.config import Settings
from hail_guard.errors import ConfigError, HailGuardError, NotFound
from hail_guard.ledger import Heartbeat
from hail_guard.ledger import migrate as migrate_ledger
from hail_guard.models import State
from hail_guard.spawned import env_shown
from hail_guard.upstream import UpstreamTarget, connect_upstream
from hail_guard.urls import display_url
from hail_guard.views import operation_view


def add_commands(commands: Commands) -> None:
    serve = commands.add("serve", help="run the MCP proxy (stdio; or SSE and Streamable HTTP)", run=_serve)
    serve.add_argument(
        "--transport",
        choices=["stdio", "sse", "http"],
        default="stdio",
        help="stdio, or HTTP: one server answers Streamable HTTP at /mcp and SSE at /sse",
    )
    serve.add_argument("--host", help="HTTP address to bind (default: [http] host, 127.0.0.1)")
    serve.add_argument("--port", type=whole_number("--port", 0, 65535), help="HTTP port (default: [http] port, 8765)")
    status = commands.add(
        "status", help="the ledger and upstream in use, counts by state, the review queue, tool changes", run=_status
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    commands.add("migrate", help="create or upgrade the ledger's schema (SQLite or PostgreSQL)", run=_migrate)
    upstream = commands.group("upstream", help="upstream tool pinning")
    accept = upstream.add("accept", help="accept the current look of changed upstream tools", run=_upstream_accept)
    accept.add_argument("tools", nargs="*", help="tool names (default: every changed tool)")
    backup = commands.add("backup", help="copy the SQLite ledger, online, to a new file", run=_backup)
    backup.add_argument("path", help="the new file (never overwritten)")
    prune = commands.add("prune", help="delete old resolved operations and their history", run=_prune)
    prune.add_argument(
        "--older-than", type=float, required=True, metavar="DAYS", help="only operations untouched this many days"
    )


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.transport == "stdio":
        await app.until_signalled(partial(app.serve_stdio, settings), event="stdio_stopping")
    else:
        await app.serve_http_until_signalled(settings, host=args.host, port=args.port)
    return 0


def ledger_shown(url: str) -> str:
    """The ledger's URL as it may be printed: rebuilt from its parts, never with a password (`urls.display_url`)."""
    return display_url(url)


def upstream_shown(settings: Settings) -> str:
    """Where hail-guard reads Hail, as it may be printed (no userinfo, query or token)."""
    upstream = settings.upstream
    if upstream.kind == "sandbox":
        return "the built-in sandbox (nothing real is sent)"
    try:
        if upstream.kind == "stdio":
            return UpstreamTarget(kind="stdio", command=tuple(upstream.command or ())).display
        return f"{UpstreamTarget(kind=upstream.kind, url=upstream.url).display} ({upstream.kind})"
    except ConfigError as exc:
        return f"not usable: {exc}"


def upstream_env_shown(settings: Settings) -> dict[str, str]:
    """`[upstream.env]` as `status` shows it: URLs without their secrets, every other value a secret."""
    upstream = settings.upstream
    try:
        return env_shown(upstream.resolved_env())
    except ConfigError:
        return {name: value if value.startswith("${") else "(secret)" for name, value in upstream.env.items()}


def _start_problem(settings: Settings) -> str | None:
    """Why the upstream command could not be started, said as the agent would be told it."""
    try:
        problem = settings.upstream.command_problem()
    except ConfigError as exc:
        return str(exc)
    if problem is None:
        return None
    return f"the upstream ({policy.upstream_name()}) could not be started: {problem}; nothing would be sent"


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.verify()  # a damaged ledger is an error here too, as for every command that reads it
        await ledger.expire_leases()
        counts = await ledger.count_by_state()
        oldest_unknown = await ledger.oldest(State.UNKNOWN)
        pins = await ledger.tool_pins()
        beats, now = await ledger.heartbeats(), await ledger.now()
    by_state = {state.value: count for state, count in sorted(counts.items())}
    signin = await signin_report(settings)
    warning = settings.upstream.token_warning(signed_in=signin["method"] == "oauth")
    problem = _start_problem(settings)
    warnings = [said for said in (warning, problem, placeholder_warning(settings)) if said is not None]
    report: dict[str, Any] = {
        "ledger": ledger_shown(settings.ledger.url),
        "upstream": upstream_shown(settings),
        "upstream_env": upstream_env_shown(settings),
        "upstream_answers": await upstream_answers(settings),
        "profile": settings.upstream.profile,
        "warnings": warnings,
        "operations": by_state,
        "oldest_unknown": operation_view(oldest_unknown) if oldest_unknown else None,
        "review_queue": counts.get(State.NEEDS_REVIEW, 0),
        "upstream_tools": [
            {
                "name": pin.name,
                "changed": pin.changed,
                "changed_at": pin.changed_at.isoformat() if pin.changed_at else None,
            }
            for pin in pins
        ],
        "signin": signin,
        "sending": [sender_view(beat, now) for beat in beats],
    }
    if args.json:
        print(json_text(report, indent=2))
        return 0
    say(labelled("ledger", report["ledger"]))
    say(labelled("upstream", report["upstream"]))
    say(labelled("upstream answers", answers_line(report["upstream_answers"])))
    for name, value in report["upstream_env"].items():
        say(labelled(f"  env {name}", value))
    say(labelled("profile", report["profile"]))
    for warning in report["warnings"]:
        say(("warning", "bold red"), ": ", warning)
    say(labelled("operations", ", ".join(f"{k} {v}" for k, v in by_state.items()) or "none"))
    say(labelled("review queue", report["review_queue"]))
    if oldest_unknown is not None:
        since = oldest_unknown.created_at.strftime(TIME_FORMAT)
        say(labelled("oldest unknown", oldest_unknown.id), f" since {since}")
    changed = [terminal_text(pin.name) for pin in pins if pin.changed]
    say(
        ("upstream tools", "bold"),
        f" (as last seen): {len(pins)}",
        Text(f"; CHANGED since accepted: {', '.join(changed)} (`hail-guard upstream accept`)" if changed else ""),
    )
    say(labelled("sign-in", signin_line(signin)))
    for line in sending_lines(report["sending"]):
        say(labelled("sending", line))
    return 0


def sender_view(beat: Heartbeat, now: datetime) -> dict[str, Any]:
    """A heartbeat as `status` shows it: who (host and process), what, since when, how long silent."""
    silent = (now - beat.seen_at).total_seconds() if beat.seen_at is not None else None
    return {
        "who": sender_name(beat.who),
        "role": beat.role,
        "batch_id": beat.batch_id,
        "since": beat.started_at.isoformat() if beat.started_at is not None else None,
        "silent_seconds": round(silent, 1) if silent is not None else None,
        "stale": silent is None or silent > STALE_SECONDS,
    }


def sending_lines(senders: list[dict[str, Any]]) -> list[str]:
    """Who is sending, a line each; said plainly when nobody is."""
    if not senders:
        return [
            "nobody: no worker, `batch run` or serve is sending from this ledger, so ready sends wait "
            "(`hail-guard worker`, or `hail-guard batch run BATCH`)"
        ]
    lines = []
    for sender in senders:
        what = f"{sender['role']}, " + (f"batch {sender['batch_id']}" if sender["batch_id"] else "every batch")
        since = datetime.fromisoformat(sender["since"]).strftime(TIME_FORMAT) if sender["since"] else "-"
        heard = f"last heard {sender['silent_seconds']:.0f} s ago" if sender["silent_seconds"] is not None else ""
        lines.append(
            f"{sender['who']} ({what}) since {since}, {heard}" + (": it may have stopped" if sender["stale"] else "")
        )
    return lines


def placeholder_warning(settings: Settings) -> str | None:
    """The token variable still holds the placeholder `client-config` writes: Hail refuses every send."""
    upstream = settings.upstream
    if upstream.token() != TOKEN_PLACEHOLDER:
        return None
    return (
        f"{upstream.token_env} holds {TOKEN_PLACEHOLDER}, the placeholder `hail-guard client-config` writes: put "
        "your Hail key there (in the client's config too); until then Hail refuses every send"
    )


UPSTREAM_CHECK_SECONDS = 10.0
"""How long `status` waits for the upstream to connect and list its tools; past it, it says so and goes on."""


async def upstream_answers(settings: Settings) -> dict[str, Any]:
    """Whether the upstream answers now (it connects and lists its tools within `UPSTREAM_CHECK_SECONDS`):
    reported, never fatal. The built-in sandbox runs in this process: it always answers."""
    if settings.upstream.kind == "sandbox":
        return {"answers": True, "detail": "the built-in sandbox runs in this process"}
    seconds = min(UPSTREAM_CHECK_SECONDS, settings.upstream.timeout_seconds)
    try:
        with anyio.fail_after(seconds):
            target = app.upstream_target(settings)
            async with connect_upstream(
                target, timeout_seconds=seconds, connect_timeout_seconds=seconds, heartbeat_seconds=None
            ) as upstream:
                tools = await upstream.list_tools()
    except TimeoutError:
        return {"answers": False, "detail": f"no answer within {seconds:g} s"}
    except HailGuardError as exc:
        return {"answers": False, "detail": str(exc)}
    return {"answers": True, "detail": f"it lists {len(tools)} tool(s)"}


def answers_line(answered: dict[str, Any]) -> str:
    return f"{'yes' if answered['answers'] else 'NO'}: {answered['detail']}"


async def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    version = await migrate_ledger(settings.ledger.url)
    print(f"the ledger is at schema version {version}")
    return 0


async def _upstream_accept(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        refuse_unknown_tools(args.tools, {pin.name for pin in await ledger.tool_pins()})
        accepted = await ledger.accept_tools(args.tools or None)
    print(f"accepted {len(accepted)} changed tool(s): {terminal_text(', '.join(accepted) or 'none')}")
    return 0


def refuse_unknown_tools(named: list[str], known: set[str]) -> None:
    """`NotFound` naming each tool the upstream was never seen to list, and the ones it was; nothing accepted."""
    unknown = [name for name in named if name not in known]
    if not unknown:
        return
    seen = ", ".join(sorted(known)) if known else "none yet (they are recorded when `serve` connects)"
    raise NotFound(
        f"no upstream tool named {', '.join(repr(name) for name in unknown)}; nothing was accepted. "
        f"The upstream's tools as last seen: {seen}"
    )


async def _backup(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        count = await ledger.backup(args.path)
    print(f"backed up {count} operation(s) to {terminal_text(args.path)}")
    return 0


async def _prune(args: argparse.Namespace, settings: Settings) -> int:
    retention = await anyio.to_thread.run_sync(app.key_retention_hours, settings)  # may read a profile file
    seconds = policy.prune_age_seconds(args.older_than, key_retention_hours=retention)
    async with app.open_ledger_from(settings) as ledger:
        report = await ledger.prune(older_than_seconds=seconds)
    print(
        f"pruned {report.operations} resolved operation(s) untouched for {args.older_than:g} day(s), with "
        f"{report.events} event(s); unresolved operations are kept"
    )
    return 0
