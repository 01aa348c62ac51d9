"""The state machine of an operation, written once: every legal move, and who may make it.

    planned --approve--> ready --claim--> sending --answer--> accepted | failed | unknown | ready | needs_review
       |                   |                 |--lease runs out--> unknown --reconcile--> accepted | failed
       +--opt-out, cancel--+--> cancelled                            |                   | unknown | needs_review
                                                                     needs_review --operator--> accepted | failed
                                                                                                | cancelled

`MOVES` is the table (docs/reference/states.md, "The moves", is written from it). The state sets the ledgers
guard their writes with (`RECORDABLE`, `CLAIMABLE`, ...) are derived from it, and the ledgers' SQL is written
with those sets (`sql_list`), never with states typed again; the contract suite and the model-based test check that
every event a ledger records is a move of this table.
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


def sql_list(states: frozenset[State]) -> str:
    """A state set as an SQL list, for the named SQL of both ledgers: `('sending', 'unknown')`."""
    return "(" + ", ".join(f"'{state.value}'" for state in sorted(states)) + ")"


def sql_one(states: frozenset[State]) -> str:
    """A set of one state as an SQL value, where a partial index needs `state = '...'` (SQLite does not read
    `state IN ('...')` as the index's condition)."""
    [state] = states
    return f"'{state.value}'"


SQL_SETS: Final[dict[str, str]] = {
    "claimable_state": sql_one(CLAIMABLE),
    "recordable": sql_list(RECORDABLE),
    "claimable": sql_list(CLAIMABLE),
    "expiring": sql_list(EXPIRING),
    "cancellable": sql_list(CANCELLABLE),
    "approvable": sql_list(APPROVABLE),
    "reviewable": sql_list(REVIEWABLE),
    "terminal": sql_list(TERMINAL),
    "unresolved": sql_list(UNRESOLVED),
}
"""The names a ledger's named SQL uses for state sets (`{recordable}`), filled in once when it is loaded."""
