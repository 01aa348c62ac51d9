"""The outbox: the ground truth of what the sandbox really "sent", one entry per accepted message.

Kept in memory (`Outbox.entries`) and, when a path is given, appended to a JSON Lines file, one
line per message, flushed as it is written so another process can count lines while the sandbox
runs. Each entry: `id`, `tool`, `idempotency_key`, `to`, `status` (at acceptance), `accepted_at`
and the `request` as the API received it (the arguments without the key).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio


class Outbox:
    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: list[dict[str, Any]] = []
        self._grew: anyio.Event | None = None

    def append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as file:
                file.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")
                file.flush()
        if self._grew is not None:
            self._grew.set()
            self._grew = None

    async def wait_for(self, count: int) -> None:
        """Return once the outbox holds at least `count` entries."""
        while len(self.entries) < count:
            if self._grew is None:
                self._grew = anyio.Event()
            await self._grew.wait()
