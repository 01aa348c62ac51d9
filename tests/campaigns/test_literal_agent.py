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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hail_guard.sandbox import Sandbox, parse_fault
from tests.conftest import data, open_harness, text
from tests.end_to_end.test_retries import ADA, BOB, delivered, message
from tests.postgres import PostgresServer

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
    rewrite: Any = None
    """How it writes a retry again (`regenerated`, its form only, by default)."""

    async def send(self, arguments: dict[str, Any]) -> None:
        rewrite = self.rewrite or regenerated
        current = dict(arguments)
        answer = await self.call("send_email", current)
        for attempt in range(1, STEPS + 1):
            words = self._words(answer)
            operation = _OPERATION.search(words)
            if "reconcile" in words and operation:
                self.log.append("reconcile")
                await self.call("reconcile", {"operation_id": operation.group(1)})
                answer = await self.call("send_email", rewrite(current, attempt))  # and then it retries
            elif "allow_duplicate" in words and not current.get("allow_duplicate"):
                self.log.append("allow_duplicate")
                current = {**current, "allow_duplicate": True}
                answer = await self.call("send_email", rewrite(current, attempt))
            elif "new key" in words or "new idempotency" in words:
                self.log.append("new key")
                current = {**current, "idempotency_key": f"minted-{attempt}"}
                answer = await self.call("send_email", rewrite(current, attempt))
            elif (others := _OTHERS.search(words)) is not None:
                self.log.append("to the others alone")
                current = {**current, "to": [name.strip() for name in others.group(1).split(",")]}
                answer = await self.call("send_email", rewrite(current, attempt))
            elif "get_operation" in words and operation:
                self.log.append("get_operation")
                answer = await self.call("get_operation", {"operation_id": operation.group(1)})
            elif "call again" in words or "try again" in words or "not sent yet" in words:
                self.log.append("call again")
                answer = await self.call("send_email", rewrite(current, attempt))
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


_variation: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
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


# --- agents that repeat by intent, not by bytes (the same send by intent) ------------------------------------

PARAPHRASES = (
    {"body_text": "Hi Ada, nice to meet you!"},
    {"body_text": "Hi Ada, so nice to meet you."},
    {"subject": "Re: Hello"},
    {"body_text": "Hi Ada - nice to meet you."},
)
"""How an LLM rewords the same message when it regenerates the call: near the same, never the same bytes."""


def paraphrased(arguments: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {**regenerated(arguments, attempt), **PARAPHRASES[attempt % len(PARAPHRASES)]}


AFTER_ACCEPT = [fault for fault in FAULTS if "after_accept" in fault or "malformed" in fault or "processing" in fault]


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def ledger_of(backend: str, folder: Path, server: PostgresServer | None) -> AsyncIterator[str | None]:
    """A fresh ledger URL of `backend` (None: the harness's own SQLite file in `folder`)."""
    if backend == "sqlite":
        yield None
        return
    assert server is not None
    async with server.database() as url:
        yield url


@pytest.mark.parametrize("fault", AFTER_ACCEPT)
async def test_a_paraphrasing_agent_never_gets_a_message_delivered_twice(
    tmp_path: Path, fault: str, backend: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("postgres_server") if backend == "postgres" else None
    sandbox = Sandbox(faults=[parse_fault(fault)])
    async with (
        ledger_of(backend, tmp_path, server) as url,
        open_harness(tmp_path, sandbox=sandbox, ledger_url=url) as h,
    ):
        async with h.client() as client:
            agent = LiteralAgent(client.call_tool, rewrite=paraphrased)
            with anyio.fail_after(60):
                await agent.send(message(to=[ADA, BOB]))
        assert delivered(h.sandbox) == Counter({ADA: 1, BOB: 1}), (fault, agent.log)


LEAD = {"campaign_id": "spring", "lead_id": "ada"}
SMS = {"to": "+14155550123", "body": "Hi Ada, it's Sam from Acme.", "recipient_consent": True}
CALL = {"to": "+14155550123", "system_prompt": "Introduce Acme to Ada.", "recipient_consent": True}


@dataclass
class ChannelSwitchingAgent:
    """When its email's answer is not "accepted", it tries the lead by SMS, then by phone; it follows what each
    answer names (reconcile), and stops once one of its messages is accepted."""

    call: Any
    log: list[str] = field(default_factory=list)

    async def reach(self) -> None:
        attempts = [
            ("send_email", message(metadata={**LEAD, "message_id": "hello"})),
            ("send_sms", {**SMS, "metadata": {**LEAD, "message_id": "hello-sms"}}),
            ("place_call", {**CALL, "metadata": {**LEAD, "message_id": "hello-call"}}),
        ]
        for tool, arguments in attempts * 2:
            self.log.append(tool)
            answer = await self.call(tool, arguments)
            if await self._reached(answer):
                return

    async def _reached(self, answer: Any) -> bool:
        view = data(answer).get("hail_guard") if isinstance(data(answer), dict) else None
        if isinstance(view, dict) and view.get("state") == "accepted":
            return True
        operation = _OPERATION.search(f"{text(answer)} {view.get('next_step', '') if isinstance(view, dict) else ''}")
        if operation and "reconcile" in text(answer) + str(view):
            self.log.append("reconcile")
            settled = data(await self.call("reconcile", {"operation_id": operation.group(1)}))
            return any(found["state"] == "accepted" for found in settled.get("reconciled", []))
        return False


@pytest.mark.parametrize("fault", AFTER_ACCEPT)
async def test_a_channel_switching_agent_reaches_the_lead_once(
    tmp_path: Path, fault: str, backend: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("postgres_server") if backend == "postgres" else None
    sandbox = Sandbox(faults=[parse_fault(fault)])
    async with (
        ledger_of(backend, tmp_path, server) as url,
        open_harness(tmp_path, sandbox=sandbox, ledger_url=url) as h,
    ):
        async with h.client() as client:
            agent = ChannelSwitchingAgent(client.call_tool)
            with anyio.fail_after(60):
                await agent.reach()
        reached = [entry["tool"] for entry in h.sandbox.outbox]
        assert reached == ["send_email"], (fault, agent.log, reached)  # Hail accepted the email: nothing else went


@pytest.mark.parametrize("fault", AFTER_ACCEPT)
async def test_a_second_ledger_agent_never_gets_a_message_delivered_twice(
    tmp_path: Path, fault: str, backend: str, request: pytest.FixtureRequest
) -> None:
    """Its first try goes through one hail-guard; it regenerates every retry and sends it through another, with a
    ledger of its own (a laptop and a container; a backup restored), in front of the same Hail."""
    server = request.getfixturevalue("postgres_server") if backend == "postgres" else None
    sandbox = Sandbox(faults=[parse_fault(fault)])
    async with (
        ledger_of(backend, tmp_path / "one", server) as first_url,
        ledger_of(backend, tmp_path / "two", server) as second_url,
        open_harness(tmp_path / "one", sandbox=sandbox, ledger_url=first_url) as one,
        open_harness(tmp_path / "two", sandbox=sandbox, ledger_url=second_url) as two,
        one.client() as first,
        two.client() as second,
    ):
        tries = iter([first.call_tool])

        async def through_either(tool: str, arguments: dict[str, Any]) -> Any:
            return await next(tries, second.call_tool)(tool, arguments)

        agent = LiteralAgent(through_either)
        with anyio.fail_after(60):
            await agent.send(message(to=[ADA, BOB]))
        counts = delivered(sandbox)
        assert max(counts.values()) == 1, (fault, agent.log, counts)
        assert counts == Counter({ADA: 1, BOB: 1}), (fault, agent.log, counts)
