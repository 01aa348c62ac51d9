"""The drill's fifteen scenarios: each names its faults, sets what it expects, and checks as it goes.

A scenario drives the agent (a real MCP client) through a `Rig`; its checks are claims about what
hail-guard does, and the outbox of its sandbox is the ground truth `run_drill` judges afterwards.
Each also has an unguarded twin (`hail_guard.drill.unguarded`): the same agent behaviour straight
against a second sandbox, to show what would have been sent without hail-guard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import anyio

from hail_guard.batch import drain
from hail_guard.drill import unguarded
from hail_guard.drill.report import Tally
from hail_guard.drill.rig import (
    CALL_TIMEOUT_SECONDS,
    MAX_LEADS,
    Drill,
    Rig,
    Run,
    brief,
    check,
    data,
    paraphrased,
    text,
    view,
)
from hail_guard.guard import claim_token
from hail_guard.ledger import Ledger
from hail_guard.models import State
from hail_guard.sandbox import KEY_RETENTION_SECONDS, ManualClock

HANG_TIMEOUT_SECONDS: Final = 0.5
"""hail-guard's upstream timeout in the scenarios where Hail is scripted never to answer."""
CRASH_LEASE_SECONDS: Final = 0.5
"""The lease of the worker that crashes in scenario 9 (the drill waits for it to run out)."""
WORKER_LOOPS: Final = 4
"""Concurrent claim loops in each worker of scenario 5."""
HELD_KEY_MS: Final = 60_000
"""How long another caller holds the key upstream in scenario 8 (released early by the drill)."""


def _only_id(run: Run) -> str | None:
    return str(run.outbox[0]["id"]) if len(run.outbox) == 1 else None


async def _settles_accepted(rig: Rig, run: Run, operation_id: str, claim: str) -> None:
    """Reconcile one operation and check it found the one message Hail really accepted."""
    settled = await rig.reconcile(operation_id)
    check(
        settled["state"] == "accepted" and settled["provider_id"] == _only_id(run),
        f"{claim} (got {settled['state']}, {settled['provider_id']})",
    )


async def _drop_then_retry(drill: Drill, run: Run) -> None:
    run.faults = "Hail accepts, then drops the connection; the agent retries the same call"
    run.expected = 1
    email = drill.lead(1, 0)
    async with drill.rig(1, run, drill.sandbox(1, "send_email:1:drop_after_accept")) as rig:
        first = await rig.send(email, "the dropped send")
        check(first["state"] == "unknown", f"the lost answer is recorded unknown (got {first['state']})")
        retry = await rig.send(email, "the retry")
        check(
            retry.get("replayed") is True and rig.sandbox.calls("send_email") == 1,
            f"the retry is answered from the ledger, not forwarded (Hail got {rig.sandbox.calls('send_email')} calls)",
        )
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the one accepted message")


async def _hang_then_reconcile(drill: Drill, run: Run) -> None:
    run.faults = f"Hail accepts, then never answers (hail-guard times out after {HANG_TIMEOUT_SECONDS:g} s)"
    run.expected = 1
    sandbox = drill.sandbox(2, "send_email:1:hang_after_accept")
    async with drill.rig(2, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS) as rig:
        first = await rig.send(drill.lead(2, 0), "the send that timed out")
        check(first["state"] == "unknown", f"the timeout is recorded unknown (got {first['state']})")
        check("reconcile" in first["next_step"], "the agent is told to reconcile, not to resend")
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the accepted message")


async def _batch_dies_and_resumes(drill: Drill, run: Run) -> None:
    leads, dies_at = drill.options.leads, drill.batch_dies_at()
    run.faults = f"Hail drops the connection after accepting send {dies_at} of {leads}; the run dies"
    run.expected = leads
    sandbox = drill.sandbox(3, f"send_email:{dies_at}:drop_after_accept")
    async with drill.rig(3, run, sandbox) as first:
        batch_id = await first.plan(drill.sends(3, drill.shuffled_leads(3)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.client.call_tool, "run_batch", {"batch_id": batch_id, "concurrency": 4})
            await sandbox.wait_for_outbox(dies_at)
            tg.cancel_scope.cancel()  # the process running the batch dies
        run.saw("run_batch: cut off")
    run.faults += f" ({len(sandbox.outbox)} sent) and a new one resumes"
    async with drill.rig(3, run, sandbox) as second:
        left = (await second.batch("batch_status", batch_id))["counts"]
        check(left.get("unknown", 0) >= 1, f"the dead run left its lost answers unknown (counts {left})")
        resumed_at = await second.ledger.now()
        counts = (await second.batch("run_batch", batch_id, concurrency=8))["counts"]
        check(counts == {"accepted": leads}, f"after the resume every lead is accepted (counts {counts})")
        keys = [entry["idempotency_key"] for entry in sandbox.outbox]
        check(len(set(keys)) == len(keys) == leads, f"one message per lead ({len(set(keys))} keys)")
        settled, sending = await _events_since(second.ledger, batch_id, resumed_at)
        check(
            bool(settled) and (not sending or max(settled) <= min(sending)),
            "the resume checks the unknown sends before it sends anything new",
        )


async def _events_since(ledger: Ledger, batch_id: str, since: datetime) -> tuple[list[datetime], list[datetime]]:
    """When unknown operations were settled, and when operations were claimed to send, since `since`."""
    settled: list[datetime] = []
    sending: list[datetime] = []
    for operation in await ledger.list_operations(batch_id=batch_id, limit=MAX_LEADS):
        for event in await ledger.events(operation.id):
            if event.at >= since and event.from_state is State.UNKNOWN:
                settled.append(event.at)
            elif event.at >= since and event.to_state is State.SENDING:
                sending.append(event.at)
    return settled, sending


async def _changed_message_same_key(drill: Drill, run: Run) -> None:
    edited = drill.changed_field()
    run.faults = f"none; the agent reuses the key with a changed {edited}"
    run.expected = 1
    original = drill.lead(4, 0)
    async with drill.rig(4, run, drill.sandbox(4)) as rig:
        first = await rig.send(original, "the first send")
        check(first["state"] == "accepted", f"the first send is accepted (got {first['state']})")
        result = await rig.call("send_email", {**original, edited: f"{original[edited]} (edited)"})
        answer = data(result)
        check(
            result.is_error and answer.get("differing_fields") == [edited],
            f"the changed message is refused, naming {edited} (got: {brief('send_email', result)})",
        )
        check(rig.sandbox.calls("send_email") == 1, "the changed message never reaches Hail")
        sent = run.outbox[0]["request"][edited] if run.outbox else None
        check(sent == original[edited], "Hail holds the original message")


async def _workers_race(drill: Drill, run: Run) -> None:
    leads, workers = drill.options.leads, drill.options.workers
    run.faults = f"none; {workers} workers x {WORKER_LOOPS} loops claim one batch on one ledger at once"
    run.expected = leads
    sandbox = drill.sandbox(5, latency_seconds=0.001)
    async with drill.rig(5, run, sandbox) as rig, AsyncExitStack() as stack:
        batch_id = await rig.plan(drill.sends(5, drill.shuffled_leads(5)))
        guards = [await stack.enter_async_context(drill.worker(5, sandbox)) for _ in range(workers)]
        dispatched = [0] * workers

        async def work(index: int) -> None:
            dispatched[index] = await drain(guards[index], concurrency=WORKER_LOOPS, batch_id=batch_id)

        async with anyio.create_task_group() as tg:
            for index in range(workers):
                tg.start_soon(work, index)
        run.faults += f" (they sent {' + '.join(str(count) for count in dispatched)})"
        check(sum(dispatched) == leads, f"each operation is dispatched once ({sum(dispatched)} dispatches)")
        calls = sandbox.calls("send_email")
        check(calls == leads, f"Hail is asked once per operation ({calls} calls for {leads})")
        counts = (await rig.batch("batch_status", batch_id))["counts"]
        check(counts == {"accepted": leads}, f"every lead is accepted (counts {counts})")


async def _opt_out_after_approval(drill: Drill, run: Run) -> None:
    leads, opted_out = drill.options.leads, drill.opted_out_lead()
    run.faults = f"none; lead {opted_out} opts out after the batch is approved, before it runs"
    run.expected = leads - 1
    recipient = drill.lead(6, opted_out)["to"][0]
    async with drill.rig(6, run, drill.sandbox(6), require_approval=True) as rig:
        batch_id = await rig.plan(drill.sends(6, drill.shuffled_leads(6)))
        approved = await rig.ledger.approve_batch(batch_id, actor="drill operator")
        check(approved == leads, f"the operator approves the batch ({approved} approved)")
        opt_out = data(
            await rig.call("record_opt_out", {"recipient": recipient.upper(), "channel": "email", "reason": "STOP"})
        )
        counts = (await rig.batch("run_batch", batch_id))["counts"]
        check(all(recipient not in entry["to"] for entry in run.outbox), "nothing reaches the opted-out lead")
        cancelled = opt_out.get("cancelled_operations")
        check(
            isinstance(cancelled, list) and len(cancelled) == 1,
            f"the opt-out cancels the approved send (it cancelled {cancelled})",
        )
        expected = {"accepted": leads - 1, "cancelled": 1} if leads > 1 else {"cancelled": 1}
        check(counts == expected, f"the batch ends {expected} (got {counts})")


async def _saved_failure_replayed(drill: Drill, run: Run) -> None:
    run.faults = "Hail refuses (409, unfamiliar words), saves the refusal and replays it"
    run.expected = 0
    email = drill.lead(7, 0)
    async with drill.rig(7, run, drill.sandbox(7, "send_email:1:fail_before_accept:409")) as rig:
        first = await rig.send(email, "the refused send")
        check(first["state"] == "unknown", f"an error it does not know is unknown at first (got {first['state']})")
        settled = await rig.reconcile(first["operation_id"])
        check(settled["state"] == "failed", f"the repeated answer is taken as final: failed (got {settled['state']})")
        calls = rig.sandbox.calls("send_email")
        retry = await rig.send(email, "the retry")
        again = await rig.reconcile(first["operation_id"])
        check(
            retry.get("replayed") is True and again["state"] == "failed" and rig.sandbox.calls("send_email") == calls,
            "once failed, neither a retry nor reconcile makes a new attempt",
        )


async def _key_still_processing(drill: Drill, run: Run) -> None:
    run.faults = "another caller holds the key at Hail (still processing) while the agent sends"
    run.expected = 1
    held, release = anyio.Event(), anyio.Event()

    async def sleep(seconds: float) -> None:
        if seconds == HELD_KEY_MS / 1000:  # the `processing` fault: hold the key until the drill lets go
            held.set()
            await release.wait()
        else:
            await anyio.sleep(seconds)

    sandbox = drill.sandbox(8, f"send_email:1:processing:{HELD_KEY_MS}", sleep=sleep)
    email = drill.lead(8, 0)
    async with drill.rig(8, run, sandbox) as rig:
        schema = rig.proxy.guarded_schema("send_email") or {}
        _, forwarded = rig.proxy.guard.prepare("send_email", email, schema)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sandbox.invoke, "send_email", forwarded)
            try:
                await held.wait()
                first = await rig.send(email, "the send while Hail holds the key")
                check(first["state"] == "unknown", f"'still processing' is unknown (got {first['state']})")
                waiting = await rig.reconcile(first["operation_id"])
                check(
                    waiting["state"] == "unknown" and not sandbox.outbox,
                    f"reconcile waits: no replacement is sent (got {waiting['state']}, {len(sandbox.outbox)} sent)",
                )
            finally:
                release.set()  # Hail finishes the held send even if a check failed (it runs shielded, like Hail)
        await _settles_accepted(rig, run, first["operation_id"], "once Hail finishes, reconcile finds its one message")


async def _crash_after_acceptance(drill: Drill, run: Run) -> None:
    run.faults = f"Hail accepts a worker's send; the worker dies before recording it (lease {CRASH_LEASE_SECONDS:g} s)"
    run.expected = 1
    async with drill.rig(9, run, drill.sandbox(9)) as rig:
        batch_id = await rig.plan(drill.sends(9, [0]))
        claimed = await rig.ledger.claim_ready(
            owner=claim_token(), lease_seconds=CRASH_LEASE_SECONDS, batch_id=batch_id, limit=1
        )
        check(len(claimed) == 1, "the worker claims the send")
        operation = claimed[0]
        await rig.upstream.call_tool(operation.tool, operation.arguments(), timeout_seconds=CALL_TIMEOUT_SECONDS)
        check(len(run.outbox) == 1, "Hail accepts the crashed worker's send")  # and nothing is recorded
        await rig.batch("run_batch", batch_id)
        check(len(run.outbox) == 1, "a run while the lease holds does not send it again")
        await _until_lease_ends(rig.ledger, operation.lease_expires_at)
        await _settles_accepted(
            rig, run, operation.id, "after the lease, reconcile replays the same key and recovers it accepted"
        )
        counts = (await rig.batch("run_batch", batch_id))["counts"]
        check(counts == {"accepted": 1}, f"a later run sends nothing more (counts {counts})")


async def _until_lease_ends(ledger: Ledger, expires_at: datetime | None) -> None:
    """Wait, on the database's clock, until a lease has run out (the scenario's deadline bounds it)."""
    for _ in range(10):  # the database's clock may run a little behind this process's
        now = await ledger.now()
        if expires_at is None or now >= expires_at:
            return
        await anyio.sleep((expires_at - now).total_seconds() + 0.01)


async def _unknown_past_retention(drill: Drill, run: Run) -> None:
    run.faults = "Hail accepts, never answers, and forgets the key (25 h pass; retention set to 30 min)"
    run.expected = 1
    clock = ManualClock()
    sandbox = drill.sandbox(10, "send_email:1:hang_after_accept", clock=clock)
    email = drill.lead(10, 0)
    async with drill.rig(10, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS, key_retention_hours=0.5) as rig:
        first = await rig.send(email, "the send that timed out")
        check(first["state"] == "unknown", f"the timeout is recorded unknown (got {first['state']})")
        clock.advance(KEY_RETENTION_SECONDS + 3600)
        settled = await rig.reconcile(first["operation_id"])
        check(
            settled["state"] == "needs_review" and "retention" in (settled["review_reason"] or ""),
            f"past the key retention it goes to a human: needs_review (got {settled['state']})",
        )
        retry = await rig.send(email, "the retry")
        check(
            retry.get("replayed") is True and sandbox.calls("send_email") == 1,
            f"no blind resend reaches Hail (it got {sandbox.calls('send_email')} calls)",
        )


async def _new_key_same_content(drill: Drill, run: Run) -> None:
    run.faults = "Hail accepts, then never answers; the agent resends under a key it made up"
    run.expected = 1
    email = drill.lead(11, 0)
    sandbox = drill.sandbox(11, "send_email:1:hang_after_accept")
    async with drill.rig(11, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS) as rig:
        first = await rig.send(email, "the send that timed out")
        minted = await rig.call("send_email", {**email, "idempotency_key": f"agent-{drill.run_id}-retry"})
        answered = view(minted, "the retry under a new key")
        check(
            answered["operation_id"] == first["operation_id"] and answered.get("replayed") is True,
            f"the new key is answered from the first send, {first['operation_id']} "
            f"(got: {brief('send_email', minted)})",
        )
        settled = await rig.reconcile(first["operation_id"])
        check(settled["state"] == "accepted", f"reconcile settles the first send (got {settled['state']})")


async def _gateway_error_hid_success(drill: Drill, run: Run) -> None:
    run.faults = "Hail accepts, but its gateway answers 502; the agent follows the answer"
    run.expected = 1
    email = drill.lead(12, 0)
    async with drill.rig(12, run, drill.sandbox(12, "send_email:1:error_after_accept:502")) as rig:
        first = await rig.send(email, "the send answered 502")
        if first["state"] == "failed":  # told it failed for good, an agent sends a new message (a new key)
            await rig.send({**email, "idempotency_key": f"agent-{drill.run_id}-again"}, "the agent's new message")
        check(first["state"] == "unknown", f"the 5xx is recorded unknown, not failed (got {first['state']})")
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the accepted message behind the 5xx")


def regenerated(email: dict[str, Any]) -> dict[str, Any]:
    """The same email as an LLM writes it again: a null field added, the recipient re-cased, a trailing space."""
    return {
        **email,
        "cc": None,
        "to": [address.upper() for address in email["to"]],
        "body_text": f"{email['body_text']} ",
    }


async def _regenerated_retry(drill: Drill, run: Run) -> None:
    run.faults = "Hail accepts, then drops the connection; the agent writes its retry again, differing in form"
    run.expected = 1
    email = {name: value for name, value in drill.lead(13, 0).items() if name != "metadata"}  # the key: a hash
    async with drill.rig(13, run, drill.sandbox(13, "send_email:1:drop_after_accept")) as rig:
        first = await rig.send(email, "the dropped send")
        check(first["state"] == "unknown", f"the lost answer is recorded unknown (got {first['state']})")
        retry = await rig.send(regenerated(email), "the regenerated retry")
        check(
            retry["operation_id"] == first["operation_id"] and retry.get("replayed") is True,
            f"the retry is recognised by meaning and answered from the first send (got {retry['state']}, "
            f"Hail got {rig.sandbox.calls('send_email')} calls)",
        )
        check("reconcile" in retry["next_step"], "the agent is told to reconcile, not to resend")
        await _settles_accepted(rig, run, first["operation_id"], "reconcile finds the one accepted message")


async def _paraphrased_retry(drill: Drill, run: Run) -> None:
    run.faults = (
        f"Hail accepts, then never answers (hail-guard times out after {HANG_TIMEOUT_SECONDS:g} s); "
        "the agent rewords its retry"
    )
    run.expected = 1
    email = {name: value for name, value in drill.lead(14, 0).items() if name != "metadata"}  # the key: its meaning
    sandbox = drill.sandbox(14, "send_email:1:hang_after_accept")
    async with drill.rig(14, run, sandbox, timeout_seconds=HANG_TIMEOUT_SECONDS) as rig:
        first = await rig.send(email, "the send that timed out")
        check(first["state"] == "unknown", f"the timeout is recorded unknown (got {first['state']})")
        held = await rig.call("send_email", paraphrased(email))
        check(
            held.is_error and first["operation_id"] in text(held) and "reconcile" in text(held),
            f"the reworded retry is held while the first is unknown, naming it (got: {brief('send_email', held)})",
        )
        check(
            sandbox.calls("send_email") == 1,
            f"the reworded retry never reaches Hail ({sandbox.calls('send_email')} calls)",
        )
        settled = await rig.reconcile(first["operation_id"])
        check(settled["state"] == "accepted", f"reconcile settles the first send (got {settled['state']})")
        again = await rig.call("send_email", paraphrased(email))
        check(
            again.is_error and "probably a duplicate" in text(again),
            f"reworded again once the first is accepted, it is a probable duplicate ({brief('send_email', again)})",
        )


async def _one_template_campaign(drill: Drill, run: Run) -> None:
    leads, dies_at = drill.options.leads, drill.batch_dies_at()
    run.faults = f"one text for all {leads} leads; Hail drops the connection after accepting send {dies_at}; resumed"
    run.expected = leads
    sandbox = drill.sandbox(15, f"send_email:{dies_at}:drop_after_accept")
    async with drill.rig(15, run, sandbox) as rig:
        batch_id = await rig.plan(drill.template_sends(15, drill.shuffled_leads(15)))
        first = (await rig.batch("run_batch", batch_id, concurrency=4))["counts"]
        check(first.get("unknown", 0) >= 1, f"the dropped answer is recorded unknown (counts {first})")
        counts = (await rig.batch("run_batch", batch_id, concurrency=4))["counts"]
        check(counts == {"accepted": leads}, f"after the resume every lead is accepted (counts {counts})")
        reached = Counter(recipient for entry in sandbox.outbox for recipient in entry["to"])
        check(
            len(reached) == leads and set(reached.values()) == {1},
            f"each lead got the text once ({len(reached)} leads)",
        )


@dataclass(frozen=True)
class Scenario:
    number: int
    name: str
    body: Callable[[Drill, Run], Awaitable[None]]
    unguarded: Callable[[Drill], Awaitable[Tally]] | None = None
    """The same agent behaviour without hail-guard; returns what that sandbox accepted."""


SCENARIOS: Final[tuple[Scenario, ...]] = (
    Scenario(
        1, "the connection drops after acceptance; the agent retries", _drop_then_retry, unguarded.drop_then_retry
    ),
    Scenario(2, "Hail hangs after acceptance (timeout)", _hang_then_reconcile, unguarded.hang_then_retry),
    Scenario(3, "a batch dies at ~40% and is resumed", _batch_dies_and_resumes, unguarded.batch_dies_and_reruns),
    Scenario(4, "the same key with a changed message", _changed_message_same_key, unguarded.changed_message),
    Scenario(5, "workers claim from the same batch at once", _workers_race, unguarded.workers_race),
    Scenario(6, "an opt-out after approval", _opt_out_after_approval, unguarded.opt_out_after_approval),
    Scenario(7, "a saved failure replayed by Hail", _saved_failure_replayed, unguarded.saved_failure_retried),
    Scenario(8, "the key is still processing upstream", _key_still_processing, unguarded.key_still_processing),
    Scenario(9, "a worker crashes after acceptance, before recording", _crash_after_acceptance, unguarded.crash),
    Scenario(10, "an unknown older than Hail's key retention", _unknown_past_retention, unguarded.past_retention),
    Scenario(11, "the agent mints a new key for the same content", _new_key_same_content, unguarded.new_key),
    Scenario(12, "a gateway 5xx that hid a success", _gateway_error_hid_success, unguarded.gateway_error),
    Scenario(13, "the agent regenerates its retry", _regenerated_retry, unguarded.regenerated_retry),
    Scenario(14, "the agent paraphrases its retry", _paraphrased_retry, unguarded.paraphrased_retry),
    Scenario(15, "a campaign of one template", _one_template_campaign, unguarded.one_template_campaign),
)
