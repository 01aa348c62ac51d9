"""`FakeUpstream`: a generic fake MCP server that sends, reads back and lists messages, as its `Surface` says.

The same faults as the sandbox (`--fault TOOL:N:KIND[:ARG]`, `hail_guard.sandbox.faults`) and the same outbox
(one JSON line per message really "sent"). A send goes through, in order:

    delay -> schema check (nothing saved) -> fail_before_accept (nothing saved) -> the key check, where the
    server takes one (same key and body: the first answer again; another body: its conflict) -> accept:
    record, outbox -> the answer, possibly spoiled by malformed, error_after_accept, hang or drop.

From the key check on a send runs to completion even if its caller leaves, as a real server's would. With
an outbox file that exists already, its messages are the fake's again (a restarted fake remembers what it
sent, so that reading back and listing still find them).
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from jsonschema import Draft202012Validator

from hail_guard.fake.surfaces import Surface
from hail_guard.sandbox.answers import Answer, Refusal, Reply, Withheld
from hail_guard.sandbox.clock import Clock, Sleep, system_clock
from hail_guard.sandbox.faults import Fault, FaultPlan
from hail_guard.sandbox.outbox import Outbox
from hail_guard.sandbox.server import serve_tools

if TYPE_CHECKING:
    from mcp.server import Server

MALFORMED_TEXT = "<html><body>502 Bad Gateway</body></html>"
"""What a `malformed` fault answers: the message was sent, the answer cannot be read."""


class FakeUpstream:
    """One fake server: its surface's tools, its messages, the keys it saw, faults and an outbox."""

    def __init__(
        self,
        surface: Surface,
        *,
        faults: Iterable[Fault] = (),
        outbox_path: str | os.PathLike[str] | None = None,
        clock: Clock = system_clock,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        self.surface = surface
        self._plan = FaultPlan(tuple(faults))
        self._clock = clock
        self._sleep = sleep
        self._records: list[dict[str, Any]] = _remembered(outbox_path)
        self._outbox = Outbox(outbox_path)
        self._keys: dict[str, tuple[str, Answer]] = {}
        self._validators = {tool.name: Draft202012Validator(tool.input_schema) for tool in surface.tools}

    @property
    def outbox(self) -> list[dict[str, Any]]:
        """Every message accepted since this fake started, oldest first (the outbox file holds them all)."""
        return self._outbox.entries

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every message the fake holds, oldest first (what reading back and listing see)."""
        return self._records

    async def wait_for_outbox(self, count: int) -> None:
        """Return once at least `count` messages were accepted (bound it with `anyio.fail_after`)."""
        await self._outbox.wait_for(count)

    def add_fault(self, fault: Fault) -> None:
        self._plan.add(fault)

    def calls(self, tool: str) -> int:
        return self._plan.calls(tool)

    def server(self) -> Server[Any]:
        """A low-level MCP server over this fake (a new one per call; all share this state)."""
        surface = self.surface
        schemas = {tool.name: dict(tool.input_schema) for tool in surface.tools}
        return serve_tools(
            self.invoke, list(surface.tools), schemas.get, name=surface.name, instructions=surface.instructions
        )

    async def invoke(self, tool: str, arguments: Mapping[str, Any] | None) -> Answer:
        """Answer one tool call as the surface's server would."""
        faults = self._plan.arrive(tool)
        if (delay := faults.get("delay")) is not None:
            await self._sleep((delay.arg or 0) / 1000)
        validator = self._validators.get(tool)
        if validator is None:
            return Refusal(f"Unknown tool: {tool}")
        args = dict(arguments or {})
        problem = next(iter(validator.iter_errors(args)), None)
        if problem is not None:
            where = ".".join(str(part) for part in problem.absolute_path) or "(arguments)"
            return Refusal(f"Invalid arguments for tool {tool}: {where}: {problem.message}")
        if (failure := faults.get("fail_before_accept")) is not None:
            return self.surface.error(failure.arg or 500)
        if tool in self.surface.sends:
            return await self._send(tool, args, faults)
        return _spoil(self._read(tool, args), faults, self.surface)

    async def _send(self, tool: str, args: dict[str, Any], faults: dict[str, Fault]) -> Answer:
        send = self.surface.sends[tool]
        key = args.pop(send.key, None) if send.key is not None else None
        body = json.dumps({"tool": tool, **args}, sort_keys=True, default=str)
        if key is not None and key in self._keys:
            saved_body, saved = self._keys[key]
            return saved if saved_body == body else self.surface.error(409, "conflict")
        answer = self._accept(tool, key, args, "malformed" in faults)  # no await: a cancelled caller cannot stop it
        if key is not None:
            self._keys[key] = (body, answer)
        return _spoil(answer, faults, self.surface)

    def _accept(self, tool: str, key: str | None, args: dict[str, Any], malformed: bool) -> Answer:
        send = self.surface.sends[tool]
        now = self._clock()
        record = send.record(tool, args, str(uuid.uuid4()), now)
        self._records.append(record)
        to = [value for name in send.recipients for value in _listed(args.get(name))]
        self._outbox.append(
            {
                "id": record[send.id_field],
                "tool": tool,
                "idempotency_key": key,
                "to": to,
                "accepted_at": now.isoformat(),
                "request": copy.deepcopy(args),
                "record": record,
            }
        )
        return Reply({}, text=MALFORMED_TEXT) if malformed else send.answer(record)

    def _read(self, tool: str, args: dict[str, Any]) -> Answer:
        surface = self.surface
        if tool in surface.gets:
            get = surface.gets[tool]
            wanted = args.get(get.id_argument)
            found = next((r for r in reversed(self._records) if str(r.get(get.id_field)) == str(wanted)), None)
            return get.answer(found, str(wanted))
        if tool in surface.lists:
            lister = surface.lists[tool]
            return lister.answer([record for record in reversed(self._records) if lister.keeps(record, args)], args)
        return surface.error(404, f"{tool} does nothing in this fake")


def _spoil(answer: Answer, faults: dict[str, Fault], surface: Surface) -> Answer:
    """The answer the caller gets once the work is done, after any answer-spoiling fault."""
    if "drop_after_accept" in faults:
        return Withheld("drop")
    if "hang_after_accept" in faults:
        return Withheld("hang")
    if (gateway := faults.get("error_after_accept")) is not None:
        return surface.error(gateway.arg or 502)
    return answer


def _listed(value: object) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _remembered(path: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """The messages an existing outbox file holds (a fake started again over it)."""
    if path is None or not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        entry = json.loads(line) if line.strip() else None
        if isinstance(entry, dict) and isinstance(entry.get("record"), dict):
            records.append(entry["record"])
    return records
