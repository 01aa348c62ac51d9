"""Model-based: a hypothesis state machine over guard + ledger + sandbox checks the promise after every step.

Rules act like agents, workers and operators (send, retry, faults on the wire, reconcile, batches drained
by two workers at once, opt-outs, a worker that crashes after claiming, lease expiry, delivery webhooks,
review decisions); the invariants are the promise (docs/explanation/promise.md) read off the sandbox outbox and
the ledger.
The machine owns one event loop (a blocking portal) and drives the async system through it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from hail_guard import webhooks
from hail_guard.batch import drain
from hail_guard.lifecycle import TERMINAL, is_legal
from hail_guard.models import Operation, State
from hail_guard.sandbox import parse_fault
from tests.conftest import Harness, email, open_harness

LEADS = 3
MESSAGES = ("intro", "followup", "reminder")
SUBJECTS = ("Hello", "Hello again")
FAULTS = (
    None,
    "hang_after_accept",
    "drop_after_accept",
    "error_after_accept:502",
    "fail_before_accept:429:0",
    "fail_before_accept:422",
    "malformed",
)
CRASH_OWNER = "crashed-worker"
REVIEW_DECISIONS = (State.ACCEPTED, State.FAILED, State.CANCELLED)

leads = st.integers(0, LEADS - 1)
messages = st.sampled_from(MESSAGES)
faults = st.sampled_from(FAULTS)


def address(lead: int) -> str:
    return f"lead{lead}@example.com"


def lead_email(lead: int, message: str, subject: str = SUBJECTS[0]) -> dict[str, Any]:
    """One logical message: the key comes from (campaign, lead, message); the body differs per message."""
    return email(
        to=[address(lead)],
        subject=subject,
        body_text=f"Hello lead {lead}, this is the {message} message.",
        metadata={"campaign_id": "model", "lead_id": f"lead{lead}", "message_id": message},
    )


def sent_request(operation: Operation) -> dict[str, Any]:
    """What the sandbox records as the request of a send: the stored request without the key or nulls."""
    return {k: v for k, v in operation.arguments().items() if k != "idempotency_key" and v is not None}


class GuardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="hail-guard-model-"))
        self.stack = ExitStack()
        self.portal: BlockingPortal = self.stack.enter_context(start_blocking_portal("asyncio"))
        self.harness: Harness = self.stack.enter_context(
            self.portal.wrap_async_context_manager(open_harness(self.directory, timeout_seconds=0.3))
        )
        self.calls: list[dict[str, Any]] = []
        """Every send_email call an agent made, for retries of the very same call."""
        self.identity: dict[str, tuple[str, str, str]] = {}
        """operation id -> (key, request fingerprint, stored request), as first seen."""
        self.terminal: dict[str, State] = {}
        """operation id -> the terminal state it reached."""
        self.opted_out: dict[str, int] = {}
        """recipient -> outbox length when the opt-out was recorded."""
        self.resolved_by_operator: set[str] = set()
        self.operations: list[Operation] = []

    def teardown(self) -> None:
        try:
            self.stack.close()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    # --- helpers ---------------------------------------------------------------------------------

    def run(self, function: Any, *args: Any) -> Any:
        return self.portal.call(function, *args)

    def fault_next_send(self, fault: str | None) -> None:
        if fault is not None:
            nth = self.harness.sandbox.calls("send_email") + 1
            self.harness.sandbox.add_fault(parse_fault(f"send_email:{nth}:{fault}"))

    def in_state(self, *states: State) -> list[Operation]:
        return [operation for operation in self.operations if operation.state in states]

    async def _all_operations(self) -> list[Operation]:
        return await self.harness.ledger.list_operations(limit=1000)

    def refresh(self) -> None:
        self.operations = self.run(self._all_operations)

    # --- rules: agents ---------------------------------------------------------------------------

    @rule(lead=leads, message=messages, subject=st.sampled_from(SUBJECTS), fault=faults)
    def send(self, lead: int, message: str, subject: str, fault: str | None) -> None:
        """An agent sends one message (the same key with other content is a conflict, refused)."""
        arguments = lead_email(lead, message, subject)
        self.fault_next_send(fault)
        self.calls.append(arguments)
        self.run(self.harness.call, "send_email", arguments)

    @precondition(lambda self: bool(self.calls))
    @rule(pick=st.integers(0, 1000), fault=faults)
    def retry(self, pick: int, fault: str | None) -> None:
        """An agent re-issues a call it made before, unchanged (a broken stream, a restarted chat)."""
        self.fault_next_send(fault)
        self.run(self.harness.call, "send_email", self.calls[pick % len(self.calls)])

    @rule(lead=leads)
    def opt_out(self, lead: int) -> None:
        self.opted_out.setdefault(address(lead), len(self.harness.sandbox.outbox))
        self.run(self.harness.call, "record_opt_out", {"recipient": address(lead), "reason": "replied STOP"})

    # --- rules: workers --------------------------------------------------------------------------

    @rule(
        message=messages,
        chosen=st.lists(leads, min_size=1, max_size=LEADS, unique=True),
        fault=faults,
    )
    def batch(self, message: str, chosen: list[int], fault: str | None) -> None:
        """Plan a small batch, then two workers drain it at once."""
        sends = [{"tool": "send_email", "arguments": lead_email(lead, message)} for lead in chosen]
        self.fault_next_send(fault)
        self.run(self._plan_and_drain, sends)

    async def _plan_and_drain(self, sends: list[dict[str, Any]]) -> None:
        planned = await self.harness.call("plan_batch", {"sends": sends})
        if planned.is_error:  # a key already taken, a probable duplicate: nothing was planned
            return
        batch_id = json.loads(planned.content[0].text)["batch_id"]  # type: ignore[union-attr]
        guard = self.harness.proxy.guard
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: drain(guard, concurrency=1, batch_id=batch_id))

    @rule()
    def drain_everything(self) -> None:
        self.run(lambda: drain(self.harness.proxy.guard, concurrency=2))

    @rule()
    def reconcile(self) -> None:
        self.run(self.harness.proxy.guard.reconcile)

    @precondition(lambda self: bool(self.in_state(State.UNKNOWN)))
    @rule(pick=st.integers(0, 1000))
    def reconcile_one(self, pick: int) -> None:
        unknown = self.in_state(State.UNKNOWN)
        self.run(self.harness.proxy.guard.reconcile, unknown[pick % len(unknown)].id)

    @precondition(lambda self: bool(self.in_state(State.READY)))
    @rule(forwarded=st.booleans())
    def crash(self, forwarded: bool) -> None:
        """A worker claims a ready operation with a lease that has already run out, maybe forwards it,
        and dies before recording anything."""
        self.run(self._crash, forwarded)

    async def _crash(self, forwarded: bool) -> None:
        claimed = await self.harness.ledger.claim_ready(owner=CRASH_OWNER, lease_seconds=-1.0)
        for operation in claimed:
            if forwarded:
                await self.harness.sandbox.invoke(operation.tool, operation.arguments())

    @rule()
    def expire_leases(self) -> None:
        self.run(self.harness.ledger.expire_leases)

    # --- rules: the world and operators ----------------------------------------------------------

    @precondition(lambda self: any(op.provider_id for op in self.in_state(State.ACCEPTED)))
    @rule(pick=st.integers(0, 1000), event=st.sampled_from(("email.delivered", "email.bounced", "email.opened")))
    def webhook(self, pick: int, event: str) -> None:
        accepted = [op for op in self.in_state(State.ACCEPTED) if op.provider_id]
        operation = accepted[pick % len(accepted)]
        body = json.dumps({"type": event, "data": {"id": operation.provider_id}}).encode()
        hook = webhooks.parse(body, delivery_id=str(uuid.uuid4()), signature=str(uuid.uuid4()))
        self.run(self.harness.ledger.record_webhook, hook)

    @precondition(lambda self: bool(self.in_state(State.NEEDS_REVIEW)))
    @rule(pick=st.integers(0, 1000), decision=st.sampled_from(REVIEW_DECISIONS))
    def resolve_review(self, pick: int, decision: State) -> None:
        waiting = self.in_state(State.NEEDS_REVIEW)
        operation = waiting[pick % len(waiting)]
        self.resolved_by_operator.add(operation.id)
        self.run(
            lambda: self.harness.ledger.resolve_review(
                operation.id, state=decision, reason="checked in Hail's console", actor="operator"
            )
        )

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def the_promise_holds(self) -> None:
        self.refresh()
        outbox = self.harness.sandbox.outbox
        by_key = {operation.idempotency_key: operation for operation in self.operations}

        keys = [operation.idempotency_key for operation in self.operations]
        assert len(keys) == len(set(keys)), "two operations share a key"

        sent_keys = [line["idempotency_key"] for line in outbox]
        assert len(sent_keys) == len(set(sent_keys)), f"a logical send reached Hail twice: {sent_keys}"
        assert set(sent_keys) <= set(by_key), "something reached Hail that the ledger never recorded"

        for line in outbox:
            operation = by_key[line["idempotency_key"]]
            assert line["request"] == sent_request(operation), f"{operation.id} was sent with other content"

        seen = {operation.id for operation in self.operations}
        assert set(self.identity) <= seen, f"operations lost: {set(self.identity) - seen}"

        for operation in self.operations:
            identity = (operation.idempotency_key, operation.request_fingerprint, operation.request)
            assert self.identity.setdefault(operation.id, identity) == identity, f"{operation.id} changed key/request"
            if operation.id in self.terminal:
                assert operation.state is self.terminal[operation.id], (
                    f"{operation.id} left {self.terminal[operation.id]} for {operation.state}"
                )
            elif operation.state in TERMINAL:
                self.terminal[operation.id] = operation.state
            if operation.idempotency_key in sent_keys and operation.id not in self.resolved_by_operator:
                assert operation.state not in (State.FAILED, State.CANCELLED, State.READY, State.PLANNED), (
                    f"{operation.id} reached Hail but is recorded {operation.state}"
                )

        for recipient, sent_before in self.opted_out.items():
            late = [line for line in outbox[sent_before:] if recipient in line["to"]]
            assert not late, f"{recipient} opted out but was sent {late}"

    @invariant()
    def every_recorded_event_is_a_move_of_the_state_machine(self) -> None:
        for operation in self.operations:
            for event in self.portal.call(self.harness.ledger.events, operation.id):
                assert is_legal(event.from_state, event.to_state), (
                    f"{operation.id}: {event.from_state} -> {event.to_state}"
                )


def test_guard_keeps_its_promise_under_any_sequence_of_events() -> None:
    run_state_machine_as_test(
        GuardMachine,
        settings=settings(
            max_examples=25, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 40 s here, more on shared cores: past the 60 s default
def test_guard_keeps_its_promise_over_longer_runs() -> None:
    run_state_machine_as_test(
        GuardMachine,
        settings=settings(
            max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
