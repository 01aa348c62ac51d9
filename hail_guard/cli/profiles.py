"""`hail-guard profile init` and `profile check`: a profile drafted from an upstream, and held against it.

    hail-guard profile init --from URL_OR_COMMAND [--name NAME] [--output FILE]
    hail-guard profile check FILE [--from URL_OR_COMMAND]

`--from` is a Streamable HTTP URL (`http://...`, `https://...`) or a command that serves MCP on stdio
(`"npx -y resend-mcp"`); `check` without it asks the configured upstream. The key is read from the variable
`[upstream] token_env` names, else the one the checked profile names (`key_env`: RESEND_API_KEY for
`resend`), else `--key-env` (init); a command also gets `[upstream.env]`, as `serve` gives it. What an upstream
lists is hostile text: the draft escapes it (`drafting`), and every line printed here is made safe for a
terminal.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import anyio
import anyio.to_thread
from mcp import types

from hail_guard import app, profiles
from hail_guard.cli.parsing import Commands
from hail_guard.cli.terminal import terminal_text
from hail_guard.config import Settings
from hail_guard.errors import BadInput, ConfigError
from hail_guard.profiles.checking import check
from hail_guard.profiles.drafting import draft
from hail_guard.upstream import UpstreamTarget, connect_upstream


def add_commands(commands: Commands) -> None:
    group = commands.group("profile", help="draft an upstream profile, or check one against the upstream")
    init = group.add("init", help="draft a profile from an upstream's tools (every guess marked REVIEW)", run=_init)
    init.add_argument("--from", dest="source", required=True, metavar="URL_OR_COMMAND", help=_FROM)
    init.add_argument("--name", help="the profile's name (default: the upstream server's)")
    init.add_argument("--output", metavar="FILE", help="write the draft to this new file (default: stdout)")
    init.add_argument("--key-env", metavar="NAME", help=_KEY_ENV + " (written into the draft as key_env)")
    checked = group.add(
        "check", help="check that every pointer of a profile exists in the upstream's schemas", run=_check
    )
    checked.add_argument("file", help="a profile file, or a built-in name (hail, resend, agentmail)")
    checked.add_argument("--from", dest="source", metavar="URL_OR_COMMAND", help=_FROM + " (default: [upstream])")
    checked.add_argument("--key-env", metavar="NAME", help=_KEY_ENV + " (default: the profile's key_env)")


_FROM = "a Streamable HTTP URL, or a command that serves MCP on stdio"
_KEY_ENV = "the variable that holds the upstream's API key, unless [upstream] token_env names one"


def target_of(
    source: str, settings: Settings, *, key_env: str | None = None, name: str = "the upstream"
) -> UpstreamTarget:
    """Where `--from` points: a URL is Streamable HTTP, anything else a stdio command (given `[upstream.env]`).
    The key is in `[upstream] token_env` when the config names one, else in `key_env`."""
    upstream = settings.upstream
    variable = upstream.token_env if "token_env" in upstream.model_fields_set or key_env is None else key_env
    token = os.environ.get(variable) or None
    if source.startswith(("http://", "https://")):
        return UpstreamTarget(kind="http", url=source, token=token, token_env=variable, name=name)
    command = shlex.split(source)
    if not command:
        raise BadInput("--from needs a URL or a command; nothing was read")
    env = upstream.resolved_env()
    return UpstreamTarget(kind="stdio", command=tuple(command), token=token, token_env=variable, env=env, name=name)


async def listed_tools(target: UpstreamTarget, settings: Settings) -> tuple[str, list[types.Tool]]:
    """The upstream server's name and every tool it lists."""
    async with connect_upstream(
        target, timeout_seconds=settings.upstream.timeout_seconds, heartbeat_seconds=None
    ) as up:
        await up.wait_connected()
        return up.server_name or "upstream", await up.list_tools()


async def _init(args: argparse.Namespace, settings: Settings) -> int:
    target = target_of(args.source, settings, key_env=args.key_env, name=args.name or "the upstream")
    if args.output is not None and await anyio.to_thread.run_sync(os.path.lexists, args.output):
        raise BadInput(f"{terminal_text(args.output)} exists; give a new file (nothing was written)")
    server, tools = await listed_tools(target, settings)
    text = draft(tools, source=target.display, name=args.name or server, key_env=args.key_env)
    profiles.parse_profile(text, "the draft")  # a draft is always a profile hail-guard reads
    if args.output is None:
        sys.stdout.write(text)
        return 0
    await anyio.to_thread.run_sync(_write_new, args.output, text)
    print(f"wrote {terminal_text(args.output)}: review every line marked REVIEW", file=sys.stderr)
    return 0


def _write_new(path: str, text: str) -> None:
    try:
        with open(path, "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError:
        raise BadInput(f"{terminal_text(path)} exists; give a new file (nothing was written)") from None
    except OSError as exc:
        raise BadInput(f"cannot write {terminal_text(path)}: {exc.strerror}; nothing was written") from None


async def _check(args: argparse.Namespace, settings: Settings) -> int:
    base = None if args.file in profiles.BUILT_IN else Path.cwd()
    profile = await anyio.to_thread.run_sync(profiles.load_profile, args.file, base)
    if args.source:
        key_env = args.key_env or profile.key_env
        target = target_of(args.source, settings, key_env=key_env, name=profile.display_name)
    else:
        target = app.upstream_target(settings, profile)
    _, tools = await listed_tools(target, settings)
    findings = check(profile, tools)
    for finding in findings:
        print(f"{finding.level}: {terminal_text(finding.where)}: {terminal_text(finding.what)}")
    errors = sum(finding.level == "error" for finding in findings)
    where = terminal_text(target.display)
    if errors:
        raise ConfigError(f"the profile {profile.source} does not fit {where}: {errors} error(s) above; fix them")
    name = terminal_text(profile.display_name)
    print(f"ok: every pointer of {terminal_text(profile.source)} exists in the schemas of {name} ({where})")
    return 0
