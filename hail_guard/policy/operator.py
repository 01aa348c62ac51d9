"""An operator's decisions: review resolutions, resends, opt-outs and pruning, and the texts they write.

Both ledger backends write these texts (through the ledger core) and raise these refusals, so an
operator reads the same history and the same "nothing changed" whichever ledger holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hail_guard.errors import (
    BadInput,
    RefusedByPolicy,
)
from hail_guard.models import Operation, State, Suppression
from hail_guard.policy.answers import upstream_name

REVIEW_RESOLUTIONS = (State.ACCEPTED, State.FAILED, State.CANCELLED)
"""What an operator may decide a `needs_review` operation became."""
WEBHOOK_DEDUPE_SECONDS = 3 * 86400.0
"""Processed webhook deliveries are kept at least this long: Hail retries one for about 31 hours."""


def found_in_upstream(
    operation: Operation, record: Mapping[str, Any], searched: str, found: str | None
) -> RefusedByPolicy:
    """The refusal of a resend whose message the upstream already has (`found`: its id there)."""
    found, name = found or "?", upstream_name()
    return RefusedByPolicy(
        f"{name} has this message ({searched} found {found}, status {record.get('status', '?')}): it was sent, so "
        f"nothing was resent. Record it with `hail-guard review resolve {operation.id} --as accepted "
        f'--provider-id {found} --reason "found in {name}"`'
    )


def check_review_decision(state: State, reason: str, provider_id: str | None = None) -> None:
    """An operator's resolution must be a final state, say why, and give a provider id only when accepted."""
    if state not in REVIEW_RESOLUTIONS:
        names = ", ".join(s.value for s in REVIEW_RESOLUTIONS)
        raise BadInput(f"a review is resolved as one of {names}, not {state.value}; nothing changed")
    if not reason.strip():
        raise BadInput("say why (--reason): every review decision is kept in the history; nothing changed")
    if provider_id is not None and state is not State.ACCEPTED:
        raise BadInput(
            f"a provider id goes only with `accepted` (the id {upstream_name()} gave the message); nothing changed"
        )


def not_in_review(operation: Operation, action: str) -> RefusedByPolicy:
    """The refusal for a review decision on an operation that is not waiting for one."""
    return RefusedByPolicy(
        f"operation {operation.id} is {operation.state.value}, not in review: only a needs_review operation "
        f"can be {action}; nothing changed (see `hail-guard review list`)"
    )


def prune_age_seconds(older_than_days: float | None, *, key_retention_hours: float) -> float:
    """How old a resolved operation must be to be pruned; refuses no age, and one inside the upstream's key
    retention. A pruned key is forgotten by hail-guard; while the upstream may still remember it, the ledger
    must too.
    """
    if older_than_days is None:
        raise BadInput("prune needs an age: --older-than DAYS; nothing was removed")
    seconds = older_than_days * 86400.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadInput(f"--older-than must be a positive number of days (got {older_than_days:g})")
    retention = key_retention_hours * 3600.0
    if seconds < retention:
        raise RefusedByPolicy(
            f"--older-than {older_than_days:g} is inside {upstream_name()}'s key retention "
            f"({key_retention_hours:g} h): those "
            f"operations are kept; use --older-than {math.ceil(retention / 86400.0)} or more. Nothing was removed"
        )
    return seconds


def review_decision_text(state: State, reason: str, provider_id: str | None = None) -> str:
    """The history line of an operator's review decision (both ledger backends write it)."""
    given = f" (provider id {provider_id})" if provider_id else ""
    return f"review: resolved as {state.value}{given}: {reason.strip()}"


@dataclass(frozen=True)
class ResendTexts:
    new_event: str
    old_event: str
    cancel_reason: str


def resend_texts(old_id: str, new_id: str, reason: str) -> ResendTexts:
    """What an operator's resend writes on the new operation and on the one it supersedes."""
    return ResendTexts(
        new_event=f"review: resend of {old_id}: {reason.strip()}",
        old_event=f"review: superseded by resend {new_id}: {reason.strip()}",
        cancel_reason=(
            f"superseded by resend {new_id} (an operator's decision; {upstream_name()} may have this one too)"
        ),
    )


def resend_key_taken(key: str, taken: Operation) -> RefusedByPolicy:
    return RefusedByPolicy(f"the resend key {key!r} already belongs to operation {taken.id}; nothing changed")


def suppression_reason(suppression: Suppression) -> str:
    """Why sends were cancelled by an opt-out (both ledger backends write it)."""
    return f"the recipient opted out: {suppression.reason} (source: {suppression.source})"
