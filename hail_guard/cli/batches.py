"""Batches, workers and opt-outs on the command line: `batch plan|approve|run|status|list`, `worker`, `suppress`."""

from __future__ import annotations

import argparse
import getpass
import signal
from typing import Any

import anyio
import structlog

from hail_guard import app, policy
from hail_guard.batch import read_batch_file, run_worker
from hail_guard.cli.parsing import Commands, add_wide, whole_number
from hail_guard.cli.terminal import (
    TIME_FORMAT,
    Column,
    json_text,
    print_batch,
    print_table,
    progress,
    say,
    terminal_text,
)
from hail_guard.config import Settings
from hail_guard.errors import BadInput, NotFound
from hail_guard.lifecycle import STATES
from hail_guard.models import SUPPRESSION_CHANNELS, BatchStatus, State, Suppression
from hail_guard.recipients import normalise_recipient
from hail_guard.server import Proxy
from hail_guard.views import batch_view

log = structlog.get_logger(__name__)
MOST_AT_ONCE = 256


def add_commands(commands: Commands) -> None:
    _batch_commands(commands.group("batch", help="plan, approve, run, list and inspect batches"))
    _suppress_commands(commands.group("suppress", help="the opt-out list"))
    worker = commands.add("worker", help="claim and send ready operations until stopped (SIGTERM)", run=_worker)
    worker.add_argument(
        "--concurrency",
        type=whole_number("--concurrency", 1, MOST_AT_ONCE),
        help="sends at once (default: [worker] concurrency, 4)",
    )
    worker.add_argument("--batch", help="only this batch (default: every batch)")


def _batch_commands(batch: Commands) -> None:
    plan = batch.add("plan", help="record a batch from a JSON Lines or CSV file; sends nothing", run=_batch_plan)
    plan.add_argument("file", help="*.jsonl ({tool, arguments} per line) or *.csv (see docs/how-to/campaigns.md)")
    plan.add_argument("--name", help="a name to recognise the batch by")
    approve = batch.add("approve", help="let a planned batch be sent (an operator act)", run=_batch_approve)
    approve.add_argument("batch_id", help="the batch id `batch plan` printed")
    approve.add_argument("--by", default=getpass.getuser(), help="who approves (default: this user)")
    run = batch.add("run", help="settle the batch's unknowns, then send what is ready", run=_batch_run)
    run.add_argument("batch_id", help="the batch id `batch plan` printed")
    run.add_argument(
        "--concurrency", type=whole_number("--concurrency", 1, MOST_AT_ONCE), default=4, help="sends at once"
    )
    run.add_argument("--no-progress", action="store_true", help="draw no progress bar (none is drawn off a terminal)")
    add_wide(run)
    status = batch.add("status", help="counts by state and unresolved sends", run=_batch_status)
    status.add_argument("batch_id", help="the batch id `batch plan` printed")
    status.add_argument("--json", action="store_true", help="print JSON")
    add_wide(status)
    cancel = batch.add(
        "cancel",
        help="cancel the batch's sends not sent yet (planned, ready); never one that may have left",
        run=_batch_cancel,
    )
    cancel.add_argument("batch_id", help="the batch id `batch plan` printed")
    cancel.add_argument("--reason", required=True, help="why: kept with each cancelled send")
    listing = batch.add("list", help="batches, newest first: name, when planned, counts by state", run=_batch_list)
    listing.add_argument("--limit", type=whole_number("--limit", 1, 10_000), default=50, help="at most this many")
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    add_wide(listing)


def _suppress_commands(suppress: Commands) -> None:
    add = suppress.add(
        "add", help="never send to RECIPIENT again; cancels unforwarded sends to them", run=_suppress_add
    )
    add.add_argument("recipient", help="email address or phone number")
    add.add_argument("--channel", choices=SUPPRESSION_CHANNELS, default="all", help="where the opt-out applies")
    add.add_argument("--reason", required=True, help="why: kept with the opt-out")
    add.add_argument("--source", default=f"operator {getpass.getuser()}", help="who recorded it")
    listing = suppress.add("list", help="every opt-out", run=_suppress_list)
    listing.add_argument("--json", action="store_true", help="print JSON lines")
    add_wide(listing)
    remove = suppress.add("remove", help="take an opt-out back (only when the recipient asked)", run=_suppress_remove)
    remove.add_argument("--reason", required=True, help="why: the recipient asked? (logged)")
    remove.add_argument("recipient", help="email address or phone number")
    remove.add_argument("--channel", choices=SUPPRESSION_CHANNELS, default="all", help="the opt-out's channel")


def next_command(status: BatchStatus) -> str:
    """What to run next for a batch, as a command line."""
    if status.counts.get(State.PLANNED):
        return f"hail-guard batch approve {status.batch_id}"
    if status.counts.get(State.READY) or status.unresolved:
        return f"hail-guard batch run {status.batch_id}"
    return f"nothing left to send; hail-guard batch status {status.batch_id}"


async def _batch_plan(args: argparse.Namespace, settings: Settings) -> int:
    opened: list[Proxy] = []

    def schema_of(tool: str) -> dict[str, Any] | None:
        return opened[0].guarded_schema(tool)

    sends = read_batch_file(args.file, schema_of)  # a missing file is refused before anything connects
    async with app.open_proxy(settings) as parts:
        proxy = parts.proxy
        opened.append(proxy)
        batch_id = await proxy.batches.plan(sends, name=args.name, actor=f"operator {getpass.getuser()}")
        status = await proxy.batches.status(batch_id)
    print(json_text({**batch_view(status), "next_step": next_command(status)}, indent=2))
    return 0


async def _batch_approve(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        approved = await ledger.approve_batch(args.batch_id, actor=args.by)
    print(f"approved {approved} planned send(s) in {terminal_text(args.batch_id)}")
    return 0


async def _batch_run(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_proxy(settings) as opened:
        batches = opened.proxy.batches
        before = await batches.status(args.batch_id)  # no batch: an error, and no bar drawn
        await opened.upstream.wait_connected()
        total = before.counts.get(State.READY, 0) or None
        with progress(f"sending {args.batch_id}", total=total, enabled=not args.no_progress) as advance:

            async def sent(done: int, total: int | None) -> None:
                advance(done, total)

            status = await batches.run(args.batch_id, concurrency=args.concurrency, progress=sent)
    print_batch(status, wide=args.wide)
    for step in unresolved_steps(status):
        say(("next step", "bold"), ": ", terminal_text(step))
    return 0 if not status.unresolved else 3


def unresolved_steps(status: BatchStatus) -> list[str]:
    """What to do about the sends a run left unresolved (exit 3), a line for each kind."""
    steps = (
        policy.operator_step(state, status.counts[state], status.batch_id) for state in STATES if state in status.counts
    )
    return [step for step in steps if step is not None]


async def _batch_cancel(args: argparse.Namespace, settings: Settings) -> int:
    """What the console's Cancel does (`Ledger.cancel_batch`), from the command line."""
    reason = args.reason.strip()
    if not reason:
        raise BadInput("--reason is empty: say why the batch is cancelled; nothing was cancelled")
    async with app.open_ledger_from(settings) as ledger:
        cancelled = await ledger.cancel_batch(args.batch_id, reason=reason, actor=f"operator {getpass.getuser()}")
        status = await ledger.batch_status(args.batch_id)
    batch = terminal_text(args.batch_id)
    print(f"cancelled {len(cancelled)} unsent send(s) of {batch}; see `hail-guard batch status {batch}`")
    print_batch(status)
    return 0


async def _batch_status(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        status = await ledger.batch_status(args.batch_id, hold_lead=settings.guard.hold_lead_across_channels)
    if args.json:
        print(json_text({**batch_view(status), "next_step": next_command(status)}, indent=2))
    else:
        print_batch(status, wide=args.wide)
    return 0


async def _batch_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        await ledger.expire_leases()
        batches = await ledger.list_batches(limit=args.limit)
    if args.json:
        for batch in batches:
            print(json_text(batch.model_dump(mode="json") | {"total": batch.total}))
        return 0
    rows = [
        (
            batch.batch_id,
            batch.name,
            batch.created_at.strftime(TIME_FORMAT),
            batch.total,
            ", ".join(f"{state.value} {count}" for state, count in sorted(batch.counts.items())) or "none",
        )
        for batch in batches
    ]
    columns = (Column("batch", whole=True), "name", "created", "sends", "by state")
    print_table(columns, rows, title=f"{len(batches)} batch(es), newest first", wide=args.wide)
    return 0


async def _worker(args: argparse.Namespace, settings: Settings) -> int:
    stop = anyio.Event()
    concurrency = args.concurrency or settings.worker.concurrency
    async with app.open_proxy(settings) as opened, app.tracking(settings, opened), anyio.create_task_group() as tg:

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
            opened.proxy.guard,
            opened.ledger,
            concurrency=concurrency,
            stop=stop,
            batch_id=args.batch,
            poll_seconds=settings.worker.poll_seconds,
        )
        tg.cancel_scope.cancel()
    return 0


async def _suppress_add(args: argparse.Namespace, settings: Settings) -> int:
    shown = normalise_recipient(
        args.recipient, args.channel, region=settings.guard.default_region
    )  # refuses a non-recipient
    opt_out = Suppression(recipient=shown, channel=args.channel, reason=args.reason, source=args.source)
    async with app.open_ledger_from(settings) as ledger:
        cancelled = await ledger.add_suppression(opt_out, actor=f"operator {getpass.getuser()}")
    print(f"suppressed {terminal_text(shown)} on {args.channel}; cancelled {len(cancelled)} send(s)")
    return 0


async def _suppress_list(args: argparse.Namespace, settings: Settings) -> int:
    async with app.open_ledger_from(settings) as ledger:
        suppressions = await ledger.list_suppressions()
    if args.json:
        for item in suppressions:
            print(json_text(item.model_dump(mode="json")))
        return 0
    rows: list[tuple[Any, ...]] = [
        (
            item.recipient,
            item.channel,
            item.reason,
            item.source,
            item.created_at.strftime(TIME_FORMAT) if item.created_at else None,
        )
        for item in suppressions
    ]
    columns = (Column("recipient", whole=True), "channel", "reason", "source", "since")
    print_table(columns, rows, title=f"{len(suppressions)} opt-out(s)", wide=args.wide)
    return 0


async def _suppress_remove(args: argparse.Namespace, settings: Settings) -> int:
    reason = args.reason.strip()
    if not reason:
        raise BadInput("--reason is empty: say why the opt-out is taken back (the recipient asked?); nothing changed")
    async with app.open_ledger_from(settings) as ledger:
        region = settings.guard.default_region
        removed = await ledger.remove_suppression(
            normalise_recipient(args.recipient, args.channel, region=region), args.channel
        )
    recipient = terminal_text(args.recipient)
    if not removed:
        raise NotFound(f"{recipient} has no opt-out on {args.channel}; see `hail-guard suppress list`")
    by = f"operator {getpass.getuser()}"
    log.info("opt_out_removed", recipient=args.recipient, channel=args.channel, by=by, reason=reason)
    shown = terminal_text(normalise_recipient(args.recipient, args.channel, region=settings.guard.default_region))
    print(f"removed the opt-out of {shown} on {args.channel} ({terminal_text(reason)})")
    return 0
