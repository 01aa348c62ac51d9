"""The counterfactual: each scenario's agent behaviour straight against a second sandbox, no hail-guard.

The agent makes the same calls with the same arguments as in the guarded run, the way an agent
does without hail-guard: it passes no idempotency key of its own (Hail then makes a fresh one for
every call), and when a call gets no answer or an error it sends again, once. A batch runner sends
its list in order and, after a crash, sends again everything it has no answer for; workers without
a shared ledger each send the whole batch. Each function returns what the sandbox accepted (how many
messages, and the most any one lead got), to be shown beside the guarded run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hail_guard.drill.report import Tally
from hail_guard.drill.rig import Drill, paraphrased
from hail_guard.sandbox import Reply, Sandbox


async def _answered(sandbox: Sandbox, arguments: Mapping[str, Any]) -> bool:
    """One `send_email` as the agent makes it; True when Hail answered with a message."""
    answer = await sandbox.invoke("send_email", dict(arguments))
    return isinstance(answer, Reply) and "error" not in answer.result


async def _send_retrying_once(sandbox: Sandbox, arguments: Mapping[str, Any], **retry: Any) -> None:
    if not await _answered(sandbox, arguments):
        await _answered(sandbox, {**arguments, **retry})


async def _retried(drill: Drill, number: int, fault: str, **retry: Any) -> Tally:
    sandbox = drill.sandbox(number, fault, unguarded=True)
    await _send_retrying_once(sandbox, drill.lead(number, 0), **retry)
    return Tally.of(sandbox.outbox)


async def _run_list(sandbox: Sandbox, sends: Sequence[Mapping[str, Any]]) -> set[int]:
    """Send the list in order until a send gets no answer (the runner dies there); the ones answered."""
    answered: set[int] = set()
    for position, send in enumerate(sends):
        if not await _answered(sandbox, send["arguments"]):
            break
        answered.add(position)
    return answered


async def drop_then_retry(drill: Drill) -> Tally:
    return await _retried(drill, 1, "send_email:1:drop_after_accept")


async def hang_then_retry(drill: Drill) -> Tally:
    return await _retried(drill, 2, "send_email:1:hang_after_accept")


async def batch_dies_and_reruns(drill: Drill) -> Tally:
    sandbox = drill.sandbox(3, f"send_email:{drill.batch_dies_at()}:drop_after_accept", unguarded=True)
    sends = drill.sends(3, drill.shuffled_leads(3))
    answered = await _run_list(sandbox, sends)
    await _run_list(sandbox, [send for position, send in enumerate(sends) if position not in answered])
    return Tally.of(sandbox.outbox)


async def changed_message(drill: Drill) -> Tally:
    sandbox, original, edited = drill.sandbox(4, unguarded=True), drill.lead(4, 0), drill.changed_field()
    await _send_retrying_once(sandbox, original)
    await _send_retrying_once(sandbox, {**original, edited: f"{original[edited]} (edited)"})
    return Tally.of(sandbox.outbox)


async def workers_race(drill: Drill) -> Tally:
    sandbox = drill.sandbox(5, unguarded=True)
    for _ in range(drill.options.workers):
        await _run_list(sandbox, drill.sends(5, drill.shuffled_leads(5)))
    return Tally.of(sandbox.outbox)


async def opt_out_after_approval(drill: Drill) -> Tally:
    sandbox = drill.sandbox(6, unguarded=True)
    await _run_list(sandbox, drill.sends(6, drill.shuffled_leads(6)))  # the approved list, opt-out or not
    return Tally.of(sandbox.outbox)


async def saved_failure_retried(drill: Drill) -> Tally:
    return await _retried(drill, 7, "send_email:1:fail_before_accept:409")


async def key_still_processing(drill: Drill) -> Tally:
    sandbox, email = drill.sandbox(8, unguarded=True), drill.lead(8, 0)
    await _answered(sandbox, {**email, "idempotency_key": f"other-caller-{drill.run_id}"})  # the other caller
    await _send_retrying_once(sandbox, email)
    return Tally.of(sandbox.outbox)


async def crash(drill: Drill) -> Tally:
    sandbox = drill.sandbox(9, unguarded=True)
    await _answered(sandbox, drill.lead(9, 0))  # accepted; the worker dies before it records that
    await _run_list(sandbox, drill.sends(9, [0]))  # the restarted worker has no record of it
    return Tally.of(sandbox.outbox)


async def past_retention(drill: Drill) -> Tally:
    return await _retried(drill, 10, "send_email:1:hang_after_accept")


async def new_key(drill: Drill) -> Tally:
    return await _retried(drill, 11, "send_email:1:hang_after_accept", idempotency_key=f"agent-{drill.run_id}-retry")


async def gateway_error(drill: Drill) -> Tally:
    return await _retried(drill, 12, "send_email:1:error_after_accept:502")


async def regenerated_retry(drill: Drill) -> Tally:
    sandbox = drill.sandbox(13, "send_email:1:drop_after_accept", unguarded=True)
    email = {name: value for name, value in drill.lead(13, 0).items() if name != "metadata"}
    if not await _answered(sandbox, email):
        await _answered(sandbox, {**email, "cc": None, "body_text": f"{email['body_text']} "})
    return Tally.of(sandbox.outbox)


async def paraphrased_retry(drill: Drill) -> Tally:
    sandbox = drill.sandbox(14, "send_email:1:hang_after_accept", unguarded=True)
    email = {name: value for name, value in drill.lead(14, 0).items() if name != "metadata"}
    if not await _answered(sandbox, email):
        await _answered(sandbox, paraphrased(email))
    return Tally.of(sandbox.outbox)


async def one_template_campaign(drill: Drill) -> Tally:
    sandbox = drill.sandbox(15, f"send_email:{drill.batch_dies_at()}:drop_after_accept", unguarded=True)
    sends = drill.template_sends(15, drill.shuffled_leads(15))
    answered = await _run_list(sandbox, sends)
    await _run_list(sandbox, [send for position, send in enumerate(sends) if position not in answered])
    return Tally.of(sandbox.outbox)
