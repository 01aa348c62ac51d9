"""JSON pointers (RFC 6901): how a profile names a field of a tool's arguments, of its answer, or of its schema.

`/to` is the argument `to`, `/to/0` its first item, `/llm/api_key` a member of an object, `""` the whole
document; `~1` stands for `/` and `~0` for `~` inside a name (`escape` writes them). One extension: `*`
stands for every item of an array (`/emails/*/to`: the `to` of each email of a batch), and `resolve` then
gives the values found, lists flattened, in order. `resolve` reads a value (absent: None), `schema_at`
finds the part of a JSON Schema that describes the value a pointer names, and `shown` is how messages name
a pointer (`to`, `llm.api_key`, `emails.*.to`). Imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class PointerError(ValueError):
    """Text that is not a JSON pointer."""


def parse(pointer: str) -> tuple[str, ...]:
    """The reference tokens of `pointer`; `PointerError` for text that is not a pointer."""
    if pointer == "":
        return ()
    if not pointer.startswith("/"):
        raise PointerError(f"{pointer!r} is not a JSON pointer: write it with a leading slash, as {'/' + pointer!r}")
    tokens = pointer[1:].split("/")
    for token in tokens:
        if "~" in token.replace("~0", "").replace("~1", ""):
            raise PointerError(f"{pointer!r} is not a JSON pointer: a ~ must be written ~0 (and a / inside a name ~1)")
    return tuple(token.replace("~1", "/").replace("~0", "~") for token in tokens)


def escape(name: str) -> str:
    """One name as a pointer's reference token."""
    return name.replace("~", "~0").replace("/", "~1")


def pointer_to(*names: str) -> str:
    """The pointer naming `names`, one level each (`pointer_to("to")` is `/to`)."""
    return "".join(f"/{escape(name)}" for name in names)


EVERY = "*"
"""The token that stands for every item of an array."""


def resolve(document: Any, pointer: str) -> Any:
    """The value `pointer` names in `document`; None when it is absent (or the document has another shape).
    Through a `*`: the list of what each item holds (lists flattened, absent values left out), or None."""
    return _resolve(document, parse(pointer))


def _resolve(document: Any, tokens: tuple[str, ...]) -> Any:
    value = document
    for at, token in enumerate(tokens):
        if token == EVERY and _is_list(value):
            return _every(value, tokens[at + 1 :])
        if isinstance(value, Mapping):
            value = value.get(token)
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes) and _index(token) is not None:
            index = _index(token)
            value = value[index] if index is not None and index < len(value) else None
        else:
            return None
        if value is None:
            return None
    return value


def _every(items: Sequence[Any], rest: tuple[str, ...]) -> list[Any] | None:
    found: list[Any] = []
    for item in items:
        value = _resolve(item, rest)
        found.extend(value if _is_list(value) else [] if value is None else [value])
    return found or None


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def top_level(pointer: str) -> str | None:
    """The argument name of a pointer one level deep (`/to` -> `to`), else None."""
    tokens = parse(pointer)
    return tokens[0] if len(tokens) == 1 else None


def shown(pointer: str) -> str:
    """How a message names a pointer: `to`, `llm.api_key`, `to.0`; the whole document is `(arguments)`."""
    return ".".join(parse(pointer)) or "(arguments)"


def schema_at(schema: Any, pointer: str) -> list[Mapping[str, Any]] | None:
    """The parts of a JSON Schema that describe what `pointer` names (several where `anyOf`/`oneOf` offer
    alternatives); [] when the schema says nothing either way (free-form); None when it rules it out."""
    found: list[Mapping[str, Any]] = [schema] if isinstance(schema, Mapping) else []
    for token in parse(pointer):
        step: list[Mapping[str, Any]] = []
        free = False
        for part in _alternatives(found):
            described, open_ended = _child(part, token)
            step.extend(described)
            free = free or open_ended
        if not step:
            return [] if free or not found else None
        found = step
    return found


def _alternatives(parts: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each part, and the alternatives its `anyOf`/`oneOf`/`allOf` offer (at any depth)."""
    out: list[Mapping[str, Any]] = []
    for part in parts:
        out.append(part)
        choices = [
            choice
            for key in ("anyOf", "oneOf", "allOf")
            for choice in part.get(key) or ()
            if isinstance(choice, Mapping)
        ]
        out.extend(_alternatives(choices))
    return out


def _child(part: Mapping[str, Any], token: str) -> tuple[list[Mapping[str, Any]], bool]:
    """The schemas of `token` inside `part`, and whether `part` leaves it open (says nothing either way)."""
    declared = part.get("type")
    kinds = set(declared) if isinstance(declared, list) else ({declared} if isinstance(declared, str) else set())
    properties, items, extra = part.get("properties"), part.get("items"), part.get("additionalProperties")
    if isinstance(properties, Mapping) and isinstance(properties.get(token), Mapping):
        return [properties[token]], False
    if isinstance(extra, Mapping):
        return [extra], False
    if (_index(token) is not None or token == EVERY) and isinstance(items, Mapping):
        return [items], False
    object_open = (not kinds or "object" in kinds) and not isinstance(properties, Mapping) and extra is not False
    array_open = (
        (not kinds or "array" in kinds) and "items" not in part and (_index(token) is not None or token == EVERY)
    )
    return [], object_open or array_open


def _index(part: str) -> int | None:
    """An array index as RFC 6901 writes one (digits, no leading zero), else None."""
    return int(part) if part.isdigit() and (part == "0" or not part.startswith("0")) else None


def present(document: Any, pointer: str) -> bool:
    """Whether `pointer` names a member of `document` (even one whose value is null)."""
    tokens = parse(pointer)
    if not tokens:
        return True
    parent = resolve(document, "".join(f"/{escape(token)}" for token in tokens[:-1]))
    if isinstance(parent, Mapping):
        return tokens[-1] in parent
    return resolve(document, pointer) is not None
