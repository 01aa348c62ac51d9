"""Profiles as files: what the chat example leaves out gets a default; a bad file is refused naming the file, the
key and what to do; `profile init` writes hostile tool text safely; `profile check` names what does not exist."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import types

from hail_guard import pointers
from hail_guard.cli import main
from hail_guard.cli.fake import from_profile
from hail_guard.config import load_settings
from hail_guard.errors import ConfigError
from hail_guard.fake.servers import agentmail, resend
from hail_guard.profiles import BUILT_IN, built_in, hail, load_profile, parse_profile
from hail_guard.profiles.checking import check
from hail_guard.profiles.drafting import comment_text, draft, toml_string
from hail_guard.profiles.sending import writes_to_world
from hail_guard.sandbox.tools import tool_list

EXAMPLE = Path(__file__).parents[2] / "examples" / "chat.toml"


def test_the_chat_example_is_read_as_written_with_defaults_for_the_rest() -> None:
    spec = load_profile(str(EXAMPLE)).spec("post_message")
    assert (spec.channel, spec.recipients, spec.content, spec.provider_id) == ("chat", ("/channel",), ("/text",), "/id")
    assert spec.key is None
    assert not spec.forwards_key
    assert spec.key_field == "idempotency_key"
    assert spec.search is not None
    assert spec.search.arguments == {"channel": "/channel"}
    assert spec.answers.is_error == "lost"
    assert spec.rules == ()
    assert spec.retention_hours == 24
    assert spec.message({"channel": "#a", "text": "hi", "extra": 1}) == {"text": "hi"}


def test_every_built_in_profile_loads_and_hail_is_the_default() -> None:
    assert [built_in(name).name for name in BUILT_IN] == list(BUILT_IN)
    assert load_settings(None, environ={}).upstream.profile == "hail"
    assert set(hail().tools) == {"send_email", "send_sms", "place_call"}
    taking_key: dict[str, dict[str, Any]] = {
        "acquire_number": {"properties": {"idempotency_key": {}}},
        "whoami": {"properties": {}},
    }
    assert hail().guarded(taking_key, None) == {"acquire_number"}
    assert built_in("resend").spec("send-email").key == "idempotencyKey"
    assert built_in("agentmail").spec("send_message").key is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('[profile]\nname = "x"\n[[tools]]\nname = "post"\nserach = {}\n', 'unknown key "serach" in tools[0] (post)'),
        ('[profile]\nname = "x"\n[[tools]]\nname = "post"\nserach = {}\n', 'did you mean "search"?'),
        ('[profile]\nname = "x"\n[[tools]]\nname = "post"\nrecipients = ["channel"]\n', "tools[0] (post).recipients"),
        (
            '[profile]\nname = "x"\n[[tools]]\nname = "post"\nrecipients = ["channel"]\n',
            "write it with a leading slash",
        ),
        ("[profile]\nname = \n", "is not valid TOML"),
        ("[profile]\nname = \n", "line 2"),
        ('[tools]\nname = "x"\n', "profile: missing; add it"),
        ('[profile]\nname="x"\n[[answers.patterns]]\nmatch = "(("\nkind = "refused"\n', "not a regular expression"),
        ('[profile]\nname="x"\n[[answers.patterns]]\nmatch = "a"\nkind = "sent"\n', "answers.patterns[0].kind"),
        ('[profile]\nname="x"\n[[rules]]\nfield = "/a"\nequals = 1\nnot_empty = true\nmessage = "m"\n', "exactly one"),
        ('[profile]\nname="x"\n[[tools]]\nname="a"\n[[tools]]\nname="a"\n', "tools named more than once: a"),
        ('[profile]\nname="x"\n[[tools]]\nname="a"\nsearch={tool="l",arguments={c="$nope"}}\n', "$provider_id, $since"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_file_the_key_and_what_to_do(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=r"the profile mine\.toml") as refused:
        parse_profile(text, "mine.toml")
    assert said in str(refused.value)


def test_a_missing_profile_file_says_what_profile_takes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the profile .*nope\.toml.*built-in name \(hail, resend"):
        load_profile("nope.toml", tmp_path)


def test_serve_with_a_bad_profile_exits_1_saying_what_to_fix_before_starting_the_upstream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.toml").write_text('[profile]\nname = "x"\n[[tools]]\nname = "post"\nrecipients = ["channel"]\n')
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    config = tmp_path / "hail-guard.toml"
    config.write_text(f'[upstream]\nprofile = "bad.toml"\ncommand = {json.dumps(command)}\n')
    assert main(["--config", str(config), "serve"]) == 1
    said = capsys.readouterr().err
    assert f"the profile {tmp_path / 'bad.toml'} is not valid: tools[0] (post).recipients[0]" in said
    assert "write it with a leading slash" in said
    assert not started.exists()


def test_a_profile_file_is_found_beside_the_config_that_names_it(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "hail-guard.toml"
    config.write_text('[upstream]\nprofile = "chat.toml"\n')
    assert load_settings(str(config), environ={}).upstream.profile == str(tmp_path / "conf" / "chat.toml")
    named = {"HAIL_GUARD_UPSTREAM_PROFILE": "chat.toml"}  # from the environment: the working folder's
    assert load_settings(str(config), environ=named).upstream.profile == "chat.toml"


def test_pointers_read_arguments_and_schemas_as_rfc_6901_says() -> None:
    document = {"to": ["a", "b"], "a/b": {"~x": 1}, "none": None}
    assert pointers.resolve(document, "/to/1") == "b"
    assert pointers.resolve(document, "/a~1b/~0x") == 1
    assert pointers.resolve(document, "/to/9") is None
    assert pointers.present(document, "/none")
    schema = {"properties": {"to": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object"}}}
    assert pointers.schema_at(schema, "/to/0") == [{"type": "string"}]
    assert pointers.schema_at(schema, "/meta/anything") == []  # free-form: nothing to rule it out
    assert pointers.schema_at(schema, "/nope") is None
    with pytest.raises(pointers.PointerError, match="leading slash"):
        pointers.parse("to")


@given(st.text())
def test_any_text_written_as_a_toml_string_reads_back_as_itself(text: str) -> None:
    expected = "".join("\ufffd" if 0xD800 <= ord(char) <= 0xDFFF else char for char in text)
    assert tomllib.loads(f"x = {toml_string(text)}")["x"] == expected
    assert "\n" not in comment_text(text)
    assert "\x1b" not in comment_text(text)


HOSTILE = 'evil"]\n[profile]\nname = "pwned" #\u202e\x1b[2J\ud800'


def test_a_hostile_tool_list_drafts_a_profile_that_reads_back_unchanged() -> None:
    schema = {"type": "object", "properties": {HOSTILE: {"type": "string"}, "to": {"type": "string"}}}
    tool = types.Tool(name=HOSTILE, description=HOSTILE, input_schema=schema)
    text = draft([tool], source=HOSTILE, name=HOSTILE)
    profile = parse_profile(text, "draft")
    assert profile.name == HOSTILE.replace("\ud800", "\ufffd")
    [spec] = profile.tools.values()
    assert spec.name == profile.name
    assert spec.recipients == ("/to",)
    assert all(line.startswith("#") or "\x1b" not in line for line in text.splitlines())
    assert "\u202e" not in text
    assert "\x1b" not in text


def test_a_draft_proposes_exactly_the_tools_that_write_to_the_world() -> None:
    def tool(name: str, notes: types.ToolAnnotations | None) -> types.Tool:
        return types.Tool(name=name, input_schema={"type": "object"}, annotations=notes)

    assert writes_to_world(tool("unsaid", None))  # MCP's defaults: not read-only, open world
    assert not writes_to_world(tool("reads", types.ToolAnnotations(read_only_hint=True)))
    assert not writes_to_world(tool("closed", types.ToolAnnotations(read_only_hint=False, open_world_hint=False)))
    hail_draft = tomllib.loads(draft(tool_list(), source="sandbox", name="hail"))
    assert [t["name"] for t in hail_draft["tools"]] == ["send_email", "send_sms", "place_call"]


@pytest.mark.parametrize(
    ("profile", "tools"),
    [("resend", resend().tools), ("agentmail", agentmail().tools), ("hail", tuple(tool_list()))],
)
def test_each_shipped_profile_fits_the_schemas_of_its_server(profile: str, tools: tuple[types.Tool, ...]) -> None:
    assert [f for f in check(built_in(profile), tools) if f.level == "error"] == []


def test_check_finds_a_tool_or_an_argument_the_upstream_does_not_have() -> None:
    chat = load_profile(str(EXAMPLE))
    listed = list(from_profile(chat).tools)
    renamed = [t.model_copy(update={"name": "list_posts"}) if t.name == "list_messages" else t for t in listed]
    found = [(f.level, f.where) for f in check(chat, renamed)]
    assert ("error", "post_message.search") in found
    narrowed = [
        t.model_copy(update={"input_schema": {"type": "object", "properties": {"text": {}}}})
        if t.name == "post_message"
        else t
        for t in listed
    ]
    assert ("error", "post_message.recipients") in [(f.level, f.where) for f in check(chat, narrowed)]
    assert [f for f in check(chat, listed) if f.level == "error"] == []
