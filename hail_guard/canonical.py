"""Canonical JSON: the one function that turns arguments into bytes, and the fingerprint of those bytes.

The same text is hashed for fingerprints, stored in the ledger and forwarded upstream, so a replay is
byte-identical: sorted keys, no insignificant whitespace, UTF-8 kept; NaN and infinities refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from hail_guard.errors import BadInput


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant whitespace, UTF-8 kept; NaN and infinities refused."""
    _refuse_non_finite(value)
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an integer of more than 4,300 digits
        raise BadInput(f"the arguments are not a JSON value hail-guard can record: {exc}") from None


def _refuse_non_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise BadInput(f"{value!r} is not a JSON number; send a finite number or a string")
    if isinstance(value, Mapping):
        for item in value.values():
            _refuse_non_finite(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _refuse_non_finite(item)


def fingerprint(text: str) -> str:
    """SHA-256 of `text` (UTF-8), in hex."""
    return hashlib.sha256(text.encode()).hexdigest()
