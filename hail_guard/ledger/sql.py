"""Named SQL: each backend's statements live in `sql/<dialect>/queries.sql`, each under `-- name: NAME`;
its migrations in `migrations/<dialect>/NNNN_*.sql` (`migrations`).

Python only says which statement runs (procrastinate keeps its queries the same way), and gives its parameters
by name: every statement writes `:name` placeholders, and a statement of the same name takes the same names on
both dialects, so the ledger core (`hail_guard.ledger.core`) runs it on either. asyncpg takes only `$1`, `$2`,
..., so each statement is translated once, when the file is loaded (`statements` is cached), into numbered
placeholders (`$n` for asyncpg, `?n` for sqlite3: binding by position costs it less than its own lookup of
each name) and the names in their order (`Statement`): a call then costs one `itemgetter` over its mapping,
never a parse. The translation reads past `::type` casts, string literals, quoted names, dollar quotes and
comments; `:name` must start with a letter or `_` (write an array slice `a[i : j]` with spaces). A call that
leaves out a name its statement uses, or gives one it does not, is refused at once (`TypeError`, naming both),
before anything reaches the database.

State sets are written `{recordable}`, `{claimable}`, `{holding}`, ... and filled in from `hail_guard.lifecycle`
and `hail_guard.same_send` when the file is loaded: the SQL never types a state set again. `{columns}` is an
operation's columns.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

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
_TOKEN = re.compile(
    r"'(?:[^']|'')*'"  # a string
    r'|"(?:[^"]|"")*"'  # a quoted name
    r"|--[^\n]*"  # a comment
    r"|/\*.*?\*/"  # a block comment
    r"|(?P<dollar>\$(?:[A-Za-z_]\w*)?\$).*?(?P=dollar)"  # a dollar-quoted string
    r"|::"  # a cast
    r"|:(?P<name>[A-Za-z_]\w*)"  # a parameter
    r"|(?P<positional>[$?]\d+|\?)",  # a positional parameter: refused (a bare `?` is a jsonb operator on PostgreSQL)
    re.DOTALL,
)


@dataclass(frozen=True, slots=True)
class Statement:
    """A named statement as its driver takes it, and the parameters it names."""

    name: str
    text: str
    """Numbered where the file wrote `:name`: `$1`, `$2`, ... (PostgreSQL) or `?1`, `?2`, ... (SQLite), the n-th
    being `names[n - 1]`."""
    names: tuple[str, ...]
    """Each parameter once, in the order of first use."""
    ordered: Callable[[Mapping[str, Any]], tuple[Any, ...]] = field(repr=False, compare=False)
    """A mapping's values in `names`' order (`KeyError` for a name it lacks)."""

    def values(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """`params` in the order of the statement's placeholders, once they are exactly the names it uses."""
        if len(params) != len(self.names):
            raise self.mismatch(params)
        try:
            return self.ordered(params)
        except KeyError:
            raise self.mismatch(params) from None

    def mismatch(self, params: Mapping[str, Any]) -> TypeError:
        missing = ", ".join(f":{name}" for name in self.names if name not in params)
        extra = ", ".join(f":{name}" for name in params if name not in self.names)
        said = [f"it uses {missing}, which the call does not give"] if missing else []
        said += [f"the call gives {extra}, which it does not use"] if extra else []
        return TypeError(f"statement {self.name!r}: {'; '.join(said)}")


@cache
def statements(dialect: str) -> dict[str, Statement]:
    """Every named statement of `dialect` (`sqlite` or `postgres`), its state sets filled in, as its driver takes
    it (`Statement`)."""
    text = (resources.files("hail_guard.ledger") / "sql" / dialect / "queries.sql").read_text()
    parts = _NAME.split(text)
    named = {
        name: parsed(name, filled(body.strip(), dialect), dialect)
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }
    if len(named) != len(parts) // 2:
        raise ValueError(f"sql/{dialect}/queries.sql names a statement twice")
    return named


def parsed(name: str, sql: str, dialect: str) -> Statement:
    """`sql`'s `:name` parameters, in order of first use, each turned into its number (`$n` or `?n`)."""
    names: dict[str, int] = {}
    mark = "$" if dialect == "postgres" else "?"

    def placeholder(found: re.Match[str]) -> str:
        positional = found.group("positional")
        if positional == "?" and dialect == "postgres":
            return positional
        if positional is not None:
            raise ValueError(f"statement {name!r} uses {found.group(0)}: name its parameters (:name)")
        parameter = found.group("name")
        if parameter is None:
            return found.group(0)
        return f"{mark}{names.setdefault(parameter, len(names) + 1)}"

    text = _TOKEN.sub(placeholder, sql)
    return Statement(name, text, tuple(names), _ordered(tuple(names)))


def _ordered(names: tuple[str, ...]) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """`itemgetter` over `names`, always answering a tuple (it answers the bare value for one name)."""
    if len(names) > 1:
        getter: Callable[[Mapping[str, Any]], tuple[Any, ...]] = operator.itemgetter(*names)
        return getter
    return lambda params: tuple(params[name] for name in names)


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
