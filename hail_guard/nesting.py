"""How deep JSON may nest: checked before anything parses, validates or serialises it.

Python's JSON parser, jsonschema and `json.dumps` recurse once per level and fail with a
`RecursionError` (a crash, not an answer) near 1,000 levels; an HTTP body of 40 kB of `[` gets
there. Real requests nest a handful of levels (a batch's send's metadata is about 7), so
`MAX_DEPTH` is generous and far from that limit.

- `too_deep(raw)` scans the raw bytes of a body for brackets outside strings (no parsing): the
  HTTP edge (`gate`) and the webhook reader (`webhooks`) refuse such a body with 400.
- `check_arguments(tool, arguments)` walks parsed tool arguments without recursion, for calls that
  arrive already parsed (stdio, in memory): `BadInput` names the limit, nothing is recorded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from hail_guard.errors import BadInput

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects accepted, in a body or in a tool's arguments."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when arrays and objects in the JSON text `raw` nest deeper than `limit` (strings skipped)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # cannot nest deeper than it has openings (the common case: no scan at all)
    depth = 0
    for bracket in _BRACKETS.findall(_STRING.sub(b'""', raw)):
        depth += 1 if bracket in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


def depth_of(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep `value` nests (a scalar: 0, `[]`: 1), counted up to `limit + 1` at most; no recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = _children(item)
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        pending.extend((child, depth + 1) for child in children)
    return deepest


def _children(value: Any) -> Iterable[Any] | None:
    if isinstance(value, Mapping):
        return value.values()
    return value if isinstance(value, list | tuple) else None


def check_arguments(tool: str, arguments: Mapping[str, Any]) -> None:
    """Refuse (`BadInput`) arguments nested deeper than `MAX_DEPTH`, before anything looks inside."""
    if depth_of(arguments) > MAX_DEPTH:
        raise BadInput(
            f"the arguments for {tool} nest deeper than {MAX_DEPTH} levels of arrays and objects; "
            "flatten them and call again (nothing was recorded)"
        )
