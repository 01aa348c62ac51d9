"""`hail-guard client-config CLIENT`: the block an MCP client needs to start this hail-guard, and `--write`.

The block names the absolute path of the running install (so it works whatever the client's PATH)
and the configured upstream. A URL: hosted Hail, and an upstream `hail-guard login` signed in to, need
nothing more (the client's hail-guard uses the stored sign-in). A command (`[upstream] command`, Resend's
`npx -y resend-mcp`): the command by its absolute path, with its folder on PATH (a desktop client's PATH
lacks npx and node), the profile, and `[upstream.env]` (`HAIL_GUARD_UPSTREAM_ENV`), its `${NAME}`
references and secret values as variables of their own. An upstream that takes a static key (a
self-hosted Hail, a command, or `--api-key`) also gets the key's variable, never the key: Claude Desktop
and Cursor get a placeholder to replace, VS Code prompts for it once (`inputs`), Claude Code reads it from
the environment. `--write` merges the block into the client's config file: other servers are kept, the old
file is copied aside first, and a server of the same name is replaced only with `--force`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
import httpx2

from hail_guard import policy
from hail_guard.cli.parsing import Commands
from hail_guard.config import Settings
from hail_guard.errors import ConfigError
from hail_guard.urls import parse_url

HAIL_URL: Final = "https://mcp.hail.so"
TOKEN_PLACEHOLDER: Final = "PASTE-YOUR-HAIL-TOKEN"  # noqa: S105  (a placeholder, not a secret)
_VSCODE_INPUT: Final = "hail-token"


@dataclass(frozen=True)
class McpClient:
    name: str
    servers_key: str
    """Where the file keeps its servers: `mcpServers`, or `servers` (VS Code)."""
    where: str
    """The config file, as docs/how-to/clients.md names it."""

    def default_path(self) -> Path:
        if self.name == "claude-desktop":
            return _claude_desktop_folder() / "claude_desktop_config.json"
        if self.name == "cursor":
            return Path.home() / ".cursor" / "mcp.json"
        if self.name == "vscode":
            return Path.cwd() / ".vscode" / "mcp.json"
        return Path.cwd() / ".mcp.json"


CLIENTS: Final = {
    client.name: client
    for client in (
        McpClient("claude-desktop", "mcpServers", "claude_desktop_config.json"),
        McpClient("cursor", "mcpServers", "~/.cursor/mcp.json"),
        McpClient("vscode", "servers", ".vscode/mcp.json in the workspace"),
        McpClient("claude-code", "mcpServers", ".mcp.json in the project (or `claude mcp add`)"),
    )
}


def _claude_desktop_folder() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "Claude"
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA", Path.home() / "AppData" / "Roaming")) / "Claude"
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "Claude"


def add_commands(commands: Commands) -> None:
    names = ", ".join(f"{client.name} ({client.where})" for client in CLIENTS.values())
    command = commands.add(
        "client-config",
        help="print (or --write) the config an MCP client needs to start this hail-guard",
        description=f"The block an MCP client needs to start this hail-guard. Clients: {names}.",
        run=_client_config,
    )
    command.add_argument("client", choices=list(CLIENTS), help="the MCP client")
    command.add_argument("--write", action="store_true", help="merge it into the client's config file (keeps a backup)")
    command.add_argument("--file", type=Path, help="the config file to write (default: the client's usual one)")
    command.add_argument("--force", action="store_true", help="replace a server of the same name")
    command.add_argument("--name", help="the server's name in the client (default: hail, or the profile's name)")
    command.add_argument("--upstream-url", help=f"Hail's URL (default: [upstream] url, else {HAIL_URL})")
    command.add_argument("--sandbox", action="store_true", help="use the built-in sandbox: nothing real is sent")
    command.add_argument(
        "--api-key",
        action="store_true",
        help="the upstream takes a static key (self-hosted Hail does; hosted Hail signs in with `hail-guard login`)",
    )


@dataclass(frozen=True)
class Upstream:
    """Where the client's hail-guard reads its upstream, and how it gets in."""

    url: str | None
    """None: the built-in sandbox, or a command."""
    takes_key: bool
    """A static key in the token variable (self-hosted Hail, a command); else a sign-in (`hail-guard login`)."""
    signed_in: bool = False
    command: tuple[str, ...] = ()
    """The configured upstream command, its program by its absolute path when the PATH has it."""
    path: str | None = None
    """The folder of that program: on the entry's PATH (npx needs node beside it)."""


def upstream_of(args: argparse.Namespace, settings: Settings) -> Upstream:
    """The upstream the entry names: the configured command, else a URL. Hosted Hail, or an upstream signed in
    to, needs no key. Reads the sign-in file: call it off the event loop."""
    if args.sandbox:
        return Upstream(url=None, takes_key=False)
    configured = settings.upstream
    if not args.upstream_url and configured.command and configured.transport in (None, "stdio") and not configured.url:
        program = shutil.which(configured.command[0])
        found = str(Path(program).absolute()) if program else configured.command[0]
        folder = str(Path(found).parent) if program else None
        return Upstream(url=None, takes_key=True, command=(found, *configured.command[1:]), path=folder)
    url = args.upstream_url or settings.upstream.url or HAIL_URL
    signed_in = _signed_in(url, settings)
    hosted = httpx2.URL(url).host == httpx2.URL(HAIL_URL).host
    return Upstream(url=url, takes_key=args.api_key or not (hosted or signed_in), signed_in=signed_in)


def _signed_in(url: str, settings: Settings) -> bool:
    from hail_guard.oauth import TokenStore  # here: only this check needs the sign-in store

    try:
        return TokenStore(url, settings.upstream.signin_dir).load() is not None
    except ConfigError:
        return False


def server_entry(args: argparse.Namespace, settings: Settings, upstream: Upstream) -> dict[str, Any]:
    """The client's entry for this hail-guard: command, arguments and environment."""
    command, arguments = install_command()
    config = getattr(args, "config", None)
    arguments += ["serve", *(["--config", str(Path(config).absolute())] if config else [])]
    env: dict[str, str] = {} if upstream.url is None else {"HAIL_GUARD_UPSTREAM_URL": upstream.url}
    if upstream.command:
        env |= _command_env(settings, upstream)
    if upstream.takes_key:
        token_env = settings.upstream.token_env
        if "token_env" in settings.upstream.model_fields_set and not upstream.command:
            env["HAIL_GUARD_UPSTREAM_TOKEN_ENV"] = token_env
        env[token_env] = _asked(args.client, token_env, key=True)
    for name in _referenced(settings.upstream.env) if upstream.command else ():
        env.setdefault(name, _asked(args.client, name, key=False))
    entry: dict[str, Any] = {"type": "stdio"} if args.client == "vscode" else {}
    return {**entry, "command": command, "args": arguments, **({"env": env} if env else {})}


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _command_env(settings: Settings, upstream: Upstream) -> dict[str, str]:
    """What makes the client's hail-guard start the same command, whatever the client's own environment: the
    command and its folder on PATH, the profile, and `[upstream.env]` (each secret value as a `${NAME}` of
    its own, asked for like the key)."""
    configured = settings.upstream
    env = {"HAIL_GUARD_UPSTREAM_COMMAND": shlex.join(upstream.command)}
    if upstream.path is not None:
        env["PATH"] = os.pathsep.join(dict.fromkeys([upstream.path, *os.defpath.split(os.pathsep)]))
    profile = configured.profile
    env["HAIL_GUARD_UPSTREAM_PROFILE"] = profile if profile in _built_in() else str(Path(profile).absolute())
    if configured.env:
        env["HAIL_GUARD_UPSTREAM_ENV"] = json.dumps(
            {name: _kept(name, value) for name, value in configured.env.items()}
        )
    return env


def _kept(name: str, value: str) -> str:
    """An `[upstream.env]` value as the entry writes it: a reference or a plain URL as it is, a secret as
    `${NAME}` (its own variable, asked for)."""
    plain_url = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) and not parse_url(value).secrets
    if _REFERENCE.search(value) or plain_url:
        return value
    return f"${{{name}}}"


def _referenced(env: dict[str, str]) -> list[str]:
    """The variables the entry must give: those `[upstream.env]` refers to, and those its secrets become."""
    names = [found for value in env.values() for found in _REFERENCE.findall(value)]
    names += [name for name, value in env.items() if _kept(name, value) == f"${{{name}}}"]
    return list(dict.fromkeys(names))


def _asked(client: str, variable: str, *, key: bool) -> str:
    """How the entry asks for a secret (`key`: the upstream's key): VS Code prompts, Claude Code reads the
    shell, others a placeholder."""
    if client == "vscode":
        return f"${{input:{_VSCODE_INPUT if key else variable.lower()}}}"
    if client == "claude-code":
        return f"${{{variable}}}"
    return placeholder(variable)


def placeholder(variable: str) -> str:
    """What stands in the file for a secret the user pastes in."""
    return TOKEN_PLACEHOLDER if variable == "HAIL_API_KEY" else f"PASTE-YOUR-{variable}"


def _built_in() -> tuple[str, ...]:
    from hail_guard.profiles import BUILT_IN  # here: only a command upstream's entry names a profile

    return BUILT_IN


def install_command() -> tuple[str, list[str]]:
    """How to start the running install: its `hail-guard` script, else its Python with `-m hail_guard`."""
    folder = Path(sys.executable).absolute().parent  # not resolved: a venv's python is a link out of it
    script = folder / ("hail-guard.exe" if sys.platform == "win32" else "hail-guard")
    if script.is_file():
        return str(script), []
    return str(Path(sys.executable).absolute()), ["-m", "hail_guard"]


def config_block(client: str, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The whole file's content for this one server (what `--write` merges)."""
    block: dict[str, Any] = {CLIENTS[client].servers_key: {name: entry}}
    if client != "vscode":
        return block
    asked = [found for value in entry.get("env", {}).values() for found in re.findall(r"^\$\{input:([^}]+)\}$", value)]
    prompts = [{"type": "promptString", "id": ask, "description": _prompt(ask), "password": True} for ask in asked]
    return {"inputs": prompts, **block} if prompts else block


def _prompt(ask: str) -> str:
    return f"{policy.upstream_name()} token" if ask == _VSCODE_INPUT else ask.upper()


def merged(existing: dict[str, Any], block: dict[str, Any], *, name: str, force: bool, path: Path) -> dict[str, Any]:
    """`existing` with the block's server (and inputs) added; refused when `name` differs there, unless `force`."""
    result = dict(existing)
    for key, value in block.items():
        if key == "inputs":
            inputs = _list_at(existing, key, path)
            ids = {item.get("id") for item in inputs if isinstance(item, dict)}
            result[key] = inputs + [item for item in value if item["id"] not in ids]
            continue
        servers = _object_at(existing, key, path)
        if name in servers and servers[name] != value[name] and not force:
            raise ConfigError(
                f"{path} already has a server named {name!r}: pass --force to replace it (the old file is kept as "
                "a backup), or --name to add this one beside it; nothing was written"
            )
        result[key] = {**servers, **value}
    return result


def _object_at(existing: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = existing.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key!r} is not an object; fix the file first; nothing was written")
    return value


def _list_at(existing: dict[str, Any], key: str, path: Path) -> list[Any]:
    value = existing.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {key!r} is not a list; fix the file first; nothing was written")
    return value


def read_config(path: Path) -> dict[str, Any] | None:
    """The client's config file as it is (None: there is none yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}; nothing was written") from exc
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix or move it; nothing was written") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path} does not hold a JSON object; fix or move it; nothing was written")
    return value


def write_config(path: Path, content: dict[str, Any], *, had_file: bool) -> Path | None:
    """Write `content` to `path` in one step (a temporary file, then a rename); returns the backup made."""
    backup = None
    path.parent.mkdir(parents=True, exist_ok=True)
    if had_file:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        backup = path.with_name(f"{path.name}.{stamp}.bak")
        with open(backup, "xb") as copy:  # never over an earlier backup
            copy.write(path.read_bytes())
    mode = path.stat().st_mode & 0o777 if had_file else 0o600  # it may hold a token: private when new
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(json.dumps(content, indent=2) + "\n")
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return backup


def claude_code_command(name: str, entry: dict[str, Any]) -> str:
    """`claude mcp add ...`: the shell line Claude Code takes instead of a file (the token read from the shell)."""
    words = ["claude mcp add", shlex.quote(name)]
    for key, value in entry.get("env", {}).items():
        from_shell = value == f"${{{key}}}"
        words.append(f'--env {key}="${key}"' if from_shell else f"--env {shlex.quote(f'{key}={value}')}")
    return " ".join([*words, "--", shlex.join([entry["command"], *entry["args"]])])


async def _client_config(args: argparse.Namespace, settings: Settings) -> int:
    upstream = await anyio.to_thread.run_sync(upstream_of, args, settings)
    if args.name is None:
        args.name = "hail" if not upstream.command else _profile_name(settings)
    entry = server_entry(args, settings, upstream)
    block = config_block(args.client, args.name, entry)
    if not args.write:
        if args.client == "claude-code":  # a shell line; `--write` writes the project's .mcp.json instead
            print(claude_code_command(args.name, entry))
        else:
            print(json.dumps(block, indent=2))
        _remind(args, upstream, settings.upstream.token_env)
        return 0
    path = args.file or CLIENTS[args.client].default_path()
    existing = await anyio.to_thread.run_sync(read_config, path)
    content = merged(existing or {}, block, name=args.name, force=args.force, path=path)
    if existing == content:
        print(f"{path} already has this {args.name!r} server; nothing to write")
        return 0
    backup = await anyio.to_thread.run_sync(partial(write_config, path, content, had_file=existing is not None))
    print(f"wrote the {args.name!r} server into {path}" + (f" (the old file is kept as {backup})" if backup else ""))
    _remind(args, upstream, settings.upstream.token_env)
    return 0


def _profile_name(settings: Settings) -> str:
    from hail_guard.profiles import load_profile  # here: only a command upstream's entry is named by it

    return load_profile(settings.upstream.profile).name


def _remind(args: argparse.Namespace, upstream: Upstream, token_env: str) -> None:
    """What is left to do, on stderr: the key to give, or the sign-in to make; then a restart."""
    if upstream.command:
        step = _command_step(args, upstream, token_env)
    elif upstream.url is None:
        step = "restart the client (it sends to the built-in sandbox: nothing real is sent)"
    elif not upstream.takes_key:
        step = (
            "restart the client"
            if upstream.signed_in
            else "run `hail-guard login` as this user, then restart the client"
        )
    elif args.client == "claude-code":
        step = f"export your {policy.upstream_name()} key as {token_env} where you start `claude`"
    elif args.client == "vscode":
        step = f"restart VS Code; it asks for the {policy.upstream_name()} key once"
    else:
        step = f"replace {TOKEN_PLACEHOLDER} with your {policy.upstream_name()} key, then restart the client"
    print(f"next: {step}", file=sys.stderr)


def _command_step(args: argparse.Namespace, upstream: Upstream, token_env: str) -> str:
    name = policy.upstream_name()
    found = "" if upstream.path is not None else f" ({upstream.command[0]} is not on this PATH: give its absolute path)"
    if args.client == "claude-code":
        return f"export your {name} key as {token_env} where you start `claude`{found}"
    if args.client == "vscode":
        return f"restart VS Code; it asks for the {name} key once{found}"
    return f"replace each PASTE-YOUR-... with its value ({token_env}: your {name} key), then restart the client{found}"
