"""The ledger's roles: one protocol per part of the program that uses it, and `Ledger`, all of them.

Each part is given the role it uses (`guard.Guard` is given `Sending`, the tracker `Tracking`, the web
app's webhook receiver `Tracking` and `Upkeep`...), so what a part may do to the ledger is read off its
signature. Both backends (`sqlite.SqliteLedger`, `postgres.PostgresLedger`) play every role; the
contract suite runs over both. The values the roles pass that are the ledger's own (`Begin`,
`ConsoleSession`, `Heartbeat`) live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from hail_guard.models import (
    BatchStatus,
    BatchSummary,
    DeliveryEvent,
    DeliveryObservation,
    Event,
    HourOfSends,
    Intent,
    Operation,
    Outcome,
    PruneReport,
    State,
    Suppression,
    ToolPin,
    Webhook,
    WebhookOutcome,
)
from hail_guard.same_send import Candidates, Rules

Where = Callable[[int], str]
"""How a batch names its send at a position (from 1) in a refusal: `send 3`, or a file's `line 4`."""


def send_at(position: int) -> str:
    """A send named by its position in the batch (`plan_batch`'s default `where`)."""
    return f"send {position}"


@dataclass(frozen=True)
class Plan:
    """A batch being planned, as `plan_batch` was asked: what each backend's planning is given beside the sends."""

    batch_id: str
    name: str | None
    state: State
    actor: str
    rules: Rules
    where: Where


@dataclass(frozen=True)
class Begin:
    """What `begin_send` found: either a claim to forward, or an existing operation to answer from."""

    operation: Operation
    claimed: bool
    """True: `sending` is committed under our lease and the request must now be forwarded."""


@dataclass(frozen=True)
class ConsoleSession:
    """An operator signed in to the console (`hail_guard.console.auth`), as the ledger keeps it."""

    name: str
    """Who every decision of the session is recorded as."""
    created_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class Heartbeat:
    """Someone sending from the ledger now: a worker, a `batch run`, or a `serve` draining a batch."""

    id: str
    who: str
    """The process: `host:pid`."""
    role: str
    """`worker`, `batch run` or `serve`."""
    batch_id: str | None = None
    """The batch it sends, or None for every batch."""
    started_at: datetime | None = None
    """Its first beat (the database's clock); None until recorded."""
    seen_at: datetime | None = None
    """Its last beat: one that stops beating (a process killed) goes stale."""


class Records(Protocol):
    """What every role may read: the clock, an operation, its events (each role below extends it)."""

    async def now(self) -> datetime:
        """The database's clock."""

    async def get(self, operation_id: str) -> Operation:
        """The operation, or `NotFound`."""

    async def find_by_key(self, idempotency_key: str) -> Operation | None: ...

    async def list_operations(
        self,
        *,
        state: State | None = None,
        campaign_id: str | None = None,
        batch_id: str | None = None,
        recipient: str | None = None,
        since: datetime | None = None,
        before: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        """Newest first. `recipient` is compared normalised; `since` bounds `created_at`; `before` (an
        operation id) continues a listing after that operation, for paging through everything."""

    async def events(self, operation_id: str) -> list[Event]: ...


class Sending(Records, Protocol):
    """The send path (`guard.Guard`): record an intent before it leaves, its outcome after, claims for
    reconcile and for batches, and what the rules about the same send and opt-outs read."""

    async def begin_send(self, intent: Intent, *, owner: str, lease_seconds: float, rules: Rules = ...) -> Begin:
        """Record the intent as `sending` under a lease, atomically with the key lookup.

        The key's operation (or the one under the key an earlier version derived, `Intent.legacy_key`) is
        answered from when it is the same message, and claimed when it is `ready` and its recipients are not
        held; another message under the key is returned unclaimed (the caller refuses it). A new key is refused
        (`Suppressed`) when a recipient opted out; otherwise the rules about the same send decide, in the same
        transaction (`policy.decide` over what `same_send` compares): answered from the operation that has the
        same message, refused (`ProbableDuplicate`, `Held`), or recorded.
        """

    async def record_outcome(self, operation_id: str, *, owner: str, outcome: Outcome, actor: str) -> Operation:
        """Fenced: only the holder of the current claim (`owner`) may record; else `LeaseLost`."""

    async def claim_unknown(
        self,
        *,
        owner: str,
        lease_seconds: float,
        operation_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
    ) -> list[Operation]:
        """Claim `unknown` operations for reconcile: one by id, or every one that is due."""

    async def claim_ready(
        self, *, owner: str, lease_seconds: float, batch_id: str | None = None, limit: int = 1, hold_lead: bool = True
    ) -> list[Operation]:
        """Atomically take `ready` operations whose recipients have not opted out and are not held (a recipient key
        with an unresolved send on the channel, or with `hold_lead` the lead with one on any): `sending` under a
        lease, oldest first. A held send stays `ready` until what holds it is settled."""

    async def same_send_candidates(self, intent: Intent, rules: Rules) -> Candidates:
        """What the ledger holds that is the same message to one of the send's recipients, or holds them (reads
        only: how a retry whose new form its schema refuses is still answered from the ledger)."""

    async def is_suppressed(self, recipients: Sequence[str], channel: str) -> bool: ...


class Batching(Records, Protocol):
    """Batches as plans (`batch.Batches`, the operator's approvals and cancellations)."""

    async def plan_batch(
        self,
        *,
        batch_id: str,
        name: str | None,
        intents: Iterable[Intent],
        state: State,
        actor: str,
        rules: Rules = ...,
        where: Where = ...,
    ) -> int:
        """Record a whole batch (`planned` or `ready`) or nothing; returns how many sends it holds.

        `intents` is read once, a chunk at a time (it may be a generator over a large file, and may raise
        `BadInput` part-way: then nothing is planned). Refused when a key is already in the ledger, or when a
        send repeats a message a recipient has (`same_send`), naming the send as `where` does (`send_at`: its
        position); sends to opted-out recipients start `cancelled`.
        A recipient's unresolved send does not refuse a plan: it holds the planned send when it is claimed."""

    async def approve_batch(self, batch_id: str, *, actor: str) -> int:
        """`planned` -> `ready` for the batch; returns how many."""

    async def batch_status(self, batch_id: str, *, hold_lead: bool = True) -> BatchStatus:
        """The batch's counts by state, its unresolved sends, and its `ready` sends that are held (with `hold_lead`,
        by their lead's unresolved send too) and what holds each."""

    async def list_batches(self, *, after: str | None = None, limit: int = 50) -> list[BatchSummary]:
        """Batches, newest first, each with its counts by state; `after` (a batch id) continues after it."""

    async def cancel_batch(self, batch_id: str, *, reason: str, actor: str) -> list[str]:
        """Cancel the batch's sends that were not forwarded (`planned`, `ready`), with events; their ids."""


class OptOuts(Records, Protocol):
    """Opt-outs: recorded, lifted and listed; a recorded one cancels what was not forwarded."""

    async def add_suppression(self, suppression: Suppression, *, actor: str) -> list[str]:
        """Record an opt-out and cancel every unforwarded operation to that recipient; returns their ids."""

    async def remove_suppression(self, recipient: str, channel: str) -> bool: ...

    async def list_suppressions(self) -> list[Suppression]: ...

    async def search_suppressions(
        self, *, prefix: str | None = None, after: tuple[str, str] | None = None, limit: int = 100
    ) -> list[Suppression]:
        """Opt-outs by recipient (those starting with `prefix`, normalised), after (recipient, channel)."""

    async def opt_out_cancellations(self, recipient: str, channel: str, *, limit: int = 20) -> list[Operation]:
        """Sends to `recipient` (or a sub-address of it) on `channel` cancelled by an opt-out, newest first."""


class Tracking(Records, Protocol):
    """Acceptance kept apart from delivery: the tracker's polls and the webhooks' events."""

    async def record_delivery(
        self,
        operation_id: str,
        observations: Sequence[DeliveryObservation],
        *,
        next_check_seconds: float | None = None,
    ) -> Operation:
        """Record delivery facts: each state once as a `DeliveryEvent`; the current delivery state moves only
        forward (`delivery.settle`); the operation's `state` never changes. With `next_check_seconds` (a
        poll), the check is counted and the next one scheduled."""

    async def claim_delivery_checks(
        self, *, channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int = 50
    ) -> list[Operation]:
        """Accepted operations of `channels` with a provider id, delivery not settled, first sent within
        `max_age_seconds` and due for a check; held `hold_seconds` so that other trackers skip them."""

    async def delivery_events(self, operation_id: str) -> list[DeliveryEvent]:
        """Delivery events, oldest recorded first."""

    async def record_webhook(self, webhook: Webhook) -> WebhookOutcome:
        """In one transaction: refuse a seen signature (`REPLAYED`), count a delivery id once (`DUPLICATE`),
        then suppress an opt-out's sender, or apply the delivery event to the operation with the provider id.
        An event for an id no operation has yet is kept (`PARKED`, a bounded number, for as long as its delivery
        id is remembered) and applied in the transaction that records that id: `record_outcome`, or
        `resolve_review` with a provider id. Nothing changes for `REPLAYED` and `DUPLICATE`."""


class Reviewing(Records, Protocol):
    """An operator's decisions on what stayed unclear (`review`)."""

    async def resolve_review(
        self, operation_id: str, *, state: State, reason: str, actor: str, provider_id: str | None = None
    ) -> Operation:
        """An operator's decision on a `needs_review` operation (`accepted`, `failed` or `cancelled`), with
        an event naming who and why; refused (`RefusedByPolicy`) for an operation not in review."""

    async def resend(self, operation_id: str, intent: Intent, *, reason: str, actor: str) -> Operation:
        """Supersede a `needs_review` operation by a new one (`intent`, a new key): the new operation is
        recorded `ready` with `resend_of`, the old one `cancelled` with `resent_as`, both with events;
        refused when the old one is not in review, the key exists, or a recipient opted out."""


class ToolPins(Records, Protocol):
    """The upstream's tools as accepted, and each definition seen (`hail-guard upstream accept`)."""

    async def observe_tools(self, fingerprints: Mapping[str, str]) -> list[ToolPin]:
        """Record each upstream tool's fingerprint as seen now; a tool seen first is accepted as is."""

    async def accept_tools(self, names: Sequence[str] | None = None) -> list[str]:
        """Accept the current look of changed tools (all, or those named); returns the names accepted."""

    async def tool_pins(self) -> list[ToolPin]: ...

    async def remember_tool_definitions(self, definitions: Mapping[str, str]) -> None:
        """Keep each upstream tool definition (canonical JSON) under its fingerprint, so a change can be shown."""

    async def tool_definitions(self, fingerprints: Sequence[str]) -> dict[str, str]:
        """The definitions kept for these fingerprints (those known)."""


class Overview(Records, Protocol):
    """What the operator sees at a glance (the console, `status`, metrics); every list walks an index."""

    async def count_by_state(self) -> dict[State, int]: ...

    async def count_states(self, states: Sequence[State]) -> dict[State, int]:
        """How many operations are in each of these states (those with none left out): one index range each,
        so the states that hold few (the unresolved ones) are counted at once whatever the ledger's size."""

    async def oldest(self, state: State) -> Operation | None: ...

    async def sends_by_hour(self, since: datetime) -> list[HourOfSends]:
        """What first left in each hour from the one starting at `since` (a whole UTC hour) on, oldest first: how
        many, by state and by delivery state now. Hours without a send are left out. Kept by the database as it
        writes, so this reads a small table, never the operations."""

    async def search_operations(
        self,
        *,
        key_prefix: str | None = None,
        state: State | None = None,
        campaign_id: str | None = None,
        batch_id: str | None = None,
        recipient: str | None = None,
        since: datetime | None = None,
        after: str | None = None,
        limit: int = 50,
    ) -> list[Operation]:
        """Operations matching every filter given, newest first (by key with `key_prefix`); `recipient`
        (normalised) is one of an operation's recipients; `after` (an operation id) continues after it."""


class Upkeep(Records, Protocol):
    """Keeping the ledger: expired leases, pruning, backups, its check, closing."""

    async def expire_leases(self) -> int:
        """Turn every `sending` operation whose lease has run out into `unknown`."""

    async def prune(self, *, older_than_seconds: float) -> PruneReport:
        """Delete resolved operations (accepted, failed, cancelled) untouched for `older_than_seconds`, with
        their events; never an unresolved one. Old processed webhook deliveries go too."""

    async def backup(self, path: str) -> int:
        """Copy the ledger, online, to a new file at `path`; returns the operations it holds."""

    async def verify(self) -> None:
        """Check that the ledger's storage is whole, or raise `LedgerUnavailable` naming the damage (SQLite reads
        every page: `PRAGMA quick_check`; PostgreSQL checks its own pages as it reads them)."""

    async def aclose(self) -> None: ...


class Sessions(Records, Protocol):
    """Console sign-ins, shared by every `serve` on the ledger."""

    async def start_session(self, digest: str, *, name: str, seconds: float) -> None:
        """Keep a console sign-in under `digest` (a hash of its id: never the id) for `seconds`; expired ones go."""

    async def find_session(self, digest: str) -> ConsoleSession | None:
        """The sign-in kept under `digest`, unless it expired or ended."""

    async def end_session(self, digest: str) -> None:
        """End a sign-in (signing out): from now on no `serve` sharing the ledger knows it."""


class Heartbeats(Records, Protocol):
    """Who is sending now (workers, `batch run`, a `serve` draining a batch)."""

    async def record_heartbeat(self, beat: Heartbeat) -> None:
        """`beat` is alive now (the database's clock); its first beat is its start. Beats silent a day go."""

    async def end_heartbeat(self, beat_id: str) -> None:
        """The sender stopped: its heartbeat goes."""

    async def heartbeats(self) -> list[Heartbeat]:
        """Every heartbeat, the earliest started first (a stale one's process may have died)."""


class Ledger(
    Sending, Batching, OptOuts, Tracking, Reviewing, ToolPins, Overview, Upkeep, Sessions, Heartbeats, Protocol
):
    """Every role: what a backend implements, and what the edge (`app`, the CLI, the console) opens."""
