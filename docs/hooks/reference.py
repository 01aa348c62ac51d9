"""The reference pages, generated from the code each time the site is built, so they cannot go stale.

A page asks for a generated part with a marker on a line of its own, `<!-- reference: NAME -->`, where
NAME is one of `PARTS`: `commands` (the argparse parser of `hail_guard.cli`), `configuration` (the pydantic
settings of `hail_guard.config`, each key's meaning from its docstring, else from its comment in
config.example.toml), `profile` (the profile model, `hail_guard.profiles.model`), `tools` (the registry,
`hail_guard.tools.OWN`), `states`, `moves` and `machine` (`hail_guard.lifecycle` and the answers' texts),
`delivery` (`hail_guard.delivery`), `same_send` (the rules as `hail_guard/same_send.py`'s docstring states
them), `imports` (the import rules, `[tool.importlinter]` in pyproject.toml). MkDocs runs it as a hook
(mkdocs.yml `hooks:`); tests/unit/test_docs.py renders every part too, so a change to the code that breaks a
part fails the tests, not only the site's build.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- reference: ([a-z_]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs' hook: each marker replaced by its generated part (an unknown name stops the build)."""
    return MARKER.sub(lambda found: render(found[1]), markdown)


def render(name: str) -> str:
    if name not in PARTS:
        raise KeyError(f"<!-- reference: {name} --> names no generated part; the parts are {', '.join(PARTS)}")
    return PARTS[name]().strip() + "\n"


def _cell(text: object) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(head: tuple[str, ...], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


# --- commands (argparse) ----------------------------------------------------------------------------------


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command line's words (`ops list`) with its parser, in the order `--help` lists them."""
    groups = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not groups:
        yield path, parser
    for group in groups:
        for name, child in group.choices.items():
            yield from _leaves(child, (*path, name))


def command_parser() -> argparse.ArgumentParser:
    from hail_guard.cli import parser

    return parser(["drill", "sandbox", "fake", "console"])  # their options load only when named


def _option_rows(command: argparse.ArgumentParser) -> list[tuple[str, str]]:
    formatter = command._get_formatter()
    rows: list[tuple[str, str]] = []
    for action in command._actions:
        if isinstance(action, argparse._HelpAction) or "--config" in action.option_strings:
            continue
        if "--verbose" in action.option_strings or "--version" in action.option_strings:
            continue
        if action.option_strings:
            takes = "" if action.nargs == 0 else " " + str(action.metavar or action.dest.upper())
            names = ", ".join(f"`{name}{takes}`" for name in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest.upper()!s}`"
        meaning = formatter._expand_help(action) if action.help else ""
        if action.choices and not action.option_strings:
            meaning += " (one of: " + ", ".join(f"`{choice}`" for choice in action.choices) + ")"
        rows.append((names, meaning))
    return rows


def commands() -> str:
    leaves = list(_leaves(command_parser()))
    parts = [_table(("command", "what it does"), [(f"[`hail-guard {' '.join(p)}`](#{_anchor(p)})", c.description or "")
                                                   for p, c in leaves])]  # fmt: skip
    for path, command in leaves:
        parts.append(f"## hail-guard {' '.join(path)} {{#{_anchor(path)}}}\n\n{command.description or ''}")
        parts.append("```text\n" + command.format_usage().strip() + "\n```")
        rows = _option_rows(command)
        if rows:
            parts.append(_table(("argument", "meaning"), rows))
        if command.epilog:
            parts.append("```text\n" + command.epilog.strip() + "\n```")
    return "\n\n".join(parts)


def _anchor(path: tuple[str, ...]) -> str:
    return "hail-guard-" + "-".join(path)


# --- settings and profiles (pydantic) -------------------------------------------------------------------


def _attribute_docstrings(source: Path) -> dict[tuple[str, str], str]:
    """(class, field) -> the string literal right after the field's annotation, as the source writes it."""
    found: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement, following in zip(node.body, node.body[1:], strict=False):
            targets = [statement.target] if isinstance(statement, ast.AnnAssign) else getattr(statement, "targets", [])
            if (
                len(targets) == 1
                and isinstance(targets[0], ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                found[(node.name, targets[0].id)] = " ".join(following.value.value.split())
    return found


def _example_comments() -> dict[tuple[str, str], str]:
    """(section, key) -> what config.example.toml says of the key: its line's own comment, else the comments
    right above it (keys one after another share the comments above the first)."""
    found: dict[tuple[str, str], str] = {}
    section, above, after_key = "", list[str](), False
    for line in (ROOT / "config.example.toml").read_text().splitlines():
        stripped = line.strip()
        header = re.fullmatch(r"#?\s*\[([a-z_.]+)\]", stripped)
        key = re.fullmatch(r"#?\s*([a-z_]+) = [^#]*(?:#\s*(.*))?", stripped)
        if header:
            section, above = header[1].replace(".", "_"), []
        elif key:
            found[(section, key[1])] = key[2] or " ".join(above)
        elif stripped.startswith("#"):
            above = [*([] if after_key else above), stripped.lstrip("# ")]
        else:
            above = []
        after_key = bool(key)
    return found


def _type_name(annotation: Any) -> str:
    """A field's type in a reader's words: text, number, true/false, a list of..., one of..."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin is typing.Annotated:
        named = {"_pointer": "pointer", "_regex": "pattern", "_top_level": "pointer to an argument"}
        check = getattr(arguments[1], "func", None)
        return named.get(getattr(check, "__name__", ""), _type_name(arguments[0]))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(argument) for argument in arguments if argument is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in arguments)
    if origin in (list, tuple):
        return "list of " + (_type_name(arguments[0]) if arguments else "values")
    if origin is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    if getattr(annotation, "__name__", "") == "SecretStr":
        return "text (a secret: never shown)"
    simple = {str: "text", int: "whole number", float: "number", bool: "true/false", Any: "any value"}
    return simple.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        made = field.default_factory()  # type: ignore[call-arg]
        return "" if isinstance(made, BaseModel) else f"`{json.dumps(made)}`"
    if field.default is None or field.default is PydanticUndefined:
        return "unset"
    value = field.default.get_secret_value() if hasattr(field.default, "get_secret_value") else field.default
    return f"`{json.dumps(value)}`"


def configuration() -> str:
    from hail_guard.config import ENV_PREFIX, Settings, default_ledger_url

    docstrings = _attribute_docstrings(ROOT / "hail_guard" / "config.py")
    comments = _example_comments()
    parts = []
    for section, holder in Settings.model_fields.items():
        model = holder.annotation
        assert isinstance(model, type)
        assert issubclass(model, BaseModel)
        rows = []
        for key, field in model.model_fields.items():
            meaning = docstrings.get((model.__name__, key)) or comments.get((section, key), "")
            default = _default(field)
            if field.default_factory is default_ledger_url:
                default = "`ledger.db` in the per-user data folder"
            variable = f"`{ENV_PREFIX}{section.upper()}_{key.upper()}`"
            rows.append((f"`{key}`", _type_name(field.annotation), default, variable, meaning))
        parts.append(f"## [{section}]\n\n" + _table(("key", "type", "default", "variable", "meaning"), rows))
    return "\n\n".join(parts)


PROFILE_MEANINGS: Mapping[str, str] = {
    "Meta.name": "the profile's name (logs, `status`)",
    "Meta.description": "what the upstream is, for a reader",
    "ToolEntry.name": "the upstream tool this entry guards",
    "ToolEntry.lookup": "how to read a send back by the upstream's id (the table [lookup](#lookup) below)",
    "ToolEntry.search": "how to find a send with no id (the table [search](#search) below)",
    "ToolEntry.rules": "argument rules for this tool, checked before anything is recorded ([rules](#rules))",
    "ToolFields.channel": "what it sends (`email`, `sms`, `call`, `chat`...): keys and opt-outs are per channel; "
    "`email`, `sms` and `call` normalise addresses and numbers; default: the tool's name",
    "ToolFields.recipients": "pointers to who receives it, each checked against opt-outs; default: "
    "`/to`, `/cc`, `/bcc`, `/recipient`, `/recipients`",
    "ToolFields.not_content": "top-level arguments that are not the message (metadata, attestations)",
    "Lookup.tool": "the read tool to call",
    "Lookup.arguments": "its arguments: a pointer into the stored request, `$provider_id`, `$since` or a literal",
    "Search.tool": "the listing tool to call",
    "Search.arguments": "its arguments, written as a lookup's are",
    "Rule.field": "the argument the rule checks",
    "Rule.equals": "the value it must have (Hail's consent: `true`)",
    "Rule.length": "`[shortest, longest]` for a text or a list",
    "Rule.pattern": "a regular expression the text must match",
    "Rule.not_empty": "it must be given and not empty",
    "Rule.one_of": "at least one of these arguments must be given (a rule with `one_of` has no `field`)",
    "Pattern.match": "a regular expression searched in the error text",
    "Pattern.kind": "what the text means: `refused` (for good), `retry_later`, `gateway_error`, `still_processing`, "
    "`key_conflict`, `lost` or `unrecognised`",
    "FailedRecord.field": "where the record says its status",
    "FailedRecord.equals": "the status that means it failed (an SMS `failed`)",
    "FailedRecord.reason": "how the failure is worded",
    "Answers.failed": "records that say they failed ([answers.failed](#answersfailed))",
}
"""Meanings of the profile's keys whose fields carry no docstring (tests/unit/test_docs.py: each names a field)."""


def _model_rows(model: type[BaseModel], docstrings: Mapping[tuple[str, str], str]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for key, field in model.model_fields.items():
        owner = next(base for base in model.__mro__ if key in getattr(base, "__annotations__", {}))
        meaning = docstrings.get((owner.__name__, key)) or PROFILE_MEANINGS.get(f"{owner.__name__}.{key}", "")
        rows.append((f"`{key}`", _type_name(field.annotation), _default(field), meaning))
    return rows


def profile_sections() -> list[tuple[str, type[BaseModel], str]]:
    """(the table's name as a profile writes it, its model, a line about it) for every table of a profile."""
    from hail_guard.profiles import model

    return [
        ("[profile]", model.Meta, "The profile itself."),
        ("[defaults]", model.ToolFields, "What every `[[tools]]` entry leaves out; then the built-in defaults."),
        ("[[tools]]", model.ToolEntry, "One guarded tool each: every key of `[defaults]`, and these."),
        ("lookup", model.Lookup, "A tool entry's `lookup = { ... }`: read a send back by the upstream's id."),
        ("search", model.Search, "A tool entry's `search = { ... }`: find a send with no id among listed items."),
        ("match", model.Match, "An entry of `search.match` written as a table (a pointer alone compares text)."),
        ("rules", model.Rule, "A rule: in a tool entry's `rules = [...]`, or `[[rules]]` for every guarded tool."),
        ("[answers]", model.Answers, "How an answer is read and sorted."),
        ("[[answers.patterns]]", model.Pattern, "One pattern of the table; the first that matches wins."),
        ("[[answers.failed]]", model.FailedRecord, "An answer that is the upstream's record of a failed send."),
    ]


def profile() -> str:
    docstrings = _attribute_docstrings(ROOT / "hail_guard" / "profiles" / "model.py")
    parts = []
    for name, model, about in profile_sections():
        rows = _model_rows(model, docstrings)
        if name == "[[tools]]":
            rows = [row for row in rows if row[0].strip("`") not in _inherited()]
        parts.append(f"## {name}\n\n{about}\n\n" + _table(("key", "type", "default", "meaning"), rows))
    return "\n\n".join(parts)


def _inherited() -> set[str]:
    from hail_guard.profiles.model import ToolFields

    return set(ToolFields.model_fields)


# --- tools, states, delivery --------------------------------------------------------------------------------


def _hints(annotations: Any) -> str:
    said = [
        ("read-only", annotations.read_only_hint),
        ("idempotent", annotations.idempotent_hint),
        ("destructive", annotations.destructive_hint),
    ]
    return ", ".join(name if value else f"not {name}" for name, value in said if value is not None)


def _schema_words(schema: Mapping[str, Any]) -> str:
    words = [schema.get("type", "any")]
    if "enum" in schema:
        words.append("one of " + ", ".join(f"`{value}`" for value in schema["enum"]))
    bounds = {"minLength": "at least {} character(s)", "maxLength": "at most {} characters",
              "minimum": "at least {}", "maximum": "at most {}", "minItems": "at least {} items"}  # fmt: skip
    words += [text.format(schema[name]) for name, text in bounds.items() if name in schema]
    if "default" in schema:
        words.append(f"default `{json.dumps(schema['default'])}`")
    return ", ".join(str(word) for word in words)


def tools() -> str:
    from hail_guard.tools import OWN

    parts = []
    for name, entry in OWN.items():
        tool = entry.tool
        description = (tool.description or "").replace("{upstream}", "Hail")
        offered = " Offered to the agent only with `[review] expose_to_agent = true`." if entry.review else ""
        schema = tool.input_schema
        required = set(schema.get("required", ()))
        rows = [
            (f"`{argument}`", "required" if argument in required else "optional", _schema_words(details))
            for argument, details in schema.get("properties", {}).items()
        ]
        hints = f"Annotations: {_hints(tool.annotations)}." if tool.annotations else ""
        table = _table(("argument", "", "what it takes"), rows) if rows else "It takes no arguments."
        parts.append(f"## {name}\n\n{description}{offered}\n\n{hints}\n\n{table}")
    return "\n\n".join(parts)


def _operation(state: Any) -> Any:
    from hail_guard.models import Operation

    now = datetime(2030, 1, 1, tzinfo=UTC)
    return Operation(id="OPERATION_ID", idempotency_key="KEY", tool="send_email", channel="email", recipients=[],
                     request="{}", request_fingerprint="", content_fingerprint="", state=state, created_at=now,
                     updated_at=now)  # fmt: skip


def states() -> str:
    from hail_guard import lifecycle
    from hail_guard.models import State
    from hail_guard.policy.answers import next_step, state_phrase

    sets = {
        "terminal": lifecycle.TERMINAL,
        "unresolved": lifecycle.UNRESOLVED,
        "not forwarded yet": lifecycle.CANCELLABLE,
    }
    rows = []
    for state in State:
        operation = _operation(state)
        kinds = ", ".join(name for name, members in sets.items() if state in members)
        rows.append((f"`{state.value}`", kinds, state_phrase(operation), next_step(operation)))
    return _table(("state", "kind", "an answer calls it", "the one safe next step"), rows)


MOVERS: Mapping[str, str] = {
    "RECONCILE": "`reconcile`: the tool, the command, and `batch run` and workers before they send",
    "OPERATOR": "an operator: the command line, the console (the agent too, with the review queue exposed)",
}
"""Who moves an operation, where `lifecycle.Mover` has no docstring (tests/unit/test_docs.py checks each names one)."""


def moves() -> str:
    from hail_guard import lifecycle

    docstrings = _attribute_docstrings(ROOT / "hail_guard" / "lifecycle.py")
    movers = {mover: docstrings.get(("Mover", mover.name)) or MOVERS.get(mover.name, "") for mover in lifecycle.Mover}
    rows = [
        ("(new)" if move.before is None else f"`{move.before.value}`", f"`{move.after.value}`", move.mover.value)
        for move in lifecycle.MOVES
    ]
    who = _table(("who", "what that is"), [(mover.value, meaning) for mover, meaning in movers.items()])
    return _table(("from", "to", "who moves it"), rows) + "\n\n" + who


def delivery() -> str:
    from hail_guard import delivery as known

    rows = [
        (channel, ", ".join(f"`{state.value}`" for state in states)) for channel, states in known.CHANNEL_STATES.items()
    ]
    ranks = sorted(known.RANK.items(), key=lambda item: (item[1], item[0].value))
    ranked = [(str(rank), f"`{state.value}`", "settled" if state in known.SETTLED else "") for state, rank in ranks]
    words = ", ".join(f"`{word}`" for word in sorted(known.OPT_OUT_WORDS))
    return (
        _table(("channel", "delivery states"), rows)
        + "\n\n"
        + _table(("rank", "state", "polling"), ranked)
        + f"\n\nAn inbound SMS whose whole body is one of {words} (any case, trimmed) is an opt-out."
    )


def machine() -> str:
    """The state machine as `hail_guard/lifecycle.py` draws it in its docstring."""
    from hail_guard import lifecycle

    drawing = [line for line in (lifecycle.__doc__ or "").splitlines() if line.startswith("    ")]
    return "```text\n" + textwrap.dedent("\n".join(drawing)) + "\n```"


def imports() -> str:
    """The import rules as pyproject.toml writes them for import-linter (`[tool.importlinter]`), which
    tests/unit/test_layout.py checks: the layers top to bottom, then each other contract."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    [layers] = [contract for contract in contracts if contract["type"] == "layers"]
    rows = []
    for layer in layers["layers"]:
        independent = ":" not in layer
        parts = [part.strip() for part in layer.replace(":", "|").split("|")]
        said = "each imports none of the others" if independent and len(parts) > 1 else ""
        rows.append(
            (", ".join(f"`{part}`" for part in parts), said or ("may import one another" if len(parts) > 1 else ""))
        )
    lines = [f"**{layers['name']}** (top to bottom; a part may import any part in a row below its own):", ""]
    lines.append(_table(("parts", "within the row"), rows))
    for contract in contracts:
        if contract["type"] != "forbidden":
            continue
        sources = ", ".join(f"`{_short(name)}`" for name in contract["source_modules"])
        forbidden = ", ".join(f"`{_short(name)}`" for name in contract["forbidden_modules"])
        lines += ["", f"**{contract['name']}**: {sources} import none of {forbidden}."]
    return "\n".join(lines)


def _short(module: str) -> str:
    return module.removeprefix("hail_guard.")


def same_send() -> str:
    """The rules of the same send as `hail_guard/same_send.py` states them, its docstring after the first line."""
    from hail_guard import same_send as rules

    return (rules.__doc__ or "").split("\n", 1)[1].strip()


PARTS: Mapping[str, Callable[[], str]] = {
    "commands": commands,
    "configuration": configuration,
    "profile": profile,
    "tools": tools,
    "states": states,
    "moves": moves,
    "delivery": delivery,
    "machine": machine,
    "same_send": same_send,
    "imports": imports,
}
