"""Named SQL: each backend's statements live in `sql/<dialect>/queries.sql`, each under `-- name: NAME`;
its migrations in `migrations/<dialect>/NNNN_*.sql` (`migrations`).

Python only says which statement runs (procrastinate keeps its queries the same way). A statement of
the same name takes the same parameters, in the same order, on both dialects (`?1`, `?2` on SQLite,
`$1`, `$2` on PostgreSQL), so the ledger core (`hail_guard.ledger.core`) runs it on either. State sets
are written `{recordable}`, `{claimable}`, `{holding}`, ... and filled in from `hail_guard.lifecycle` and
`hail_guard.same_send` when the file is loaded: the SQL never types a state set again. `{columns}` is an
operation's columns.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from hail_guard import lifecycle, same_send
from hail_guard.errors import SchemaTooNew
from hail_guard.models import State

OPERATION_COLUMNS = (
    "id, idempotency_key, tool, channel, recipients, request, request_fingerprint, content_fingerprint, sender, "
    "campaign_id, lead_id, message_id, batch_id, lead, state, provider_id, result, last_error, review_reason, "
    "cancel_reason, attempts, lease_owner, lease_expires_at, not_before, next_check_at, created_at, updated_at, "
    "first_sent_at, delivery_state, delivery_at, delivery_checks, delivery_next_check_at, resend_of, resent_as, "
    "may_have_left"
)
"""What every statement that answers with operations selects (`{columns}`, or `{o_columns}` for a table `o`)."""


def sql_list(states: frozenset[State]) -> str:
    """A state set as an SQL list: `('sending', 'unknown')`."""
    return "(" + ", ".join(f"'{state.value}'" for state in sorted(states)) + ")"


def sql_one(states: frozenset[State]) -> str:
    """A set of one state as an SQL value, where a partial index needs `state = '...'` (SQLite does not read
    `state IN ('...')` as the index's condition)."""
    [state] = states
    return f"'{state.value}'"


STATE_SETS = {
    "claimable_state": sql_one(lifecycle.CLAIMABLE),
    "recordable": sql_list(lifecycle.RECORDABLE),
    "claimable": sql_list(lifecycle.CLAIMABLE),
    "expiring": sql_list(lifecycle.EXPIRING),
    "cancellable": sql_list(lifecycle.CANCELLABLE),
    "approvable": sql_list(lifecycle.APPROVABLE),
    "reviewable": sql_list(lifecycle.REVIEWABLE),
    "terminal": sql_list(lifecycle.TERMINAL),
    "unresolved": sql_list(lifecycle.UNRESOLVED),
    "holding": sql_list(same_send.HOLDING),
    "waiting": sql_list(same_send.WAITING),
    "settled_live": sql_list(same_send.SETTLED_LIVE),
}
"""The names the named SQL uses for state sets (`{recordable}`), from `lifecycle` and `same_send`."""
_FRAGMENTS = {
    **STATE_SETS,
    "columns": OPERATION_COLUMNS,
    "o_columns": ", ".join(f"o.{name}" for name in OPERATION_COLUMNS.split(", ")),
    "recorded_columns": ", ".join(f"recorded.{name}" for name in OPERATION_COLUMNS.split(", ")),
}
NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)", "postgres": "statement_timestamp()"}
"""The database's clock (`{now}`): Unix epoch seconds on SQLite, fixed for the statement on PostgreSQL."""
_NAME = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


@cache
def statements(dialect: str) -> dict[str, str]:
    """Every named statement of `dialect` (`sqlite` or `postgres`), its state sets filled in."""
    text = (resources.files("hail_guard.ledger") / "sql" / dialect / "queries.sql").read_text()
    parts = _NAME.split(text)
    named = {name: filled(body.strip(), dialect) for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    if len(named) != len(parts) // 2:
        raise ValueError(f"sql/{dialect}/queries.sql names a statement twice")
    return named


def filled(sql: str, dialect: str) -> str:
    """`sql` with its state sets, columns and clock filled in (any other `{word}` is left as written)."""
    fragments = {**_FRAGMENTS, "now": NOW[dialect]}

    def fill(found: re.Match[str]) -> str:
        return fragments.get(found.group(1), found.group(0))

    return _PLACEHOLDER.sub(fill, sql)


def migrations(dialect: str) -> list[tuple[int, str]]:
    """(version, SQL) for every migration shipped for `dialect`, in order."""
    folder = resources.files("hail_guard.ledger") / "migrations" / dialect
    found = [
        (int(item.name.split("_")[0]), item.read_text()) for item in folder.iterdir() if item.name.endswith(".sql")
    ]
    return sorted(found)


def check_version(current: int, latest: int, where: str) -> int:
    if current > latest:
        raise SchemaTooNew(
            f"the ledger {where} has schema version {current}, newer than this hail-guard knows ({latest}); "
            "upgrade hail-guard"
        )
    return current
