"""How the PostgreSQL ledger's failures read: every asyncpg and socket error becomes ours here, and only here.

`errors_mapped` turns each into `LedgerUnavailable` with what it means for the operator (`_EXPLANATIONS`,
first match wins: unreachable, refused login, no database, locked, read-only, out of resources...).
Messages name the server as `urls.parse_url` shows it (`describe`: scheme, host, port, database), and
the password is masked in every spelling where the driver's words repeat it whole (never inside a word,
never in our own words); a driver message that repeated it is not chained.
tests/ledger/test_ledger_postgres.py walks every class asyncpg defines to prove nothing escapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg

from hail_guard.errors import ConfigError, HailGuardError, LedgerUnavailable
from hail_guard.urls import masked, parse_url


def describe(url: str) -> tuple[str, frozenset[str]]:
    """Where the ledger is, as messages may show it (`urls.parse_url`: scheme, host, port, database), and
    the password's spellings to scrub from any message; a URL drivers would misread is refused first."""
    parts = parse_url(url)
    if parts.ambiguous:
        raise ConfigError(
            f"the ledger URL for {parts.display} has a /, ?, # or @ in its user name or password: write them "
            "percent-encoded (%2F, %3F, %23, %40), or pass the password with ?password= (encoded the same way)"
        )
    if any(not 0 < port <= _MAX_PORT for port in parts.ports):
        raise ConfigError(f"the ledger URL {parts.display} names a port outside 1-{_MAX_PORT}: fix the port")
    return parts.display, parts.secrets


_MAX_PORT = 65535
_EXPLANATIONS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], str], ...] = (
    (
        OSError,
        "cannot reach the PostgreSQL ledger at {where}: {detail}; check that the server is running and the host "
        "and port in the ledger URL",
    ),
    (
        asyncpg.InvalidPasswordError,
        "the PostgreSQL ledger at {where} refused the password: check the user and password in the ledger URL",
    ),
    (asyncpg.InvalidAuthorizationSpecificationError, "the PostgreSQL ledger at {where} refused the login: {detail}"),
    (
        asyncpg.InvalidCatalogNameError,
        "the PostgreSQL ledger at {where} does not exist: {detail}; create the database or fix the ledger URL",
    ),
    (
        (asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError),
        "the PostgreSQL ledger at {where} is not accepting connections now: {detail}; retry",
    ),
    (
        (asyncpg.ClientConfigurationError, ValueError, OverflowError),  # a malformed URL; a value asyncpg cannot send
        "the PostgreSQL ledger at {where} cannot be used: {detail}",
    ),
    (
        (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            asyncpg.OperatorInterventionError,
        ),
        "the connection to the PostgreSQL ledger at {where} failed: {detail}; retry (a write cut off while "
        "committing may have been recorded after all: the retry finds it)",
    ),
    (
        asyncpg.LockNotAvailableError,
        "the PostgreSQL ledger at {where} stayed locked past the lock timeout; another process holds it: retry, "
        "or raise [ledger] busy_timeout_seconds",
    ),
    (
        (asyncpg.TransactionRollbackError, asyncpg.UniqueViolationError),
        "another process wrote the PostgreSQL ledger at {where} at the same moment ({detail}); nothing was "
        "recorded: retry",
    ),
    (
        asyncpg.ReadOnlySQLTransactionError,
        "the PostgreSQL ledger at {where} is read-only (a standby?): point the ledger URL at the primary",
    ),
    (
        asyncpg.InsufficientResourcesError,
        "the PostgreSQL ledger at {where} is out of resources (disk full?): {detail}",
    ),
    (asyncpg.InsufficientPrivilegeError, "the user of the PostgreSQL ledger at {where} lacks a privilege: {detail}"),
    (
        asyncpg.UndefinedTableError,
        "the PostgreSQL ledger at {where} has no hail-guard tables ({detail}): run `hail-guard migrate`",
    ),
)
"""What each kind of failure means for the operator, first match wins; anything else says what failed."""


@contextmanager
def errors_mapped(where: str, secrets: frozenset[str] = frozenset()) -> Iterator[None]:
    """The one place asyncpg and socket errors become ours; the password never reaches a message."""
    try:
        yield
    except HailGuardError:
        raise
    except (
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.InternalClientError,
        OSError,
        ValueError,
        OverflowError,
    ) as exc:
        leaks = any(secret in str(exc) for secret in secrets)
        raise LedgerUnavailable(_explain(exc, where, secrets)) from (None if leaks else exc)


def _explain(exc: Exception, where: str, secrets: frozenset[str]) -> str:
    """What failed, in our words around the driver's; only the driver's part is masked (`urls.masked`, by the
    URL's parts: our own words and `where` hold no password, and a short one must not eat them)."""
    detail = masked(str(exc), secrets) or type(exc).__name__
    for kinds, template in _EXPLANATIONS:
        if isinstance(exc, kinds):
            return template.format(where=where, detail=detail)
    return f"the PostgreSQL ledger at {where} failed: {detail}"
