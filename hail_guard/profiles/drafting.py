"""`hail-guard profile init`: a profile drafted from an upstream's tool list, every guess marked for review.

Every tool that sends (`sending.sends`: it writes to the world and takes a key, names people or says it
sends) is drafted: guarded when it takes a key, says whom a message goes to (`to`, `phone`, `channel`) or
its name says it sends, else listed in `pass_through` (a tool that only names whom it is about, such as
`create-contact(email)`). Its recipients,
message, sender and key argument are guessed from the property names and formats of its input schema (in
the items of an array of objects too: `/emails/*/to`), its id from its output schema, and its lookup and
search from the read-only tools that share its name's words. Everything an upstream says (names,
descriptions) is hostile text: written only inside escaped TOML strings and one-line, escaped comments
(`toml_string`, `comment_text`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mcp import types

from hail_guard import pointers
from hail_guard.profiles import sending

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


def draft(tools: Sequence[types.Tool], *, source: str, name: str, key_env: str | None = None) -> str:
    """The TOML text of a profile for the upstream whose `tools/list` answered `tools`."""
    reads = [tool for tool in tools if not sending.writes_to_world(tool)]
    senders = [tool for tool in tools if sending.sends(tool)]
    guarded = [tool for tool in senders if _surely_sends(tool)]
    passed = [tool for tool in senders if tool not in guarded]
    lines = [
        f"# Drafted by `hail-guard profile init` from {comment_text(source)}.",
        "# Every line marked REVIEW is a guess from the tool's schema: check it against the server's",
        "# documentation, then run `hail-guard profile check FILE --from ...` against the server.",
        "",
        "[profile]",
        f"name = {toml_string(name)}",
        *([f"key_env = {toml_string(key_env)}  # the variable that holds its API key"] if key_env else []),
    ]
    if passed:
        lines += [
            "# REVIEW: these write to the world and name people, but say neither whom a message goes to nor that",
            "# they send: they pass through unguarded. Move each one that messages someone to a [[tools]] entry.",
            "pass_through = [" + ", ".join(toml_string(tool.name) for tool in passed) + "]",
        ]
    for tool in guarded:
        lines += ["", *_tool_lines(tool, reads)]
    if not guarded:
        lines += ["", "# No tool says it sends (a key, recipients, a name such as send_...): add a [[tools]] entry for"]
        lines += ["# each tool that sends."]
    others = [tool for tool in tools if tool not in reads and tool not in senders]
    for title, listed in (
        ("Not guarded (it writes, but names no one and takes no key):", others),
        ("Not guarded (read-only, or writing to a closed world only):", reads),
    ):
        if listed:
            lines += ["", f"# {title}", *(f"#   {comment_text(tool.name)}" for tool in listed)]
    return "\n".join(lines) + "\n"


def _surely_sends(tool: types.Tool) -> bool:
    return bool(sending.key_arguments(tool) or sending.addresses_someone(tool) or sending.says_it_sends(tool))


def _tool_lines(tool: types.Tool, reads: Sequence[types.Tool]) -> list[str]:
    schema = tool.input_schema
    properties = sending.properties(schema)
    keys = sending.key_arguments(tool)
    recipients = sending.recipient_pointers(schema)
    content = _named(schema, _CONTENT) or _first_text(properties, keys)
    senders, sender_names = _named(schema, _SENDERS), _named(schema, _SENDER_NAMES)
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
    if keys:
        lines.append(f"key = {toml_string(pointers.pointer_to(keys[0]))}{REVIEW}: its idempotency key")
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


def _named(schema: Mapping[str, Any] | None, names: set[str]) -> list[str]:
    """Pointers to the arguments called one of `names`: at the top, else in the items of an array of objects."""
    found: list[str] = []
    for name, spec in sending.properties(schema).items():
        if sending.words(name) in names:
            found.append(pointers.pointer_to(name))
            continue
        items = spec.get("items")
        inner = sending.properties(items) if isinstance(items, Mapping) else {}
        found += [pointers.pointer_to(name, pointers.EVERY, part) for part in inner if sending.words(part) in names]
    return found


def _first_text(properties: Mapping[str, Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The first text argument that is not the key: the message, when nothing is named like one."""
    texts = [name for name, spec in properties.items() if _is_text(spec) and name not in keys]
    return [pointers.pointer_to(name) for name in texts[:1]]


def _is_text(spec: Mapping[str, Any]) -> bool:
    kind = spec.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _channel(tool: types.Tool, properties: Mapping[str, Any]) -> str:
    words = sending.words(tool.name) + " " + " ".join(sending.words(name) for name in properties)
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
    declared = sending.properties(tool.output_schema)
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
    """The read tool's required arguments that the send also takes are the send's; its id argument (the first
    other required one ending in `id`, else an `id` it declares and the send does not give) the provider id."""
    required = [name for name in (read.input_schema or {}).get("required") or () if isinstance(name, str)]
    mapped = {name: toml_string(pointers.pointer_to(name)) for name in required if name in send}
    declared = sending.properties(read.input_schema)
    free = [name for name in required if name.lower().endswith("id") and name not in send]
    id_argument = free[0] if free else "id" if "id" not in send and ("id" in declared or not declared) else None
    if id_argument is not None:
        mapped[id_argument] = '"$provider_id"'
    said = ", ".join(f"{toml_key(name)} = {value}" for name, value in mapped.items())
    return f"{{ tool = {toml_string(read.name)}, arguments = {{ {said} }} }}"


def _search(read: types.Tool, send: Mapping[str, Any], recipients: Sequence[str], content: Sequence[str]) -> str:
    shared = [
        name
        for name in sending.properties(read.input_schema)
        if name in send and (pointers.pointer_to(name) in recipients or sending.words(name) in _SENDERS)
    ]
    arguments = ", ".join(f"{toml_key(name)} = {toml_string(pointers.pointer_to(name))}" for name in shared)
    texts = {"subject", "text", "body", "message"}
    match = _pointer_list([pointer for pointer in content if sending.words(pointers.parse(pointer)[-1]) in texts][:1])
    arguments = f"{{ {arguments} }}" if arguments else "{}"
    return f"{{ tool = {toml_string(read.name)}, arguments = {arguments}, match = {match} }}"


def _pointer_list(found: Sequence[str]) -> str:
    return "[" + ", ".join(toml_string(pointer) for pointer in found) + "]"


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
