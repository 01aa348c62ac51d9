"""Each state's one row (`lifecycle.STATES`): every state is placed, shown and coloured from one table."""

from __future__ import annotations

import re
import string
from pathlib import Path

import pytest

from hail_guard import lifecycle
from hail_guard.console import chart
from hail_guard.lifecycle import MOVES, STATES, StateRow
from hail_guard.models import State
from tests.conftest import open_harness
from tests.console_site import OPERATOR_ENV, OPERATOR_TOKEN, console_client, console_site

PLACEHOLDERS = {"phrase": {"upstream"}, "next_step": {"upstream", "id"}, "headline": {"upstream", "reason"}}


def test_every_state_has_one_row_and_every_move_is_between_states_that_have_one() -> None:
    assert set(STATES) == set(State)
    assert {move.after for move in MOVES} | {move.before for move in MOVES if move.before} <= set(STATES)


@pytest.mark.parametrize("state", list(State))
def test_a_rows_texts_say_only_what_they_are_given(state: State) -> None:
    row: StateRow = STATES[state]
    for field, allowed in PLACEHOLDERS.items():
        text = getattr(row, field)
        if text is None:
            continue
        named = {name for _, name, _, _ in string.Formatter().parse(text) if name}
        assert named <= allowed, (state, field, named)
    if row.operator_step is not None:
        assert {name for _, name, _, _ in string.Formatter().parse(row.operator_step) if name} <= {
            "n",
            "batch",
            "upstream",
        }
    assert (row.headline is None) == (state in (State.ACCEPTED, State.FAILED))  # answered with the record
    assert row.reason is None or row.reason in {"cancel_reason", "review_reason", "last_error"}
    assert re.fullmatch(r"#[0-9a-f]{6}", row.colour)


def test_the_rows_run_settled_then_in_flight_then_waiting() -> None:
    order = list(STATES)
    assert order.index(State.ACCEPTED) < order.index(State.UNKNOWN) < order.index(State.READY)
    assert tuple(STATES) == chart.PROGRESS_ORDER
    assert set(order[: len(lifecycle.TERMINAL)]) == lifecycle.TERMINAL


def test_open_states_are_every_state_not_settled() -> None:
    assert frozenset(State) - lifecycle.TERMINAL == lifecycle.OPEN
    assert lifecycle.UNRESOLVED <= lifecycle.OPEN


async def test_the_console_colours_each_state_from_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPERATOR_ENV, OPERATOR_TOKEN)
    async with open_harness(tmp_path) as harness, console_client(console_site(harness)) as client:
        answer = await client.get("/console/static/states.css")
        assert (answer.status_code, answer.headers["content-type"].split(";")[0]) == (200, "text/css")
        for state, row in STATES.items():
            assert f".s-{state.value} {{ fill: {row.colour}; background: {row.colour}; }}" in answer.text
