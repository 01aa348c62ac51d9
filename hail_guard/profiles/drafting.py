"""`hail-guard profile init`: a profile drafted from an upstream's tool list, every guess marked for review.

A tool is proposed as guarded when its annotations say it writes to the world (`readOnlyHint` false,
`openWorldHint` not false; MCP's defaults when it has none). Its recipients, message, sender and key
argument are guessed from the property names and formats of its input schema, its id from its output
schema, and its lookup and search from the read-only tools that share its name's words. Everything an
upstream says (names, descriptions) is hostile text: written only inside escaped TOML strings and
one-line, escaped comments (`toml_string`, `comment_text`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mcp import types

from hail_guard import pointers

_KEYS = {"idempotencykey", "idempotencytoken", "dedupekey", "dedupkey", "deduplicationkey"}
_RECIPIENTS = {
    "to",
    "cc",
    "bcc",
    "recipient",
    "recipients",
    "channel",
    "channelid",
    "chatid",
    "conversationid",
    "roomid",
    "phone",
    "phonenumber",
    "number",
    "email",
    "emailaddress",
    "userid",
    "target",
    "destination",
}
_CONTENT = {
    "subject",
    "text",
    "body",
    "bodytext",
    "bodyhtml",
    "html",
    "message",
    "content",
    "caption",
    "title",
    "markdown",
    "firstmessage",
    "systemprompt",
    "prompt",
    "attachments",
    "blocks",
}
_SENDERS = {"from", "sender", "replyto", "inboxid", "fromaddress"}
_SENDER_NAMES = {"fromname", "sendername", "displayname"}
_IDS = ("id", "messageId", "message_id", "messageID", "emailId", "email_id")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
REVIEW = "  # REVIEW: guessed from the schema"


def writes_to_world(tool: types.Tool) -> bool:
    """What MCP's annotations say: not read-only, and not limited to a closed world (defaults when unsaid)."""
    notes = tool.annotations
    read_only = bool(notes.read_only_hint) if notes is not None and notes.read_only_hint is not None else False
    open_world = notes.open_world_hint if notes is not None and notes.open_world_hint is not None else True
    return not read_only and open_world is not False


def draft(tools: Sequence[types.Tool], *, source: str, name: str) -> str:
    """The TOML text of a profile for the upstream whose `tools/list` answered `tools`."""
    lines = [
        f"# Drafted by `hail-guard profile init` from {comment_text(source)}.",
        "# Every line marked REVIEW is a guess from the tool's schema: check it against the server's",
        "# documentation, then run `hail-guard profile check FILE --from ...` against the server.",
        "",
        "[profile]",
        f"name = {toml_string(name)}",
    ]
    reads = [tool for tool in tools if not writes_to_world(tool)]
    guarded = [tool for tool in tools if writes_to_world(tool)]
    for tool in guarded:
        lines += ["", *_tool_lines(tool, reads)]
    if not guarded:
        lines += [
            "",
            "# No tool says it writes to the world (readOnlyHint false, openWorldHint not false): add",
            "# a [[tools]] entry for each tool that sends.",
        ]
    if reads:
        lines += ["", "# Not guarded (read-only, or writing to a closed world only):"]
        lines += [f"#   {comment_text(tool.name)}" for tool in reads]
    return "\n".join(lines) + "\n"


def _tool_lines(tool: types.Tool, reads: Sequence[types.Tool]) -> list[str]:
    properties = _properties(tool.input_schema)
    recipients = _pick(properties, _RECIPIENTS, formats=("email",))
    content = _pick(properties, _CONTENT) or [name for name, spec in properties.items() if _is_text(spec)][:1]
    senders, sender_names = _pick(properties, _SENDERS), _pick(properties, _SENDER_NAMES)
    key = next(iter(_pick(properties, _KEYS)), None)
    lines = [
        f"# {comment_text(tool.name)}: {comment_text(tool.description or 'no description')}",
        "[[tools]]",
        f"name = {toml_string(tool.name)}",
        f"channel = {toml_string(_channel(tool, properties))}  # REVIEW: what it sends (email, sms, chat, ...)",
        f"recipients = {_pointer_list(recipients)}{REVIEW}" + ("" if recipients else ": none found, add them"),
        f"content = {_pointer_list(content)}{REVIEW}",
    ]
    if senders:
        lines.append(f"sender = {_pointer_list(senders)}{REVIEW}")
    if sender_names:
        lines.append(f"sender_names = {_pointer_list(sender_names)}{REVIEW}")
    if key is not None:
        lines.append(f"key = {toml_string(pointers.pointer_to(key))}{REVIEW}: its idempotency key")
    else:
        lines.append("# No key argument found: the upstream takes none, so hail-guard never replays this tool.")
    lines.append(f"provider_id = {toml_string(_provider_id(tool))}{REVIEW}: where an answer carries its id")
    lookup = _read_tool(tool, reads, ("get", "read", "fetch", "retrieve"))
    if lookup is not None:
        lines.append(f"lookup = {_lookup(lookup, properties)}{REVIEW}")
    search = _read_tool(tool, reads, ("list", "search", "find", "history"))
    if search is not None:
        lines.append(f"search = {_search(search, properties, recipients, content)}{REVIEW}")
    return lines


def _properties(schema: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    found = (schema or {}).get("properties")
    if not isinstance(found, Mapping):
        return {}
    return {str(name): spec if isinstance(spec, Mapping) else {} for name, spec in found.items()}


def _words(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _pick(properties: Mapping[str, Mapping[str, Any]], names: set[str], formats: Sequence[str] = ()) -> list[str]:
    picked = []
    for name, spec in properties.items():
        items = spec.get("items")
        shapes = {spec.get("format"), items.get("format") if isinstance(items, Mapping) else None}
        if _words(name) in names or shapes & set(formats):
            picked.append(name)
    return picked


def _is_text(spec: Mapping[str, Any]) -> bool:
    kind = spec.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _channel(tool: types.Tool, properties: Mapping[str, Any]) -> str:
    words = _words(tool.name) + " " + " ".join(_words(name) for name in properties)
    for channel, hints in (
        ("email", ("email", "mail", "subject")),
        ("sms", ("sms", "text message")),
        ("call", ("call", "dial")),
        ("chat", ("channel", "chat", "post", "message")),
    ):
        if any(hint in words for hint in hints):
            return channel
    return tool.name


def _provider_id(tool: types.Tool) -> str:
    declared = _properties(tool.output_schema)
    found = next((name for name in _IDS if name in declared), None)
    found = found or next((name for name in declared if name.lower().endswith("id")), "id")
    return pointers.pointer_to(found)


def _tokens(name: str) -> set[str]:
    return {part for part in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()) if part}


def _read_tool(tool: types.Tool, reads: Sequence[types.Tool], verbs: Iterable[str]) -> types.Tool | None:
    """The read-only tool that starts with one of `verbs` and shares the most words with `tool`'s name."""
    nouns = _tokens(tool.name) - {"send", "post", "create", "place", "make", "new", "add"}
    candidates = [read for read in reads if _verb(read) in verbs]
    scored = sorted(candidates, key=lambda read: -len(_stems(nouns) & _stems(_tokens(read.name))))
    best = scored[0] if scored else None
    return best if best is not None and _stems(nouns) & _stems(_tokens(best.name)) else None


def _verb(tool: types.Tool) -> str:
    first = re.split(r"[^a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", tool.name).lower())
    return next((part for part in first if part), "")


def _stems(words: set[str]) -> set[str]:
    return {word.removesuffix("s") for word in words}


def _lookup(read: types.Tool, send: Mapping[str, Any]) -> str:
    """The read tool's id argument takes the provider id; its other required arguments the send's alike."""
    required = [name for name in (read.input_schema or {}).get("required") or () if isinstance(name, str)]
    id_argument = next((name for name in required if name.lower().endswith("id") and name not in send), "id")
    mapped = [f'{toml_key(id_argument)} = "$provider_id"']
    mapped += [f"{toml_key(name)} = {toml_string(pointers.pointer_to(name))}" for name in required if name in send]
    return f"{{ tool = {toml_string(read.name)}, arguments = {{ {', '.join(mapped)} }} }}"


def _search(read: types.Tool, send: Mapping[str, Any], recipients: Sequence[str], content: Sequence[str]) -> str:
    properties = _properties(read.input_schema)
    shared = [name for name in properties if name in send and (name in recipients or _words(name) in _SENDERS)]
    arguments = ", ".join(f"{toml_key(name)} = {toml_string(pointers.pointer_to(name))}" for name in shared)
    match = _pointer_list([name for name in content if _words(name) in {"subject", "text", "body", "message"}][:1])
    arguments = f"{{ {arguments} }}" if arguments else "{}"
    return f"{{ tool = {toml_string(read.name)}, arguments = {arguments}, match = {match} }}"


def _pointer_list(names: Sequence[str]) -> str:
    return "[" + ", ".join(toml_string(pointers.pointer_to(name)) for name in names) + "]"


def toml_key(name: str) -> str:
    """A TOML key: bare when it can be, else a quoted, escaped string."""
    return name if _BARE_KEY.match(name) else toml_string(name)


def toml_string(text: str) -> str:
    """`text` as a TOML basic string that reads back as `text`: quotes, backslashes, control and format
    characters (bidi overrides, zero-width ones) escaped; a lone surrogate, which TOML cannot hold, as U+FFFD."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif 0xD800 <= code <= 0xDFFF:
            out.append("\\uFFFD")
        elif unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}")
        else:
            out.append(char)
    return "".join(out) + '"'


def comment_text(text: str, most: int = 100) -> str:
    """Text safe inside a one-line TOML comment and on a terminal: escaped as in `toml_string`, cut short."""
    shown = toml_string(" ".join(text.split()))[1:-1]
    return shown if len(shown) <= most else shown[: most - 3] + "..."
