"""Operations, their states and events, and what an upstream answer means.

An operation is one logical send with one idempotency key for its whole life. Its state moves
along the machine in docs/explanation/states.md; every move is an `Event`. `Answer` is what Hail said, sorted into
an `AnswerKind`; `Outcome` is what the ledger records because of it. Delivery (what happened after
Hail accepted it) is tracked apart: `DeliveryState`, `DeliveryObservation`, `DeliveryEvent`, and
the signed `Webhook`s that report it.
"""

from __future__ import annotations

import json
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict


class State(StrEnum):
    PLANNED = "planned"
    READY = "ready"
    SENDING = "sending"
    ACCEPTED = "accepted"
    FAILED = "failed"
    UNKNOWN = "unknown"
    NEEDS_REVIEW = "needs_review"
    CANCELLED = "cancelled"


class DeliveryState(StrEnum):
    """What happened to a message after Hail accepted it (see `hail_guard.delivery` for their order)."""

    DELIVERY_DELAYED = "delivery_delayed"
    DELIVERED = "delivered"
    OPENED = "opened"
    COMPLAINED = "complained"
    BOUNCED = "bounced"
    UNDELIVERED = "undelivered"
    FAILED = "failed"
    COMPLETED = "completed"
    BUSY = "busy"
    NO_ANSWER = "no_answer"
    CANCELED = "canceled"


class Intent(BaseModel):
    """A send the guard wants recorded before anything is forwarded."""

    model_config = ConfigDict(frozen=True)

    idempotency_key: str
    tool: str
    channel: str
    recipients: tuple[str, ...]
    """Everyone it reaches (to, cc, bcc, ...), each once, in the one normal form (`hail_guard.recipients`)."""
    request: str
    """Canonical JSON of the arguments exactly as forwarded (the key included)."""
    request_fingerprint: str
    content_fingerprint: str
    """What the message says, by meaning (`same_send.content_fingerprint`): how a regenerated retry is
    recognised."""
    sender: str = "{}"
    """The sender fields it gives, normalised, as canonical JSON (`same_send.sender_of`)."""
    campaign_id: str | None = None
    lead_id: str | None = None
    message_id: str | None = None
    batch_id: str | None = None
    lead: str | None = None
    """Who it is for in the caller's records (`same_send.lead_of`): a send to a lead with an unresolved send
    waits."""
    allow_duplicate: bool = False
    """Not stored: lets a deliberate repeat of earlier content through the duplicate guard."""
    legacy_key: str | None = None
    """Not stored: the key an earlier version derived for this send (`keys.legacy_key`), looked up too."""
    text: str = ""
    """Not stored: the message as one text (`same_send.message_text`), compared for near-same messages."""


class Operation(BaseModel):
    """One row of the ledger."""

    id: str
    idempotency_key: str
    tool: str
    channel: str
    recipients: list[str]
    request: str
    request_fingerprint: str
    content_fingerprint: str
    sender: dict[str, str] = {}
    campaign_id: str | None = None
    lead_id: str | None = None
    message_id: str | None = None
    batch_id: str | None = None
    lead: str | None = None
    state: State
    provider_id: str | None = None
    result: dict[str, Any] | None = None
    last_error: str | None = None
    review_reason: str | None = None
    cancel_reason: str | None = None
    attempts: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    not_before: datetime | None = None
    next_check_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    first_sent_at: datetime | None = None
    delivery_state: DeliveryState | None = None
    """What Hail reported after acceptance (None: nothing yet); the `state` never changes because of it."""
    delivery_at: datetime | None = None
    """When the current delivery state happened (as its source said, else when it was recorded)."""
    delivery_checks: int = 0
    delivery_next_check_at: datetime | None = None
    resend_of: str | None = None
    """The operation an operator resent as this one (`hail-guard review resend`)."""
    resent_as: str | None = None
    """The operation that superseded this one when an operator resent it."""
    may_have_left: bool = False
    """Closed (`failed` or `cancelled`) by an operator while it may have been sent: it still counts as
    sent for the duplicate guard, and its answers say so. False for a send cancelled before it left."""

    def arguments(self) -> dict[str, Any]:
        """The stored request, as the arguments that were (or will be) forwarded."""
        value: dict[str, Any] = json.loads(self.request)
        return value


class DeliveryObservation(BaseModel):
    """One delivery fact from a source: a polled record or a webhook."""

    model_config = ConfigDict(frozen=True)

    state: DeliveryState
    occurred_at: datetime | None = None
    """As the source says; None when it gives no time."""
    source: str
    """`poll` or `webhook`."""
    detail: str | None = None
    """E.g. the webhook delivery id, or the tool that was polled."""


class DeliveryEvent(BaseModel):
    """A delivery state an operation reached, first seen at `recorded_at` (one per state)."""

    operation_id: str
    state: DeliveryState
    occurred_at: datetime | None
    recorded_at: datetime
    source: str
    detail: str | None = None


class WebhookOutcome(StrEnum):
    """What a signed webhook did (each delivery id counts once)."""

    APPLIED = "applied"
    """A delivery event of a known operation was recorded."""
    OPTED_OUT = "opted_out"
    """An inbound opt-out word: the sender was suppressed."""
    PARKED = "parked"
    """No operation has this provider id yet (a send whose answer was lost): kept, and applied when its id is
    recorded (an outcome, a reconcile, a review decision)."""
    UNKNOWN_OPERATION = "unknown_operation"
    """No operation has this provider id, and no more can be kept waiting for one: recorded for audit only."""
    IGNORED = "ignored"
    """An event type that carries no delivery state (recorded for audit)."""
    DUPLICATE = "duplicate"
    """This `X-Hail-Delivery` was processed before: nothing changed."""
    REPLAYED = "replayed"
    """This exact signature was accepted before: a replayed request, refused; nothing changed."""


class Event(BaseModel):
    """One transition in an operation's history."""

    operation_id: str
    at: datetime
    from_state: State | None
    to_state: State
    actor: str
    reason: str


class AnswerKind(StrEnum):
    """What an upstream answer means for the send (docs/explanation/hail.md, "How hail-guard sorts an answer")."""

    ACCEPTED = "accepted"
    """A record with an id: Hail took the request."""
    REFUSED = "refused"
    """A definitive refusal that Hail saved under the key (consent, validation, credit...)."""
    STILL_PROCESSING = "still_processing"
    KEY_CONFLICT = "key_conflict"
    RETRY_LATER = "retry_later"
    """Nothing was saved upstream (rate limit, auth, released call key): the same key is safe later."""
    GATEWAY_ERROR = "gateway_error"
    """A 5xx that may hide a saved failure or a lost success."""
    LOST = "lost"
    """No usable answer: timeout, cancel, dropped connection, isError, malformed."""
    MISREAD_SUCCESS = "misread_success"
    """A validation-shaped error naming a field that is not in the request."""
    UNRECOGNISED = "unrecognised"


class Answer(BaseModel):
    """An upstream answer, sorted."""

    kind: AnswerKind
    result: dict[str, Any] | None = None
    provider_id: str | None = None
    error: str | None = None
    retry_after_seconds: float | None = None


class Outcome(BaseModel):
    """What the ledger records after an attempt."""

    state: State
    reason: str
    provider_id: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    not_before_seconds: float | None = None
    """For `ready`: wait this long before the next attempt."""
    check_after_seconds: float | None = None
    """For `unknown`: reconcile again no sooner than this."""
    review_reason: str | None = None
    attempted: bool = True
    """False when the claim behind it made no attempt (Hail unreachable): reconcile's count gives it back."""


SUPPRESSION_CHANNELS = ("email", "sms", "call", "all")


class Suppression(BaseModel):
    """An opt-out: never send to this recipient on this channel (or on any, with `all`)."""

    recipient: str
    channel: str = "all"
    reason: str
    source: str
    created_at: datetime | None = None


class Webhook(BaseModel):
    """A verified webhook, ready for the ledger."""

    model_config = ConfigDict(frozen=True)

    delivery_id: str
    signature: str
    event_type: str
    provider_id: str | None
    payload: str
    """The body as received."""
    observation: DeliveryObservation | None = None
    opt_out: Suppression | None = None


class PruneReport(BaseModel):
    operations: int
    events: int
    webhook_deliveries: int


class HeldSend(BaseModel):
    """A `ready` send that waits: a recipient (or its lead) has an unresolved send (`held_by`)."""

    operation: Operation
    held_by: Operation


class BatchStatus(BaseModel):
    batch_id: str
    name: str | None
    counts: dict[State, int]
    unresolved: list[Operation]
    """Operations a human or reconcile still has to settle (sending, unknown, needs_review)."""
    held: list[HeldSend] = []
    """`ready` sends that wait for another send to the same recipient (or lead) to be settled (the first 100)."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class BatchSummary(BaseModel):
    """A batch as `hail-guard batch list` shows it: when it was planned and its counts by state."""

    batch_id: str
    name: str | None
    created_at: datetime
    counts: dict[State, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class ToolPin(BaseModel):
    """An upstream tool as last seen and as last accepted (MCP "rug pull" defence)."""

    name: str
    fingerprint: str
    accepted_fingerprint: str
    first_seen_at: datetime
    changed_at: datetime | None = None

    @property
    def changed(self) -> bool:
        return self.fingerprint != self.accepted_fingerprint


class HourOfSends(BaseModel):
    """What left in one hour (by the time it was first sent), and what became of it so far."""

    start: datetime
    sent: int
    states: dict[State, int]
    deliveries: dict[DeliveryState, int]
