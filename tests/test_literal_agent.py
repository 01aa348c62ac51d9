"""A literal agent: it does whatever an answer names, and regenerates every retry. Nothing reaches anyone twice.

The agent below reads each answer's text and does what it says: it calls `reconcile` or `get_operation`
when named, sets `allow_duplicate` when the flag is mentioned, mints a new key when a new key is
mentioned, sends to "the others alone" when told that is fine, and calls again when told to. Each
retry it makes is regenerated (a null field added, the recipient re-cased, whitespace changed), as an
LLM's is. From every fault the drill rehearses, the sandbox must deliver each message to each
recipient at most once (exactly once when Hail accepted it).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hail_guard.sandbox import Sandbox, parse_fault
from tests.conftest import data, open_harness, text
from tests.postgres import PostgresServer
from tests.test_retries import ADA, BOB, delivered, message

_OPERATION = re.compile(r"operation_id=([0-9a-f-]{36})")
_OTHERS = re.compile(r"to the others alone \(([^)]*)\)")
STEPS = 12
"""Answers the agent follows at most before it stops."""


def regenerated(arguments: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The same message as an LLM writes it again: another form each time."""
    forms: list[dict[str, Any]] = [
        {"cc": None},
        {"to": [recipient.upper() for recipient in arguments["to"]]},
        {"body_text": f"  {arguments['body_text']}\n"},
        {"body_html": None, "bcc": []},
        {"from_": None},
        {"metadata": {"attempt": attempt}},
    ]
    return {**arguments, **forms[attempt % len(forms)]}


@dataclass
class LiteralAgent:
    """Follows every instruction it reads. `log` is what it did, step by step."""

    call: Any
    log: list[str] = field(default_factory=list)

    async def send(self, arguments: dict[str, Any]) -> None:
        current = dict(arguments)
        answer = await self.call("send_email", current)
        for attempt in range(1, STEPS + 1):
            words = self._words(answer)
            operation = _OPERATION.search(words)
            if "reconcile" in words and operation:
                self.log.append("reconcile")
                await self.call("reconcile", {"operation_id": operation.group(1)})
                answer = await self.call("send_email", regenerated(current, attempt))  # and then it retries
            elif "allow_duplicate" in words and not current.get("allow_duplicate"):
                self.log.append("allow_duplicate")
                current = {**current, "allow_duplicate": True}
                answer = await self.call("send_email", regenerated(current, attempt))
            elif "new key" in words or "new idempotency" in words:
                self.log.append("new key")
                current = {**current, "idempotency_key": f"minted-{attempt}"}
                answer = await self.call("send_email", regenerated(current, attempt))
            elif (others := _OTHERS.search(words)) is not None:
                self.log.append("to the others alone")
                current = {**current, "to": [name.strip() for name in others.group(1).split(",")]}
                answer = await self.call("send_email", regenerated(current, attempt))
            elif "get_operation" in words and operation:
                self.log.append("get_operation")
                answer = await self.call("get_operation", {"operation_id": operation.group(1)})
            elif "call again" in words or "try again" in words or "not sent yet" in words:
                self.log.append("call again")
                answer = await self.call("send_email", regenerated(current, attempt))
            else:
                return

    @staticmethod
    def _words(answer: Any) -> str:
        view = data(answer).get("hail_guard") if isinstance(data(answer), dict) else None
        step = view.get("next_step", "") if isinstance(view, dict) else ""
        return f"{text(answer)} {step}".lower().replace("do not", "do-not")


FAULTS = [
    "send_email:1:drop_after_accept",
    "send_email:1:hang_after_accept",
    "send_email:1:error_after_accept:502",
    "send_email:1:malformed",
    "send_email:*:malformed",
    "send_email:1:processing:1500",
    "send_email:1:fail_before_accept:429",
    "send_email:1:fail_before_accept:401",
    "send_email:1:fail_before_accept:402",
    "send_email:1:fail_before_accept:409",
    "send_email:1:delay:3000",
]
"""The faults the drill rehearses, on the agent's first send, and ones Hail's answers add."""


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_literal_agent_never_gets_a_message_delivered_twice(tmp_path: Path, fault: str) -> None:
    sandbox = Sandbox(faults=[parse_fault(fault)])
    async with open_harness(tmp_path, sandbox=sandbox) as harness, harness.client() as client:
        agent = LiteralAgent(client.call_tool)
        with anyio.fail_after(60):
            await agent.send(message(to=[ADA, BOB]))
        counts = delivered(harness.sandbox)
        assert max(counts.values(), default=0) <= 1, (fault, agent.log, counts)
        if "after_accept" in fault or "malformed" in fault or "processing" in fault:
            assert counts == {ADA: 1, BOB: 1}, (fault, agent.log)


async def test_a_literal_agent_changing_its_recipients_never_doubles_anyone(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept") as harness, harness.client() as client:
        agent = LiteralAgent(client.call_tool)
        await agent.send(message(to=[ADA]))
        await agent.send(message(to=[ADA, BOB]))  # it adds a colleague on its retry
        await agent.send(message(to=[BOB]))
        assert delivered(harness.sandbox) == Counter({ADA: 1, BOB: 1}), agent.log


_variation = st.fixed_dictionaries(
    {},
    optional={
        "cc": st.sampled_from([None, []]),
        "bcc": st.sampled_from([None, []]),
        "body_html": st.none(),
        "from_": st.sampled_from([None, "sales@example.com", "SALES@Example.com "]),
        "metadata": st.dictionaries(st.sampled_from(["a", "b", "attempt"]), st.integers(0, 9), max_size=2),
        "message_type": st.sampled_from(["informational"]),
        "consent_source": st.sampled_from(["signup", "form 2026"]),
    },
)
_spacing = st.sampled_from(["{}", " {}", "{} ", "{}\n", "  {}  "])
_casing = st.sampled_from([str.lower, str.upper, str.title, lambda s: s])


async def _variations_hold(folder: Path, retries: list[tuple[dict[str, Any], str, Any]], url: str | None) -> None:
    async with open_harness(folder, ledger_url=url) as harness, harness.client() as agent:
        first = data(await agent.call_tool("send_email", message()))["hail_guard"]
        for changes, spacing, casing in retries:
            retry = message(**changes, to=[casing(ADA)], body_text=spacing.format(message()["body_text"]))
            answer = data(await agent.call_tool("send_email", retry))
            assert answer["hail_guard"]["operation_id"] == first["operation_id"], (changes, retry)
        assert delivered(harness.sandbox) == {ADA: 1}


_VARIATIONS = given(st.lists(st.tuples(_variation, _spacing, _casing), min_size=1, max_size=4))
_EXAMPLES = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_EXAMPLES
@_VARIATIONS
def test_any_form_only_variation_of_a_send_is_the_same_send_on_sqlite(
    tmp_path_factory: pytest.TempPathFactory, retries: list[tuple[dict[str, Any], str, Any]]
) -> None:
    anyio.run(_variations_hold, tmp_path_factory.mktemp("variations"), retries, None)


@_EXAMPLES
@_VARIATIONS
def test_any_form_only_variation_of_a_send_is_the_same_send_on_postgresql(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    retries: list[tuple[dict[str, Any], str, Any]],
) -> None:
    async def check() -> None:
        async with postgres_server.database() as url:
            await _variations_hold(tmp_path_factory.mktemp("variations"), retries, url)

    anyio.run(check)
