"""Hail's webhooks: the signature check, and what each event means, before the ledger records it.

    POST /webhooks/hail                            served by `web.py` on the HTTP transport
    X-Hail-Signature: t=<unix seconds>,v1=<hex>    v1 = HMAC-SHA256(secret, "<t>.<raw body>")
    X-Hail-Delivery:  <id>                         stable across Hail's retries

`receive` turns one request into a `Webhook`, or refuses it (`WebhookRefused`, nothing recorded):
401 for a missing, malformed or wrong signature, and for a timestamp further than the tolerance
from now; 400 for a missing delivery id, a body that is not a JSON object with a `type`, or one
nested deeper than `nesting.MAX_DEPTH` (checked before it is parsed). Several
`v1=` values are allowed (a secret being rotated): any one may match. The ledger then refuses a
signature it accepted before (a replayed request: 401) and counts each delivery id once, so a
retry is answered 200 and changes nothing (`Ledger.record_webhook`).

The body accepted (Hail's exact payload is not in our documents; extra fields are ignored):

    {"type": "email.bounced", "data": {"id": "<Hail's message id>", "occurred_at": "<ISO 8601>"}}

- `type` one of `delivery.EVENT_TYPES` (`email.delivered`, `sms.undelivered`, `call.no_answer`...):
  a delivery event for the operation whose provider id is `data.id`. When no operation has that id
  yet (a send whose answer was lost is `unknown`, its id not known), the event is kept (`parked`) and
  applied when reconcile, a late answer or an operator's decision records the id;
- `sms.received` with `data.from` (or `from_number`) and `data.body`: a body that is an opt-out
  word (`delivery.OPT_OUT_WORDS`) suppresses the sender on SMS, in the one normal form
  (`recipients`). A sender that is not a phone number in it is refused loudly (`UnreadableOptOut`,
  422): the webhook is kept, without the opt-out, for an operator to review;
- anything else is recorded and ignored.
The event's time is `data.occurred_at`, else `occurred_at` or `created_at` at the top level.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from hail_guard import delivery, nesting
from hail_guard.errors import WebhookRefused
from hail_guard.models import DeliveryObservation, Suppression, Webhook
from hail_guard.recipients import BadRecipient, normalise_recipient

SIGNATURE_HEADER: Final = "x-hail-signature"
DELIVERY_HEADER: Final = "x-hail-delivery"
MAX_DELIVERY_ID_LENGTH: Final = 200
_SENDER_FIELDS: Final = ("from", "from_number", "from_")


class UnreadableOptOut(WebhookRefused):
    """An SMS opt-out from a sender that is not a phone number hail-guard can read, so nobody can be suppressed:
    refused (422, so that Hail shows it failed and retries it), and `webhook` (the same, without the opt-out) is
    to be kept for an operator to review."""

    def __init__(self, message: str, webhook: Webhook) -> None:
        super().__init__(message, status=422)
        self.webhook = webhook


def sign(secret: str, body: bytes, timestamp: int) -> str:
    """The `X-Hail-Signature` value for `body` at `timestamp` (what Hail sends; tests and tools use it)."""
    return f"t={timestamp},v1={_digest(secret, str(timestamp), body)}"


def receive(secret: str, body: bytes, headers: Mapping[str, str], *, now: float, tolerance_seconds: float) -> Webhook:
    """Verify one request and read it; `WebhookRefused` says why it is not taken."""
    signature = verify(secret, body, headers.get(SIGNATURE_HEADER), now=now, tolerance_seconds=tolerance_seconds)
    return parse(body, delivery_id=_delivery_id(headers.get(DELIVERY_HEADER)), signature=signature)


def verify(secret: str, body: bytes, header: str | None, *, now: float, tolerance_seconds: float) -> str:
    """The matching signature (hex), or `WebhookRefused` (401): missing, malformed, wrong, or stale."""
    if not header:
        raise WebhookRefused("no X-Hail-Signature header")
    fields = [part.strip().partition("=") for part in header.split(",")]
    stamps = [value for name, _, value in fields if name == "t"]
    offered = [value for name, _, value in fields if name == "v1"]
    if len(stamps) != 1 or not stamps[0].isdigit() or not offered:
        raise WebhookRefused("a malformed X-Hail-Signature header: expected t=<unix seconds>,v1=<hex>")
    expected = _digest(secret, stamps[0], body)
    if not any(hmac.compare_digest(value.encode(), expected.encode()) for value in offered):
        raise WebhookRefused("the signature does not match the body")
    age = now - int(stamps[0])
    if abs(age) > tolerance_seconds:
        raise WebhookRefused(f"a stale signature: signed {age:.0f} s from now, beyond {tolerance_seconds:g} s")
    return expected


def parse(body: bytes, *, delivery_id: str, signature: str) -> Webhook:
    """What a verified body means (see the module docstring); 400 for one that cannot be read."""
    if nesting.too_deep(body):
        raise WebhookRefused(f"the body nests deeper than {nesting.MAX_DEPTH} levels of arrays and objects", status=400)
    try:
        payload = json.loads(body)
    except ValueError:
        raise WebhookRefused("the body is not JSON", status=400) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
        raise WebhookRefused('the body must be a JSON object with a "type"', status=400)
    given = payload.get("data")
    data: dict[str, Any] = given if isinstance(given, dict) else {}
    event_type: str = payload["type"]
    provider_id = data.get("id") if isinstance(data.get("id"), str) and data.get("id") else None
    state = delivery.EVENT_TYPES.get(event_type)
    observation = None
    if state is not None:
        observation = DeliveryObservation(
            state=state, occurred_at=_occurred_at(payload, data), source="webhook", detail=delivery_id
        )
    hook = Webhook(
        delivery_id=delivery_id,
        signature=signature,
        event_type=event_type,
        provider_id=provider_id,
        payload=body.decode("utf-8", errors="replace"),
        observation=observation,
    )
    if event_type != delivery.SMS_RECEIVED:
        return hook
    try:
        return hook.model_copy(update={"opt_out": _opt_out(data, delivery_id)})
    except BadRecipient as exc:
        word = delivery.opt_out_word(data.get("body"))
        raise UnreadableOptOut(
            f'an SMS opt-out ("{word}") whose sender cannot be read, so nobody was suppressed: {exc}. The webhook is '
            "kept for review: find the number and add it with "
            '`hail-guard suppress add NUMBER --channel sms --reason "replied STOP by SMS"`',
            hook,
        ) from None


def _digest(secret: str, timestamp: str, body: bytes) -> str:
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def _delivery_id(value: str | None) -> str:
    if not value or len(value) > MAX_DELIVERY_ID_LENGTH or not value.isprintable() or any(c.isspace() for c in value):
        raise WebhookRefused(
            f"X-Hail-Delivery must be a printable id of at most {MAX_DELIVERY_ID_LENGTH} characters", status=400
        )
    return value


def _occurred_at(payload: Mapping[str, Any], data: Mapping[str, Any]) -> datetime | None:
    for value in (data.get("occurred_at"), payload.get("occurred_at"), payload.get("created_at")):
        if (moment := delivery.parse_time(value)) is not None:
            return moment
    return None


def _opt_out(data: Mapping[str, Any], delivery_id: str) -> Suppression | None:
    word = delivery.opt_out_word(data.get("body"))
    senders = [data[name] for name in _SENDER_FIELDS if isinstance(data.get(name), str) and data[name].strip()]
    if word is None or not senders:
        return None
    return Suppression(
        recipient=normalise_recipient(senders[0], "sms"),
        channel="sms",
        reason=f'replied "{word}" by SMS',
        source=f"hail webhook sms.received {delivery_id}",
    )
