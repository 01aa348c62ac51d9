"""The `hail-guard` command line: the edge where settings are read and errors become exit codes.

Exit codes: 0 done, 1 a hail-guard error (the message says what to do), 2 bad usage, 3 sends left
unresolved (`batch run`, `review resend`). Command output goes to stdout; logs and notices go to stderr.
"""

from __future__ import annotations

import gc

# Start-up (`serve` answers its first tools/list sooner): importing the MCP SDK and our models
# builds thousands of pydantic classes, and the collector ran ~200 times meanwhile (~15 % of the
# imports' time) to free next to nothing. Paused for the imports; what they built lives as long as
# the process, so it is frozen (never walked by a collection again) before collecting resumes.
_collecting = gc.isenabled()
gc.disable()
try:
    import argparse
    import csv
    import getpass
    import json
    import os
    import re
    import signal
    import sys
    from collections.abc import Callable, Coroutine, Iterator, Sequence
    from contextlib import contextmanager
    from datetime import UTC, datetime, timedelta
    from typing import TYPE_CHECKING, Any, TextIO

    import anyio
    import anyio.to_thread
    import structlog
    from rich.console import Console  # imported by structlog anyway
    from rich.markup import escape

    from hail_guard import __version__, app, keys, policy, review
    from hail_guard.batch import read_batch_file, run_worker
    from hail_guard.config import Settings, load_settings
    from hail_guard.errors import ConfigError, HailGuardError, NotFound, RefusedByPolicy
    from hail_guard.ledger import Ledger
    from hail_guard.ledger import migrate as migrate_ledger
    from hail_guard.logs import configure_logging
    from hail_guard.models import SUPPRESSION_CHANNELS, BatchStatus, Operation, State, Suppression
    from hail_guard.recipients import normalise_recipient
    from hail_guard.server import batch_view, delivery_view, next_step, operation_view, request_view
    from hail_guard.urls import display_url
finally:
    if _collecting:
        gc.freeze()
        gc.enable()

if TYPE_CHECKING:
    from rich.table import Table

    from hail_guard import oauth

log = structlog.get_logger(__name__)
_STATES = [state.value for state in State]


async def drill_command(args: argparse.Namespace, settings: Settings) -> int:
    """The drill's report on stdout; 0 only when every scenario holds."""
    from hail_guard import drill

    report = await drill.run_from_args(args, settings)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        drill.print_report(report, Console())
    return drill.EXIT_OK if report.passed else drill.EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv)
    args = parser.parse_args(argv)
    if args.command == "sandbox":
        from hail_guard import sandbox

        configure_logging("info")
        return sandbox.run_from_args(args)
    try:
        settings = load_settings(args.config)
        configure_logging(settings.log.level)
        runner: Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]] = args.run
        return anyio.run(runner, args, settings)
    except HailGuardError as exc:
        print(f"hail-guard: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("crashed")
        print("hail-guard: failed unexpectedly; the log above has the details", file=sys.stderr)
        return 1


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hail-guard", description="At-most-once sends in front of Hail MCP.")
    parser.add_argument("--version", action="version", version=f"hail-guard {__version__}")
    parser.add_argument("--config", help="TOML config file (default: $HAIL_GUARD_CONFIG, else built-in defaults)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rehearsal = commands.add_parser("drill", help="rehearse the failures against the sandbox: nothing is sent twice")
    if "drill" in argv:  # its module (the rehearsals) loads only for it: `serve` starts sooner
        from hail_guard import drill

        drill.add_arguments(rehearsal)
        rehearsal.set_defaults(run=drill_command)

    serve = commands.add_parser("serve", help="run the MCP proxy (stdio; or SSE and Streamable HTTP)")
    serve.add_argument(
        "--transport",
        choices=["stdio", "sse", "http"],
        default="stdio",
        help="stdio (default), or HTTP: one server answers Streamable HTTP at /mcp and SSE at /sse",
    )
    serve.add_argument("--host", help="HTTP address to bind (default: [http] host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (default: [http] port, 8765)")
    serve.set_defaults(run=_serve)

    fake = commands.add_parser("sandbox", help="run the fake Hail MCP server over HTTP")
    if "sandbox" in argv:  # likewise: a real upstream never loads the sandbox
        from hail_guard import sandbox

        sandbox.add_arguments(fake)

    reconcile = commands.add_parser("reconcile", help="settle unknown sends (one by id, or all that are due)")
    reconcile.add_argument("operation_id", nargs="?")
    reconcile.add_argument("--json", action="store_true", help="print JSON")
    reconcile.set_defaults(run=_reconcile)

    _batch_commands(commands)
    _suppress_commands(commands)
    worker = commands.add_parser("worker", help="claim and send ready operations until stopped (SIGTERM)")
    worker.add_argument("--concurrency", type=int, help="sends at once (default: [worker] concurrency)")
    worker.add_argument("--batch", help="only this batch")
    worker.set_defaults(run=_worker)

    migrate = commands.add_parser("migrate", help="create or upgrade the ledger's schema (SQLite or PostgreSQL)")
    migrate.set_defaults(run=_migrate)
    status = commands.add_parser("status", help="counts by state, the review queue, upstream tool changes")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_status)
    upstream = commands.add_parser("upstream", help="upstream tool pinning").add_subparsers(
        dest="upstream", required=True
    )
    accept = upstream.add_parser("accept", help="accept the current look of changed upstream tools")
    accept.add_argument("tools", nargs="*", help="tool names (default: every changed tool)")
    accept.set_defaults(run=_upstream_accept)

    _signin_commands(commands)
    _ops_commands(commands)
    _review_commands(commands)
    backup = commands.add_parser("backup", help="copy the SQLite ledger, online, to a new file")
    backup.add_argument("path", help="the new file (never overwritten)")
    backup.set_defaults(run=_backup)
    prune = commands.add_parser("prune", help="delete old resolved operations and their history")
    prune.add_argument(
        "--older-than", type=float, required=True, metavar="DAYS", help="only operations untouched this many days"
    )
    prune.set_defaults(run=_prune)
    return parser


def _ops_commands(commands: Any) -> None:
    ops = commands.add_parser("ops", help="inspect and export operations").add_subparsers(dest="ops", required=True)
    listing = ops.add_parser("list", help="list operations, newest first")
    _filters(listing)
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    listing.set_defaults(run=_ops_list)
    show = ops.add_parser("show", help="one operation with its whole history (states, decisions, delivery)")
    show.add_argument("id_or_key", help="operation id or idempotency key")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_ops_show)
    export = ops.add_parser("export", help="every operation (or those filtered), newest first, as CSV or JSON Lines")
    _filters(export)
    export.add_argument("--format", choices=["csv", "jsonl"], default="jsonl")
    export.add_argument("--output", help="a new file (created 0600; default: stdout)")
    export.set_defaults(run=_ops_export)


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state", choices=_STATES)
    parser.add_argument("--campaign")
    parser.add_argument("--batch", help="a batch id")
    parser.add_argument("--recipient", help="an email address or phone number (any letter case)")
    parser.add_argument("--since", type=_since, help="created since a date (2026-03-01, ISO 8601) or an age (7d, 12h)")


def _review_commands(commands: Any) -> None:
    review = commands.add_parser("review", help="the review queue: sends a human must decide").add_subparsers(
        dest="review", required=True
    )
    listing = review.add_parser("list", help="operations waiting in needs_review, with why")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    listing.set_defaults(run=_review_list)
    resolve = review.add_parser("resolve", help="record what became of it (sends nothing)")
    resolve.add_argument("id_or_key", help="operation id or idempotency key")
    resolve.add_argument("--as", dest="resolution", required=True, choices=[s.value for s in policy.REVIEW_RESOLUTIONS])
    resolve.add_argument("--reason", required=True, help="why: kept in the history")
    resolve.add_argument("--provider-id", help="Hail's id of the message, when it was accepted")
    resolve.add_argument("--by", default=getpass.getuser(), help="who decides (default: this user)")
    resolve.set_defaults(run=_review_resolve)
    resend = review.add_parser("resend", help="send it again as a NEW operation under a new key (asks first)")
    resend.add_argument("id_or_key", help="operation id or idempotency key")
    resend.add_argument("--reason", required=True, help="why: kept in the history")
    resend.add_argument("--yes", action="store_true", help="confirm without asking (for scripts)")
    resend.add_argument("--by", default=getpass.getuser(), help="who decides (default: this user)")
    resend.set_defaults(run=_review_resend)


def _batch_commands(commands: Any) -> None:
    batch = commands.add_parser("batch", help="plan, approve, run and inspect batches").add_subparsers(
        dest="batch", required=True
    )
    plan = batch.add_parser("plan", help="record a batch from a JSON Lines or CSV file; sends nothing")
    plan.add_argument("file", help="*.jsonl ({tool, arguments} per line) or *.csv (see the README)")
    plan.add_argument("--name", help="a name to recognise the batch by")
    plan.set_defaults(run=_batch_plan)
    approve = batch.add_parser("approve", help="let a planned batch be sent (an operator act)")
    approve.add_argument("batch_id")
    approve.add_argument("--by", default=getpass.getuser(), help="who approves (default: this user)")
    approve.set_defaults(run=_batch_approve)
    run = batch.add_parser("run", help="settle the batch's unknowns, then send what is ready")
    run.add_argument("batch_id")
    run.add_argument("--concurrency", type=int, default=4)
    run.set_defaults(run=_batch_run)
    status = batch.add_parser("status", help="counts by state and unresolved sends")
    status.add_argument("batch_id")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_batch_status)


def _suppress_commands(commands: Any) -> None:
    suppress = commands.add_parser("suppress", help="the opt-out list").add_subparsers(dest="suppress", required=True)
    add = suppress.add_parser("add", help="never send to RECIPIENT again; cancels unforwarded sends to them")
    add.add_argument("recipient", help="email address or phone number")
    add.add_argument("--channel", choices=SUPPRESSION_CHANNELS, default="all")
    add.add_argument("--reason", required=True)
    add.add_argument("--source", default=f"operator {getpass.getuser()}")
    add.set_defaults(run=_suppress_add)
    listing = suppress.add_parser("list", help="every opt-out")
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    listing.set_defaults(run=_suppress_list)
    remove = suppress.add_parser("remove", help="take an opt-out back (only when the recipient asked)")
    remove.add_argument("recipient")
    remove.add_argument("--channel", choices=SUPPRESSION_CHANNELS, default="all")
    remove.set_defaults(run=_suppress_remove)


async def _batch_plan(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as proxy:
        sends = read_batch_file(args.file, proxy.guarded_schema)
        batch_id = await proxy.batches.plan(sends, name=args.name, actor=f"operator {getpass.getuser()}")
        status = await proxy.guard.ledger.batch_status(batch_id)
    print(json.dumps(batch_view(status), indent=2))
    return 0


async def _batch_approve(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        approved = await ledger.approve_batch(args.batch_id, actor=args.by)
    print(f"approved {approved} planned send(s) in {args.batch_id}")
    return 0


async def _batch_run(args: argparse.Namespace, settings: Settings) -> int:
    # Here, not at the top: only this command draws a progress bar.
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"sending {args.batch_id}", total=None)

        async def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        async with app.open_proxy(settings) as proxy:
            await proxy.guard.upstream.wait_connected()
            status = await proxy.batches.run(args.batch_id, concurrency=args.concurrency, progress=progress)
    _print_batch(status)
    return 0 if not status.unresolved else 3


async def _batch_status(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        status = await ledger.batch_status(args.batch_id)
    if args.json:
        print(json.dumps(batch_view(status), indent=2))
    else:
        _print_batch(status)
    return 0


async def _worker(args: argparse.Namespace, settings: Settings) -> int:
    stop = anyio.Event()
    concurrency = args.concurrency or settings.worker.concurrency
    async with app.open_proxy(settings) as proxy, app.tracking(settings, proxy), anyio.create_task_group() as tg:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("worker_stopping", signal=signal.Signals(signum).name)
                    stop.set()
                    # In-flight sends get a bounded time; past it they are cut off and recorded unknown.
                    await anyio.sleep(settings.worker.shutdown_seconds)
                    tg.cancel_scope.cancel()

        tg.start_soon(on_signal)
        log.info("worker_started", concurrency=concurrency, batch=args.batch)
        await run_worker(
            proxy.guard,
            concurrency=concurrency,
            stop=stop,
            batch_id=args.batch,
            poll_seconds=settings.worker.poll_seconds,
        )
        tg.cancel_scope.cancel()
    return 0


async def _suppress_add(args: argparse.Namespace, settings: Settings) -> int:
    shown = normalise_recipient(args.recipient, args.channel)  # refuses what is no address or number
    opt_out = Suppression(recipient=shown, channel=args.channel, reason=args.reason, source=args.source)
    async with app.open_ledger_from(settings) as ledger:
        cancelled = await ledger.add_suppression(opt_out, actor=f"operator {getpass.getuser()}")
    print(f"suppressed {shown} on {args.channel}; cancelled {len(cancelled)} send(s)")
    return 0


async def _suppress_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        suppressions = await ledger.list_suppressions()
    if args.json:
        for item in suppressions:
            print(item.model_dump_json())
        return 0
    table = _table("recipient", "channel", "reason", "source", "since", title=f"{len(suppressions)} opt-out(s)")
    for item in suppressions:
        since = item.created_at.strftime("%Y-%m-%d %H:%M:%S") if item.created_at else "-"
        table.add_row(item.recipient, item.channel, item.reason, item.source, since)
    Console().print(table)
    return 0


async def _suppress_remove(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        removed = await ledger.remove_suppression(args.recipient, args.channel)
    if not removed:
        raise NotFound(f"{args.recipient} has no opt-out on {args.channel}; see `hail-guard suppress list`")
    print(f"removed the opt-out of {normalise_recipient(args.recipient, args.channel)} on {args.channel}")
    return 0


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        counts = await ledger.count_by_state()
        oldest_unknown = await ledger.oldest(State.UNKNOWN)
        pins = await ledger.tool_pins()
    by_state = {state.value: count for state, count in sorted(counts.items())}
    report: dict[str, Any] = {
        "ledger": display_url(settings.ledger.url),
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
        "signin": await _signin_report(settings),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    console.print(f"[bold]ledger[/bold]: {escape(report['ledger'])}", highlight=False)
    console.print("[bold]operations[/bold]: " + (", ".join(f"{k} {v}" for k, v in by_state.items()) or "none"))
    console.print(f"[bold]review queue[/bold]: {report['review_queue']}")
    if oldest_unknown is not None:
        console.print(
            f"[bold]oldest unknown[/bold]: {oldest_unknown.id} since {oldest_unknown.created_at:%Y-%m-%d %H:%M:%S}"
        )
    changed = [pin.name for pin in pins if pin.changed]
    console.print(
        f"[bold]upstream tools[/bold] (as last seen): {len(pins)}"
        + (f"; CHANGED since accepted: {', '.join(changed)} (`hail-guard upstream accept`)" if changed else "")
    )
    console.print(f"[bold]sign-in[/bold]: {escape(_signin_line(report['signin']))}", highlight=False, soft_wrap=True)
    return 0


def _signin_commands(commands: Any) -> None:
    login = commands.add_parser("login", help="sign in to an upstream that uses OAuth (hosted Hail): no API key")
    login.add_argument("--upstream", metavar="URL", help="the upstream to sign in to (default: [upstream] url)")
    login.add_argument("--no-browser", action="store_true", help="only print the address to open; open no browser")
    login.add_argument("--port", type=int, help="receive the browser's redirect on 127.0.0.1:PORT (default: any)")
    login.set_defaults(run=_login)
    logout = commands.add_parser("logout", help="forget the sign-in (and revoke it where the upstream allows)")
    logout.add_argument("--upstream", metavar="URL", help="the upstream to sign out of (default: [upstream] url)")
    logout.set_defaults(run=_logout)


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
    print(f"signed in: {_signin_line(_signed_in(record))}")
    return 0


async def _logout(args: argparse.Namespace, settings: Settings) -> int:
    from hail_guard import oauth

    print(await oauth.logout(_signin_store(args.upstream, settings)))
    return 0


def _has_display() -> bool:
    """Whether a browser can be shown (without one, a console browser would take the terminal over)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


async def _signin_report(settings: Settings) -> dict[str, Any]:
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


def _signin_line(report: dict[str, Any]) -> str:
    if report["method"] != "oauth":
        return str(report["note"])
    who = report["account"] or "an account it does not name"
    since = datetime.fromisoformat(report["signed_in_at"]).strftime("%Y-%m-%d %H:%M")
    until = report["access_until"]
    expiry = f"access until {datetime.fromisoformat(until):%Y-%m-%d %H:%M} UTC" if until else "no stated expiry"
    return f"{who} at {report['upstream']}, since {since} UTC; {expiry}, renewed automatically"


async def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    version = await migrate_ledger(settings.ledger.url)
    print(f"the ledger is at schema version {version}")
    return 0


async def _upstream_accept(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        accepted = await ledger.accept_tools(args.tools or None)
    print(f"accepted {len(accepted)} changed tool(s): {', '.join(accepted) or 'none'}")
    return 0


def _print_batch(status: BatchStatus) -> None:
    console = Console()
    counts = ", ".join(f"{state.value} {count}" for state, count in sorted(status.counts.items()))
    console.print(f"[bold]{status.batch_id}[/bold] {status.name or ''}: {status.total} send(s): {counts}")
    if status.unresolved:
        _print_operations(status.unresolved, title="unresolved")


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.transport == "stdio":
        await app.serve_stdio(settings)
    else:
        from hail_guard import web

        await web.serve_http_until_signalled(settings, host=args.host, port=args.port)
    return 0


async def _reconcile(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as proxy:
        settled = await proxy.guard.reconcile(args.operation_id)
    if args.json:
        print(json.dumps([operation_view(op) for op in settled], indent=2))
    else:
        _print_operations(settled, title=f"reconciled {len(settled)} operation(s)")
    return 0


async def _ops_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        operations = await ledger.list_operations(**_filter_values(args), limit=args.limit)
    if args.json:
        for operation in operations:
            print(json.dumps(operation_view(operation)))
    else:
        _print_operations(operations, title=f"{len(operations)} operation(s)")
    return 0


async def _ops_show(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        operation = await _find_operation(ledger, args.id_or_key)
        events = await ledger.events(operation.id)
        deliveries = delivery_view(await ledger.delivery_events(operation.id))
    history = [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]
    if args.json:
        shown = {**operation_view(operation), "request": request_view(operation), "history": history}
        print(json.dumps({**shown, "delivery_events": deliveries}, indent=2))
        return 0
    console = Console()
    for name, value in operation_view(operation).items():
        console.print(f"[bold]{name}[/bold]: {value}", highlight=False)
    table = _table("at", "from", "to", "who", "why", title="history")
    for event in history:
        table.add_row(event["at"], event["from_state"] or "-", event["to_state"], event["actor"], event["reason"])
    console.print(table)
    if deliveries:
        table = _table("delivery", "happened", "recorded", "from", title="delivery")
        for item in deliveries:
            source = f"{item['source']} {item['detail'] or ''}".strip()
            table.add_row(item["state"], item["occurred_at"] or "-", item["recorded_at"], source)
        console.print(table)
    return 0


async def _find_operation(ledger: Ledger, id_or_key: str) -> Operation:
    try:
        return await ledger.get(id_or_key)
    except NotFound:
        found = await ledger.find_by_key(id_or_key)
    if found is None:
        raise NotFound(f"no operation has the id or key {id_or_key!r}")
    return found


EXPORT_COLUMNS = (
    "id",
    "idempotency_key",
    "state",
    "tool",
    "channel",
    "recipients",
    "campaign_id",
    "lead_id",
    "message_id",
    "batch_id",
    "provider_id",
    "attempts",
    "delivery_state",
    "delivery_at",
    "review_reason",
    "cancel_reason",
    "last_error",
    "resend_of",
    "resent_as",
    "created_at",
    "updated_at",
    "first_sent_at",
)
"""The CSV columns of `ops export` (JSON Lines carries every field, the stored request included)."""
EXPORT_PAGE = 500


async def _ops_export(args: argparse.Namespace, settings: Settings) -> int:
    count = 0
    async with app.open_ledger_from(settings) as ledger:
        with _export_target(args.output) as out:
            write = _csv_writer(out) if args.format == "csv" else _jsonl_writer(out)
            before: str | None = None
            while page := await ledger.list_operations(**_filter_values(args), before=before, limit=EXPORT_PAGE):
                for operation in page:
                    write(operation)
                count += len(page)
                before = page[-1].id
    if args.output:
        print(f"exported {count} operation(s) to {args.output}")
    return 0


@contextmanager
def _export_target(path: str | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stdout
        return
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write the export to {path}: {exc.strerror} (it must be a new file)") from exc
    with open(descriptor, "w", encoding="utf-8", newline="") as file:
        yield file


def _csv_writer(out: TextIO) -> Callable[[Operation], None]:
    writer = csv.writer(out)
    writer.writerow(EXPORT_COLUMNS)

    def write(operation: Operation) -> None:
        values = operation.model_dump(mode="json")
        values["recipients"] = ";".join(operation.recipients)
        writer.writerow(["" if values[name] is None else values[name] for name in EXPORT_COLUMNS])

    return write


def _jsonl_writer(out: TextIO) -> Callable[[Operation], None]:
    def write(operation: Operation) -> None:
        values = {**operation.model_dump(mode="json"), "request": keys.canonical_json(request_view(operation))}
        out.write(json.dumps(values) + "\n")

    return write


def _filter_values(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "state": State(args.state) if args.state else None,
        "campaign_id": args.campaign,
        "batch_id": args.batch,
        "recipient": args.recipient,
        "since": args.since,
    }


_AGE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([dhm])$")
_AGE_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def _since(text: str) -> datetime:
    """`--since`: an ISO 8601 date or time (UTC unless it says), or an age such as 7d, 12h, 30m."""
    age = _AGE.match(text.strip().lower())
    if age is not None:
        try:
            return datetime.now(UTC) - timedelta(**{_AGE_UNITS[age.group(2)]: float(age.group(1))})
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text!r} reaches back before the year 1; give a smaller age") from None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a date (2026-03-01, 2026-03-01T09:00) nor an age (7d, 12h, 30m)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


async def _review_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        waiting = await ledger.list_operations(state=State.NEEDS_REVIEW, limit=args.limit)
    if args.json:
        for operation in waiting:
            print(json.dumps(operation_view(operation)))
        return 0
    if not waiting:
        print("nothing waits for review")
        return 0
    table = _table("operation", "key", "tool", "to", "why", "since", title=f"{len(waiting)} operation(s) in review")
    for op in waiting:
        since = op.updated_at.strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(op.id, op.idempotency_key, op.tool, ", ".join(op.recipients), op.review_reason or "-", since)
    Console().print(table)
    return 0


async def _review_resolve(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        operation = await _find_operation(ledger, args.id_or_key)
        resolved = await ledger.resolve_review(
            operation.id,
            state=State(args.resolution),
            reason=args.reason,
            actor=args.by,
            provider_id=args.provider_id,
        )
    print(f"{resolved.id} resolved as {resolved.state.value} by {args.by}")
    return 0


async def _review_resend(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as proxy:
        operation = await _find_operation(proxy.guard.ledger, args.id_or_key)
        if operation.state is not State.NEEDS_REVIEW:
            raise policy.not_in_review(operation, "resent")
        await proxy.guard.upstream.wait_connected()
        seen = await proxy.guard.look_for(operation)
        print(f"looked in Hail ({seen.searched}): {_sighting_text(seen)}", file=sys.stderr)
        if seen.record is not None:
            raise policy.found_in_upstream(operation, seen.record, seen.searched)
        if not args.yes and not await _confirm_resend(operation):
            print("nothing was resent", file=sys.stderr)
            return 1
        resent = await review.resend(proxy.guard, operation.id, reason=args.reason, actor=args.by)
    print(f"{operation.id} resent as {resent.id} (key {resent.idempotency_key}): {resent.state.value}")
    if resent.state is not State.ACCEPTED:
        print(f"next: {next_step(resent)}")
        return 3
    return 0


def _sighting_text(seen: Any) -> str:
    if seen.record is not None:
        return f"found {seen.record.get('id')} (status {seen.record.get('status')})"
    return "no such message" if seen.complete else "there is no way to look, so not finding it proves nothing"


async def _confirm_resend(operation: Operation) -> bool:
    """Ask on the terminal; refuse (nothing sent) without one: scripts pass --yes."""
    if not sys.stdin.isatty():
        raise RefusedByPolicy(
            "review resend asks for confirmation: run it in a terminal, or pass --yes; nothing was resent"
        )
    print(
        f"{operation.id} ({operation.tool} to {', '.join(operation.recipients)}, key {operation.idempotency_key}) "
        f"is in review: {operation.review_reason or 'its outcome stayed unclear'}.\n"
        f"A resend sends it again as a NEW message under the key {keys.resend_key(operation.idempotency_key)}. "
        "If the first attempt reached the recipient, they get it twice.\nType yes to resend: ",
        end="",
        file=sys.stderr,
        flush=True,
    )
    answer: str = await anyio.to_thread.run_sync(sys.stdin.readline)
    return answer.strip().lower() == "yes"


async def _backup(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        count = await ledger.backup(args.path)
    print(f"backed up {count} operation(s) to {args.path}")
    return 0


async def _prune(args: argparse.Namespace, settings: Settings) -> int:
    seconds = policy.prune_age_seconds(args.older_than, key_retention_hours=settings.upstream.key_retention_hours)
    async with app.open_ledger_from(settings) as ledger:
        report = await ledger.prune(older_than_seconds=seconds)
    print(
        f"pruned {report.operations} resolved operation(s) untouched for {args.older_than:g} day(s), with "
        f"{report.events} event(s); unresolved operations are kept"
    )
    return 0


def _table(*headers: str, title: str) -> Table:
    from rich.table import Table  # here: only listing commands draw tables, `serve` never does

    return Table(*headers, title=title)


def _print_operations(operations: Sequence[Operation], *, title: str) -> None:
    table = _table("operation", "key", "state", "delivery", "tool", "to", "provider id", "updated", title=title)
    for op in operations:
        table.add_row(
            op.id,
            op.idempotency_key,
            op.state.value,
            op.delivery_state.value if op.delivery_state else "-",
            op.tool,
            ", ".join(op.recipients),
            op.provider_id or "-",
            op.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    Console().print(table)
