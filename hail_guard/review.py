"""The review queue's one action that sends: an operator's resend, under a new key.

An operation in `needs_review` stayed unclear: Hail may or may not have sent it. An operator
decides. `Ledger.resolve_review` records what became of it (accepted, failed, cancelled) and sends
nothing. A resend is the other decision: "it did not go; send it again". That is a NEW, explicitly
intended action, so it gets a new key, `<original key>:resend:<n>` (`keys.resend_key`), over the
same stored request. The ledger records the new operation `ready`, linked both ways, and closes the
old one as `cancelled` ("superseded by resend <new id>"): the old one is settled by the operator's
decision, not known to be unsent. Then the new operation is sent at once, like any guarded send.
"""

from __future__ import annotations

import structlog

from hail_guard import keys, policy
from hail_guard.guard import Guard
from hail_guard.ledger import Reviewing
from hail_guard.models import Intent, Operation, State
from hail_guard.profiles import ToolSpec

log = structlog.get_logger(__name__)


def resend_intent(spec: ToolSpec, operation: Operation) -> Intent:
    """The stored request of `operation` under the resend key (nothing else changes; an upstream that takes
    no key gets the very same request, the new key is the ledger's alone)."""
    key = keys.resend_key(operation.idempotency_key)
    request = operation.arguments() if spec.key is None else {**operation.arguments(), spec.key: key}
    text = keys.canonical_json(request)
    return Intent(
        idempotency_key=key,
        tool=operation.tool,
        channel=operation.channel,
        recipients=tuple(operation.recipients),
        request=text,
        request_fingerprint=keys.fingerprint(text),
        content_fingerprint=operation.content_fingerprint,
        campaign_id=operation.campaign_id,
        lead_id=operation.lead_id,
        message_id=operation.message_id,
        batch_id=operation.batch_id,
        allow_duplicate=True,
    )


async def resend(ledger: Reviewing, guard: Guard, operation_id: str, *, reason: str, actor: str) -> Operation:
    """Supersede a `needs_review` operation by a new one and send that; returns the new operation.

    Refused before anything is recorded when the operation is not in review, when Hail is unreachable, and
    when Hail has the message (`Guard.look_for`: by its id, else among the messages to its recipient).
    """
    operation = await ledger.get(operation_id)
    if operation.state is not State.NEEDS_REVIEW:
        raise policy.not_in_review(operation, "resent")
    await guard.wait_connected()
    seen = await guard.look_for(operation)  # a resend of a message Hail has would be a second send
    if seen.sighted is not None:
        raise policy.found_in_upstream(operation, seen.sighted.record, seen.searched, seen.sighted.provider_id)
    intent = resend_intent(guard.spec(operation.tool), operation)
    created = await ledger.resend(operation.id, intent, reason=reason, actor=actor)
    log.info("operation_resent", operation_id=operation.id, new_operation_id=created.id, key=intent.idempotency_key)
    return await guard.send_recorded(intent)  # a worker may take it first: then it is being sent
