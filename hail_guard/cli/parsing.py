"""The shape every command shares: global options before or after it, and every default in `--help`.

`Commands` adds a command (or a group of them) with the global options (`--config`, `--version`)
and the help layout; a command's handler is `async (args, settings) -> exit code`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from hail_guard import __version__

if TYPE_CHECKING:
    from hail_guard.config import Settings

Handler = Callable[[argparse.Namespace, "Settings"], Coroutine[Any, Any, int]]
_QUIET_ACTIONS = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction)


class HelpLayout(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default (or says it is required); descriptions keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or isinstance(action, _QUIET_ACTIONS) or "default" in text:
            return text
        if action.required:
            return f"{text} (required)"
        if action.default in (None, [], argparse.SUPPRESS):
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def _global_options() -> argparse.ArgumentParser:
    shared = argparse.ArgumentParser(add_help=False)
    options = shared.add_argument_group("global options (before or after the command)")
    options.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,  # a command's own copy must not undo one given before the command
        help="TOML config file (default: $HAIL_GUARD_CONFIG, else built-in defaults)",
    )
    options.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the log too (info and up, as JSON lines); without it a command prints its result and "
        "warnings only. serve, worker and console always log",
    )
    options.add_argument("--version", action="version", version=f"hail-guard {__version__}")
    return shared


GLOBAL_OPTIONS = _global_options()


def top_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="hail-guard",
        description="At-most-once sends in front of Hail MCP.",
        parents=[GLOBAL_OPTIONS],
        formatter_class=HelpLayout,
    )


class Commands:
    """The commands of one parser (the top level, or a group such as `ops`)."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str) -> None:
        self._commands = parser.add_subparsers(dest=dest, required=True, metavar="COMMAND")

    def add(self, name: str, *, help: str, run: Handler | None = None, **options: Any) -> argparse.ArgumentParser:
        options.setdefault("description", help)
        parser: argparse.ArgumentParser = self._commands.add_parser(
            name, help=help, parents=[GLOBAL_OPTIONS], formatter_class=HelpLayout, **options
        )
        if run is not None:
            parser.set_defaults(run=run)
        return parser

    def group(self, name: str, *, help: str) -> Commands:
        return Commands(self.add(name, help=help), dest=name)


def whole_number(what: str, lowest: int, highest: int) -> Callable[[str], int]:
    """An argument type: a whole number from `lowest` to `highest`, else a usage error naming `what`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, not {text!r}") from None
        if not lowest <= value <= highest:
            raise argparse.ArgumentTypeError(f"{what} must be from {lowest} to {highest}, not {value}")
        return value

    return parse


def add_wide(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wide", action="store_true", help="print tables at full width, never wrapped")
