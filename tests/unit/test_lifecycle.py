"""The state machine of an operation (`hail_guard.lifecycle`), read against its diagram written out here."""

from __future__ import annotations

import pytest

from hail_guard import lifecycle
from hail_guard.ledger.sql import STATE_SETS, sql_list, sql_one
from hail_guard.lifecycle import (
    APPROVABLE,
    CANCELLABLE,
    CLAIMABLE,
    EXPIRING,
    LIVE,
    MOVES,
    NEVER_REACHED,
    RECORDABLE,
    REVIEWABLE,
    TERMINAL,
    UNRESOLVED,
    Move,
    Mover,
    afters,
    befores,
    is_legal,
)
from hail_guard.models import State

P, R, S, A, F, U, N, C = (
    State.PLANNED,
    State.READY,
    State.SENDING,
    State.ACCEPTED,
    State.FAILED,
    State.UNKNOWN,
    State.NEEDS_REVIEW,
    State.CANCELLED,
)
DIAGRAM = {
    (None, S), (R, S),  # an agent's call, a worker's claim
    (S, A), (S, F), (S, U), (S, R), (S, N),  # Hail's answer (and a lease that ran out: unknown)
    (U, A), (U, F), (U, U), (U, N),  # reconcile
    (None, P), (None, R),  # planning (and an operator's resend: ready)
    (P, R),  # approval
    (P, C), (R, C),  # an opt-out, a batch cancelled
    (N, A), (N, F), (N, C),  # an operator's decision
}  # fmt: skip
"""Every move of the module docstring's diagram, and no other."""


@pytest.mark.parametrize("before", [None, *State])
def test_a_move_is_legal_exactly_when_the_diagram_draws_it(before: State | None) -> None:
    for after in State:
        assert is_legal(before, after) is ((before, after) in DIAGRAM), (before, after)


def test_the_table_holds_each_move_of_the_diagram_and_who_makes_it() -> None:
    assert {(move.before, move.after) for move in MOVES} == DIAGRAM
    assert Move(U, A, Mover.RECONCILE) in MOVES
    assert Move(S, U, Mover.LEASE_EXPIRY) in MOVES
    assert Move(N, C, Mover.OPERATOR) in MOVES
    assert Move(R, C, Mover.BATCH_CANCEL) in MOVES


def test_moves_are_written_as_every_before_to_every_after() -> None:
    assert lifecycle._moves((P, R), (C,), Mover.OPT_OUT) == (Move(P, C, Mover.OPT_OUT), Move(R, C, Mover.OPT_OUT))
    assert lifecycle._moves((S,), (A, F), Mover.SENDER) == (Move(S, A, Mover.SENDER), Move(S, F, Mover.SENDER))
    assert lifecycle._moves((), (A,), Mover.SENDER) == ()


def test_the_states_each_mover_moves_out_of() -> None:
    assert befores(Mover.WORKER) == {R}
    assert befores(Mover.SENDER, Mover.RECONCILE) == {S, U}
    assert befores(Mover.PLANNING) == frozenset()  # it only creates
    assert befores(Mover.OPERATOR) == {P, N}
    assert befores() == frozenset()


def test_the_states_a_mover_moves_into() -> None:
    assert afters(Mover.SENDER, S) == {A, F, U, R, N}
    assert afters(Mover.PLANNING, None) == {P, R}
    assert afters(Mover.OPERATOR, N) == {A, F, C}
    assert afters(Mover.OPERATOR, None) == {R}
    assert afters(Mover.WORKER, S) == frozenset()


def test_the_state_sets_the_ledgers_guard_their_writes_with() -> None:
    assert tuple(map(frozenset, ({S, U}, {R}, {S}, {P, R}))) == (RECORDABLE, CLAIMABLE, EXPIRING, CANCELLABLE)
    assert tuple(map(frozenset, ({P}, {N}, {A, F, C}))) == (APPROVABLE, REVIEWABLE, TERMINAL)
    assert frozenset({S, U, N}) == UNRESOLVED
    assert (frozenset({F, C}), frozenset({P, R, S, A, U, N})) == (NEVER_REACHED, LIVE)


def test_a_state_set_is_written_as_sql() -> None:
    assert sql_list(frozenset({U, S})) == "('sending', 'unknown')"
    assert sql_list(frozenset({R})) == "('ready')"
    assert sql_one(frozenset({R})) == "'ready'"
    with pytest.raises(ValueError, match="too many values"):
        sql_one(frozenset({R, S}))
    assert STATE_SETS["claimable_state"] == "'ready'"
    assert STATE_SETS["unresolved"] == "('needs_review', 'sending', 'unknown')"
