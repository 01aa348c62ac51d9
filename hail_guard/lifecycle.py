"""The state machine of an operation, written once: every legal move, and who may make it.

    planned --approve--> ready --claim--> sending --answer--> accepted | failed | unknown | ready | needs_review
       |                   |                 |--lease runs out--> unknown --reconcile--> accepted | failed
       +--opt-out, cancel--+--> cancelled                            |                   | unknown | needs_review
                                                                     needs_review --operator--> accepted | failed
                                                                                                | cancelled

`MOVES` is the table (docs/reference/states.md, "The moves", is written from it). The state sets the ledgers
guard their writes with (`RECORDABLE`, `CLAIMABLE`, ...) are derived from it, and the ledgers' SQL is written
with those sets (`hail_guard.ledger.sql` fills them in), never with states typed again; the contract suite and
the model-based test check that every event a ledger records is a move of this table. `STATES`, beside it, is
each state's one row of what it is shown as: its phrase, the agent's next step, the headline, the operator's
step, its order and colour, read by the answers, the command line, the console and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from hail_guard.models import State


class Mover(StrEnum):
    """Who makes a move."""

    AGENT_CALL = "agent call"
    """A guarded tool call: it records a new send's intent, or repeats a `ready` one."""
    WORKER = "worker"
    """A batch run or a worker claiming a `ready` send."""
    SENDER = "sender"
    """Whoever holds the claim and forwarded it (an agent call or a worker), recording Hail's answer."""
    RECONCILE = "reconcile"
    LEASE_EXPIRY = "lease expiry"
    """The ledger itself: a claim whose holder died (the request may have left)."""
    PLANNING = "planning"
    """A batch planned by the agent or an operator."""
    OPT_OUT = "opt-out"
    """An opt-out recorded by an operator, the agent or an inbound webhook."""
    OPERATOR = "operator"
    BATCH_CANCEL = "batch cancel"
    """An operator cancelling what a batch has not sent yet (the console's campaigns)."""


@dataclass(frozen=True)
class Move:
    before: State | None
    """None: the operation is created by this move."""
    after: State
    mover: Mover


def _moves(befores: tuple[State | None, ...], afters: tuple[State, ...], mover: Mover) -> tuple[Move, ...]:
    return tuple(Move(before, after, mover) for before in befores for after in afters)


_ANSWERED = (State.ACCEPTED, State.FAILED, State.UNKNOWN, State.READY, State.NEEDS_REVIEW)
_SETTLED_BY_RECONCILE = (State.ACCEPTED, State.FAILED, State.UNKNOWN, State.NEEDS_REVIEW)
MOVES: Final[tuple[Move, ...]] = (
    Move(None, State.SENDING, Mover.AGENT_CALL),
    Move(State.READY, State.SENDING, Mover.AGENT_CALL),
    Move(State.READY, State.SENDING, Mover.WORKER),
    *_moves((State.SENDING,), _ANSWERED, Mover.SENDER),
    Move(State.SENDING, State.UNKNOWN, Mover.LEASE_EXPIRY),
    *_moves((State.UNKNOWN,), _SETTLED_BY_RECONCILE, Mover.RECONCILE),
    *_moves((None,), (State.PLANNED, State.READY), Mover.PLANNING),
    Move(State.PLANNED, State.READY, Mover.OPERATOR),
    *_moves((State.PLANNED, State.READY), (State.CANCELLED,), Mover.OPT_OUT),
    *_moves((State.PLANNED, State.READY), (State.CANCELLED,), Mover.BATCH_CANCEL),
    *_moves((State.NEEDS_REVIEW,), (State.ACCEPTED, State.FAILED, State.CANCELLED), Mover.OPERATOR),
    Move(None, State.READY, Mover.OPERATOR),  # a resend: a new operation
)
"""Every legal move. Nothing else ever changes an operation's state."""


def befores(*movers: Mover) -> frozenset[State]:
    """The states these movers may move an operation out of."""
    return frozenset(m.before for m in MOVES if m.mover in movers and m.before is not None)


def afters(mover: Mover, before: State | None) -> frozenset[State]:
    return frozenset(m.after for m in MOVES if m.mover is mover and m.before is before)


def is_legal(before: State | None, after: State) -> bool:
    """Whether some mover may move an operation from `before` to `after`."""
    return any(m.before is before and m.after is after for m in MOVES)


RECORDABLE: Final = befores(Mover.SENDER, Mover.RECONCILE)
"""Where the holder of a claim records an outcome: `sending` (an answer) and `unknown` (a reconcile)."""
CLAIMABLE: Final = befores(Mover.WORKER)
"""Where a send is taken to be forwarded."""
EXPIRING: Final = befores(Mover.LEASE_EXPIRY)
"""Where a claim's lease can run out."""
CANCELLABLE: Final = befores(Mover.OPT_OUT)
"""Not forwarded yet: an opt-out cancels them."""
APPROVABLE: Final = frozenset(
    m.before for m in MOVES if m.mover is Mover.OPERATOR and m.after is State.READY and m.before is not None
)
REVIEWABLE: Final = frozenset(
    m.before for m in MOVES if m.mover is Mover.OPERATOR and m.after is State.CANCELLED and m.before is not None
)
"""Where an operator decides (and resends)."""
TERMINAL: Final = frozenset(State) - frozenset(m.before for m in MOVES if m.before is not None)
"""No move leaves them."""
UNRESOLVED: Final = frozenset(State) - TERMINAL - CANCELLABLE
"""It may have left, and nobody knows yet what became of it: `sending`, `unknown`, `needs_review`."""
NEVER_REACHED: Final = frozenset({State.FAILED, State.CANCELLED})
"""Hail refused it, or it never left (unless an operator closed it after it may have: `may_have_left`)."""
LIVE: Final = frozenset(State) - NEVER_REACHED
"""It may reach, or may have reached, the recipient."""


OPEN: Final = frozenset(State) - TERMINAL
"""Not settled yet: it waits for someone (an approval, a worker, Hail, reconcile or a human)."""


@dataclass(frozen=True)
class StateRow:
    """Everything a state is shown as, in one row: what answers, the command line and the console read.

    Texts may say `{upstream}` (the upstream's name), `{id}` (the operation) and, in a headline, `{reason}` (the
    operation's `reason` field, else `reason_default`)."""

    phrase: str
    """How an answer names an operation in this state, honest about what it means for the recipient."""
    next_step: str
    """The one safe thing for an agent to do next (a clause: lower case, no full stop)."""
    headline: str | None
    """What happened, for an answer that is not the upstream's own record; None: it is answered with the record."""
    colour: str
    """The console's colour for it (its charts, its legend)."""
    reason: str | None = None
    """The operation field a headline quotes as `{reason}`."""
    reason_default: str = "no reason was given"
    operator_step: str | None = None
    """What an operator does about the sends a batch run left in this state (`{n}` of them, batch `{batch}`)."""


STATES: Final[dict[State, StateRow]] = {
    State.ACCEPTED: StateRow(
        phrase="accepted by {upstream}",
        next_step="done: {upstream} accepted it (delivery is tracked apart); do not send it again",
        headline=None,
        colour="#2e9d62",
    ),
    State.FAILED: StateRow(
        phrase="failed (refused by {upstream})",
        next_step="{upstream} refused it for good: fix the cause, then send a new message (it needs a new key)",
        headline=None,
        colour="#c8423b",
    ),
    State.CANCELLED: StateRow(
        phrase="cancelled before it was sent",
        next_step="nothing to do: it was cancelled before it left",
        headline="NOT SENT: it was cancelled before it left ({reason}).",
        colour="#8a93a3",
        reason="cancel_reason",
    ),
    State.NEEDS_REVIEW: StateRow(
        phrase="waiting for a human decision (it may have been sent)",
        next_step="do not send it again: a human decides (`hail-guard review list`)",
        headline="NEEDS REVIEW: {reason}.",
        colour="#e08a00",
        reason="review_reason",
        reason_default="the outcome stayed unclear",
        operator_step="{n} send(s) need a person to decide: `hail-guard review list`, or the console's review queue",
    ),
    State.UNKNOWN: StateRow(
        phrase="unknown ({upstream} may have sent it)",
        next_step="do NOT resend it, in any form: call `reconcile` with operation_id={id}",
        headline="OUTCOME UNKNOWN: {upstream} may already have sent this message.",
        colour="#f0b400",
        operator_step="{n} send(s) have no known outcome ({upstream} may have sent them): `hail-guard reconcile` "
        "settles them, or run `hail-guard batch run {batch}` again later (it reconciles first); never send them "
        "another way",
    ),
    State.SENDING: StateRow(
        phrase="being sent right now",
        next_step="do not send it again: call `get_operation` with operation_id={id} in a minute",
        headline="IN FLIGHT: this message is being sent right now.",
        colour="#4a78d8",
        operator_step="{n} send(s) are being sent by another process: `hail-guard batch status {batch}` shows them "
        "settle",
    ),
    State.READY: StateRow(
        phrase="waiting to be sent",
        next_step="call again later with the same arguments (the same key is safe)",
        headline="NOT SENT YET: {reason}.",
        colour="#9db8f0",
        reason="last_error",
        reason_default="{upstream} asked to wait",
    ),
    State.PLANNED: StateRow(
        phrase="planned, waiting for approval",
        next_step="wait for an operator to approve the batch (`hail-guard batch approve`)",
        headline="NOT SENT YET: the send is planned and waits for approval.",
        colour="#cfd6e4",
    ),
}
"""Every state's row, in the order a batch's progress shows them: settled first, then what is in flight, then what
waits. A new state gets its moves in `MOVES` and its row here."""
