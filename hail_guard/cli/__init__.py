"""The `hail-guard` command line: the edge where settings are read and errors become exit codes.

Exit codes: 0 done, 1 a hail-guard error (`BadInput` among them: the message says what to do), 2 options
argparse cannot read, 3 sends left unresolved (`batch run`, `review resend`). Command output goes to
stdout; logs and notices go to stderr: for an operator's command, warnings and errors only, as text
(`--verbose`: the whole log); `serve`, `worker` and `console` log as `[log] level` says.
Global options (`--config`) go before or after the command. Each module here owns a few commands,
their options and their output: `operations` (ops, reconcile, review), `batches` (batch, worker,
suppress), `admin` (serve, status, migrate, upstream, backup, prune), `signin` (login, logout),
`clients` (client-config), `drill`, `profiles` (profile init, profile check); `parsing` and `terminal` are
what they share. `sandbox` and `fake` (the fakes) read no settings.
"""

from __future__ import annotations

import gc

# Start-up (`serve` answers its first tools/list sooner): importing the MCP SDK and our models
# builds thousands of pydantic classes, and the collector ran ~200 times meanwhile (~15 % of the
# imports' time) to free next to nothing. Paused for the imports; what they built lives as long as
# the process, so it is frozen (never walked by a collection again) before collecting resumes.
_collecting = gc.isenabled()
gc.disable()
try:
    import argparse
    import sys
    from collections.abc import Sequence

    import anyio
    import structlog

    from hail_guard.cli import admin, batches, clients, drill, operations, profiles, signin
    from hail_guard.cli.parsing import Commands, Handler, top_parser
    from hail_guard.cli.terminal import terminal_text
    from hail_guard.config import Settings, load_settings
    from hail_guard.errors import HailGuardError
    from hail_guard.logs import configure_logging
    from hail_guard.policy.answers import DEFAULT_UPSTREAM_NAME, naming
finally:
    if _collecting:
        gc.freeze()
        gc.enable()

log = structlog.get_logger(__name__)

_FAULT_MEANINGS = {
    "delay": "delay:MS, wait MS milliseconds first",
    "fail_before_accept": "fail_before_accept:STATUS, Hail refuses with STATUS (401 and 429 save nothing)",
    "processing": 'processing:MS, the key stays in flight ("still processing") for MS milliseconds',
    "malformed": "malformed, sent, but the answer cannot be read",
    "error_after_accept": "error_after_accept:STATUS, sent, but the gateway answers STATUS (5xx)",
    "hang_after_accept": "hang_after_accept, sent; the answer never comes",
    "drop_after_accept": "drop_after_accept, sent; then the connection is closed",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(argv).parse_args(argv)
    if args.command == "sandbox":
        from hail_guard import sandbox

        configure_logging("info")
        return sandbox.run_from_args(args)
    if args.command == "fake":
        from hail_guard.cli import fake

        configure_logging("info")
        return fake.run_from_args(args)
    try:
        settings = load_settings(getattr(args, "config", None))
        _configure_logs(args, settings.log.level)
        runner: Handler = args.run
        with naming(upstream_name_of(settings)):  # every text of the run names the profile's upstream
            return anyio.run(runner, args, settings)
    except HailGuardError as exc:
        print(f"hail-guard: {terminal_text(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("crashed")
        print("hail-guard: failed unexpectedly; the log above has the details", file=sys.stderr)
        return 1


SERVICES = frozenset({"serve", "worker", "console"})
"""Commands whose log is their output: they log as `[log] level` says, as JSON lines."""
_QUIET_LEVELS = {"debug": "warning", "info": "warning"}


def _configure_logs(args: argparse.Namespace, level: str) -> None:
    """A service logs as configured; any other command (or `--verbose`: as configured) prints its result
    and, before it, only warnings and errors, as text."""
    if args.command in SERVICES or getattr(args, "verbose", False):
        configure_logging(level)
    else:
        configure_logging(_QUIET_LEVELS.get(level, level), text=True)


def upstream_name_of(settings: Settings) -> str:
    """The display name of the configured profile; Hail's when it does not read (the command that needs the
    profile says why)."""
    from hail_guard.profiles import load_profile

    try:
        return load_profile(settings.upstream.profile).display_name
    except HailGuardError:
        return DEFAULT_UPSTREAM_NAME


def parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Every command, each with the global options; the drill's and the sandbox's options load only for them."""
    top = top_parser()
    commands = Commands(top, dest="command")
    drill.add_commands(commands, argv)
    admin.add_commands(commands)
    hail = commands.add("sandbox", help="run the fake Hail MCP server over HTTP", epilog=_fault_kinds())
    if "sandbox" in argv:  # likewise: a real upstream never loads the sandbox
        from hail_guard import sandbox

        sandbox.add_arguments(hail)
    generic = commands.add("fake", help="run a generic fake MCP server a profile describes (stdio or HTTP)")
    if "fake" in argv:  # likewise: only the fake needs its options
        from hail_guard.cli import fake

        fake.add_arguments(generic)
    profiles.add_commands(commands)
    signin.add_commands(commands)
    console = commands.add("console", help="the operator console in a browser, alone on 127.0.0.1")
    if "console" in argv:  # its web stack loads only for it
        from hail_guard.cli import console as console_command

        console_command.add_arguments(console)
    operations.add_commands(commands)
    batches.add_commands(commands)
    clients.add_commands(commands)
    return top


def _fault_kinds() -> str:
    lines = [f"  {meaning}" for meaning in _FAULT_MEANINGS.values()]
    return "fault kinds (--fault TOOL:N:KIND[:ARG], N the Nth call or *):\n" + "\n".join(lines)
