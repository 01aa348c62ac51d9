"""What the named statements are given: an intent, an outcome and the checks of the same send, as parameters by name.

Each is the same on both dialects (`hail_guard.ledger.sql`): JSON values and lists as JSON text, times as Unix
epoch seconds. The core (`core`), planning and each backend's send path build their statements' parameters here,
so a statement's names are spelled once on the Python side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hail_guard import delivery, same_send
from hail_guard.models import Intent, Outcome

Params = dict[str, Any]
"""A statement's parameters, by name."""


def intent_values(intent: Intent) -> Params:
    """An intent as the parameters of `insert_operation` (and of each backend's first step), but its id and state."""
    return {
        "idempotency_key": intent.idempotency_key,
        "tool": intent.tool,
        "channel": intent.channel,
        "recipients": json.dumps(list(intent.recipients)),
        "recipient_keys": json.dumps(same_send.keys_of_intent(intent)),
        "request": intent.request,
        "request_fingerprint": intent.request_fingerprint,
        "content_fingerprint": intent.content_fingerprint,
        "sender": intent.sender,
        "campaign_id": intent.campaign_id,
        "lead_id": intent.lead_id,
        "message_id": intent.message_id,
        "batch_id": intent.batch_id,
        "lead": intent.lead,
    }


def outcome_values(outcome: Outcome) -> Params:
    """An outcome as the parameters of each backend's `record_outcome`, but the operation and its owner (`id`,
    `owner`); `attempts_back` counts the claim's attempt back when none was made."""
    return {
        "state": outcome.state.value,
        "provider_id": outcome.provider_id,
        "result": json.dumps(outcome.result) if outcome.result is not None else None,
        "error": outcome.error,
        "review_reason": outcome.review_reason,
        "attempts_back": 0 if outcome.attempted else 1,
        "not_before_seconds": outcome.not_before_seconds,
        "check_after_seconds": outcome.check_after_seconds,
    }


def match_args(intent: Intent, rules: same_send.Rules) -> Params:
    """The parameters of `matches`: the same message to a shared recipient, in a state that blocks `intent`
    being recorded (`same_send.Rules.match_states`)."""
    always, windowed, closed_block = rules.match_states(allow_duplicate=intent.allow_duplicate)
    return {
        "content_fingerprint": intent.content_fingerprint,
        "recipient_keys": json.dumps(same_send.keys_of_intent(intent)),
        "idempotency_key": intent.idempotency_key,
        "tool": intent.tool,
        "always": json.dumps(always),
        "windowed": json.dumps(windowed),
        "closed_block": closed_block,
        "window_seconds": rules.window_seconds,
        "sender": intent.sender,
    }


def hold_args(intent: Intent, rules: same_send.Rules) -> Params:
    """The parameters of `holds`: unresolved sends to a shared recipient on the channel, or to the same lead."""
    lead = intent.lead if rules.hold_lead else None
    return {"recipient_keys": json.dumps(same_send.keys_of_intent(intent)), "channel": intent.channel, "lead": lead}


def near_args(intent: Intent, rules: same_send.Rules) -> Params:
    """The parameters of `near`: other messages a shared recipient has on the channel, to compare by similarity."""
    return {
        "recipient_keys": json.dumps(same_send.keys_of_intent(intent)),
        "channel": intent.channel,
        "content_fingerprint": intent.content_fingerprint,
        "window_seconds": rules.window_seconds,
        "idempotency_key": intent.idempotency_key,
    }


def delivery_check_args(channels: Sequence[str], max_age_seconds: float, hold_seconds: float, limit: int) -> Params:
    """The parameters of `claim_delivery_checks`."""
    return {
        "hold_seconds": hold_seconds,
        "channels": json.dumps(list(channels)),
        "settled": json.dumps(sorted(state.value for state in delivery.SETTLED)),
        "max_age_seconds": max_age_seconds,
        "limit": limit,
    }
