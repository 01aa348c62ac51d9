"""The issue's acceptance check, as a user runs it: `[upstream] profile = "chat.toml"`, `hail-guard serve` over stdio
in front of the chat fake (`hail-guard fake --profile chat.toml --stdio`); and `hail-guard profile init` and
`profile check` against the sandbox and the generic fake, as typed."""

from __future__ import annotations

import json
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters

from hail_guard.cli import main
from hail_guard.profiles import parse_profile
from tests.conftest import data
from tests.end_to_end.test_stdio import outbox_lines, running_sandbox

EXAMPLE = Path(__file__).parents[2] / "examples" / "chat.toml"
FAKE = [sys.executable, "-m", "hail_guard", "fake"]


def chat_serve(tmp_path: Path, *faults: str) -> tuple[StdioServerParameters, Path]:
    """`hail-guard serve` with the chat profile beside its config, the chat fake as its upstream command."""
    shutil.copy(EXAMPLE, tmp_path / "chat.toml")
    outbox = tmp_path / "outbox.jsonl"
    command = [*FAKE, "--profile", str(tmp_path / "chat.toml"), "--stdio", "--outbox", str(outbox)]
    for fault in faults:
        command += ["--fault", fault]
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        "[ledger]\n"
        f'url = "sqlite:///{tmp_path / "ledger.db"}"\n'
        "[upstream]\n"
        'profile = "chat.toml"\n'
        f"command = {json.dumps(command)}\n"
        "timeout_seconds = 1\n"
        "[delivery]\npoll = false\n"
    )
    args = ["-m", "hail_guard", "--config", str(config), "serve"]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(tmp_path)), outbox


def state(result: Any) -> str:
    value: str = data(result)["hail_guard"]["state"]
    return value


async def test_the_chat_example_over_stdio_never_posts_anything_twice(tmp_path: Path) -> None:
    params, outbox = chat_serve(tmp_path, "post_message:2:hang_after_accept", "post_message:3:delay:5000")
    async with Client(params, mode="legacy") as agent:
        hello = {"channel": "#general", "text": "Hello, team"}
        assert state(await agent.call_tool("post_message", hello)) == "accepted"
        repeated = await agent.call_tool("post_message", hello)
        assert data(repeated)["hail_guard"]["replayed"] is True

        recorded = await agent.call_tool("post_message", {"channel": "#general", "text": "Deploying now"})
        never = await agent.call_tool("post_message", {"channel": "#ops", "text": "Paging on-call"})
        assert (state(recorded), state(never)) == ("unknown", "unknown")
        assert data(await agent.call_tool("post_message", {"channel": "#general", "text": "Deploying now"}))[
            "hail_guard"
        ]["replayed"]

        settled = data(await agent.call_tool("reconcile", {}))["reconciled"]
        by_id = {view["operation_id"]: view for view in settled}
        assert by_id[data(recorded)["hail_guard"]["operation_id"]]["state"] == "accepted"
        assert by_id[data(never)["hail_guard"]["operation_id"]]["state"] == "needs_review"

    posted = [line["request"]["text"] for line in outbox_lines(outbox)]
    assert sorted(posted) == ["Deploying now", "Hello, team"]
    lookup = {line["request"]["text"]: line["id"] for line in outbox_lines(outbox)}
    assert by_id[data(recorded)["hail_guard"]["operation_id"]]["provider_id"] == lookup["Deploying now"]


def test_profile_init_drafts_a_profile_from_the_chat_fake(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = " ".join([*FAKE, "--profile", str(EXAMPLE), "--stdio"])
    assert main(["profile", "init", "--from", source, "--output", str(tmp_path / "draft.toml")]) == 0
    drafted = (tmp_path / "draft.toml").read_text()
    profile = parse_profile(drafted, "draft")
    [tool] = profile.tools.values()
    assert (tool.name, tool.recipients, tool.content, tool.key) == ("post_message", ("/channel",), ("/text",), None)
    assert tool.search is not None
    assert tool.search.tool == "list_messages"
    assert "REVIEW" in drafted
    assert main(["profile", "check", str(tmp_path / "draft.toml"), "--from", source]) == 0
    assert "ok: every pointer" in capsys.readouterr().out


async def test_profile_init_and_check_work_against_the_sandbox(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_sandbox(tmp_path) as (url, _):  # the command line, in a thread: it runs its own event loop
        assert await anyio.to_thread.run_sync(main, ["profile", "init", "--from", url]) == 0
        init = capsys.readouterr().out
        assert await anyio.to_thread.run_sync(main, ["profile", "check", "hail", "--from", url]) == 0
        check = capsys.readouterr().out
    draft = tomllib.loads(init)
    assert {tool["name"] for tool in draft["tools"]} == {"send_email", "send_sms", "place_call"}
    assert next(t for t in draft["tools"] if t["name"] == "send_email")["key"] == "/idempotency_key"
    assert "ok: every pointer of hail" in check


def test_profile_check_names_every_pointer_the_upstream_does_not_have(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = tmp_path / "wrong.toml"
    hostile = '\n[[tools]]\nname = "shout\\u001b[31m"\n'  # a tool the upstream lacks, named with an escape
    wrong.write_text(EXAMPLE.read_text().replace('content = ["/text"]', 'content = ["/body"]') + hostile)
    source = " ".join([*FAKE, "--profile", str(EXAMPLE), "--stdio"])
    assert main(["profile", "check", str(wrong), "--from", source]) == 1
    out = capsys.readouterr()
    assert "post_message.content: '/body' is not in post_message's input schema" in out.out
    assert "shout\\x1b[31m" in out.out
    assert "\x1b" not in out.out
    assert "does not fit" in out.err
