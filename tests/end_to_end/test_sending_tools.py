"""Which tools send, and what a profile must say of them: the one rule (`profiles.sending`) that `profile init`,
`profile check` and `serve` share; tools that send many (`/emails/*/to`); a key that is not a key."""

from __future__ import annotations

import tomllib
from typing import Any

from mcp import types

from hail_guard import pointers, recipients
from hail_guard.fake.servers import agentmail, resend
from hail_guard.profiles import load_profile, parse_profile
from hail_guard.profiles.checking import check
from hail_guard.profiles.drafting import draft
from hail_guard.profiles.sending import recipient_pointers, sends

_EMAILS = {"type": "array", "items": {"type": "string", "format": "email"}}
BATCH: dict[str, Any] = {
    "type": "object",
    "properties": {
        "emails": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"to": _EMAILS, "cc": _EMAILS, "subject": {"type": "string"}, "text": {"type": "string"}},
            },
        },
        "idempotencyKey": {"type": "string"},
    },
}


def tool(name: str, properties: dict[str, Any], notes: types.ToolAnnotations | None = None, **extra: Any) -> types.Tool:
    schema = {"type": "object", "properties": properties, **extra}
    return types.Tool(name=name, input_schema=schema, annotations=notes)


READS = types.ToolAnnotations(read_only_hint=True)
CLOSED = types.ToolAnnotations(read_only_hint=False, open_world_hint=False)


def test_a_pointer_through_every_item_reads_each_items_value_flattened() -> None:
    batch = {"emails": [{"to": ["a@x.io"], "cc": ["c@x.io"]}, {"to": ["b@x.io", "d@x.io"]}, {"subject": "s"}]}
    assert pointers.resolve(batch, "/emails/*/to") == ["a@x.io", "b@x.io", "d@x.io"]
    assert pointers.resolve(batch, "/emails/*/bcc") is None
    assert pointers.resolve({"emails": "not a list"}, "/emails/*/to") is None
    assert pointers.schema_at(BATCH, "/emails/*/to") == [_EMAILS]
    assert pointers.schema_at(BATCH, "/emails/*/bcc") is None
    assert pointers.shown("/emails/*/to") == "emails.*.to"
    reached = recipients.recipients_of("email", batch, ("/emails/*/to", "/emails/*/cc"))
    assert reached == ("a@x.io", "b@x.io", "d@x.io", "c@x.io")


def test_a_tool_sends_when_it_writes_and_takes_a_key_names_people_or_is_named_like_a_send() -> None:
    assert sends(tool("send-broadcast", {"broadcastId": {"type": "string"}}))  # no annotations: it writes
    assert sends(tool("create-contact", {"email": {"type": "string"}}))
    assert sends(tool("anything", {"dedupe_key": {"type": "string"}}))
    assert sends(tool("send-batch-emails", BATCH["properties"]))
    assert not sends(tool("send-email", {"to": _EMAILS}, READS))
    assert not sends(tool("send_note", {"to": _EMAILS}, CLOSED))
    assert not sends(tool("create-template", {"name": {"type": "string"}}))
    assert recipient_pointers(BATCH) == ["/emails/*/to", "/emails/*/cc"]


def test_a_tool_that_sends_but_is_neither_guarded_nor_let_pass_is_an_error_of_profile_check() -> None:
    profile = parse_profile('[profile]\nname = "x"\npass_through = ["create-contact"]\n', "x")
    listed = [
        tool("send-broadcast", {"broadcastId": {"type": "string"}}),
        tool("create-contact", {"email": {"type": "string"}}),
        tool("list-emails", {"limit": {"type": "number"}}, READS),
    ]
    findings = check(profile, listed)
    [error] = [finding for finding in findings if finding.level == "error"]
    assert (error.where, error.per_call) == ("send-broadcast", True)
    assert "is named like a send" in error.what
    assert "pass_through" in error.what


def test_a_key_pointing_at_a_field_that_is_not_a_key_is_an_error_unless_said_checked() -> None:
    listed = [tool("send-email", {"to": _EMAILS, "subject": {"type": "string"}, "idempotencyKey": {"type": "string"}})]
    wrong = '[profile]\nname = "x"\n[[tools]]\nname = "send-email"\nrecipients = ["/to"]\nkey = "/subject"\n'
    [error] = [finding for finding in check(parse_profile(wrong, "x"), listed) if finding.level == "error"]
    assert error.where == "send-email.key"
    assert "not named like an idempotency key" in error.what
    vouched = wrong + "key_checked = true\n"
    assert not [finding for finding in check(parse_profile(vouched, "x"), listed) if finding.level == "error"]
    absent = wrong.replace('key = "/subject"', 'key = "/nonce"') + "key_checked = true\n"
    [missing] = [finding for finding in check(parse_profile(absent, "x"), listed) if finding.level == "error"]
    assert "'/nonce' is not in send-email's input schema" in missing.what


def test_a_draft_maps_a_read_tools_id_once_when_the_send_takes_it_too() -> None:
    """Regression: `profile init` against resend-mcp failed with "Duplicate inline table key 'id'" when the
    read tool's `id` was also an argument of the writing tool."""
    listed = [
        tool("send-reminder", {"id": {"type": "string"}, "to": _EMAILS, "text": {"type": "string"}}),
        tool("get-reminder", {"id": {"type": "string"}}, READS, required=["id"]),
    ]
    drafted = tomllib.loads(draft(listed, source="test", name="x"))
    [entry] = drafted["tools"]
    assert entry["lookup"] == {"tool": "get-reminder", "arguments": {"id": "/id"}}


def test_a_draft_guards_each_tool_that_sends_and_lets_pass_those_that_only_name_people() -> None:
    listed = [
        tool("send-batch-emails", BATCH["properties"]),
        tool("send-broadcast", {"broadcastId": {"type": "string"}}),
        tool("add-suppression", {"email": {"type": "string"}}),
        tool("get-email", {"id": {"type": "string"}}, READS, required=["id"]),
    ]
    text = draft(listed, source="test", name="mail")
    drafted = tomllib.loads(text)
    assert drafted["profile"]["pass_through"] == ["add-suppression"]
    batch, broadcast = drafted["tools"]
    assert batch["recipients"] == ["/emails/*/to", "/emails/*/cc"]
    assert batch["content"] == ["/emails/*/subject", "/emails/*/text"]
    assert batch["key"] == "/idempotencyKey"
    assert broadcast["name"] == "send-broadcast"
    assert all("REVIEW" in line for line in text.splitlines() if line.startswith(("recipients", "content", "key")))
    assert not [finding for finding in check(parse_profile(text, "draft"), listed) if finding.level == "error"]


def test_the_built_in_resend_and_agentmail_profiles_fit_their_servers_fakes() -> None:
    for name, surface in (("resend", resend()), ("agentmail", agentmail())):
        profile = load_profile(name)
        errors = [finding for finding in check(profile, surface.tools) if finding.level == "error"]
        assert errors == [], name
    guarded = set(load_profile("resend").tools)
    assert guarded == {"send-email", "send-batch-emails", "send-broadcast", "send-event"}
    assert set(load_profile("agentmail").tools) == {"send_message", "reply_to_message", "forward_message", "send_draft"}
    assert (load_profile("resend").display_name, load_profile("agentmail").display_name) == ("Resend", "AgentMail")
    assert load_profile("resend").key_env == "RESEND_API_KEY"
