"""What `serve` does with a profile and an upstream that may not fit: a sending tool the profile forgets is refused
(fail closed), a profile that does not fit is refused at start, a command that cannot start is said in its own
words, `[upstream.env]` reaches the command and stays secret, and every text names the upstream by the profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client

from hail_guard import policy
from hail_guard.cli import main
from hail_guard.config import UpstreamSettings, load_settings
from hail_guard.errors import ConfigError
from hail_guard.fake import FakeUpstream
from hail_guard.fake.servers import agentmail, resend
from hail_guard.guard import GuardSettings
from hail_guard.ledger import open_ledger
from hail_guard.models import State
from hail_guard.profiles import built_in, parse_profile
from hail_guard.server import Proxy, build_server
from hail_guard.spawned import env_shown
from hail_guard.upstream import UpstreamTarget, connect_upstream
from tests.conftest import data, text
from tests.end_to_end.test_other_upstreams import rig

# The resend profile as it was before send-batch-emails, send-broadcast and send-event were guarded.
SEND_EMAIL_ONLY = """
[profile]
name = "resend-old"
display_name = "Resend"
pass_through = ["send-event", "send-broadcast"]
[[tools]]
name = "send-email"
channel = "email"
key = "/idempotencyKey"
recipients = ["/to", "/cc", "/bcc"]
content = ["/subject", "/text"]
answer_text = '^Email sent successfully! (?P<json>\\\\{.*\\\\})\\\\s*$'
[answers]
is_error = "classify"
"""
BATCH = {"emails": [{"to": ["ada@example.com"], "subject": "Hi", "text": "Hello", "from": "a@acme.test"}]}


async def test_a_sending_tool_the_profile_forgets_is_refused_never_forwarded(tmp_path: Path) -> None:
    """Regression: send-batch-emails was not in the resend profile, passed through unguarded, and a repeat
    reached every recipient twice."""
    fake = FakeUpstream(resend())
    async with rig(tmp_path, parse_profile(SEND_EMAIL_ONLY, "resend-old"), fake) as r:
        first = await r.call("send-batch-emails", BATCH)
        again = await r.call("send-batch-emails", BATCH)
        assert first.is_error
        assert again.is_error
        assert "hail-guard refuses send-batch-emails" in text(first)
        assert "neither guards it nor lets it pass; nothing was sent" in text(first)
        assert fake.outbox == []
        assert set(r.proxy.refused) == {"send-batch-emails"}
        listed = await r.call("send-event", {"event": "signed-up", "email": "ada@example.com"})
        assert not listed.is_error  # named in pass_through: forwarded as it is
    assert [entry["tool"] for entry in fake.outbox] == ["send-event"]


async def test_a_profile_that_does_not_fit_is_refused_at_start_naming_each_misfit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a profile whose key pointed at another field (key = "/subject") served, the key was never set,
    and reconcile sent a second copy."""
    wrong = built_in("resend").source
    profile = tmp_path / "wrong.toml"
    from importlib import resources

    text_ = resources.files("hail_guard.profiles").joinpath(f"{wrong}.toml").read_text(encoding="utf-8")
    profile.write_text(
        text_.replace('key = "/idempotencyKey"\nrecipients = ["/to"', 'key = "/subject"\nrecipients = ["/to"', 1)
    )
    config = tmp_path / "hail-guard.toml"
    fake = [sys.executable, "-m", "hail_guard", "fake", "--profile", "resend", "--stdio"]
    config.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        f'[upstream]\nprofile = "wrong.toml"\ncommand = {fake!r}\n'.replace("'", '"')
        + "[delivery]\npoll = false\n"
    )
    code = await anyio.to_thread.run_sync(main, ["--config", str(config), "serve"])
    said = capsys.readouterr().err
    assert code == 1
    assert "does not fit Resend's tools" in said
    assert "send-email.key: '/subject' is not named like an idempotency key" in said
    assert "hail-guard profile check" in said
    assert "hail-guard did not start" in said


@pytest.mark.parametrize(
    ("command", "cause"),
    [
        (
            (sys.executable, "-c", "import sys; sys.stderr.write('No API key. Set RESEND_API_KEY\\n'); sys.exit(1)"),
            "it stopped, saying: No API key. Set RESEND_API_KEY",
        ),
        (("/nonexistent/resend-mcp",), "FileNotFoundError"),
    ],
)
async def test_an_upstream_command_that_cannot_start_is_answered_in_its_own_words(
    tmp_path: Path, command: tuple[str, ...], cause: str
) -> None:
    """Regression: the agent saw "unknown tool 'send-email'", the cause only in stderr."""
    target = UpstreamTarget(kind="stdio", command=command, name="Resend")
    async with (
        open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger,
        connect_upstream(target, timeout_seconds=2, connect_timeout_seconds=5, heartbeat_seconds=None) as upstream,
    ):
        proxy = Proxy(ledger, upstream, GuardSettings(profile=built_in("resend")))
        async with Client(build_server(proxy), mode="legacy") as agent:
            result = await agent.call_tool("send-email", {"to": ["ada@example.com"], "subject": "Hi", "text": "x"})
    assert result.is_error
    said = text(result)
    assert said.startswith("the upstream (Resend) could not be started: ")
    assert cause in said
    assert said.endswith("nothing was sent")
    assert "unknown tool" not in said


async def test_the_upstream_env_reaches_the_command_and_its_values_stay_secret(tmp_path: Path) -> None:
    settings = UpstreamSettings(
        command=["x"], env={"SENDER_EMAIL_ADDRESS": "${SENDER}", "API_BASE": "https://u:pa55word@api.test/v1?k=1"}
    )
    env = settings.resolved_env({"SENDER": "hello@acme.test"})
    assert env == {"SENDER_EMAIL_ADDRESS": "hello@acme.test", "API_BASE": "https://u:pa55word@api.test/v1?k=1"}
    assert env_shown(env) == {"SENDER_EMAIL_ADDRESS": "(secret)", "API_BASE": "https://api.test/v1"}
    with pytest.raises(ConfigError, match=r"SENDER_EMAIL_ADDRESS take \$\{SENDER\}.*SENDER is not set"):
        settings.resolved_env({})
    # The command sees the variable; a message that repeats it does not.
    leak = "import os, sys; sys.stderr.write('bad sender ' + os.environ['SENDER_EMAIL_ADDRESS'] + '\\n'); sys.exit(3)"
    target = UpstreamTarget(kind="stdio", command=(sys.executable, "-c", leak), env=env, name="Resend")
    async with connect_upstream(target, connect_timeout_seconds=5, heartbeat_seconds=None) as upstream:
        problem = upstream.problem
    assert "bad sender" in problem
    assert "hello@acme.test" not in problem
    assert "pa55word" not in repr(target)


def test_a_url_and_a_command_both_set_are_refused_not_silently_chosen(tmp_path: Path) -> None:
    """Regression: client-config's HAIL_GUARD_UPSTREAM_URL won over the configured command without a word."""
    config = tmp_path / "hail-guard.toml"
    config.write_text('[upstream]\ncommand = ["npx", "-y", "resend-mcp"]\nprofile = "resend"\n')
    settings = load_settings(str(config), environ={"HAIL_GUARD_UPSTREAM_URL": "https://mcp.hail.so"})
    with pytest.raises(ConfigError, match="both a url and a command"):
        _ = settings.upstream.kind
    assert load_settings(str(config), environ={}).upstream.token_env == "RESEND_API_KEY"  # the profile's key_env


async def test_every_text_of_a_lost_agentmail_send_names_agentmail(tmp_path: Path) -> None:
    """Regression: an agent behind AgentMail was told "Hail may already have sent this message"."""
    fake = FakeUpstream(agentmail())
    async with rig(tmp_path, built_in("agentmail"), fake, "send_message:1:hang_after_accept") as r:
        message = {"inboxId": "agent@agentmail.to", "to": ["ada@example.com"], "subject": "Hi", "text": "Hello"}
        lost = await r.call("send_message", message)
        said = text(lost)
        assert said.startswith("OUTCOME UNKNOWN: AgentMail may already have sent this message.")
        operation = await r.ledger.get(data(lost)["hail_guard"]["operation_id"])
        assert operation.state is State.UNKNOWN
        history = " ".join(event.reason or "" for event in await r.ledger.events(operation.id))
        assert "Hail" not in said + history
        listed = {tool.name: tool.description or "" for tool in r.proxy.listed_tools()}
        assert "after AgentMail may have accepted them" in listed["reconcile"]
    with policy.naming("AgentMail"):
        assert policy.next_step(operation.model_copy(update={"state": State.ACCEPTED})).startswith("done: AgentMail")
    assert policy.next_step(operation.model_copy(update={"state": State.FAILED})).startswith("Hail refused")


def test_status_shows_the_upstream_env_without_its_secrets_and_says_why_the_command_cannot_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SENDER", "hello@acme.test")
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        '[upstream]\ncommand = ["no-such-resend-mcp"]\nprofile = "resend"\n'
        '[upstream.env]\nSENDER_EMAIL_ADDRESS = "${FAKE_SENDER}"\nRESEND_BASE_URL = "https://u:pa55@api.test/"\n'
    )
    assert main(["--config", str(config), "status", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    assert report["upstream_env"] == {"SENDER_EMAIL_ADDRESS": "(secret)", "RESEND_BASE_URL": "https://api.test/"}
    assert "hello@acme.test" not in out
    assert "pa55" not in out
    [problem] = [w for w in report["warnings"] if "could not be started" in w]
    assert problem.startswith("the upstream (Resend) could not be started: 'no-such-resend-mcp' is not found")


def test_the_upstream_env_can_come_from_one_variable_as_a_json_object(tmp_path: Path) -> None:
    """What client-config writes into a client's entry (`HAIL_GUARD_UPSTREAM_ENV`)."""
    given = {"HAIL_GUARD_UPSTREAM_ENV": '{"RESEND_BASE_URL": "https://api.resend.test"}'}
    assert load_settings(None, environ=given).upstream.env == {"RESEND_BASE_URL": "https://api.resend.test"}
    with pytest.raises(ConfigError, match="HAIL_GUARD_UPSTREAM_ENV must be a JSON object of texts"):
        load_settings(None, environ={"HAIL_GUARD_UPSTREAM_ENV": "RESEND_BASE_URL=https://x"})
