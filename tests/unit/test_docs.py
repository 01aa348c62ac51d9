"""The README and the docs site as a newcomer meets them: every shell, TOML and JSON block works as shown, the
reference pages generated from the code render every command, key, tool and state, and every file the code or
the pages cite exists."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hail_guard.cli import parser as cli_parser
from hail_guard.config import Settings, load_settings
from hail_guard.errors import ConfigError
from hail_guard.lifecycle import MOVES, Mover
from hail_guard.models import State
from hail_guard.profiles import parse_profile
from hail_guard.tools import OWN

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
README_MOST_LINES = 250


def _reference() -> ModuleType:
    """docs/hooks/reference.py, the MkDocs hook that writes the reference pages from the code."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look modules up by name
    spec.loader.exec_module(module)
    return module


reference = _reference()


def _fenced(text: str, language: str) -> Iterator[tuple[int, str]]:
    """(line, body) of every ```language block, dedented as far as its fence is (blocks inside list items)."""
    fence = re.compile(rf"^( *)```{language}\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)
    for found in fence.finditer(text):
        indent = len(found[1])
        body = "".join(line[indent:] for line in found[2].splitlines(keepends=True))
        yield text.count("\n", 0, found.start()) + 1, body


def blocks(language: str) -> list[tuple[str, str]]:
    """(page:line, body) of every ```language block in the README and the docs."""
    return [
        (f"{page.relative_to(ROOT)}:{line}", body)
        for page in PAGES
        for line, body in _fenced(page.read_text(), language)
    ]


def doc_block(page: str, language: str, after: str) -> str:
    """The first ```language block of a page (`docs/how-to/campaigns.md`) after the text `after`, verbatim."""
    text = (ROOT / page).read_text()
    rest = text[text.index(after) :]
    return next(body for _, body in _fenced(rest, language))


# --- the blocks ---------------------------------------------------------------------------------------------


def _profile_or_config(body: str, tmp_path: Path) -> str:
    """Read a TOML block as what it shows: a profile (it has [profile]) or hail-guard's configuration."""
    if "profile" in tomllib.loads(body) and isinstance(tomllib.loads(body)["profile"], dict):
        parse_profile(body, "the block")
        return "profile"
    config = tmp_path / "hail-guard.toml"
    config.write_text(body)
    load_settings(str(config), environ={})
    return "config"


@pytest.mark.parametrize(("where", "body"), blocks("toml"), ids=[where for where, _ in blocks("toml")])
def test_every_toml_block_reads_as_the_profile_or_configuration_it_shows(where: str, body: str, tmp_path: Path) -> None:
    assert _profile_or_config(body, tmp_path) in ("profile", "config"), where


def test_a_toml_block_with_a_misspelt_key_is_refused_by_the_check(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean"):
        _profile_or_config("[upstream]\ntimeout = 5\n", tmp_path)
    with pytest.raises(ConfigError, match="pass_thru"):
        _profile_or_config('[profile]\nname = "x"\npass_thru = []\n', tmp_path)


@pytest.mark.parametrize(("where", "body"), blocks("json"), ids=[where for where, _ in blocks("json")])
def test_every_json_block_is_json(where: str, body: str) -> None:
    assert isinstance(json.loads(body), dict), where


def test_the_client_entry_the_readme_and_the_guide_show_is_what_client_config_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hail_guard.cli import main

    monkeypatch.delenv("HAIL_GUARD_UPSTREAM_URL", raising=False)
    (tmp_path / "hail-guard.toml").write_text("")
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(tmp_path / "hail-guard.toml"))
    assert main(["client-config", "claude-desktop"]) == 0
    printed = capsys.readouterr().out
    written = json.loads(printed[: printed.rindex("}") + 1])
    written["mcpServers"]["hail"]["command"] = "/path/to/hail-guard/.venv/bin/hail-guard"
    for page, after in (("README.md", "## Chain it ahead of Hail"), ("docs/how-to/clients.md", "entry it writes")):
        assert json.loads(doc_block(page, "json", after)) == written, page


_SEPARATORS = frozenset({"&&", "||", ";", "|", "&"})
_DOCKER_VALUE_OPTIONS = frozenset({"-v", "-e", "-p", "-w", "-u", "--network", "--name", "--volume", "--env", "--user"})


def _commands(body: str) -> Iterator[list[str]]:
    """Each simple command of a shell block, as words (comments gone, continued lines joined)."""
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for word in lexer:
            if word in _SEPARATORS:
                yield command
                command = []
            else:
                command.append(word)
        yield command


def hail_guard_argv(words: list[str]) -> list[str] | None:
    """The arguments a command gives hail-guard: `hail-guard ...`, `.venv/bin/hail-guard ...`, or the image's
    command in `docker run ... hail-guard ...`; None for any other command."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]  # VARIABLE=value before the command
    if words and Path(words[0]).name == "hail-guard":
        return words[1:]
    if words[:2] == ["docker", "run"]:
        rest = iter(words[2:])
        for word in rest:
            if word in _DOCKER_VALUE_OPTIONS:
                next(rest)
            elif not word.startswith("-"):
                return list(rest) if word == "hail-guard" else None
    return None


def shell_commands() -> list[tuple[str, list[str]]]:
    return [
        (where, argv) for where, body in blocks("sh") for words in _commands(body) if (argv := hail_guard_argv(words))
    ]


@pytest.mark.parametrize(("where", "argv"), shell_commands(), ids=[" ".join(a[:2]) for _, a in shell_commands()])
def test_every_hail_guard_command_in_a_shell_block_parses_with_hail_guards_own_parser(
    where: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        cli_parser(argv).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: hail-guard {shlex.join(argv)}: {capsys.readouterr().err.strip()} (exit {exc.code})")


def test_the_shell_blocks_hold_the_commands_the_guides_walk_through() -> None:
    shown = {argv[0] for _, argv in shell_commands()}
    walked = {"drill", "serve", "status", "login", "client-config", "sandbox", "batch", "review", "ops", "suppress"}
    assert walked | {"migrate", "backup", "prune", "profile", "console"} <= shown


def test_a_command_with_an_option_hail_guard_lacks_is_caught() -> None:
    [argv] = [hail_guard_argv(words) for words in _commands("FOO=1 .venv/bin/hail-guard serve --prot 8 # x\n")]
    assert argv == ["serve", "--prot", "8"]
    with pytest.raises(SystemExit):
        cli_parser(argv).parse_args(argv)


def test_docker_run_lines_are_read_as_the_images_command() -> None:
    line = "docker run -it --rm --network host -v hail-guard:/data -e X=1 hail-guard login --no-browser"
    assert [hail_guard_argv(words) for words in _commands(line)] == [["login", "--no-browser"]]
    assert [hail_guard_argv(words) for words in _commands("docker build -t hail-guard .")] == [None]


# --- the reference, generated ---------------------------------------------------------------------------------


def _leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    groups = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not groups:
        yield " ".join(path), parser
    for group in groups:
        for name, child in group.choices.items():
            yield from _leaf_commands(child, (*path, name))


def test_the_commands_reference_has_every_command_and_every_option() -> None:
    page = reference.render("commands")
    shared = {"-h", "--help", "--config", "--verbose", "--version"}  # global options: said once, on the page
    missing = []
    for path, command in _leaf_commands(reference.command_parser()):
        assert f"## hail-guard {path} " in page, path
        section = page.split(f"## hail-guard {path} ", 1)[1].split("\n## ", 1)[0]
        options = {option for action in command._actions for option in action.option_strings} - shared
        missing += [f"{path} {option}" for option in sorted(options) if f"`{option}" not in section]
    assert missing == []


def _rows(page: str, heading: str) -> dict[str, list[str]]:
    """The table under `## heading`: its first column's `name` -> the row's cells."""
    section = page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [cell.strip() for cell in cells] for cells in rows}


def test_the_configuration_reference_gives_every_key_its_default_variable_and_meaning() -> None:
    page = reference.render("configuration")
    for section, holder in Settings.model_fields.items():
        model = holder.annotation
        assert isinstance(model, type)
        rows = _rows(page, f"[{section}]")
        assert sorted(rows) == sorted(model.model_fields), section
        for key, cells in rows.items():
            assert cells[3] == f"`HAIL_GUARD_{section.upper()}_{key.upper()}`"
            assert cells[4], (
                f"[{section}] {key} has no meaning: give it a docstring or a comment in config.example.toml"
            )


def test_the_profile_reference_gives_every_key_of_every_table_a_meaning() -> None:
    page = reference.render("profile")
    for name, model, _ in reference.profile_sections():
        rows = _rows(page, name)
        assert rows, name
        for key, cells in rows.items():
            assert key in model.model_fields, (name, key)
            assert cells[3], f"{name} {key} has no meaning: give it a docstring (or PROFILE_MEANINGS one)"


def test_the_reference_supplements_name_fields_and_movers_that_exist() -> None:
    from hail_guard.profiles import model

    for name in reference.PROFILE_MEANINGS:
        owner, field = name.split(".")
        assert field in getattr(model, owner).model_fields, name
    assert set(reference.MOVERS) <= {mover.name for mover in Mover}


def test_the_tools_reference_lists_every_tool_of_ours_with_its_arguments() -> None:
    page = reference.render("tools")
    for name, entry in OWN.items():
        assert sorted(_rows(page, name)) == sorted(entry.tool.input_schema.get("properties", {})), name


def test_the_states_reference_lists_every_state_and_every_move() -> None:
    states = reference.render("states")
    assert [line.split("`")[1] for line in states.splitlines() if line.startswith("| `")] == [s.value for s in State]
    moves = reference.render("moves").split("\n\n")[0].splitlines()
    assert len(moves) - 2 == len(MOVES)  # the head and its rule, then a row a move


def test_the_sandbox_page_names_every_fault_kind() -> None:
    from hail_guard.sandbox import FAULT_KINDS

    page = (DOCS / "reference" / "sandbox.md").read_text()
    assert [kind for kind in FAULT_KINDS if f"`{kind}" not in page] == []


def test_every_marker_in_the_pages_names_a_part_and_every_part_is_shown() -> None:
    used = {name for page in PAGES for name in reference.MARKER.findall(page.read_text())}
    assert used == set(reference.PARTS)
    assert [name for name in reference.PARTS if len(reference.render(name).splitlines()) < 3] == []


def test_an_unknown_marker_stops_the_build_naming_the_parts() -> None:
    with pytest.raises(KeyError, match="commands"):
        reference.on_page_markdown("<!-- reference: command -->\n")


# --- what cites what ------------------------------------------------------------------------------------------

_CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md|README)\b(?:'s)?(?:[,:]? \"([^\"]+)\")?")
"""A Markdown file named in code or text (`docs/explanation/hail.md`, the README), and the section named after it
in quotes, if one is."""


def _code_files() -> Iterator[Path]:
    for folder in ("hail_guard", "tests", "bench", "scripts", "examples", "docs/hooks"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "vendors" not in path.parts and path.suffix not in (".png", ".pyc", ".db"):
                yield path
    yield from (ROOT / name for name in ("Dockerfile", "config.example.toml", "pyproject.toml"))
    yield ROOT / ".ci" / "run"


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("#")}


def citations() -> list[tuple[str, str, str | None]]:
    """(where, the file, the section or None) of every Markdown file the code names."""
    found = []
    for path in _code_files():
        text = path.read_text(errors="replace")
        for match in _CITED.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            name = "README.md" if match[1] == "README" else match[1]
            found.append((f"{path.relative_to(ROOT)}:{line}", name, match[2]))
    return found


def test_every_markdown_file_the_code_cites_exists_with_the_section_it_names() -> None:
    cited = citations()
    assert len(cited) >= 18  # the code does cite its docs
    wrong = [
        (where, name, section)
        for where, name, section in cited
        if where.split(":")[0] != "tests/unit/test_docs.py"
        and (not (ROOT / name).is_file() or (section is not None and section.lower() not in _headings(ROOT / name)))
    ]
    assert wrong == []


def test_a_citation_of_a_missing_page_or_section_is_caught() -> None:
    text = 'see docs/explanation/hail.md, "How its failures read", docs/nowhere.md and the README: "Docker"'
    assert [(m[1], m[2]) for m in _CITED.finditer(text)] == [
        ("docs/explanation/hail.md", "How its failures read"),
        ("docs/nowhere.md", None),
        ("README", "Docker"),
    ]
    assert "docker" not in _headings(ROOT / "README.md")
    assert not (ROOT / "docs/nowhere.md").exists()


def test_every_file_the_readme_links_to_exists() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_readme_is_short_and_keeps_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MOST_LINES
    assert [body.strip() for _, body in _fenced(text, "sh")][:2] == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/hail-guard drill",
        'python3 -m venv .venv && .venv/bin/pip install -e ".[dev,postgres]" && scripts/test',
    ]


def test_the_ci_script_builds_the_docs_strictly() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert sorted(re.split(r"[<>=]", extra)[0] for extra in extras) == ["mkdocs", "mkdocs-material"]


def test_the_site_fetches_no_fonts() -> None:
    config = textwrap.dedent((ROOT / "mkdocs.yml").read_text())
    assert re.search(r"^  font: false", config, re.MULTILINE)
    assert "privacy" not in config
