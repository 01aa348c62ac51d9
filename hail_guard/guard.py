"""The durable send and reconcile, over a ledger and an upstream.

`Guard.send` is the flow of docs/explanation/states.md: validate, derive the key, commit `sending`, forward, classify,
commit the outcome. `Guard.reconcile` is the only way out of `unknown`: it replays the SAME key
with the SAME stored request, or looks the message up, or searches for it, or hands it to a human.
Everything the upstream's contract decides (the key argument, recipients, the message, how answers
read, how to look a send up or find it) comes from the profile (`GuardSettings.profile`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import anyio
import structlog
from mcp import types

from hail_guard import keys, nesting, pointers, policy, profiles, recipients, same_send
from hail_guard.crashpoints import check as check_crash_points
from hail_guard.crashpoints import crash_point
from hail_guard.errors import (
    BadInput,
    LeaseLost,
    LedgerUnavailable,
    OutcomeNotRecorded,
    UpstreamError,
    UpstreamLost,
    UpstreamUnavailable,
)
from hail_guard.ledger import Sending
from hail_guard.models import Answer, AnswerKind, Intent, Operation, Outcome, State
from hail_guard.profiles import Profile, ToolSpec

log = structlog.get_logger(__name__)

_RECORD_ATTEMPTS = 5
_RECONCILE_MAX = 100
"""Operations one `reconcile` call settles at most (the rest are due for the next call)."""
PROCESS_ID = f"{socket.gethostname()}:{os.getpid()}"
ALLOW_DUPLICATE = profiles.ALLOW_DUPLICATE
"""An argument hail-guard adds to guarded tools: a deliberate repeat; removed before forwarding."""


class UpstreamCaller(Protocol):
    """What the guard needs of the upstream (see `hail_guard.upstream.Upstream`)."""

    async def wait_connected(self) -> None:
        """Return once connected; `UpstreamUnavailable` if that does not happen soon."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, timeout_seconds: float | None = None
    ) -> types.CallToolResult: ...


@dataclass(frozen=True)
class GuardSettings:
    key_template: str | None = None
    key_retention_hours: float | None = None
    """How long the upstream keeps a key (None: as its profile says)."""
    timeout_seconds: float = 45.0
    lease_seconds: float | None = None
    """How long a claim lasts; default: the upstream timeout plus a margin."""
    max_reconcile_attempts: int = 5
    duplicate_window_hours: float = 24.0
    """Settled sends are compared with a new one while they first left within this window (0: none are);
    unresolved and waiting sends always are (`same_send`)."""
    similarity_threshold: float | None = same_send.DEFAULT_SIMILARITY
    """A text this similar to one a recipient has (within the window) is a probable duplicate; None: off."""
    hold_lead_across_channels: bool = True
    """While a send to a lead (`campaign_id` and `lead_id`) is unresolved, nothing new goes to that lead."""
    default_region: str | None = None
    """Where a phone number without its country code is read (ISO 3166, `GB`); None: such numbers are refused."""
    profile: Profile = field(default_factory=profiles.hail)
    """The upstream's contract (`[upstream] profile`; the built-in `hail` by default)."""

    @property
    def lease(self) -> float:
        return self.lease_seconds if self.lease_seconds is not None else self.timeout_seconds + 15.0


@dataclass(frozen=True)
class SendReport:
    """What happened to one guarded call."""

    operation: Operation
    replayed: bool
    """True when answered from the ledger without forwarding."""


class Guard:
    """Sends and reconciles over the ledger's `Sending` role and one upstream; its settings are its own."""

    def __init__(self, ledger: Sending, upstream: UpstreamCaller, settings: GuardSettings) -> None:
        check_crash_points()  # a testing hook: refuse a misspelt point at startup
        self._ledger = ledger
        self._upstream = upstream
        self._settings = settings
        self._schemas: dict[str, Mapping[str, Any]] = {}
        """Each guarded tool's input schema as the upstream declares it (`know_schemas`): an error naming a
        field it does not declare is Hail failing to read its own answer, not a refusal."""

    def know_schemas(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        """The guarded tools' input schemas as the upstream lists them now (the proxy tells, on each listing)."""
        self._schemas = dict(schemas)

    async def wait_connected(self) -> None:
        """Return once the upstream is connected; `UpstreamUnavailable` if that does not happen soon."""
        await self._upstream.wait_connected()

    async def claim_ready(self, owner: str, *, batch_id: str | None = None) -> list[Operation]:
        """Claim the next `ready` send (of `batch_id`, or of any batch) for `owner`, as the settings hold
        recipients and leads; an empty list when none can go now. Forward it with `dispatch`."""
        settings = self._settings
        return await self._ledger.claim_ready(
            owner=owner,
            lease_seconds=settings.lease,
            batch_id=batch_id,
            limit=1,
            hold_lead=settings.hold_lead_across_channels,
        )

    async def send_recorded(self, intent: Intent) -> Operation:
        """Send an intent the ledger already holds `ready` (a resend): claimed and forwarded now, or, when a
        worker claimed it first, as it stands (being sent)."""
        owner = claim_token()
        begin = await self._ledger.begin_send(intent, owner=owner, lease_seconds=self._settings.lease)
        if not begin.claimed:
            return begin.operation
        return await self.dispatch(begin.operation, owner)

    async def send(self, tool: str, arguments: Mapping[str, Any], input_schema: Mapping[str, Any]) -> SendReport:
        try:
            intent, request = self.prepare(tool, arguments, input_schema)
        except BadInput as refused:  # the ledger first: a retry it recognises is answered whatever its new form
            return await self._answer_retry_or_refuse(tool, arguments, refused)
        self._schemas[tool] = input_schema
        try:
            await self._upstream.wait_connected()  # refused before anything is recorded
        except UpstreamUnavailable:
            # A retry of a send that may already have left is answered from the ledger, never "not sent".
            existing = await self._find_by_keys(intent)
            if existing is None or existing.state is State.READY:
                raise
            return self._answer_from_ledger(existing, intent, request)
        crash_point("before_intent")
        owner = claim_token()
        begin = await self._ledger.begin_send(intent, owner=owner, lease_seconds=self._settings.lease, rules=self.rules)
        if not begin.claimed:
            return self._answer_from_ledger(begin.operation, intent, request)
        crash_point("after_intent")
        return SendReport(await self.dispatch(begin.operation, owner), replayed=False)

    async def dispatch(self, operation: Operation, owner: str) -> Operation:
        """Forward an operation we hold the claim on (`sending`), then record what Hail said."""
        with structlog.contextvars.bound_contextvars(
            operation_id=operation.id, key=operation.idempotency_key, tool=operation.tool
        ):
            log.info("operation_sending")
            answer = await self._forward(operation, owner, operation.tool, operation.arguments())
            outcome = policy.outcome_of_send(answer)
            crash_point("after_answer")
            return await self._record(operation, owner, outcome)

    @property
    def rules(self) -> same_send.Rules:
        """The rules about the same send, as the settings make them (`same_send.Rules`)."""
        settings = self._settings
        return same_send.Rules(
            window_seconds=settings.duplicate_window_hours * 3600.0,
            hold_lead=settings.hold_lead_across_channels,
            similarity_threshold=settings.similarity_threshold,
            message_of=self._message_of,
        )

    def _message_of(self, tool: str, arguments: Mapping[str, Any]) -> str:
        return same_send.message_text(self.spec(tool), arguments)

    def spec(self, tool: str) -> ToolSpec:
        """How the profile guards `tool`."""
        return self._settings.profile.spec(tool)

    def prepare(
        self, tool: str, arguments: Mapping[str, Any], input_schema: Mapping[str, Any] | None
    ) -> tuple[Intent, dict[str, Any]]:
        """Validate (against `input_schema` and the profile's rules, unless it is None) and derive everything the
        ledger needs; records nothing."""
        spec = self.spec(tool)
        request, own_key, allow_duplicate = _split_arguments(spec, arguments)
        if input_schema is not None:
            policy.validate_arguments(tool, request, input_schema)
            policy.check_rules(spec, request, input_schema)
        else:
            nesting.check_arguments(tool, request)  # every step below recurses once per level
        keys.canonical_json(request)  # and reads values a schema may leave free: one that cannot be written is refused
        region = self._settings.default_region
        reaches = recipients.recipients_of(spec.channel, request, spec.recipients, region=region)  # refuses bad ones
        derived_from = {**request, **own_key}
        key = keys.derive_key(spec, derived_from, self._settings.key_template, region=region)
        legacy = keys.legacy_key(spec, derived_from) if key.startswith(keys.MEANING_PREFIX) else None
        if spec.key is not None:
            request[spec.key] = key  # the upstream takes the key: it is part of what is forwarded
        text = keys.canonical_json(request)
        metadata = request.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}
        intent = Intent(
            idempotency_key=key,
            tool=tool,
            channel=spec.channel,
            recipients=reaches,
            request=text,
            request_fingerprint=keys.fingerprint(text),
            content_fingerprint=same_send.content_fingerprint(spec, request),
            sender=keys.canonical_json(same_send.sender_of(spec, request, region=region)),
            lead=same_send.lead_of(spec, request),
            allow_duplicate=allow_duplicate,
            legacy_key=legacy,
            text=same_send.message_text(spec, request),
            **{name: _text(metadata.get(name)) for name in keys.METADATA_KEY_FIELDS},
        )
        return intent, request

    async def _find_by_keys(self, intent: Intent) -> Operation | None:
        """The operation under the send's key, else under the key an earlier version derived for it."""
        found = await self._ledger.find_by_key(intent.idempotency_key)
        if found is None and intent.legacy_key is not None:
            found = await self._ledger.find_by_key(intent.legacy_key)
        return found

    async def _answer_retry_or_refuse(self, tool: str, arguments: Mapping[str, Any], refused: BadInput) -> SendReport:
        """A send its schema or a rule refuses: a retry of a send the ledger has is answered from it (or refused as
        its recipients' unresolved send says), before the schema's word; anything else gets `refused`."""
        try:
            intent, request = self.prepare(tool, arguments, None)
        except BadInput:
            raise refused from None
        existing = await self._find_by_keys(intent)
        if existing is not None and same_send.repeats(existing, intent):
            return self._answer_from_ledger(existing, intent, request)
        found = await self._ledger.same_send_candidates(intent, self.rules)
        verdict = same_send.judge(intent, intent.text, found, self.rules)
        if verdict.finding is same_send.Finding.SAME and verdict.operation is not None:
            return self._answer_from_ledger(verdict.operation, intent, request)
        if verdict.finding in (same_send.Finding.NEW, same_send.Finding.NEAR):
            raise refused
        raise policy.refusal(intent, verdict)

    def _answer_from_ledger(self, existing: Operation, intent: Intent, request: dict[str, Any]) -> SendReport:
        """A send the ledger already has: under its key (the same message, in any form), or another key's
        operation that carries the same message to the same recipients."""
        if existing.idempotency_key in (intent.idempotency_key, intent.legacy_key) and not same_send.repeats(
            existing, intent
        ):
            raise policy.key_conflict(self.spec(intent.tool), existing, intent, request)
        log.info(
            "operation_replayed",
            operation_id=existing.id,
            key=existing.idempotency_key,
            state=existing.state,
            asked_key=intent.idempotency_key,
        )
        return SendReport(existing, replayed=True)

    async def _forward(self, operation: Operation, owner: str, tool: str, request: dict[str, Any]) -> Answer:
        """Forward under the claim; any way out of here leaves an answer to record."""
        try:
            result = await self._upstream.call_tool(tool, request, timeout_seconds=self._settings.timeout_seconds)
        except UpstreamError as exc:
            return policy.answer_of_failure(exc)
        except BaseException:
            # Cancelled (the agent gave up) or a bug: the request may have left. Record that first.
            said = f"the call was interrupted while {policy.upstream_name()} had the request"
            lost = Answer(kind=AnswerKind.LOST, error=said)
            await self._record(operation, owner, policy.outcome_of_send(lost))
            raise
        crash_point("after_forward")
        return self._answer_of(tool, result, request)

    def _answer_of(self, tool: str, result: types.CallToolResult, request: Mapping[str, Any]) -> Answer:
        return policy.classify(
            self.spec(tool),
            is_error=bool(result.is_error),
            payload=payload_of(result),
            text=text_of(result),
            request=request,
            declared=policy.declared_fields(self._schemas.get(tool)),
        )

    async def _record(self, operation: Operation, owner: str, outcome: Outcome) -> Operation:
        """Commit an outcome, shielded: once Hail has answered, a cancelled caller must not lose it."""
        with anyio.CancelScope(shield=True):
            recorded = await self._record_with_retries(operation, owner, outcome)
        return recorded  # noqa: RET504  (returning inside the shield reads to mypy as a missing return)

    async def _record_with_retries(self, operation: Operation, owner: str, outcome: Outcome) -> Operation:
        """An answer from Hail is retried into the ledger, never dropped silently (bounded)."""
        for attempt in range(1, _RECORD_ATTEMPTS + 1):
            try:
                recorded = await self._ledger.record_outcome(operation.id, owner=owner, outcome=outcome, actor=owner)
            except LeaseLost:
                log.warning("operation_taken_over", operation_id=operation.id, outcome=outcome.state)
                return await self._ledger.get(operation.id)
            except LedgerUnavailable as exc:
                log.error(
                    "outcome_not_recorded",
                    operation_id=operation.id,
                    key=operation.idempotency_key,
                    outcome=outcome.state,
                    provider_id=outcome.provider_id,
                    attempt=attempt,
                    error=str(exc),
                )
                if attempt == _RECORD_ATTEMPTS:
                    raise _not_recorded(operation, outcome, exc) from exc
                await anyio.sleep(0.2 * attempt)
                continue
            log.info(
                "operation_recorded",
                operation_id=operation.id,
                key=operation.idempotency_key,
                state=recorded.state,
                provider_id=recorded.provider_id,
            )
            return recorded
        raise AssertionError("unreachable")

    async def reconcile(self, operation_id: str | None = None, *, batch_id: str | None = None) -> list[Operation]:
        """Settle `unknown` operations (one, or all that are due); return them as they now stand.

        They are claimed one at a time: a claim (and the attempt it counts) covers only the operation being
        settled, so a crash or a slow replay never holds the others for a lease or spends their attempts.
        """
        await self._upstream.wait_connected()  # unreachable: refused before any attempt is claimed or counted
        owner = claim_token()
        settled: list[Operation] = []
        for _ in range(1 if operation_id is not None else _RECONCILE_MAX):
            claimed = await self._ledger.claim_unknown(
                owner=owner, lease_seconds=self._settings.lease, operation_id=operation_id, batch_id=batch_id, limit=1
            )
            if not claimed:
                break
            settled.append(await self._reconcile_one(claimed[0], owner))
        if operation_id is not None and not settled:
            return [await self._ledger.get(operation_id)]
        return settled

    async def _reconcile_one(self, operation: Operation, owner: str) -> Operation:
        crash_point("reconcile_claimed")
        spec = self.spec(operation.tool)
        plan = policy.plan_reconcile(
            operation,
            now=await self._ledger.now(),
            key_retention_hours=self._settings.key_retention_hours or spec.retention_hours,
            recipient_suppressed=await self._ledger.is_suppressed(operation.recipients, operation.channel),
            replayable=spec.forwards_key,
        )
        log.info("reconcile_step", operation_id=operation.id, key=operation.idempotency_key, step=plan.step)
        if plan.step is policy.ReconcileStep.REVIEW:
            outcome = await self._search(operation, plan.reason)
        elif plan.step is policy.ReconcileStep.LOOKUP:
            outcome = await self._look_up(operation)
        else:
            outcome = await self._replay(operation)
        crash_point("reconcile_answered")
        return await self._record(operation, owner, outcome)

    async def _replay(self, operation: Operation) -> Outcome:
        request = operation.arguments()
        try:
            result = await self._upstream.call_tool(
                operation.tool, request, timeout_seconds=self._settings.timeout_seconds
            )
        except UpstreamUnavailable as exc:
            return policy.replay_not_made(str(exc))  # nothing left: no attempt spent
        except UpstreamError as exc:
            answer = policy.answer_of_failure(exc)
        else:
            answer = self._answer_of(operation.tool, result, request)
        return policy.outcome_of_replay(
            answer,
            previous_error=operation.last_error,
            attempts=operation.attempts - 1,
            max_attempts=self._settings.max_reconcile_attempts,
        )

    async def _look_up(self, operation: Operation) -> Outcome:
        lookup = self.spec(operation.tool).lookup
        if lookup is None or operation.provider_id is None:
            reason = f"no lookup tool for the {operation.channel} channel"
            return Outcome(state=State.NEEDS_REVIEW, reason=reason, review_reason=reason)
        try:
            found = await self._find_by_id(operation, lookup)
        except UpstreamError as exc:
            return policy.lookup_failed(str(exc))
        if found is not None:
            return Outcome(state=State.ACCEPTED, reason=f"{lookup.tool} found the message", result=found)
        reason = f"{lookup.tool} did not find {operation.provider_id}"
        return Outcome(state=State.NEEDS_REVIEW, reason=reason, review_reason=reason)

    async def _search(self, operation: Operation, why_not_replay: str) -> Outcome:
        """Where a replay could send again, look in the upstream's messages: one that proves the send (under
        its key, or where the upstream takes none, alike in every matched field and sent after it was
        recorded) settles it; one that only looks like it is shown to the human who decides."""
        try:
            seen = await self.look_for(operation)
        except UpstreamError as exc:
            return policy.lookup_failed(str(exc))
        return policy.outcome_of_search(operation, seen.sighted, seen.searched, why_not_replay, complete=seen.complete)

    async def look_for(self, operation: Operation) -> Sighting:
        """Look upstream for the message of `operation`: by its id when known (the profile's `lookup`), else by
        the profile's `search`. Sends nothing; `UpstreamError` when the upstream gave no answer."""
        spec = self.spec(operation.tool)
        if operation.provider_id and spec.lookup is not None:
            record = await self._find_by_id(operation, spec.lookup)
            sighted = policy.Sighted(record, operation.provider_id, proven=True) if record is not None else None
            return Sighting(sighted, f"{spec.lookup.tool} {operation.provider_id}", complete=True)
        search = spec.search
        if search is None:
            return Sighting(None, f"no tool lists {operation.channel} messages", complete=False)
        since = operation.created_at - timedelta(seconds=policy.SIGHTING_MARGIN_SECONDS)
        filled = profiles.read_arguments(search.arguments, operation.arguments(), provider_id=None, since=since)
        if filled.missing:
            said = ", ".join(pointers.shown(pointer) for pointer in filled.missing)
            return Sighting(None, f"{search.tool} cannot be asked: the send has no {said}", complete=False)
        result = await self._read(search.tool, filled.arguments)
        items = profiles.read_items(search, result.structured_content, text_of(result))
        searched = f"{search.tool} {filled.described}".rstrip() + f" since {operation.created_at:%Y-%m-%d %H:%M:%S}"
        if items is None:
            raise UpstreamLost(f"{search.tool} answered without a list of messages; nothing was resent")
        claimed = await self._claimed_ids(operation) if not spec.forwards_key else frozenset()
        return Sighting(policy.sighting(spec, operation, items, claimed=claimed), searched, complete=True)

    async def _claimed_ids(self, operation: Operation) -> frozenset[str]:
        """The upstream ids other operations to the same recipients already hold (one message is one send)."""
        since = operation.created_at - timedelta(hours=24)
        recipient = operation.recipients[0] if operation.recipients else None
        others = await self._ledger.list_operations(recipient=recipient, since=since, limit=500)
        return frozenset(other.provider_id for other in others if other.provider_id and other.id != operation.id)

    async def _find_by_id(self, operation: Operation, lookup: profiles.Lookup) -> dict[str, Any] | None:
        """The upstream's record of `operation` by its id, or None when the upstream has none."""
        since = operation.created_at - timedelta(seconds=policy.SIGHTING_MARGIN_SECONDS)
        filled = profiles.read_arguments(
            lookup.arguments, operation.arguments(), provider_id=operation.provider_id, since=since
        )
        result = await self._read(lookup.tool, filled.arguments)
        record = profiles.read_answer(result.structured_content, text_of(result), lookup.answer_text)
        if record is None:
            raise UpstreamLost(f"{lookup.tool} gave an answer hail-guard cannot read; nothing was resent")
        return record if str(pointers.resolve(record, lookup.id)) == operation.provider_id else None

    async def _read(self, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """A read tool's answer; `UpstreamLost` when it gave none (an error that does not say "not found")."""
        result = await self._upstream.call_tool(tool, arguments, timeout_seconds=self._settings.timeout_seconds)
        answers = self._settings.profile.data.answers
        text = text_of(result)
        payload = payload_of(result)
        error = pointers.resolve(payload, answers.error) if payload is not None and answers.error else None
        if result.is_error or error is not None:
            said = str(error) if error is not None else text
            if answers.not_found is not None and re.search(answers.not_found, said, re.IGNORECASE):
                return types.CallToolResult(content=[], structured_content={})  # an answer: no such message
            raise UpstreamLost(f"{tool} gave no usable answer ({text[:200]}); nothing was resent")
        return result


@dataclass(frozen=True)
class Sighting:
    """What a look upstream for an operation's message found (`Guard.look_for`)."""

    sighted: policy.Sighted | None
    """The upstream's record of the message, or of one that looks like it."""
    searched: str
    """What was asked, in words (for an operator)."""
    complete: bool
    """False when there is no way to look: then not finding proves nothing."""

    @property
    def record(self) -> dict[str, Any] | None:
        """The upstream's record of the message, or of one that looks like it."""
        return self.sighted.record if self.sighted is not None else None


def _not_recorded(operation: Operation, outcome: Outcome, cause: LedgerUnavailable) -> OutcomeNotRecorded:
    said = f"{policy.upstream_name()}'s answer: {outcome.state.value}" + (
        f", message id {outcome.provider_id}" if outcome.provider_id else ""
    )
    return OutcomeNotRecorded(
        f"{said}; but hail-guard could not record it ({cause}). The request has left: do NOT send it again. "
        f"Operation {operation.id} (key {operation.idempotency_key!r}) stays `sending` until its lease runs out; "
        f"then `reconcile` records what {policy.upstream_name()} has",
        operation_id=operation.id,
        state=outcome.state.value,
        provider_id=outcome.provider_id,
    )


def payload_of(result: types.CallToolResult) -> dict[str, Any] | None:
    """The JSON object a tool answered (structured content, else its text), or None."""
    if isinstance(result.structured_content, dict):
        return result.structured_content
    try:
        value = json.loads(text_of(result))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def text_of(result: types.CallToolResult) -> str:
    """The text blocks of a result, joined."""
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


def _split_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The request to forward, hail-guard's own key argument (for an upstream that takes none: recorded, never
    forwarded) and `allow_duplicate`, taken out of an agent's arguments."""
    request = dict(arguments)
    allow_duplicate = request.pop(ALLOW_DUPLICATE, False)
    if not isinstance(allow_duplicate, bool):
        raise BadInput(f"{ALLOW_DUPLICATE} must be true or false")
    own_key = {}
    if not spec.forwards_key and keys.KEY_FIELD in request:
        own_key[keys.KEY_FIELD] = request.pop(keys.KEY_FIELD)
    return request, own_key, allow_duplicate


def _text(value: object) -> str | None:
    return str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None


def claim_token() -> str:
    """Who holds a claim: this process, and a fence unique to the claim."""
    return f"{PROCESS_ID}:{uuid.uuid4().hex[:12]}"
