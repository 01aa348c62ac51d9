"""`hail-guard profile check`: a profile held against an upstream's tool list: every pointer must exist.

Each tool the profile guards must be listed, and every pointer into its arguments (recipients, content,
sender, key, rules) must be something its input schema declares; its lookup's and search's tools must be
listed and take the arguments they are given; pointers into answers are checked against the output schema
where the tool declares one (where it declares none, they cannot be, and the check says so). A key must be
named like one (`idempotencyKey`), unless the tool says `key_checked = true`. A tool that sends
(`sending.sends`) but that the profile neither guards nor lets pass (`pass_through`) is an error too:
`serve` refuses it to the agent (`per_call`); every other error makes `serve` refuse the profile at start.
A key argument the profile does not use is warned of.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mcp import types

from hail_guard import pointers
from hail_guard.profiles import sending
from hail_guard.profiles.model import Search
from hail_guard.profiles.spec import Profile, ToolSpec


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "note"]
    where: str
    """The key of the profile it is about: `post_message.search.match`."""
    what: str
    per_call: bool = False
    """An error `serve` answers per call (the tool is refused to the agent) rather than at start."""


CHECK_COMMAND = "hail-guard profile check PROFILE"
"""What checks a profile against the configured upstream (`--from` for another)."""


def check(profile: Profile, tools: Iterable[types.Tool]) -> list[Finding]:
    """What does not fit between `profile` and the upstream's `tools`; errors first."""
    listed = {tool.name: tool for tool in tools}
    findings: list[Finding] = []
    for name, spec in profile.tools.items():
        tool = listed.get(name)
        if tool is None:
            findings.append(Finding("error", name, f"the upstream lists no tool {name!r}{_known(listed)}"))
            continue
        entry = next(entry for entry in profile.data.tools if entry.name == name)
        findings += _arguments(spec, tool, inherited={f for f in type(entry).model_fields if getattr(entry, f) is None})
        findings += _answer(spec, tool)
        findings += _reads(spec, tool, listed)
    guarded = profile.guarded({name: tool.input_schema for name, tool in listed.items()}, None)
    findings += [unguarded_sender(profile, tool) for tool in unguarded_senders(profile, listed.values(), guarded)]
    if unlisted := sorted(profile.pass_through - set(listed)):
        said = ", ".join(map(repr, unlisted))
        findings.append(Finding("warning", "profile.pass_through", f"the upstream lists no tool {said}"))
    order = {"error": 0, "warning": 1, "note": 2}
    return sorted(findings, key=lambda finding: order[finding.level])


def unguarded_senders(profile: Profile, tools: Iterable[types.Tool], guarded: set[str]) -> list[types.Tool]:
    """The tools that send (`sending.sends`) which the profile neither guards nor lets pass: refused."""
    return [
        tool
        for tool in tools
        if tool.name not in guarded and tool.name not in profile.pass_through and sending.sends(tool)
    ]


def unguarded_sender(profile: Profile, tool: types.Tool) -> Finding:
    return Finding(
        "error",
        tool.name,
        f"not guarded, though {sending.why_it_sends(tool)}: guard it with a [[tools]] entry, or, if it sends "
        f"nothing, name it in [profile] pass_through; until then hail-guard refuses it",
        per_call=True,
    )


def _known(listed: Mapping[str, types.Tool]) -> str:
    return f" (it lists {', '.join(sorted(listed))})" if listed else " (it lists none)"


def _arguments(spec: ToolSpec, tool: types.Tool, *, inherited: set[str]) -> list[Finding]:
    """Every pointer into the tool's arguments must be in its schema; those `[defaults]` gives (`inherited`)
    apply where a tool has them, so only the tool's own are held to it."""
    fields: list[tuple[str, str]] = []
    for name, given in (
        ("recipients", spec.recipients),
        ("content", spec.content or ()),
        ("sender", spec.sender),
        ("sender_names", spec.sender_names),
    ):
        if name not in inherited:
            fields += [(f"{spec.name}.{name}", pointer) for pointer in given]
    if spec.key is not None and "key" not in inherited:
        fields.append((f"{spec.name}.key", pointers.pointer_to(spec.key)))
    for rule in spec.rules:
        named = [rule.field] if rule.field is not None else list(rule.one_of or ())
        fields += [(f"{spec.name}.rules", p) for p in (*named, *rule.when)]
    findings = [_missing(where, p, tool.input_schema, f"{tool.name}'s input schema") for where, p in fields]
    found = [finding for finding in findings if finding is not None]
    keyish = sending.key_arguments(tool)
    if spec.key is not None and not spec.key_checked and not sending.is_key_like(spec.key):
        found.append(
            Finding(
                "error",
                f"{spec.name}.key",
                f"{pointers.pointer_to(spec.key)!r} is not named like an idempotency key (idempotency_key, "
                "idempotencyKey...): a wrong "
                "key is never set, and a replay sends again. Point key at the tool's key argument, or say "
                "key_checked = true if this one is",
            )
        )
    if spec.key is None and keyish:
        found.append(
            Finding(
                "warning",
                f"{spec.name}.key",
                f"the tool takes {keyish[0]!r}: name it as key = "
                f"'/{pointers.escape(keyish[0])}', so a lost answer can be replayed safely",
            )
        )
    return found


def _answer(spec: ToolSpec, tool: types.Tool) -> list[Finding]:
    if tool.output_schema is None:
        return [
            Finding(
                "note",
                f"{spec.name}.provider_id",
                f"{tool.name} declares no output schema: {spec.provider_id!r} is not checked; the first answer tells",
            )
        ]
    pointers_ = [spec.provider_id, *spec.required]
    found = [
        _missing(f"{spec.name}.provider_id", p, tool.output_schema, f"{tool.name}'s output schema") for p in pointers_
    ]
    return [finding for finding in found if finding is not None]


def _reads(spec: ToolSpec, tool: types.Tool, listed: Mapping[str, types.Tool]) -> list[Finding]:
    findings: list[Finding] = []
    for part, read in (("lookup", spec.lookup), ("search", spec.search)):
        if read is None:
            continue
        where = f"{spec.name}.{part}"
        reader = listed.get(read.tool)
        if reader is None:
            findings.append(Finding("error", where, f"the upstream lists no tool {read.tool!r}{_known(listed)}"))
            continue
        for argument, source in read.arguments.items():
            checked = _missing(
                f"{where}.arguments",
                pointers.pointer_to(argument),
                reader.input_schema,
                f"{reader.name}'s input schema",
            )
            if checked is None and isinstance(source, str) and source.startswith("/"):
                checked = _missing(
                    f"{where}.arguments.{argument}", source, tool.input_schema, f"{tool.name}'s input schema"
                )
            if checked is not None:
                findings.append(checked)
        sent = [match.argument for match in read.matches()] if isinstance(read, Search) else []
        for pointer in sent:
            if missing := _missing(f"{where}.match", pointer, tool.input_schema, f"{tool.name}'s input schema"):
                findings.append(missing)
    return findings


def _missing(where: str, pointer: str, schema: Any, what: str) -> Finding | None:
    """An error when `schema` rules out what `pointer` names (free-form parts cannot rule anything out)."""
    if pointers.schema_at(schema, pointer) is not None:
        return None
    declared = ", ".join(_top(schema)) or "none"
    return Finding("error", where, f"{pointer!r} is not in {what} (its properties: {declared})")


def _top(schema: Any) -> list[str]:
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    return [str(name) for name in properties] if isinstance(properties, Mapping) else []
