"""Model-based: a hypothesis state machine over guard + ledger + sandbox checks every answer and the promise.

Rules act like agents, workers and operators (send, retry, faults on the wire, reconcile, campaigns drained by
two workers at once, opt-outs, a worker that crashes after claiming, lease expiry, delivery webhooks, review
decisions). Every step's answer is kept and checked against what the rules say it must be, worked out by the
test from the ledger as it stood before the step (`Oracle`): a send no rule stops is forwarded and ends as its
fault says; a refusal comes only where a named rule applies (the same key with another message, an opt-out, a
recipient's unresolved send, the same message, a near-same text); a campaign (one text to many leads) always
plans unless one of its sends breaks a rule. After every step the outbox is read per recipient: each has
exactly the messages the ledger says reached them, once, and states move only as `lifecycle` allows.

The machine runs on both ledgers (a new SQLite file, a new PostgreSQL database, per example). It owns one event
loop (a blocking portal) and drives the async system through it. No rule's precondition or strategy reads
the system: what the guard did depends on timing (two workers race for a batch's faulted call), and hypothesis
needs the same draws to choose the same steps on every run.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from mcp import types
from rapidfuzz import fuzz

from hail_guard import webhooks
from hail_guard.batch import drain
from hail_guard.lifecycle import TERMINAL, is_legal
from hail_guard.models import Operation, State
from hail_guard.sandbox import parse_fault
from tests.conftest import Harness, data, email, open_harness, text
from tests.postgres import PostgresServer

LEADS = 2
CAMPAIGN = "model"
TEXTS = {
    "intro": "Nice to meet you at the trade fair in Lyon last week.",
    "intro-copy": "Nice to meet you at the trade fair in Lyon last week.",
    "intro-reworded": "Nice to meet you at the trade fair in Lyon, last week!",
    "pricing": "Here is the pricing sheet you asked for, with our team discounts.",
    "webinar": "Our webinar on delivery tracking starts on Thursday at ten.",
}
"""One text per message id: `intro-copy` says what `intro` says (the same message under another key),
`intro-reworded` nearly (a paraphrased retry), the others something else."""
SUBJECTS = ("Hello", "Hello again")
THRESHOLD = 0.85
"""`[guard] similarity_threshold`'s default (README, how it keeps the promise)."""
FAULTS = (
    None,
    "hang_after_accept",
    "drop_after_accept",
    "error_after_accept:502",
    "fail_before_accept:429:0",
    "fail_before_accept:422",
    "malformed",
)
FIRST_ATTEMPT = {
    None: State.ACCEPTED,
    "hang_after_accept": State.UNKNOWN,
    "drop_after_accept": State.UNKNOWN,
    "error_after_accept:502": State.UNKNOWN,
    "fail_before_accept:429:0": State.READY,
    "fail_before_accept:422": State.FAILED,
    "malformed": State.UNKNOWN,
}
"""What a forwarded send's first attempt ends as, by the fault on its call (README, the classification table)."""
CRASH_OWNER = "crashed-worker"
REVIEW_DECISIONS = (State.ACCEPTED, State.FAILED, State.CANCELLED)
HOLDING = frozenset({State.SENDING, State.UNKNOWN, State.NEEDS_REVIEW})
"""A send in these states holds every new one to its recipient (README: a recipient's unsettled send)."""
COUNTS_AS_SENT = frozenset({State.PLANNED, State.READY, State.ACCEPTED})
"""Waiting or accepted: compared for near-same texts (with operator closes after the send may have left)."""
LIVE = frozenset(State) - {State.FAILED, State.CANCELLED}
MAY_HAVE_REACHED = HOLDING | {State.ACCEPTED}
REFUSALS = {
    "key_conflict": re.compile(r"belongs to operation"),
    "opted_out": re.compile(r"opted out of email"),
    "held": re.compile(r"has an unsettled email send"),
    "near": re.compile(r"probably a duplicate"),
    "second_copy": re.compile(r"a second copy cannot be sent yet"),
    "batch_key_twice": re.compile(r"have the same key"),
    "batch_key_known": re.compile(r"already exist in the ledger"),
    "batch_repeat": re.compile(r"^send \d+: \S+ already has this message: .* Nothing was planned\. Leave send"),
}
"""Each named rule's refusal, by the words that say it (what the agent reads)."""

leads = st.integers(0, LEADS - 1)
messages = st.sampled_from(sorted(TEXTS))
faults = st.sampled_from((None, None, None, *FAULTS[1:]))
"""Most sends meet no fault."""
picks = st.integers(0, 1000)


def address(lead: int) -> str:
    return f"lead{lead}@example.com"


@dataclass(frozen=True)
class Send:
    """One agent's send: the key comes from (campaign, lead, message id); the text from the message id."""

    lead: int
    message: str
    subject: str = SUBJECTS[0]
    allow_duplicate: bool = False

    @property
    def key(self) -> str:
        return f"{CAMPAIGN}:lead{self.lead}:email:{self.message}"

    @property
    def recipient(self) -> str:
        return address(self.lead)

    def arguments(self) -> dict[str, Any]:
        metadata = {"campaign_id": CAMPAIGN, "lead_id": f"lead{self.lead}", "message_id": self.message}
        extra = {"allow_duplicate": True} if self.allow_duplicate else {}
        return (
            email(to=[self.recipient], subject=self.subject, body_text=TEXTS[self.message], metadata=metadata) | extra
        )


def said(operation: Operation) -> tuple[str, str]:
    """What an operation's message says: (subject, body)."""
    arguments = operation.arguments()
    return arguments["subject"], arguments["body_text"]


def near(first: tuple[str, str], second: tuple[str, str]) -> bool:
    """The README's near-same rule, worked out here with rapidfuzz: the message's fields by name, lower-cased."""

    def rendered(message: tuple[str, str]) -> str:
        return f"{message[1]}\n{message[0]}".lower()

    return fuzz.ratio(rendered(first), rendered(second)) / 100.0 >= THRESHOLD


assert near(("Hello", TEXTS["intro"]), ("Hello again", TEXTS["intro-reworded"]))
assert not near(("Hello", TEXTS["intro"]), ("Hello", TEXTS["pricing"]))


@dataclass(frozen=True)
class Expected:
    """What one send must be answered with."""

    refusal: str | None = None
    """The named rule that refuses it (a key of `REFUSALS`)."""
    answered_by: frozenset[str] = frozenset()
    """Operations it may be answered from (the same key, or the same message under another key)."""
    forwarded: bool = False
    """Whether it goes to Hail now (a new send, or a `ready` one it finds and claims)."""


class Oracle:
    """The rules, read off the ledger as it stood before a step."""

    def __init__(self, operations: Sequence[Operation], opted_out: set[str]) -> None:
        self.operations = operations
        self.opted_out = opted_out

    def to(self, recipient: str) -> list[Operation]:
        return [operation for operation in self.operations if recipient in operation.recipients]

    def by_key(self, key: str) -> Operation | None:
        return next((operation for operation in self.operations if operation.idempotency_key == key), None)

    def held(self, recipient: str, but: str | None = None) -> list[Operation]:
        return [op for op in self.to(recipient) if op.state in HOLDING and op.id != but]

    def matches(self, send: Send, *, allow_duplicate: bool = False) -> list[Operation]:
        """The same message (subject and text) to the recipient in a state that blocks a new one."""
        message = (send.subject, TEXTS[send.message])
        return [
            op
            for op in self.to(send.recipient)
            if said(op) == message
            and (op.state in HOLDING if allow_duplicate else (op.state in LIVE or op.may_have_left))
        ]

    def near(self, send: Send) -> list[Operation]:
        message = (send.subject, TEXTS[send.message])
        return [
            op
            for op in self.to(send.recipient)
            if said(op) != message and (op.state in COUNTS_AS_SENT or op.may_have_left) and near(said(op), message)
        ]

    def claims(self, operation: Operation) -> bool:
        """A `ready` operation an agent's call finds is sent now, unless its recipient is held."""
        return operation.state is State.READY and not self.held(operation.recipients[0], but=operation.id)

    def send(self, send: Send) -> Expected:
        existing = self.by_key(send.key)
        if existing is not None:
            if said(existing)[0] != send.subject:
                return Expected(refusal="key_conflict")
            return Expected(answered_by=frozenset({existing.id}), forwarded=self.claims(existing))
        if send.recipient in self.opted_out:
            return Expected(refusal="opted_out")
        if send.allow_duplicate:
            if self.matches(send, allow_duplicate=True):
                return Expected(refusal="second_copy")
            return Expected(refusal="held") if self.held(send.recipient) else Expected(forwarded=True)
        if same := self.matches(send):  # answered from the newest
            newest = max(same, key=lambda operation: operation.created_at)
            return Expected(answered_by=frozenset({newest.id}), forwarded=self.claims(newest))
        if self.held(send.recipient):
            return Expected(refusal="held")
        if self.near(send):
            return Expected(refusal="near")
        return Expected(forwarded=True)

    def plan(self, sends: Sequence[Send]) -> str | None:
        """The rule that refuses a campaign, or None: it plans (holds and opt-outs do not refuse a batch; a near-same
        text does, as it does a send made alone)."""
        if len({send.key for send in sends}) < len(sends):
            return "batch_key_twice"
        if any(self.by_key(send.key) for send in sends):
            return "batch_key_known"
        if any(self.matches(send) for send in sends):
            return "batch_repeat"
        if any(self.near(send) for send in sends):  # a campaign planned again with its text reworded
            return "near"
        return None


def refusal_of(result: types.CallToolResult) -> str | None:
    """The named rule an error answer gives (None: it is not a refusal)."""
    said_text = text(result)
    found = [name for name, words in REFUSALS.items() if words.search(said_text)]
    assert len(found) <= 1, f"one refusal names several rules: {said_text}"
    event(f"refused: {found[0]}" if found else "not refused")
    return found[0] if found else None


class GuardMachine(RuleBasedStateMachine):
    ledger_of: Callable[[], AbstractAsyncContextManager[str]] | None = None
    """A new PostgreSQL database per example (set by the test); None: a new SQLite file."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="hail-guard-model-"))
        self.stack = ExitStack()
        self.stack.callback(shutil.rmtree, self.directory, ignore_errors=True)
        self.portal: BlockingPortal = self.stack.enter_context(start_blocking_portal("asyncio"))
        url = None
        if self.ledger_of is not None:
            url = self.stack.enter_context(self.portal.wrap_async_context_manager(self.ledger_of()))
        self.harness: Harness = self.stack.enter_context(
            self.portal.wrap_async_context_manager(open_harness(self.directory, ledger_url=url, timeout_seconds=0.5))
        )
        self.calls: list[Send] = []
        """Every send an agent made, for retries of the very same call."""
        self.faults_at: dict[int, str] = {}
        """The fault planned for each numbered send_email call at the sandbox (at most one waits at a time)."""
        self.answered: list[tuple[str, Any]] = []
        """What every step was answered, in order."""
        self.accepted_answers: set[str] = set()
        """Operations an agent was told are accepted."""
        self.identity: dict[str, tuple[str, str, str]] = {}
        """operation id -> (key, request fingerprint, stored request), as first seen."""
        self.terminal: dict[str, State] = {}
        self.opted_out: set[str] = set()
        self.resolved_by_operator: set[str] = set()
        self.operations: list[Operation] = []

    def teardown(self) -> None:
        self.stack.close()

    # --- helpers ---------------------------------------------------------------------------------

    def run(self, function: Any, *args: Any) -> Any:
        return self.portal.call(function, *args)

    def fault_next_send(self, fault: str | None) -> None:
        nth = self.harness.sandbox.calls("send_email") + 1
        if fault is not None and nth not in self.faults_at:  # one not reached yet still waits for that call
            self.faults_at[nth] = fault
            self.harness.sandbox.add_fault(parse_fault(f"send_email:{nth}:{fault}"))

    def waiting_fault(self) -> str | None:
        return self.faults_at.get(self.harness.sandbox.calls("send_email") + 1)

    def in_state(self, *states: State) -> list[Operation]:
        return [operation for operation in self.operations if operation.state in states]

    def oracle(self) -> Oracle:
        return Oracle(self.operations, self.opted_out)

    async def _all_operations(self) -> list[Operation]:
        return await self.harness.ledger.list_operations(limit=1000)

    def refresh(self) -> list[Operation]:
        self.operations = self.run(self._all_operations)
        return self.operations

    def call(self, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        result: types.CallToolResult = self.run(self.harness.call, tool, arguments)
        self.answered.append((tool, result))
        return result

    # --- rules: agents ---------------------------------------------------------------------------

    @rule(
        lead=leads,
        message=messages,
        subject=st.sampled_from(SUBJECTS),
        allow_duplicate=st.booleans(),
        fault=faults,
    )
    def send(self, lead: int, message: str, subject: str, allow_duplicate: bool, fault: str | None) -> None:
        """An agent sends one message."""
        self.send_and_check(Send(lead, message, subject, allow_duplicate), fault)

    @precondition(lambda self: bool(self.calls))  # the machine's own record: the same on every run
    @rule(pick=picks, fault=faults)
    def retry(self, pick: int, fault: str | None) -> None:
        """An agent re-issues a call it made before, unchanged (a broken stream, a restarted chat)."""
        self.send_and_check(self.calls[pick % len(self.calls)], fault)

    def send_and_check(self, send: Send, fault: str | None) -> None:
        expected = self.oracle().send(send)
        self.fault_next_send(fault)
        waiting = self.waiting_fault()
        self.calls.append(send)
        result = self.call("send_email", send.arguments())
        refusal = refusal_of(result)
        shown = f"{send} with {fault}: expected {expected}, answered {text(result) or data(result)}"
        if expected.refusal is not None:
            assert result.is_error, shown
            assert refusal == expected.refusal, shown
            return
        assert refusal is None, shown
        guard = data(result)["hail_guard"]
        state = State(guard["state"])
        if expected.answered_by:
            assert guard["operation_id"] in expected.answered_by, shown
        else:
            assert guard["operation_id"] not in {op.id for op in self.operations}, f"not a new operation: {shown}"
        assert guard["replayed"] is not expected.forwarded, shown
        if expected.forwarded:
            assert state is FIRST_ATTEMPT[waiting], shown
        else:
            [earlier] = [op for op in self.operations if op.id == guard["operation_id"]]
            lease_ran_out = earlier.state is State.SENDING and state is State.UNKNOWN
            assert state is earlier.state or lease_ran_out, shown
        if state is State.ACCEPTED:
            self.accepted_answers.add(guard["operation_id"])

    @rule()
    def opt_out(self) -> None:
        """The last lead replies STOP (one lead opts out: the others keep the happy path busy)."""
        lead = LEADS - 1
        pending = {op.id for op in self.oracle().to(address(lead)) if op.state in (State.PLANNED, State.READY)}
        self.opted_out.add(address(lead))
        result = self.call("record_opt_out", {"recipient": address(lead), "reason": "replied STOP"})
        assert set(data(result)["cancelled_operations"]) == pending, text(result)

    @rule()
    def opt_in(self) -> None:
        """An operator removes the opt-out (`hail-guard suppress remove`): the lead may be sent to again."""
        lead = LEADS - 1
        removed = self.run(lambda: self.harness.ledger.remove_suppression(address(lead), "all"))
        assert removed is (address(lead) in self.opted_out)
        self.opted_out.discard(address(lead))

    # --- rules: workers --------------------------------------------------------------------------

    @rule(
        message=messages,
        chosen=st.lists(leads, min_size=1, max_size=LEADS, unique=True),
        twice=st.integers(0, 3),
        fault=faults,
    )
    def campaign(self, message: str, chosen: list[int], twice: int, fault: str | None) -> None:
        """One text to some leads (now and then one named twice: a repeated key), planned as a batch, then two
        workers drain it at once."""
        sends = [Send(lead, message) for lead in chosen + chosen[:1] * (twice == 3)]
        refused_by = self.oracle().plan(sends)
        self.fault_next_send(fault)
        waiting = self.waiting_fault()
        planned = self.call(
            "plan_batch", {"sends": [{"tool": "send_email", "arguments": s.arguments()} for s in sends]}
        )
        if refused_by is not None:
            assert planned.is_error, f"{sends} planned: {refused_by} should refuse it"
            assert refusal_of(planned) == refused_by, f"{sends}: {text(planned)}"
            return
        assert not planned.is_error, f"a campaign no rule stops was refused: {sends}: {text(planned)}"
        batch_id = data(planned)["batch_id"]
        before = {op.recipients[0]: op for op in self.run(self._batch, batch_id)}
        assert sorted(before) == sorted(s.recipient for s in sends), "a batch send is missing or extra"
        for recipient, operation in before.items():
            wanted = State.CANCELLED if recipient in self.opted_out else State.READY
            assert operation.state is wanted, f"{recipient}: planned {operation.state}"
        self.run(self._drain_batch, batch_id)
        after = self.refresh()
        self.check_drained(after, [op for op in after if op.batch_id == batch_id], waiting)

    async def _batch(self, batch_id: str) -> list[Operation]:
        return await self.harness.ledger.list_operations(batch_id=batch_id, limit=100)

    async def _drain_batch(self, batch_id: str) -> None:
        guard = self.harness.proxy.guard
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: drain(guard, concurrency=1, batch_id=batch_id))

    def check_drained(self, everything: list[Operation], drained: list[Operation], fault: str | None) -> None:
        """After a drain nothing is left `ready` but a held send; the first call's fault (whichever send the race
        gave it) is the one outcome that is not `accepted`, but a dropped connection loses every answer on it."""
        oracle = Oracle(everything, self.opted_out)
        for operation in drained:
            if operation.state is State.READY:
                assert oracle.held(operation.recipients[0], but=operation.id), f"{operation.id} left ready, not held"
        sent: Counter[State] = Counter(op.state for op in drained if op.state not in (State.READY, State.CANCELLED))
        faulted = FIRST_ATTEMPT[fault] if sent else State.ACCEPTED
        shown = f"{dict(sent)} with {fault}"
        assert set(sent) <= {faulted, State.ACCEPTED}, shown
        if faulted in (State.ACCEPTED, State.READY):  # a 429 of no wait is sent again by the same drain
            assert set(sent) <= {State.ACCEPTED}, shown
        elif fault == "drop_after_accept":
            assert sent[faulted] >= 1, shown
        else:
            assert sent[faulted] == 1, shown

    @rule(fault=faults)
    def drain_everything(self, fault: str | None) -> None:
        self.fault_next_send(fault)
        ready = {op.id for op in self.in_state(State.READY)}
        self.run(lambda: drain(self.harness.proxy.guard, concurrency=2))
        after = self.refresh()
        oracle = Oracle(after, self.opted_out)
        for operation in after:
            if operation.state is State.READY:
                assert oracle.held(operation.recipients[0], but=operation.id), f"{operation.id} left ready, not held"
        assert not any(op.state is State.READY and op.id not in ready for op in after), "a drain made a send ready"

    @rule(pick=st.one_of(st.none(), picks))
    def reconcile(self, pick: int | None) -> None:
        """Settle every unknown send that is due, or one (drawn whatever the ledger holds: see the module
        docstring)."""
        unknown = self.in_state(State.UNKNOWN)
        if pick is None or not unknown:
            answer = self.call("reconcile", {})
        else:
            answer = self.call("reconcile", {"operation_id": unknown[pick % len(unknown)].id})
        assert not answer.is_error, text(answer)

    @rule(forwarded=st.booleans())
    def crash(self, forwarded: bool) -> None:
        """A worker claims a ready operation with a lease that has already run out, maybe forwards it, and dies
        before recording anything; the ledger finds the lease gone."""
        self.run(self._crash, forwarded)

    async def _crash(self, forwarded: bool) -> None:
        claimed = await self.harness.ledger.claim_ready(owner=CRASH_OWNER, lease_seconds=-1.0)
        for operation in claimed:
            if forwarded:
                await self.harness.sandbox.invoke(operation.tool, operation.arguments())
        await self.harness.ledger.expire_leases()
        for operation in claimed:
            assert (await self.harness.ledger.get(operation.id)).state is State.UNKNOWN, "a dead claim is not unknown"

    # --- rules: the world and operators ----------------------------------------------------------

    @rule(pick=picks, event=st.sampled_from(("email.delivered", "email.bounced", "email.opened")))
    def webhook(self, pick: int, event: str) -> None:
        accepted = [op for op in self.in_state(State.ACCEPTED) if op.provider_id]
        if not accepted:
            return
        operation = accepted[pick % len(accepted)]
        body = json.dumps({"type": event, "data": {"id": operation.provider_id}}).encode()
        hook = webhooks.parse(body, delivery_id=str(uuid.uuid4()), signature=str(uuid.uuid4()))
        outcome = self.run(self.harness.ledger.record_webhook, hook)
        self.answered.append(("webhook", outcome))
        assert outcome == "applied", f"{event} for {operation.id}: {outcome}"
        after = self.run(self.harness.ledger.get, operation.id)
        assert after.state is State.ACCEPTED, "delivery changed an accepted send's state"
        assert after.delivery_state is not None, "a delivery event was not recorded"

    @rule(pick=picks, decision=st.sampled_from(REVIEW_DECISIONS))
    def resolve_review(self, pick: int, decision: State) -> None:
        waiting = self.in_state(State.NEEDS_REVIEW)
        if not waiting:
            return
        operation = waiting[pick % len(waiting)]
        self.resolved_by_operator.add(operation.id)
        decided = self.run(
            lambda: self.harness.ledger.resolve_review(
                operation.id, state=decision, reason="checked in Hail's console", actor="operator"
            )
        )
        self.answered.append(("resolve_review", decided))
        assert (decided.id, decided.state) == (operation.id, decision)

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def the_promise_holds(self) -> None:
        """Read the ledger once, then check it (invariants run in no order of ours)."""
        self.refresh()
        self.each_recipient_has_exactly_what_reached_them()
        self.answers_and_states_stand()
        self.states_move_only_as_lifecycle_allows()

    def each_recipient_has_exactly_what_reached_them(self) -> None:
        outbox = self.harness.sandbox.outbox
        by_key = {operation.idempotency_key: operation for operation in self.operations}

        keys = [operation.idempotency_key for operation in self.operations]
        assert len(keys) == len(set(keys)), "two operations share a key"
        sent_keys = Counter(line["idempotency_key"] for line in outbox)
        assert max(sent_keys.values(), default=1) == 1, f"a logical send reached Hail twice: {sent_keys}"
        assert set(sent_keys) <= set(by_key), "something reached Hail that the ledger never recorded"

        for lead in range(LEADS):
            recipient = address(lead)
            received = {line["idempotency_key"] for line in outbox if recipient in line["to"]}
            mine = {op.idempotency_key: op for op in self.operations if recipient in op.recipients}
            assert received <= set(mine), f"{recipient} got a message meant for someone else"
            for key, operation in mine.items():
                if operation.id in self.resolved_by_operator:
                    continue  # an operator's word on what may have left
                if operation.state is State.ACCEPTED:
                    assert key in received, f"{operation.id} is accepted but {recipient} never got it"
                elif operation.state not in MAY_HAVE_REACHED:
                    assert key not in received, f"{recipient} got {operation.id}, recorded {operation.state}"

        for line in outbox:
            operation = by_key[line["idempotency_key"]]
            assert line["request"] == sent_request(operation), f"{operation.id} was sent with other content"

    def answers_and_states_stand(self) -> None:
        now = {operation.id: operation for operation in self.operations}
        assert set(self.identity) <= set(now), f"operations lost: {set(self.identity) - set(now)}"
        for operation_id in self.accepted_answers:
            assert now[operation_id].state is State.ACCEPTED, f"{operation_id} was answered accepted"
        for operation in self.operations:
            identity = (operation.idempotency_key, operation.request_fingerprint, operation.request)
            assert self.identity.setdefault(operation.id, identity) == identity, f"{operation.id} changed key/request"
            if operation.id in self.terminal:
                assert operation.state is self.terminal[operation.id], f"{operation.id} left {operation.state}"
            elif operation.state in TERMINAL:
                self.terminal[operation.id] = operation.state
            if operation.recipients[0] in self.opted_out:
                assert operation.state not in (State.PLANNED, State.READY), f"{operation.id} waits after an opt-out"

    def states_move_only_as_lifecycle_allows(self) -> None:
        for operation in self.operations:
            events = self.portal.call(self.harness.ledger.events, operation.id)
            assert events, f"{operation.id} has no events"
            assert events[0].from_state is None, f"{operation.id} has no creating event"
            for earlier, later in itertools.pairwise(events):
                assert earlier.to_state is later.from_state, f"{operation.id}: events do not chain"
            for move in events:
                assert is_legal(move.from_state, move.to_state), f"{operation.id}: {move.from_state} -> {move.to_state}"

            assert events[-1].to_state is operation.state, f"{operation.id} is {operation.state} with no event"


def sent_request(operation: Operation) -> dict[str, Any]:
    """What the sandbox records as the request of a send: the stored request without the key or nulls."""
    return {k: v for k, v in operation.arguments().items() if k != "idempotency_key" and v is not None}


def machine_on(ledger_of: Callable[[], AbstractAsyncContextManager[str]] | None) -> type[GuardMachine]:
    return type("GuardMachineOnLedger", (GuardMachine,), {"ledger_of": staticmethod(ledger_of) if ledger_of else None})


@pytest.fixture(params=["sqlite", "postgres"])
def machine(request: pytest.FixtureRequest) -> type[GuardMachine]:
    if request.param == "sqlite":
        return machine_on(None)
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return machine_on(server.database)


def test_guard_answers_as_its_rules_say_under_any_sequence_of_events(machine: type[GuardMachine]) -> None:
    examples = 15 if machine.ledger_of is not None else 40  # a PostgreSQL example makes a database: 0.5 s
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 40 s a ledger here, more on shared cores: past the 60 s default
def test_guard_answers_as_its_rules_say_over_longer_runs(machine: type[GuardMachine]) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
