"""What an agent is told: an operation's state in words, the one safe next step, and every failure.

`next_step` names the one safe thing to do about an operation; `headline` says what happened to a
send whose answer is not the upstream's own record; `failure_of` is the one table from our errors (and a
bug) to the text an agent gets, and says when the operator's log must hold what the text leaves out
(the ledger's host, user or path). The server builds the MCP results from these (`hail_guard.views`).

Every text names the upstream as `upstream_name()` says: the display name of the profile in use (`Hail`,
`Resend`, `AgentMail`...), set once where a process or a call learns it (`naming`: the command line for its
whole run, the proxy for each call it serves), so that no text function takes the name as an argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hail_guard.errors import (
    BadInput,
    HailGuardError,
    KeyConflict,
    LedgerUnavailable,
    NotFound,
    OutcomeNotRecorded,
    RefusedByPolicy,
    SignInRequired,
    UpstreamError,
    UpstreamUnavailable,
)
from hail_guard.lifecycle import STATES
from hail_guard.models import Operation, State

DEFAULT_UPSTREAM_NAME = "Hail"
_UPSTREAM_NAME: ContextVar[str] = ContextVar("upstream_name", default=DEFAULT_UPSTREAM_NAME)


def upstream_name() -> str:
    """How texts name the upstream here: the profile's display name (`naming`), else Hail, the default."""
    return _UPSTREAM_NAME.get()


@contextmanager
def naming(name: str) -> Iterator[None]:
    """Texts made inside the block (and in the tasks it starts) name the upstream `name`."""
    token = _UPSTREAM_NAME.set(name)
    try:
        yield
    finally:
        _UPSTREAM_NAME.reset(token)


def state_phrase(operation: Operation) -> str:
    """How an answer names an operation's state, honest about what it means for the recipient."""
    if operation.may_have_left:
        return f"{operation.state.value} (closed by an operator; it may have been sent)"
    return STATES[operation.state].phrase.format(upstream=upstream_name())


_MAY_HAVE_LEFT_STEP = "do not send it again: an operator closed it, and it may have reached the recipient"


def sentence(clause: str) -> str:
    """A clause such as `next_step`'s as a sentence of its own."""
    return clause[:1].upper() + clause[1:]


def next_step(operation: Operation) -> str:
    """The one safe thing to do next about `operation` (a clause: lower case, no full stop)."""
    if operation.resent_as is not None:
        return f"do not send it again: it was superseded by an operator's resend, operation {operation.resent_as}"
    if operation.may_have_left:
        return _MAY_HAVE_LEFT_STEP
    return STATES[operation.state].next_step.format(id=operation.id, upstream=upstream_name())


def headline(operation: Operation) -> str:
    """What happened, in one sentence, for an answer that is not the upstream's own record."""
    if operation.state is State.CANCELLED and operation.may_have_left:
        return f"CLOSED BY AN OPERATOR, MAY HAVE BEEN SENT: {_clause(operation.cancel_reason)}."
    row = STATES[operation.state]
    assert row.headline is not None, f"a {operation.state.value} send is answered with the upstream's record"
    said = getattr(operation, row.reason) if row.reason is not None else None
    reason = _clause(said or row.reason_default.format(upstream=upstream_name()))
    return row.headline.format(upstream=upstream_name(), reason=reason)


def operator_step(state: State, count: int, batch_id: str) -> str | None:
    """What an operator does about the `count` sends a batch run left in `state` (None: nothing to do)."""
    step = STATES[state].operator_step
    return step.format(n=count, batch=batch_id, upstream=upstream_name()) if step is not None else None


_SAID_ALREADY = re.compile(r"(?:^|[;,.]\s*)(?:not sent:|nothing was sent)[.;]?\s*", re.IGNORECASE)
"""What a headline says already, when someone else's sentence says it again."""


def _clause(text: str | None) -> str:
    """Someone else's sentence inside ours: no trailing full stop, no "not sent" said twice."""
    clause = _SAID_ALREADY.sub(lambda said: ". " if said.start() else "", (text or "no reason was given").strip())
    return " ".join(clause.split()).rstrip(".;, ") or "no reason was given"


LEDGER_UNAVAILABLE = (
    "the ledger is unavailable, so hail-guard stopped: nothing is sent that is not recorded first. Retrying later "
    "is safe (the same call is never sent twice); an operator sees the details in hail-guard's log"
)
"""What an agent is told when the ledger fails: never its host, user or path (the log has them)."""
CRASHED = "hail-guard failed unexpectedly; nothing more is known. See its log (stderr)."


@dataclass(frozen=True)
class Failure:
    """What an agent is told when a call fails."""

    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the answer besides `error` (the differing fields of a key conflict, what the upstream said)."""
    logged: bool = False
    """The message leaves out what an operator needs (the ledger's own failure, a bug): log the error."""
    crashed: bool = False
    """Not one of ours: a bug, logged with its traceback."""


def failure_of(error: Exception) -> Failure:
    """The one mapping from an error a call raised to what the agent is told (first match wins)."""
    for kinds, told in _TOLD:
        if isinstance(error, kinds):
            return told(error)
    return Failure(CRASHED, logged=True, crashed=True)


def _not_recorded(error: OutcomeNotRecorded) -> Failure:
    """The guard's message, with the ledger's own failure (host, user, path) left to the log."""
    cause = str(error.__cause__) if error.__cause__ is not None else ""
    message = str(error).replace(cause, "the ledger is unavailable") if cause else str(error)
    said = {"operation_id": error.operation_id, "hail_answer": error.state, "provider_id": error.provider_id}
    return Failure(message, said, logged=True)


_TOLD: tuple[tuple[type[Exception] | tuple[type[Exception], ...], Callable[[Any], Failure]], ...] = (
    (KeyConflict, lambda error: Failure(str(error), {"differing_fields": error.differing_fields})),
    ((BadInput, RefusedByPolicy, NotFound, SignInRequired), lambda error: Failure(str(error))),
    (UpstreamUnavailable, lambda error: Failure(str(error))),
    (UpstreamError, lambda error: Failure(f"{upstream_name()} did not answer: {error}")),
    (OutcomeNotRecorded, _not_recorded),
    (LedgerUnavailable, lambda _: Failure(LEDGER_UNAVAILABLE, logged=True)),
    (HailGuardError, lambda error: Failure(f"hail-guard could not do this: {error}", logged=True)),
)
"""Our errors, most particular first: a refusal, a sign-in or an upstream that could not be reached says all
(one sentence, naming the upstream: nothing was sent); any other failure of the upstream is named; the
ledger's is said without its details, which go to the operator's log."""
