"""Planning a batch: the sends staged by a backend, checked against the ledger and copied into it.

Each backend stages the sends in a temporary table of its own (`stage_rows`, a chunk at a time, without a lock
on the ledger), then calls `plan_staged` in one transaction: a key the ledger has, a message a recipient has
(the same, or near the same: `same_send`), refuse the whole batch; sends to recipients who opted out start
`cancelled`. A recipient's unresolved send does not refuse a plan: it holds the planned send when it is claimed.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Sequence

from hail_guard import policy
from hail_guard.errors import RefusedByPolicy
from hail_guard.ledger.core import Tx, cancel_opted_out, operation_of
from hail_guard.ledger.params import Params, intent_values, match_args
from hail_guard.ledger.roles import Plan, Where
from hail_guard.models import Intent
from hail_guard.same_send import Candidates, Rules

PLAN_CHUNK = 500
"""Sends staged per round trip while planning a batch (and compared per page)."""
STAGE_COLUMNS = (
    "position",
    "id",
    "idempotency_key",
    "tool",
    "channel",
    "recipients",
    "recipient_keys",
    "request",
    "request_fingerprint",
    "content_fingerprint",
    "sender",
    "campaign_id",
    "lead_id",
    "message_id",
    "lead",
    "allow_duplicate",
)
"""The planning stage's columns (`hg_plan_stage`), in order."""


def stage_rows(chunk: Sequence[Intent], *, first: int) -> list[Params]:
    """Rows of the planning stage (`STAGE_COLUMNS`: position, id, the intent but its batch, allow_duplicate), from
    `first`."""
    rows = []
    for position, intent in enumerate(chunk, start=first):
        values = intent_values(intent)
        del values["batch_id"]
        rows.append(
            {"position": position, "id": str(uuid.uuid4()), **values, "allow_duplicate": intent.allow_duplicate}
        )
    return rows


async def plan_staged(tx: Tx, plan: Plan, staged: int) -> None:
    """The `staged` sends checked against the ledger and copied into it (the caller holds one transaction); a
    refusal names a send as `plan.where` says."""
    batch_id, state, actor = plan.batch_id, plan.state.value, plan.actor
    await tx.run("insert_batch", batch_id=batch_id, name=plan.name, created_by=actor)
    await _refuse_known_keys(tx, plan.where)
    await _refuse_repeats(tx, plan.rules, plan.where)
    await _refuse_near(tx, plan.rules, staged, plan.where)
    await tx.run("plan_staged", batch_id=batch_id, state=state)
    await tx.run("plan_staged_recipients")
    await tx.run("plan_staged_events", state=state, actor=actor, reason=f"planned in batch {batch_id}")
    await cancel_opted_out(tx, actor, "the recipient opted out before the send", batch_id)


async def _refuse_known_keys(tx: Tx, where: Where) -> None:
    rows = await tx.rows("staged_known_keys")
    if rows:
        named = "; ".join(
            f"{where(row['position'])} (key {row['idempotency_key']!r} is operation {row['id']})" for row in rows
        )
        raise RefusedByPolicy(f"{rows[0]['taken']} send(s) already exist in the ledger: {named}; nothing was planned")


async def _refuse_repeats(tx: Tx, rules: Rules, where: Where) -> None:
    """The first staged send whose message the ledger already carries for one of its recipients is refused (a
    recipient's unresolved send holds a planned one when it is claimed, not here)."""
    for allow_duplicate in (False, True):
        always, windowed, closed_block = rules.match_states(allow_duplicate=allow_duplicate)
        found = await tx.row(
            "staged_repeat",
            window_seconds=rules.window_seconds,
            allow_duplicate=allow_duplicate,
            always=json.dumps(always),
            windowed=json.dumps(windowed),
            closed_block=closed_block,
        )
        if found is None:
            continue
        intent = await _staged_intent(tx, found["position"])
        matches = [operation_of(row) for row in await tx.rows("matches", **match_args(intent, rules))]
        raise policy.already_planned(intent, Candidates(matches=matches), rules, where(found["position"]))


async def _refuse_near(tx: Tx, rules: Rules, staged: int, where: Where) -> None:
    """The first staged send whose text is near one a recipient has on its channel (`same_send.judge`, by similarity)
    is refused, as a send made alone would be: a campaign planned again with its text reworded. A page of the stage
    at a time; only sends to recipients who have other messages are compared."""
    if not rules.compares_near:
        return
    for first in range(1, staged + 1, PLAN_CHUNK):
        rows = await tx.rows(
            "staged_near", window_seconds=rules.window_seconds, first=first, last=first + PLAN_CHUNK - 1
        )
        for position, group in itertools.groupby(rows, key=lambda row: int(row["position"])):
            pairs = list(group)
            intent = await _staged_intent(tx, position)
            intent = intent.model_copy(update={"text": _message(rules, pairs[0]["staged_tool"], intent.request)})
            policy.decide(intent, Candidates(near=[operation_of(row) for row in pairs]), rules, where(position))


def _message(rules: Rules, tool: str, request: str) -> str:
    assert rules.message_of is not None
    return rules.message_of(tool, json.loads(request))


async def _staged_intent(tx: Tx, position: int) -> Intent:
    staged = await tx.row("staged_intent", position=position)
    assert staged is not None
    values = dict(staged)
    values["recipients"] = tuple(
        json.loads(values["recipients"]) if isinstance(values["recipients"], str) else values["recipients"]
    )
    return Intent.model_validate(values)
