"""Batches, opt-outs and the duplicate guard, through the agent's tools, in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from hail_guard.batch import drain, read_batch_file
from hail_guard.errors import BadInput
from hail_guard.models import State
from tests.conftest import Harness, data, email, open_harness, text


def lead_email(n: int, **changes: Any) -> dict[str, Any]:
    base = {
        "to": [f"lead{n}@example.com"],
        "body_text": f"Hello lead {n}",
        "metadata": {"campaign_id": "spring", "lead_id": f"lead{n:03d}", "message_id": "intro"},
    }
    return email(**{**base, **changes})


def sends(count: int) -> list[dict[str, Any]]:
    return [{"tool": "send_email", "arguments": lead_email(n)} for n in range(count)]


async def plan(harness: Harness, count: int, **extra: Any) -> str:
    planned = await harness.call("plan_batch", {"sends": sends(count), **extra})
    assert not planned.is_error, text(planned)
    batch_id: str = data(planned)["batch_id"]
    return batch_id


async def test_a_batch_that_dies_at_40_percent_resumes_to_one_message_per_lead(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:40:drop_after_accept") as harness:
        batch_id = await plan(harness, 100)
        assert harness.sandbox.outbox == []

        async with anyio.create_task_group() as tg:  # the first run dies with the connection
            tg.start_soon(harness.proxy.batches.run, batch_id)
            with anyio.fail_after(10):
                await harness.sandbox.wait_for_outbox(40)
            tg.cancel_scope.cancel()
        status = data(await harness.call("batch_status", {"batch_id": batch_id}))
        assert status["counts"].get("unknown", 0) >= 1

        resumed_at = await harness.ledger.now()
        resumed = data(await harness.call("run_batch", {"batch_id": batch_id, "concurrency": 8}))
        assert resumed["counts"] == {"accepted": 100}
        keys = [line["idempotency_key"] for line in harness.sandbox.outbox]
        assert len(keys) == len(set(keys)) == 100
        assert {k.split(":")[1] for k in keys} == {f"lead{n:03d}" for n in range(100)}

        events = [
            e
            for op in await harness.ledger.list_operations(batch_id=batch_id, limit=200)
            for e in await harness.ledger.events(op.id)
            if e.at >= resumed_at
        ]
        settled = [e.at for e in events if e.from_state is State.UNKNOWN]
        new_sends = [e.at for e in events if e.to_state is State.SENDING]
        assert settled
        assert new_sends
        assert max(settled) <= min(new_sends)


async def test_running_a_finished_batch_again_sends_nothing(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        batch_id = await plan(harness, 5)
        await harness.call("run_batch", {"batch_id": batch_id})
        again = data(await harness.call("run_batch", {"batch_id": batch_id}))
        assert again["counts"] == {"accepted": 5}
        assert harness.sandbox.calls("send_email") == 5


async def test_two_sends_with_one_key_are_refused_with_their_positions(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        twice = [*sends(3), {"tool": "send_email", "arguments": lead_email(1, subject="Other")}]
        result = await harness.call("plan_batch", {"sends": twice})
        assert result.is_error
        assert "send 2 and send 4 have the same key" in text(result)
        assert await harness.ledger.list_operations() == []


async def test_a_bad_send_refuses_the_whole_batch_naming_it(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        bad = [*sends(2), {"tool": "send_email", "arguments": lead_email(7, recipient_consent="yes")}]
        result = await harness.call("plan_batch", {"sends": bad})
        assert "send 3: invalid arguments for send_email: recipient_consent" in text(result)
        unknown_tool = await harness.call("plan_batch", {"sends": [{"tool": "whoami", "arguments": {}}]})
        assert "send 1: 'whoami' is not a guarded send tool" in text(unknown_tool)
        assert await harness.ledger.list_operations() == []


async def test_an_unknown_batch_is_a_clear_error(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        result = await harness.call("run_batch", {"batch_id": "batch-nope"})
        assert result.is_error
        assert "no batch batch-nope" in text(result)


async def test_progress_is_reported_when_the_client_asks(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        batch_id = await plan(harness, 4)
        seen: list[tuple[float, float | None]] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            seen.append((progress, total))

        async with harness.client() as client:
            await client.call_tool("run_batch", {"batch_id": batch_id, "concurrency": 1}, progress_callback=on_progress)
        assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


async def test_an_opt_out_after_approval_wins(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        harness.proxy.batches.require_approval = True
        batch_id = await plan(harness, 3)
        assert data(await harness.call("batch_status", {"batch_id": batch_id}))["counts"] == {"planned": 3}
        assert await harness.ledger.approve_batch(batch_id, actor="alice") == 3
        opt_out = await harness.call(
            "record_opt_out", {"recipient": "LEAD1@example.com", "reason": "replied STOP", "channel": "email"}
        )
        assert len(data(opt_out)["cancelled_operations"]) == 1
        finished = data(await harness.call("run_batch", {"batch_id": batch_id}))
        assert finished["counts"] == {"accepted": 2, "cancelled": 1}
        assert "lead1@example.com" not in [line["to"][0] for line in harness.sandbox.outbox]
        [cancelled] = await harness.ledger.list_operations(state=State.CANCELLED)
        assert "replied STOP" in (cancelled.cancel_reason or "")
        direct = await harness.call("send_email", lead_email(1, metadata={"note": "direct"}))
        assert "opted out" in text(direct)
        assert len(harness.sandbox.outbox) == 2


async def test_reconcile_never_replays_to_an_opted_out_recipient(tmp_path: Path) -> None:
    async with open_harness(tmp_path, "send_email:1:hang_after_accept", timeout_seconds=0.3) as harness:
        await harness.call("send_email", email())
        await harness.call("record_opt_out", {"recipient": "lead@example.com", "reason": "STOP"})
        [settled] = await harness.proxy.guard.reconcile()
        assert settled.state is State.NEEDS_REVIEW
        assert "opted out" in (settled.review_reason or "")
        assert harness.sandbox.calls("send_email") == 1


async def test_a_new_key_for_the_same_message_is_answered_from_the_first_send(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        first = await harness.call("send_email", email(idempotency_key="agent-key-1"))
        minted = await harness.call("send_email", email(idempotency_key="agent-key-2"))
        assert not minted.is_error
        assert data(minted)["hail_guard"]["operation_id"] == data(first)["hail_guard"]["operation_id"]
        assert data(minted)["hail_guard"]["replayed"] is True
        deliberate = await harness.call("send_email", email(idempotency_key="agent-key-3", allow_duplicate=True))
        assert not deliberate.is_error
        assert "allow_duplicate" not in harness.sandbox.outbox[-1]["request"]
        assert len(harness.sandbox.outbox) == 2


async def test_guarded_tools_advertise_allow_duplicate(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness, harness.client() as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert "allow_duplicate" in tools["send_email"].input_schema["properties"]
        assert "allow_duplicate" not in tools["whoami"].input_schema.get("properties", {})
        assert "allow_duplicate" not in harness.proxy.tools["send_email"].input_schema["properties"]


async def test_concurrent_drains_send_each_operation_once(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        batch_id = await plan(harness, 40)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: drain(harness.proxy.guard, concurrency=4, batch_id=batch_id))
        assert len({line["idempotency_key"] for line in harness.sandbox.outbox}) == len(harness.sandbox.outbox) == 40


def test_batch_files_in_jsonl_and_csv(tmp_path: Path) -> None:
    schema = {
        "properties": {"to": {"type": "array"}, "recipient_consent": {"type": "boolean"}, "subject": {"type": "string"}}
    }
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"tool": "send_email", "arguments": {"to": ["a@x"]}}\n\n{"tool": "send_sms", "arguments": {}}\n')
    assert [(s.tool, s.where) for s in read_batch_file(str(jsonl), lambda _: schema)] == [
        ("send_email", "line 1"),
        ("send_sms", "line 3"),
    ]
    csv_file = tmp_path / "b.csv"
    csv_file.write_text("tool,to,subject,recipient_consent,metadata.lead_id\nsend_email,a@x;b@x,Hi,true,L1\n")
    [send] = read_batch_file(str(csv_file), lambda _: schema)
    assert send.arguments == {
        "to": ["a@x", "b@x"],
        "subject": "Hi",
        "recipient_consent": True,
        "metadata": {"lead_id": "L1"},
    }
    assert send.where == "line 2"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("b.jsonl", '{"tool": "send_email"}\n{not json\n', "line 2: not valid JSON"),
        ("b.jsonl", '["send_email"]\n', "line 1: give an object"),
        ("b.csv", "to,subject\na@x,Hi\n", "line 1: a CSV batch needs a header row with a `tool` column"),
        ("b.csv", "tool,recipient_consent\nsend_email,yes\n", "line 2, column recipient_consent: 'yes' is not"),
    ],
)
def test_malformed_batch_files_name_the_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(BadInput, match=message):
        list(read_batch_file(str(path), lambda _: {"properties": {"recipient_consent": {"type": "boolean"}}}))


def sandbox_schema(tool: str) -> dict[str, Any] | None:
    """The sandbox's own input schema of `tool`: the schema Hail gives, `metadata` a free-form object."""
    from hail_guard.sandbox.tools import input_schema

    return input_schema(tool)


def test_a_dotted_csv_cell_is_typed_by_the_nested_property_not_its_object(tmp_path: Path) -> None:
    csv_file = tmp_path / "b.csv"
    csv_file.write_text(
        "tool,to,body,recipient_consent,metadata.campaign_id,metadata.lead_id,metadata.attempt\n"
        "send_sms,+14155550100,Hi,true,spring,007,2\n"
    )
    [send] = read_batch_file(str(csv_file), sandbox_schema)
    assert send.arguments["metadata"] == {"campaign_id": "spring", "lead_id": "007", "attempt": "2"}


def test_a_nested_property_the_schema_describes_is_typed_as_it_says(tmp_path: Path) -> None:
    schema = {
        "properties": {
            "options": {
                "type": "object",
                "properties": {"retries": {"type": "integer"}, "loud": {"type": "boolean"}},
                "additionalProperties": {"type": "number"},
            }
        }
    }
    csv_file = tmp_path / "b.csv"
    csv_file.write_text("tool,options.retries,options.loud,options.weight\nsend_email,3,false,1.5\n")
    [send] = read_batch_file(str(csv_file), lambda _: schema)
    assert send.arguments["options"] == {"retries": 3, "loud": False, "weight": 1.5}


def test_an_object_column_takes_a_json_object_and_refuses_anything_else(tmp_path: Path) -> None:
    csv_file = tmp_path / "b.csv"
    csv_file.write_text('tool,metadata\nsend_email,"{""lead_id"": ""L1""}"\nsend_email,L2\n')
    sends = read_batch_file(str(csv_file), sandbox_schema)
    assert next(sends).arguments == {"metadata": {"lead_id": "L1"}}
    with pytest.raises(BadInput, match="line 3, column metadata"):
        next(sends)


def campaign_email(n: int, **changes: Any) -> dict[str, Any]:
    """One campaign's text, the same for every lead: only the recipient and the lead's ids differ."""
    base = {
        "to": [f"lead{n}@example.com"],
        "subject": "Spring offer",
        "body_text": "Our spring offer: 20% off every plan until May.",
        "metadata": {"campaign_id": "spring", "lead_id": f"lead{n:03d}", "message_id": "offer"},
    }
    return email(**{**base, **changes})


async def test_a_campaign_of_one_text_to_many_leads_plans_and_each_lead_gets_it_once(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        planned = await harness.call(
            "plan_batch", {"sends": [{"tool": "send_email", "arguments": campaign_email(n)} for n in range(5)]}
        )
        assert not planned.is_error, text(planned)
        finished = data(await harness.call("run_batch", {"batch_id": data(planned)["batch_id"]}))
        assert finished["counts"] == {"accepted": 5}
        assert sorted(line["to"][0] for line in harness.sandbox.outbox) == [f"lead{n}@example.com" for n in range(5)]
        assert {line["request"]["body_text"] for line in harness.sandbox.outbox} == {campaign_email(0)["body_text"]}


@pytest.mark.parametrize(
    ("first", "second", "who"),
    [
        ({"to": ["ada@example.com"]}, {"to": ["ada@example.com"]}, "ada@example.com"),
        ({"to": ["ada@example.com"]}, {"to": ["ADA+news@example.com"]}, "ada@example.com"),
        ({"to": ["bob@example.com"], "cc": ["ada@example.com"]}, {"to": ["ada@example.com"]}, "ada@example.com"),
    ],
    ids=["the-same-address", "a-sub-address-of-it", "in-cc-then-in-to"],
)
async def test_one_message_twice_to_one_recipient_in_a_batch_is_refused_naming_both_sends(
    tmp_path: Path, first: dict[str, Any], second: dict[str, Any], who: str
) -> None:
    async with open_harness(tmp_path) as harness:
        twice = [
            {"tool": "send_email", "arguments": campaign_email(1, **first)},
            {"tool": "send_email", "arguments": campaign_email(2, **second)},  # another lead id: another key
        ]
        result = await harness.call("plan_batch", {"sends": twice})
        assert result.is_error
        assert f"send 1 and send 2 have the same message for {who}; leave one of them out" in text(result)
        assert await harness.ledger.list_operations() == []


async def test_two_messages_to_one_recipient_in_one_batch_are_two_sends(tmp_path: Path) -> None:
    """The in-batch repeat check compares a recipient's messages: another text to the same lead is no repeat."""
    async with open_harness(tmp_path) as harness:
        two = [
            {"tool": "send_email", "arguments": campaign_email(1)},
            {
                "tool": "send_email",
                "arguments": campaign_email(
                    1,
                    subject="Webinar",
                    body_text="Our webinar on delivery tracking starts on Thursday at ten.",
                    metadata={"campaign_id": "spring", "lead_id": "lead001", "message_id": "webinar"},
                ),
            },
        ]
        result = await harness.call("plan_batch", {"sends": two})
        assert not result.is_error, text(result)
        assert len(await harness.ledger.list_operations(batch_id=data(result)["batch_id"])) == 2


async def test_one_message_twice_to_one_recipient_from_other_senders_is_two_messages(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        twice = [
            {"tool": "send_email", "arguments": campaign_email(1, to=["ada@example.com"], from_="sales@example.com")},
            {"tool": "send_email", "arguments": campaign_email(2, to=["ada@example.com"], from_="ceo@example.com")},
        ]
        result = await harness.call("plan_batch", {"sends": twice})
        assert not result.is_error, text(result)


async def test_a_batch_that_repeats_or_overlaps_a_live_message_is_refused_whole_naming_the_send(
    tmp_path: Path,
) -> None:
    async with open_harness(tmp_path) as harness:
        sent = await harness.call("send_email", campaign_email(1))
        operation_id = data(sent)["hail_guard"]["operation_id"]
        regenerated = {"campaign_id": "spring", "lead_id": "lead001", "message_id": "offer-again"}
        repeats = (  # the same people (a batch refuses rather than answers), and an overlap
            (campaign_email(1, metadata=regenerated), "Nothing was planned. Leave send 2 out of the batch"),
            (
                campaign_email(1, to=["lead1@example.com", "new@example.com"], metadata=regenerated),
                "Nothing was planned. Leave send 2 out of the batch, or give it only the others (new@example.com).",
            ),
        )
        for repeat, step in repeats:
            batch = [
                {"tool": "send_email", "arguments": campaign_email(7)},
                {"tool": "send_email", "arguments": repeat},
            ]
            result = await harness.call("plan_batch", {"sends": batch})
            assert result.is_error
            assert f"send 2: lead1@example.com already has this message: operation {operation_id} is" in text(result)
            assert step in text(result)
        assert [op.id for op in await harness.ledger.list_operations()] == [operation_id]


async def test_a_campaign_planned_again_with_its_text_reworded_is_refused_for_a_lead_who_has_it(
    tmp_path: Path,
) -> None:
    """A paraphrase of what a lead already has is refused at planning as a send made alone would be, and the
    refusal says the batch was not planned (not that a send was not sent) and which send to leave out."""
    async with open_harness(tmp_path) as harness:
        sent = await harness.call("send_email", campaign_email(1))
        operation_id = data(sent)["hail_guard"]["operation_id"]
        reworded = campaign_email(
            1,
            body_text="Our spring offer: 20% off every plan until May!",
            metadata={"campaign_id": "spring", "lead_id": "lead001", "message_id": "offer-reworded"},
        )
        batch = [{"tool": "send_email", "arguments": campaign_email(7)}, {"tool": "send_email", "arguments": reworded}]
        result = await harness.call("plan_batch", {"sends": batch})
        assert result.is_error
        said = text(result)
        assert said.startswith("send 2: probably a duplicate: lead1@example.com already has a message"), said
        assert f"(operation {operation_id} is accepted by" in said
        assert "Nothing was planned." in said
        assert "Nothing was sent" not in said
        assert said.endswith("Leave send 2 out of the batch."), said
        assert [op.id for op in await harness.ledger.list_operations()] == [operation_id]
        assert len(harness.sandbox.outbox) == 1


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"recipient_consent": False}, "send 2: recipient_consent must be the JSON boolean true (got false)"),
        ({"message_type": "marketing"}, "send 2: marketing sends need a non-empty consent_source"),
        (
            {"message_type": "marketing", "consent_source": " "},
            "send 2: marketing sends need a non-empty consent_source",
        ),
    ],
)
async def test_a_batch_with_a_send_the_consent_rules_refuse_is_refused_whole(
    tmp_path: Path, changes: dict[str, Any], said: str
) -> None:
    async with open_harness(tmp_path) as harness:
        batch = [
            {"tool": "send_email", "arguments": campaign_email(1)},
            {"tool": "send_email", "arguments": campaign_email(2, **changes)},
        ]
        result = await harness.call("plan_batch", {"sends": batch})
        assert result.is_error
        assert said in text(result)
        assert text(result).endswith("; nothing was planned")
        assert await harness.ledger.list_operations() == []


async def test_a_batch_of_no_sends_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    async with open_harness(tmp_path) as harness:
        with pytest.raises(BadInput) as refused:
            await harness.proxy.batches.plan([])
        assert str(refused.value) == "the batch has no sends; give at least one {tool, arguments}"
        assert await harness.ledger.list_operations() == []
