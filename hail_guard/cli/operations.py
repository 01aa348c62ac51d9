"""Operations on the command line: `ops list|show|export`, `reconcile` and the review queue.

Wherever a command names one operation, it takes its operation id or its idempotency key
(`ledger.find_operation`). Every value read from the ledger is printed as ledger text
(`terminal.terminal_text`); JSON output is ASCII.
"""

from __future__ import annotations

import argparse
import csv
import getpass
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import anyio
import anyio.to_thread

from hail_guard import app, keys, policy, review
from hail_guard.cli.parsing import Commands, add_wide, whole_number
from hail_guard.cli.terminal import (
    TIME_FORMAT,
    Column,
    json_text,
    labelled,
    print_operations,
    print_table,
    say,
    terminal_text,
)
from hail_guard.config import Settings
from hail_guard.errors import BadInput
from hail_guard.ledger import find_operation
from hail_guard.models import Operation, State
from hail_guard.views import csv_cell, delivery_view, operation_view, request_view

_STATES = [state.value for state in State]
REFERENCE_HELP = "an operation id or an idempotency key"


def add_commands(commands: Commands) -> None:
    reconcile = commands.add(
        "reconcile", help="settle unknown sends (one by id or key, or all that are due)", run=_reconcile
    )
    reconcile.add_argument(
        "reference", nargs="?", metavar="ID_OR_KEY", help=f"{REFERENCE_HELP} (default: every unknown send that is due)"
    )
    reconcile.add_argument("--json", action="store_true", help="print JSON")
    add_wide(reconcile)
    _ops_commands(commands.group("ops", help="inspect and export operations"))
    _review_commands(commands.group("review", help="the review queue: sends a human must decide"))


def _ops_commands(ops: Commands) -> None:
    listing = ops.add("list", help="list operations, newest first", run=_ops_list)
    _filters(listing)
    listing.add_argument("--limit", type=whole_number("--limit", 1, 10_000), default=50, help="at most this many")
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    add_wide(listing)
    show = ops.add("show", help="one operation with its whole history (states, decisions, delivery)", run=_ops_show)
    show.add_argument("reference", metavar="ID_OR_KEY", help=REFERENCE_HELP)
    show.add_argument("--json", action="store_true", help="print JSON")
    add_wide(show)
    export = ops.add(
        "export", help="every operation (or those filtered), newest first, as CSV or JSON Lines", run=_ops_export
    )
    _filters(export)
    export.add_argument("--format", choices=["csv", "jsonl"], default="jsonl", help="the file format")
    export.add_argument("--output", metavar="FILE", help="a new file (created 0600; default: stdout)")


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state", choices=_STATES, help="only operations in this state (default: any)")
    parser.add_argument("--campaign", help="only this campaign id (default: any)")
    parser.add_argument("--batch", help="only this batch id (default: any)")
    parser.add_argument("--recipient", help="an email address or phone number, any letter case (default: any)")
    parser.add_argument(
        "--since",
        type=_since,
        help="created since a date (2026-03-01, ISO 8601) or an age (7d, 12h, 30m) (default: any time)",
    )


def _review_commands(review_queue: Commands) -> None:
    listing = review_queue.add("list", help="operations waiting in needs_review, with why", run=_review_list)
    listing.add_argument("--limit", type=whole_number("--limit", 1, 10_000), default=100, help="at most this many")
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    add_wide(listing)
    resolve = review_queue.add("resolve", help="record what became of it (sends nothing)", run=_review_resolve)
    resolve.add_argument("reference", metavar="ID_OR_KEY", help=REFERENCE_HELP)
    resolve.add_argument(
        "--as",
        dest="resolution",
        required=True,
        choices=[s.value for s in policy.REVIEW_RESOLUTIONS],
        help="what became of it",
    )
    resolve.add_argument("--reason", required=True, help="why: kept in the history")
    resolve.add_argument("--provider-id", help="Hail's id of the message, when it was accepted")
    resolve.add_argument("--by", default=getpass.getuser(), help="who decides (default: this user)")
    resend = review_queue.add(
        "resend", help="send it again as a NEW operation under a new key (asks first)", run=_review_resend
    )
    resend.add_argument("reference", metavar="ID_OR_KEY", help=REFERENCE_HELP)
    resend.add_argument("--reason", required=True, help="why: kept in the history")
    resend.add_argument("--yes", action="store_true", help="confirm without asking (for scripts)")
    resend.add_argument("--by", default=getpass.getuser(), help="who decides (default: this user)")


async def _reconcile(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as opened:
        target = await find_operation(opened.ledger, args.reference) if args.reference else None
        settled = await opened.proxy.guard.reconcile(target.id if target is not None else None)
    if args.json:
        print(json_text([operation_view(op) for op in settled], indent=2))
    else:
        title = "as it stands after reconcile" if args.reference else f"reconciled {len(settled)} operation(s)"
        print_operations(settled, title=title, wide=args.wide)
    return 0


async def _ops_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        operations = await ledger.list_operations(**_filter_values(args), limit=args.limit)
    if args.json:
        for operation in operations:
            print(json_text(operation_view(operation)))
    else:
        print_operations(operations, title=f"{len(operations)} operation(s)", wide=args.wide)
    return 0


async def _ops_show(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        operation = await find_operation(ledger, args.reference)
        events = await ledger.events(operation.id)
        deliveries = delivery_view(await ledger.delivery_events(operation.id))
    history = [event.model_dump(mode="json", exclude={"operation_id"}) for event in events]
    if args.json:
        shown = {**operation_view(operation), "request": request_view(operation), "history": history}
        print(json_text({**shown, "delivery_events": deliveries}, indent=2))
        return 0
    for name, value in operation_view(operation).items():
        say(labelled(name, value))
    rows = [(e.at.strftime(TIME_FORMAT), e.from_state, e.to_state, e.actor, e.reason) for e in events]
    columns = ("at", "from", "to", Column("who", whole=True), "why")
    print_table(columns, rows, title="history", wide=args.wide)
    if deliveries:
        received = [
            (
                item["state"],
                item["occurred_at"],
                item["recorded_at"],
                f"{item['source']} {item['detail'] or ''}".strip(),
            )
            for item in deliveries
        ]
        print_table(("delivery", "happened", "recorded", "from"), received, title="delivery", wide=args.wide)
    return 0


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
        print(f"exported {count} operation(s) to {terminal_text(args.output)}")
    return 0


@contextmanager
def _export_target(path: str | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stdout
        return
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise BadInput(f"cannot write the export to {path}: {exc.strerror} (it must be a new file)") from exc
    with open(descriptor, "w", encoding="utf-8", newline="") as file:
        yield file


def _csv_writer(out: TextIO) -> Callable[[Operation], None]:
    """CSV rows as stored, each cell safe for a spreadsheet (`views.csv_cell`); on a terminal, each cell as
    ledger text too."""
    writer = csv.writer(out)
    writer.writerow(EXPORT_COLUMNS)
    cell: Callable[[Any], Any] = terminal_text if out.isatty() else (lambda value: value)

    def write(operation: Operation) -> None:
        values = operation.model_dump(mode="json")
        writer.writerow([cell(csv_cell(values[name])) for name in EXPORT_COLUMNS])

    return write


def _jsonl_writer(out: TextIO) -> Callable[[Operation], None]:
    def write(operation: Operation) -> None:
        values = {**operation.model_dump(mode="json"), "request": keys.canonical_json(request_view(operation))}
        out.write(json_text(values) + "\n")

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
            print(json_text(operation_view(operation)))
        return 0
    if not waiting:
        print("nothing waits for review")
        return 0
    columns = (Column("operation", whole=True), Column("key", whole=True), "tool", "to", "why", "since")
    rows = [
        (
            op.id,
            op.idempotency_key,
            op.tool,
            ", ".join(op.recipients),
            op.review_reason,
            op.updated_at.strftime(TIME_FORMAT),
        )
        for op in waiting
    ]
    print_table(columns, rows, title=f"{len(waiting)} operation(s) in review", wide=args.wide)
    return 0


async def _review_resolve(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        operation = await find_operation(ledger, args.reference)
        resolved = await ledger.resolve_review(
            operation.id,
            state=State(args.resolution),
            reason=args.reason,
            actor=args.by,
            provider_id=args.provider_id,
        )
    print(f"{resolved.id} resolved as {resolved.state.value} by {terminal_text(args.by)}")
    return 0


async def _review_resend(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as opened:
        operation = await find_operation(opened.ledger, args.reference)
        if operation.state is not State.NEEDS_REVIEW:
            raise policy.not_in_review(operation, "resent")
        guard = opened.proxy.guard
        await guard.wait_connected()
        seen = await guard.look_for(operation)
        print(
            f"looked upstream ({terminal_text(seen.searched)}): {terminal_text(_sighting_text(seen))}", file=sys.stderr
        )
        if seen.sighted is not None:
            raise policy.found_in_upstream(operation, seen.sighted.record, seen.searched, seen.sighted.provider_id)
        if not args.yes and not await _confirm_resend(operation):
            print("nothing was resent", file=sys.stderr)
            return 1
        resent = await review.resend(opened.ledger, guard, operation.id, reason=args.reason, actor=args.by)
    key = terminal_text(resent.idempotency_key)
    print(f"{operation.id} resent as {resent.id} (key {key}): {resent.state.value}")
    if resent.state is not State.ACCEPTED:
        print(f"next: {terminal_text(policy.next_step(resent))}")
        return 3
    return 0


def _sighting_text(seen: Any) -> str:
    if seen.sighted is not None:
        return f"found {seen.sighted.provider_id} (status {seen.sighted.record.get('status')})"
    return "no such message" if seen.complete else "there is no way to look, so not finding it proves nothing"


async def _confirm_resend(operation: Operation) -> bool:
    """Ask on the terminal; refuse (nothing sent) without one: scripts pass --yes."""
    if not sys.stdin.isatty():
        raise BadInput("review resend asks for confirmation: run it in a terminal, or pass --yes; nothing was resent")
    recipients = terminal_text(", ".join(operation.recipients))
    key, new_key = terminal_text(operation.idempotency_key), terminal_text(keys.resend_key(operation.idempotency_key))
    print(
        f"{operation.id} ({operation.tool} to {recipients}, key {key}) is in review: "
        f"{terminal_text(operation.review_reason or 'its outcome stayed unclear')}.\n"
        f"A resend sends it again as a NEW message under the key {new_key}. "
        "If the first attempt reached the recipient, they get it twice.\nType yes to resend: ",
        end="",
        file=sys.stderr,
        flush=True,
    )
    answer: str = await anyio.to_thread.run_sync(sys.stdin.readline)
    return answer.strip().lower() == "yes"
