"""Hail's idempotency keys, as the API keeps them: one namespace for the whole organisation.

A request is identified by the SHA-256 of the canonical JSON of its whole body (and the endpoint it
was sent to, so `k1` on `send_email` and `k1` on `send_sms` collide). A claim on a key is decided
synchronously, with no await between the check and the reservation, so on one event loop no two
requests can both take a key.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Final

KEY_RETENTION_SECONDS: Final = 24 * 3600
"""After this long a completed key is forgotten: a replay then runs again (and sends again)."""

CONFLICT_TEXT: Final = "idempotency key reused with a different request body"
PROCESSING_TEXT: Final = "request with this idempotency key is still processing"


def canonical_json(value: Any) -> str:
    """The one JSON spelling of `value`: sorted keys, no spaces, UTF-8 kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def request_hash(endpoint: str, body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({"endpoint": endpoint, "body": body}).encode()).hexdigest()


class Claim(Enum):
    NEW = "new"
    CONFLICT = "conflict"
    IN_FLIGHT = "in_flight"
    REPLAY = "replay"


@dataclass
class _Entry:
    request_hash: str
    claimed_at: datetime
    result: dict[str, Any] | None = None


class KeyStore:
    """Keys in flight and completed, with the saved answer of each completed one."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def claim(self, key: str, body_hash: str, now: datetime) -> tuple[Claim, dict[str, Any] | None]:
        """Decide what a request under `key` gets; on NEW the key is now in flight."""
        entry = self._entries.get(key)
        if entry is not None and entry.result is not None and self._expired(entry, now):
            entry = None
        if entry is None:
            self._entries[key] = _Entry(request_hash=body_hash, claimed_at=now)
            return Claim.NEW, None
        if entry.request_hash != body_hash:
            return Claim.CONFLICT, None
        if entry.result is None:
            return Claim.IN_FLIGHT, None
        return Claim.REPLAY, copy.deepcopy(entry.result)

    def complete(self, key: str, result: dict[str, Any]) -> None:
        """Save the answer of the request in flight under `key`."""
        self._entries[key].result = copy.deepcopy(result)

    def release(self, key: str) -> None:
        """Forget `key`: the next request under it runs afresh."""
        self._entries.pop(key, None)

    def in_flight(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.result is None

    @staticmethod
    def _expired(entry: _Entry, now: datetime) -> bool:
        return now - entry.claimed_at > timedelta(seconds=KEY_RETENTION_SECONDS)
