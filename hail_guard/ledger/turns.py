"""Whose turn it is to commit: the writes of one ledger in arrival order, one commit at a time.

Both backends group their send path's writes (`sqlite._Writer`, `postgres_group.GroupCommit`) the same way.
There is no committing task: the caller that finds no commit running commits what is queued (its own write and
whoever joined, `_commit_next`), then hands the turn to the next waiter. A queued write always runs and commits,
even when its caller is cancelled: the caller waits to the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel


@dataclass(eq=False, kw_only=True)
class Turn:
    """One write waiting for its turn, and what came of it."""

    result: Any = None
    error: BaseException | None = None
    done: bool = False
    wake: anyio.Event = field(default_factory=anyio.Event)


T = TypeVar("T", bound=Turn)


class Turns(ABC, Generic[T]):
    """The queue of one ledger's writes; a backend says how the next of them commit (`_commit_next`: take some from
    the front of `_queue`, set each one's `result` or `error`, `done`, and `wake` it)."""

    def __init__(self) -> None:
        self._queue: deque[T] = deque()
        self._busy = False
        self._quiet = anyio.Event()
        self._quiet.set()

    async def run(self, job: T) -> Any:
        """Queue `job`, wait until it is committed (committing it, and whoever joined, when it is this caller's turn)
        and answer its result or raise its error."""
        self._queue.append(job)
        with anyio.CancelScope(shield=True):  # once queued it runs and commits: its caller waits to the end
            while not job.done:
                if self._busy:
                    job.wake = anyio.Event()
                    await job.wake.wait()
                    continue
                self._busy = True
                if self._quiet.is_set():  # one event per stretch of work: `drained` waits on it
                    self._quiet = anyio.Event()
                try:
                    await self._commit_next()
                    await anyio.lowlevel.checkpoint()  # the group's callers, answered, queue their next writes now
                finally:
                    self._busy = False
                    if self._queue:
                        self._queue[0].wake.set()
                    else:
                        self._quiet.set()
        if job.error is not None:
            raise job.error
        return job.result

    async def drained(self) -> None:
        """Return once every write queued so far is committed (or failed)."""
        while self._busy or self._queue:
            await self._quiet.wait()

    @abstractmethod
    async def _commit_next(self) -> None:
        """Commit the next write, or the next group of them, from the front of the queue."""
