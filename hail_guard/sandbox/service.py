"""`Sandbox`: the fake Hail itself, one organisation, transport-free.

`Sandbox.invoke(tool, arguments)` does what Hail's tool layer and API would do and returns an
`Answer`: a `Reply` (the JSON object Hail returns, errors included as `{"error": ...}`), a
`Refusal` (a schema-level refusal: the caller sees isError) or a `Withheld` answer (hang or drop,
which the MCP layer in `server.py` carries out). A send goes through, in order:

    latency, delay -> schema check -> tool-layer validation (nothing saved) -> 401/429 (nothing
    saved) -> key check (conflict, still processing, replay) -> processing -> consent and
    scripted refusals (saved; a 503 on place_call releases the key) -> accept: record, outbox,
    save under the key -> the answer, possibly spoiled by an *_after_accept or malformed fault.

From the key check on, a send runs to completion even if its caller leaves, like Hail's API.
"""

from __future__ import annotations

import copy
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio

from hail_guard.sandbox import records
from hail_guard.sandbox.answers import Answer, Refusal, Reply, Withheld
from hail_guard.sandbox.clock import Clock, Sleep, system_clock
from hail_guard.sandbox.faults import Fault, FaultPlan
from hail_guard.sandbox.idempotency import CONFLICT_TEXT, PROCESSING_TEXT, Claim, KeyStore, request_hash
from hail_guard.sandbox.outbox import Outbox
from hail_guard.sandbox.refusals import api_error, gateway_error, send_refusal, tool_layer_error
from hail_guard.sandbox.server import build_server
from hail_guard.sandbox.tools import SEND_TOOLS, input_schema, schema_refusal

if TYPE_CHECKING:
    from mcp.server import Server

log = logging.getLogger(__name__)

DEFAULT_DELIVERY_DELAY_SECONDS: Final = 2.0
NOT_FOUND: Final = {"error": "resource not found"}
MALFORMED_RESULT: Final = {"error": "sent_at: Input should be a valid datetime"}
_CHANNELS: Final[dict[str, records.Channel]] = {"send_email": "email", "send_sms": "sms", "place_call": "call"}
_RECORD_TOOLS: Final[dict[str, tuple[records.Channel, str]]] = {
    "get_email": ("email", "email_id"),
    "get_sms": ("sms", "sms_id"),
    "get_call": ("call", "call_id"),
}
_LIST_TOOLS: Final[dict[str, records.Channel]] = {"list_emails": "email", "list_sms": "sms", "list_calls": "call"}


class Sandbox:
    """A fake Hail organisation: tools, idempotency keys, delivery progress, faults and an outbox."""

    def __init__(
        self,
        *,
        faults: Iterable[Fault] = (),
        outbox_path: str | os.PathLike[str] | None = None,
        latency_seconds: float = 0.0,
        clock: Clock = system_clock,
        sleep: Sleep = anyio.sleep,
        delivery_delay_seconds: float = DEFAULT_DELIVERY_DELAY_SECONDS,
    ) -> None:
        if latency_seconds < 0 or delivery_delay_seconds < 0:
            raise ValueError("latency_seconds and delivery_delay_seconds must not be negative")
        self._plan = FaultPlan(tuple(faults))
        self._outbox = Outbox(outbox_path)
        self._latency_seconds = latency_seconds
        self._clock = clock
        self._sleep = sleep
        self._keys = KeyStore()
        self._records = records.Records(step_seconds=delivery_delay_seconds)

    @property
    def outbox(self) -> list[dict[str, Any]]:
        """Every accepted message, oldest first (the same list the outbox file mirrors)."""
        return self._outbox.entries

    async def wait_for_outbox(self, count: int) -> None:
        """Return once at least `count` messages were accepted (bound it with `anyio.fail_after`)."""
        await self._outbox.wait_for(count)

    @property
    def faults(self) -> tuple[Fault, ...]:
        return self._plan.faults

    def add_fault(self, fault: Fault) -> None:
        """Script one more fault; call numbers count from the sandbox's start, not from now."""
        self._plan.add(fault)

    def calls(self, tool: str) -> int:
        """How many `tools/call` requests `tool` has received."""
        return self._plan.calls(tool)

    def server(self) -> Server[Any]:
        """A low-level MCP server over this sandbox (a new one per call; all share this state)."""
        return build_server(self)

    async def invoke(self, tool: str, arguments: Mapping[str, Any] | None) -> Answer:
        """Answer one tool call as Hail would."""
        faults = self._plan.arrive(tool)
        await self._sleep(self._latency_seconds)
        if (delay := faults.get("delay")) is not None:
            await self._sleep((delay.arg or 0) / 1000)
        if input_schema(tool) is None:
            return Refusal(f"Unknown tool: {tool}")
        args = dict(arguments or {})
        refusal = schema_refusal(tool, args)
        if refusal is not None:
            return Refusal(f"Error executing tool {tool}: {refusal}")
        invalid = tool_layer_error(tool, args)
        if invalid is not None:
            return Reply({"error": invalid})
        failure = faults.get("fail_before_accept")
        if failure is not None and (tool not in SEND_TOOLS or failure.arg in (401, 429)):
            log.info("sandbox_refused_before_accept tool=%s status=%s", tool, failure.arg)
            return Reply(api_error(failure.arg or 500, failure.retry_after_seconds))
        if tool in SEND_TOOLS:
            return await self._send(tool, args, faults)
        return _spoil(self._read(tool, args), faults)

    async def _send(self, tool: str, args: dict[str, Any], faults: dict[str, Fault]) -> Answer:
        key = args.pop("idempotency_key", None) or str(uuid.uuid4())
        body = {name: value for name, value in args.items() if value is not None}
        claim, saved = self._keys.claim(key, request_hash(tool, body), self._clock())
        if claim is Claim.CONFLICT:
            return Reply({"error": CONFLICT_TEXT})
        if claim is Claim.IN_FLIGHT:
            return Reply({"error": PROCESSING_TEXT})
        if claim is Claim.REPLAY and saved is not None:
            log.info("sandbox_replayed tool=%s key=%s", tool, key)
            return Reply(saved)
        try:
            with anyio.CancelScope(shield=True):
                answer = await self._accept(tool, key, body, faults)
        finally:
            if self._keys.in_flight(key):
                self._keys.release(key)
        return answer

    async def _accept(self, tool: str, key: str, body: dict[str, Any], faults: dict[str, Fault]) -> Answer:
        if (processing := faults.get("processing")) is not None:
            await self._sleep((processing.arg or 0) / 1000)
        refused = send_refusal(tool, body, faults.get("fail_before_accept"))
        if refused is not None:
            result, saved = refused
            if saved:
                self._keys.complete(key, result)
            log.info("sandbox_refused tool=%s key=%s saved=%s", tool, key, saved)
            return Reply(result)
        now = self._clock()
        message = self._records.create(_CHANNELS[tool], body, now)
        success = {**message.view(now), "idempotency_key": key}
        self._outbox.append(
            {
                "id": message.id,
                "tool": tool,
                "idempotency_key": key,
                "to": body["to"],
                "status": success["status"],
                "accepted_at": success["created_at"],
                "request": copy.deepcopy(body),
            }
        )
        self._keys.complete(key, dict(MALFORMED_RESULT) if "malformed" in faults else success)
        log.info("sandbox_accepted tool=%s id=%s key=%s", tool, message.id, key)
        if "malformed" in faults:
            success = dict(MALFORMED_RESULT)
        return _spoil(success, faults)

    def _read(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        now = self._clock()
        if tool in _RECORD_TOOLS:
            channel, id_name = _RECORD_TOOLS[tool]
            message = self._records.find(channel, args[id_name])
            return NOT_FOUND if message is None else message.view(now)
        if tool in _LIST_TOOLS:
            return self._records.page(_LIST_TOOLS[tool], now, args)
        handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "get_email_events": self._email_events,
            "get_events": self._events,
            "whoami": lambda _: _whoami(),
            "create_contact": lambda arguments: self._records.add_contact(arguments, now),
        }
        return handlers[tool](args)

    def _email_events(self, args: dict[str, Any]) -> dict[str, Any]:
        message = self._records.find("email", args["email_id"])
        if message is None:
            return NOT_FOUND
        return {"email_id": message.id, "events": message.events(self._clock())}

    def _events(self, args: dict[str, Any]) -> dict[str, Any]:
        now = self._clock()
        limit = int(args.get("limit") or 100)
        if args.get("id") is None:
            kind = args.get("kind")
            events = self._records.all_events(now, None if kind is None else records.channel_named(kind))
        else:
            prefix, _, message_id = str(args["id"]).partition(":")
            channel = records.channel_named(prefix)
            if channel is None or not message_id:
                return {"error": "id must look like email:<uuid>, sms:<uuid> or call:<uuid>"}
            message = self._records.find(channel, message_id)
            if message is None:
                return NOT_FOUND
            events = list(reversed(message.events(now)))
        return records.paginate(events, args.get("cursor"), limit)


def _spoil(result: dict[str, Any], faults: dict[str, Fault]) -> Answer:
    """The answer the caller gets once the work is done, after any answer-spoiling fault."""
    if "drop_after_accept" in faults:
        return Withheld("drop")
    if "hang_after_accept" in faults:
        return Withheld("hang")
    if (gateway := faults.get("error_after_accept")) is not None:
        return Reply(gateway_error(gateway.arg or 502))
    return Reply(result)


def _whoami() -> dict[str, Any]:
    return {
        "org": {"id": records.ORG_ID, "name": "Hail Sandbox"},
        "user": {"id": "5f0c2a9e-8b1d-4f7a-a2c3-7e6d5c4b3a21", "email": "agent@sandbox.hail.test"},
        "api_key": {"name": "sandbox", "prefix": "hail_sbx"},
        "sandbox": True,
    }
