"""Crash points: named places in the send path where a test makes hail-guard die on purpose.

A testing hook for the fault campaign (tests/campaigns/test_crash_points.py); NEVER set it in production.
`HAIL_GUARD_CRASH_AT=NAME` (or `NAME:N`) makes the first (or the Nth) time this process reaches the
point NAME end the process with SIGKILL: no cleanup, no shielded ledger write, no flushed buffer,
exactly like the OOM killer or a power cut. The variable is read once, at import; unset, a crash
point costs one comparison. A name that is not in `POINTS` is refused at startup (`check`, called
when a `Guard` is made) rather than silently never firing.

The points, in the order a send meets them:

    before_intent       Guard.send: validated and keyed, nothing recorded yet
    after_intent        Guard.send: `sending` committed under our claim, nothing forwarded yet
    after_claim         batch drain: `claim_ready` committed `sending`, nothing forwarded yet
    after_forward       the request has left and Hail's answer is in memory, not yet read
    after_answer        the answer is classified; its outcome is not yet recorded
    reconcile_claimed   Guard.reconcile: an `unknown` operation is claimed; no lookup or replay yet
    reconcile_answered  Guard.reconcile: the replay or lookup answered; the outcome is not yet recorded
"""

from __future__ import annotations

import os
import signal
from typing import Final, Literal, get_args

import structlog

from hail_guard.errors import ConfigError

log = structlog.get_logger(__name__)

Point = Literal[
    "before_intent",
    "after_intent",
    "after_claim",
    "after_forward",
    "after_answer",
    "reconcile_claimed",
    "reconcile_answered",
]
POINTS: Final[tuple[str, ...]] = get_args(Point)
ENV_VAR: Final = "HAIL_GUARD_CRASH_AT"


def parse(value: str | None) -> tuple[str | None, int]:
    """`NAME` or `NAME:N` -> (the point, which hit kills); (None, 0) when unset. ValueError says what is wrong."""
    if value is None or not value.strip():
        return None, 0
    name, _, count = value.strip().partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV_VAR}={value!r} names no crash point; the points are {', '.join(POINTS)}")
    if not count:
        return name, 1
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV_VAR}={value!r}: the hit count after ':' must be a whole number from 1")
    return name, int(count)


try:
    _ARMED, _KILL_AT_HIT = parse(os.environ.get(ENV_VAR))
    _PROBLEM: str | None = None
except ValueError as _error:
    _ARMED, _KILL_AT_HIT, _PROBLEM = None, 0, str(_error)
_hits = 0


def check() -> None:
    """Refuse (`ConfigError`) a crash point setting that names no point; warn loudly when one is armed."""
    if _PROBLEM is not None:
        raise ConfigError(f"{_PROBLEM} (a testing hook: unset it outside tests)")
    if _ARMED is not None:
        log.warning("crash_point_armed", point=_ARMED, hit=_KILL_AT_HIT, variable=ENV_VAR)


def crash_point(name: Point) -> None:
    """Die here with SIGKILL if `HAIL_GUARD_CRASH_AT` names this point and this is the hit it names."""
    if name != _ARMED:
        return
    global _hits
    _hits += 1
    if _hits == _KILL_AT_HIT:
        log.critical("crash_point_fired", point=name, hit=_hits, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
