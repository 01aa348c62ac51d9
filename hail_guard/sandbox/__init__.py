"""The Hail sandbox: a fake Hail MCP server that follows docs/explanation/hail.md.

Shipped so users can try hail-guard without a Hail account; the drill and the tests use it as the
upstream. It keeps one organisation in memory: sends with organisation-wide idempotency keys,
delivery that progresses with the clock, scripted faults, and an outbox (the ground truth of what
was really "sent").

    sandbox = Sandbox(faults=[parse_fault("send_email:2:drop_after_accept")], clock=ManualClock())
    async with mcp.Client(sandbox.server(), mode="legacy") as client: ...   # in process
    await tg.start(serve_http, sandbox, "127.0.0.1", 0, "token")            # over HTTP, returns the URL

Modules: `tools` (names, schemas, schema refusals), `refusals` (Hail's refusals and texts),
`idempotency` (keys), `records` (messages, delivery progress, special addresses), `faults`, `outbox`,
`clock`, `answers` (what a fake answers with), `server` (MCP), `http` (Streamable HTTP), `service`
(`Sandbox`), `command` (CLI).

Special recipients (see `SPECIAL_ADDRESSES`): `bounce@...` bounces, `complaint@...` complains,
`delayed@...` is delayed then delivered; SMS to +15005550001 is refused by the carrier (failed,
error_code 30007), to +15005550002 ends undelivered; calls to +15005550003 are busy, to
+15005550004 not answered, to +15005550005 failed.
"""

from hail_guard.sandbox.answers import Answer, Refusal, Reply, Withheld
from hail_guard.sandbox.clock import Clock, ManualClock, Sleep, system_clock
from hail_guard.sandbox.command import add_arguments, run_from_args
from hail_guard.sandbox.faults import FAULT_KINDS, Fault, FaultKind, parse_fault
from hail_guard.sandbox.http import serve_http
from hail_guard.sandbox.idempotency import KEY_RETENTION_SECONDS
from hail_guard.sandbox.records import (
    CALL_BUSY,
    CALL_FAILED,
    CALL_NO_ANSWER,
    SMS_CARRIER_REFUSED,
    SMS_UNDELIVERED,
    SPECIAL_ADDRESSES,
)
from hail_guard.sandbox.service import DEFAULT_DELIVERY_DELAY_SECONDS, Sandbox

__all__ = [
    "CALL_BUSY",
    "CALL_FAILED",
    "CALL_NO_ANSWER",
    "DEFAULT_DELIVERY_DELAY_SECONDS",
    "FAULT_KINDS",
    "KEY_RETENTION_SECONDS",
    "SMS_CARRIER_REFUSED",
    "SMS_UNDELIVERED",
    "SPECIAL_ADDRESSES",
    "Answer",
    "Clock",
    "Fault",
    "FaultKind",
    "ManualClock",
    "Refusal",
    "Reply",
    "Sandbox",
    "Sleep",
    "Withheld",
    "add_arguments",
    "parse_fault",
    "run_from_args",
    "serve_http",
    "system_clock",
]
