"""`hail-guard sandbox`: run the fake Hail over Streamable HTTP from the command line.

    hail-guard sandbox --host 127.0.0.1 --port 8081 [--token-env NAME | --oauth] [--fault SPEC]...
                       [--outbox PATH] [--latency-ms MS] [--delivery-delay-seconds S]

The bearer token is read from the environment variable named by `--token-env`; without the flag,
from `HAIL_API_KEY` if that is set, else the sandbox takes calls without a token. With `--oauth` it
signs clients in like hosted Hail instead (`oauth.py`: `hail-guard login` against it). Tokens are
never logged. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from functools import partial
from typing import Final

import anyio

from hail_guard.sandbox.faults import SPEC_FORMAT, Fault, parse_fault
from hail_guard.sandbox.http import serve_http
from hail_guard.sandbox.oauth import AuthorizationServer
from hail_guard.sandbox.service import DEFAULT_DELIVERY_DELAY_SECONDS, Sandbox

log = logging.getLogger(__name__)

DEFAULT_TOKEN_ENV: Final = "HAIL_API_KEY"  # noqa: S105  # the name of a variable, not a secret
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


def _fault(text: str) -> Fault:
    try:
        return parse_fault(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `sandbox` subcommand's options to `parser`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081, help="port to listen on; 0 picks one (default 8081)")
    parser.add_argument(
        "--token-env",
        metavar="NAME",
        help=f"environment variable holding the bearer token (default {DEFAULT_TOKEN_ENV}, if set)",
    )
    parser.add_argument(
        "--oauth",
        action="store_true",
        help="sign clients in with OAuth like hosted Hail (discovery, registration, auto-approved sign-in, refresh)",
    )
    parser.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="SPEC",
        help=f"scripted fault, repeatable: {SPEC_FORMAT}",
    )
    parser.add_argument("--outbox", metavar="PATH", help="append one JSON line per accepted message")
    parser.add_argument("--latency-ms", type=_milliseconds, default=0.0, metavar="MS", help="wait before every call")
    parser.add_argument(
        "--delivery-delay-seconds",
        type=float,
        default=DEFAULT_DELIVERY_DELAY_SECONDS,
        metavar="S",
        help=f"time between delivery steps (default {DEFAULT_DELIVERY_DELAY_SECONDS})",
    )


def _token(token_env: str | None) -> str | None:
    """The bearer token; raises LookupError when a named variable is not set."""
    if token_env is None:
        return os.environ.get(DEFAULT_TOKEN_ENV) or None
    token = os.environ.get(token_env)
    if not token:
        raise LookupError(token_env)
    return token


async def _serve_until_signalled(
    sandbox: Sandbox, host: str, port: int, token: str | None, oauth: AuthorizationServer | None
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(serve_http, sandbox, host, port, token, oauth=oauth))
            async for signum in signals:
                log.info("sandbox_stopping signal=%s", signal.Signals(signum).name)
                tg.cancel_scope.cancel()
                break


def _os_error(error: BaseException) -> OSError | None:
    """The OSError (e.g. address in use) that `error` is or wraps alone, if any."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error if isinstance(error, OSError) else None


def run_from_args(ns: argparse.Namespace) -> int:
    """Run the sandbox until interrupted; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        token = None if ns.oauth else _token(ns.token_env)
    except LookupError:
        log.error("sandbox_token_missing env=%s", ns.token_env)
        return EXIT_USAGE
    sandbox = Sandbox(
        faults=ns.fault,
        outbox_path=ns.outbox,
        latency_seconds=ns.latency_ms / 1000,
        delivery_delay_seconds=ns.delivery_delay_seconds,
    )
    log.info("sandbox_starting faults=%s outbox=%s", [f.spec() for f in sandbox.faults] or "none", ns.outbox)
    try:
        oauth = AuthorizationServer() if ns.oauth else None
        anyio.run(partial(_serve_until_signalled, sandbox, ns.host, ns.port, token, oauth))
    except (OSError, ExceptionGroup) as error:
        cause = _os_error(error)
        if cause is None:
            raise
        log.error("sandbox_cannot_listen host=%s port=%s error=%s", ns.host, ns.port, cause)
        return EXIT_FAILED
    log.info("sandbox_stopped")
    return EXIT_OK
