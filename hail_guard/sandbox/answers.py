"""What a fake answers a tool call with: plain data that the MCP layer (`server.py`) carries out.

`Sandbox.invoke` and the generic fakes (`hail_guard.fake`) return an `Answer`; `server.serve_tools` turns
it into a result, an isError refusal, or no answer at all (hang until cancelled, or drop the connection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class Reply:
    """An ordinary tool result (Hail's errors are ordinary results too)."""

    result: dict[str, Any]
    text: str | None = None
    """Answer in these words instead, with no structured content (a generic fake's servers that answer so)."""


@dataclass(frozen=True)
class Refusal:
    """A schema-level refusal: the caller sees isError with this text."""

    text: str


@dataclass(frozen=True)
class Withheld:
    """No answer: `hang` waits until cancelled, `drop` closes the connection."""

    how: Literal["hang", "drop"]


Answer = Reply | Refusal | Withheld


class Answering(Protocol):
    """A fake that answers tool calls: the sandbox, or a generic fake."""

    async def invoke(self, tool: str, arguments: Mapping[str, Any] | None) -> Answer: ...
