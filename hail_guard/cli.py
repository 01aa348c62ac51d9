"""The `hail-guard` command line: the edge where settings are read and errors become exit codes.

Exit codes: 0 done, 1 a hail-guard error (the message says what to do), 2 bad usage.
Command output goes to stdout; logs and notices go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import structlog
from rich.console import Console
from rich.table import Table

from hail_guard import __version__, app
from hail_guard.config import Settings, load_settings
from hail_guard.errors import HailGuardError, NotFound
from hail_guard.logs import configure_logging
from hail_guard.models import Operation, State
from hail_guard.server import operation_view

log = structlog.get_logger(__name__)
_STATES = [state.value for state in State]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hail-guard", description="At-most-once sends in front of Hail MCP.")
    parser.add_argument("--version", action="version", version=f"hail-guard {__version__}")
    parser.add_argument("--config", help="TOML config file (default: $HAIL_GUARD_CONFIG, else built-in defaults)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the MCP proxy (stdio)")
    serve.add_argument("--transport", choices=["stdio"], default="stdio")
    serve.set_defaults(run=_serve)

    from hail_guard import sandbox

    sandbox.add_arguments(commands.add_parser("sandbox", help="run the fake Hail MCP server over HTTP"))

    reconcile = commands.add_parser("reconcile", help="settle unknown sends (one by id, or all that are due)")
    reconcile.add_argument("operation_id", nargs="?")
    reconcile.add_argument("--json", action="store_true", help="print JSON")
    reconcile.set_defaults(run=_reconcile)

    ops = commands.add_parser("ops", help="inspect operations").add_subparsers(dest="ops", required=True)
    listing = ops.add_parser("list", help="list operations, newest first")
    listing.add_argument("--state", choices=_STATES)
    listing.add_argument("--campaign")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    listing.set_defaults(run=_ops_list)
    show = ops.add_parser("show", help="one operation with its event history")
    show.add_argument("id_or_key", help="operation id or idempotency key")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_ops_show)
    return parser


async def _serve(args: argparse.Namespace, settings: Settings) -> int:
    await app.serve_stdio(settings)
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
    state = State(args.state) if args.state else None
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        operations = await ledger.list_operations(state=state, campaign_id=args.campaign, limit=args.limit)
    if args.json:
        for operation in operations:
            print(json.dumps(operation_view(operation)))
    else:
        _print_operations(operations, title=f"{len(operations)} operation(s)")
    return 0


async def _ops_show(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        try:
            operation = await ledger.get(args.id_or_key)
        except NotFound:
            found = await ledger.find_by_key(args.id_or_key)
            if found is None:
                raise NotFound(f"no operation has the id or key {args.id_or_key!r}") from None
            operation = found
        events = await ledger.events(operation.id)
    history = [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]
    if args.json:
        print(json.dumps({**operation_view(operation), "request": operation.arguments(), "history": history}, indent=2))
        return 0
    console = Console()
    for name, value in operation_view(operation).items():
        console.print(f"[bold]{name}[/bold]: {value}", highlight=False)
    table = Table("at", "from", "to", "who", "why", title="history")
    for event in history:
        table.add_row(event["at"], event["from_state"] or "-", event["to_state"], event["actor"], event["reason"])
    console.print(table)
    return 0


def _print_operations(operations: Sequence[Operation], *, title: str) -> None:
    table = Table("operation", "key", "state", "tool", "to", "provider id", "updated", title=title)
    for op in operations:
        table.add_row(
            op.id,
            op.idempotency_key,
            op.state.value,
            op.tool,
            ", ".join(op.recipients),
            op.provider_id or "-",
            op.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    Console().print(table)
