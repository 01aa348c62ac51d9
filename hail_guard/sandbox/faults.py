"""Scripted faults: what goes wrong, on which call of which tool.

A fault is written `TOOL:N:KIND[:ARG]` on the command line (`--fault`, repeatable) and built with
`parse_fault`, or made directly as `Fault(tool=..., nth=..., kind=...)`. N is the Nth call of that
tool (1-based, every `tools/call` of it counts, even one refused by the schema) or `*` for every
call. Kinds, in the order they act on a call:

    delay:MS                  wait MS milliseconds before doing anything (cancellable)
    fail_before_accept:STATUS Hail refuses with STATUS. 401 and 429 come before the key check and
                              save nothing (429 reads `rate limit exceeded (retry after N seconds)`,
                              N from `:STATUS:N`, default 7); 503 on place_call releases the key;
                              any other status is saved under the key and replayed.
    processing:MS             the key stays in flight MS milliseconds: meanwhile same-key calls get
                              "still processing"; then the request completes normally.
    malformed                 the message is sent and saved, but the answer is one Hail's own client
                              cannot read: `{"error": "sent_at: Input should be a valid datetime"}`,
                              a field the request never had. Same-key replays repeat it.
    error_after_accept:STATUS sent and saved, but the caller gets `hail upstream error: STATUS` (5xx);
                              a same-key replay returns the saved success.
    hang_after_accept         sent and saved; the answer never comes (the handler waits until cancelled).
    drop_after_accept         sent and saved; then the connection is closed under the caller.

Faults named `*_after_accept`, `processing` and `malformed` act only on a call that is accepted
(a new key); a replay, a conflict or an in-flight answer is given normally. On the read tools and
`create_contact` the action is simply done: `delay`, `fail_before_accept` (nothing saved),
`error_after_accept`, `hang_after_accept` and `drop_after_accept` apply; `processing` and
`malformed` are for the send tools only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Final, Literal, cast, get_args

from hail_guard.sandbox.tools import SEND_TOOLS, TOOL_NAMES

FaultKind = Literal[
    "delay",
    "fail_before_accept",
    "processing",
    "malformed",
    "error_after_accept",
    "hang_after_accept",
    "drop_after_accept",
]
FAULT_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)

DEFAULT_RETRY_AFTER_SECONDS: Final = 7
"""The retry-after a scripted 429 announces unless told otherwise (Hail's observed example)."""

_MILLISECOND_KINDS: Final = frozenset({"delay", "processing"})
_STATUS_KINDS: Final = frozenset({"fail_before_accept", "error_after_accept"})
_SEND_ONLY_KINDS: Final = frozenset({"processing", "malformed"})
SPEC_FORMAT: Final = "TOOL:N:KIND[:ARG] (e.g. send_email:2:hang_after_accept, send_sms:*:delay:500)"


@dataclass(frozen=True)
class Fault:
    """One scripted misbehaviour. `arg` is milliseconds (delay, processing) or an HTTP status."""

    tool: str
    nth: int | None
    kind: FaultKind
    arg: int | None = None
    retry_after_seconds: int = DEFAULT_RETRY_AFTER_SECONDS
    tools: Collection[str] = field(default=TOOL_NAMES, compare=False, repr=False)
    """The tools of the fake it is for (the sandbox's: Hail's; a generic fake's: its own)."""
    sends: Collection[str] = field(default=SEND_TOOLS, compare=False, repr=False)
    """Those of `tools` that send (`processing` and `malformed` apply to them only)."""

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        if self.tool not in self.tools:
            return f"unknown tool {self.tool!r}; tools are {', '.join(self.tools)}"
        if self.nth is not None and self.nth < 1:
            return f"N must be a call number from 1, or * for every call, not {self.nth}"
        if self.kind not in FAULT_KINDS:
            return f"unknown fault kind {self.kind!r}; kinds are {', '.join(FAULT_KINDS)}"
        if self.kind in _SEND_ONLY_KINDS and self.tool not in self.sends:
            return f"{self.kind} applies to the send tools only, not {self.tool}"
        if self.retry_after_seconds < 0:
            return f"retry-after must not be negative, not {self.retry_after_seconds}"
        return self._arg_problem()

    def _arg_problem(self) -> str | None:
        if self.kind in _MILLISECOND_KINDS:
            if self.arg is None or self.arg < 0:
                return f"{self.kind} needs a duration in milliseconds (>= 0), e.g. {self.kind}:500"
        elif self.kind == "fail_before_accept":
            if self.arg is None or not 400 <= self.arg <= 599:
                return "fail_before_accept needs an HTTP status from 400 to 599, e.g. fail_before_accept:429"
        elif self.kind == "error_after_accept":
            if self.arg is None or not 500 <= self.arg <= 599:
                return "error_after_accept needs a gateway status from 500 to 599, e.g. error_after_accept:502"
        elif self.arg is not None:
            return f"{self.kind} takes no argument"
        return None

    def spec(self) -> str:
        """This fault written the way `parse_fault` reads it."""
        parts = [self.tool, "*" if self.nth is None else str(self.nth), self.kind]
        if self.arg is not None:
            parts.append(str(self.arg))
        if self.kind == "fail_before_accept" and self.arg == 429:
            parts.append(str(self.retry_after_seconds))
        return ":".join(parts)


def _number(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{what} must be a whole number, not {text!r}")
    return int(text)


def _from_parts(
    tool: str, nth_text: str, kind: str, rest: list[str], tools: Collection[str], sends: Collection[str]
) -> Fault:
    nth = None if nth_text == "*" else _number(nth_text, "N")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; kinds are {', '.join(FAULT_KINDS)}")
    retry_after = DEFAULT_RETRY_AFTER_SECONDS
    if kind == "fail_before_accept" and rest[:1] == ["429"] and len(rest) == 2:
        retry_after = _number(rest.pop(), "retry-after seconds")
    if len(rest) > 1:
        raise ValueError(f"too many parts; expected {SPEC_FORMAT}")
    arg = _number(rest[0], "ARG") if rest else None
    return Fault(tool, nth, cast(FaultKind, kind), arg, retry_after_seconds=retry_after, tools=tools, sends=sends)


def parse_fault(spec: str, *, tools: Collection[str] = TOOL_NAMES, sends: Collection[str] = SEND_TOOLS) -> Fault:
    """Read `TOOL:N:KIND[:ARG]` for a fake with `tools` (Hail's by default), of which `sends` send; raise
    ValueError saying what is wrong and what is expected."""
    parts = spec.strip().split(":")
    if len(parts) < 3 or not all(parts):
        raise ValueError(f"bad fault {spec!r}: expected {SPEC_FORMAT}")
    tool, nth_text, kind, *rest = parts
    try:
        return _from_parts(tool, nth_text, kind, rest, tools, sends)
    except ValueError as error:
        raise ValueError(f"bad fault {spec!r}: {error}") from None


class FaultPlan:
    """The faults in force and how many calls each tool has had; pick the faults for a new call."""

    def __init__(self, faults: tuple[Fault, ...] = ()) -> None:
        self._faults = list(faults)
        self._calls: Counter[str] = Counter()

    @property
    def faults(self) -> tuple[Fault, ...]:
        return tuple(self._faults)

    def add(self, fault: Fault) -> None:
        self._faults.append(fault)

    def calls(self, tool: str) -> int:
        return self._calls[tool]

    def arrive(self, tool: str) -> dict[str, Fault]:
        """Count a call of `tool` and return its faults by kind (the first of a kind wins)."""
        self._calls[tool] += 1
        number = self._calls[tool]
        chosen: dict[str, Fault] = {}
        for fault in self._faults:
            if fault.tool == tool and fault.nth in (None, number):
                chosen.setdefault(fault.kind, fault)
        return chosen
