"""Case 3, ledger growth: the hot ledger operations on a small and on a large ledger.

The history (accepted sends with two events each) is written with bulk SQL straight into the
database: a recursive CTE on SQLite, `generate_series` on PostgreSQL. On top of it, every size
gets the same working set: `ready` rows of one batch, due `unknown` rows and opt-outs. Then,
through the real `Ledger`, each operation is timed on both sizes:

- begin_send: a new guarded send's claim (key lookup, opt-out and duplicate checks, insert);
- claim_ready: a batch dispatcher's claim of the next ready send;
- find_by_key: lookup by idempotency key;
- claim_unknown: the reconcile scan for due unknowns.

PostgreSQL tables are vacuumed and analysed after the fill, as autovacuum keeps a ledger that grew
over months; SQLite's are not analysed (hail-guard never runs ANALYZE). Claims are never recorded,
so the sends in flight pile up (600 by the end): more than a real dispatcher ever holds, which is
how the quadratic lease expiry on PostgreSQL showed. The query plans of the large ledger are read
and checked for full scans.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.figures import Figure, median, ms, percentile
from bench.workload import lead_email
from hail_guard.guard import Guard, GuardSettings
from hail_guard.ledger import Ledger, open_ledger, sql, sqlite_path
from hail_guard.ledger.postgres import begin_arguments
from hail_guard.ledger.postgres_group import bound
from hail_guard.models import Intent
from hail_guard.same_send import Rules

_SQLITE_NOW = sql.NOW["sqlite"]
RATIO_TARGET = 1.5
WORK_BATCH = "batch-bench-work"
OPT_OUTS = 1_000
LEASE_SECONDS = 3600.0
"""Long enough that no claim made during the timing expires before it ends."""
RULES = Rules(window_seconds=24 * 3600.0)
OPERATIONS = ("begin_send", "claim_ready", "find_by_key", "claim_unknown")

# One history row: a request and an answer of realistic size. `{i}` is the row number (SQL text).
_REQUEST = (
    '\'{"body_text":"Hi lead \' || i || \', nice to meet you. We help teams like yours ship faster.",'
    "\"idempotency_key\":\"' || :prefix || ':lead' || i || ':email:intro\","
    '"metadata":{"campaign_id":"\' || :prefix || \'","lead_id":"lead\' || i || \'","message_id":"intro"},'
    '"recipient_consent":true,"subject":"Hello","to":["lead\' || i || \'.\' || :prefix || \'@example.com"]}\''
)
_RESULT = (
    '\'{"id":"\' || {id} || \'","status":"queued","to":["lead\' || i || \'.\' || :prefix || \'@example.com"],'
    '"created_at":"2026-01-01T00:00:00Z","idempotency_key":"\' || :prefix || \':lead\' || i || \':email:intro"}\''
)
_SQLITE_RESULT = _RESULT.replace("{id}", "lower(hex(randomblob(16)))")
_PG_REQUEST = _REQUEST.replace(":prefix", ":prefix::text")
_PG_RESULT = _RESULT.replace("{id}", "md5(random()::text)").replace(":prefix", ":prefix::text")

_SQLITE_FILL = f"""
WITH RECURSIVE n(i) AS (SELECT :first UNION ALL SELECT i + 1 FROM n WHERE i < :last)
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request, request_fingerprint,
    content_fingerprint, campaign_id, lead_id, message_id, batch_id, state, provider_id, result, attempts,
    next_check_at, created_at, updated_at, first_sent_at)
SELECT lower(hex(randomblob(16))), :prefix || ':lead' || i || ':email:intro', 'send_email', 'email',
    '["lead' || i || '.' || :prefix || '@example.com"]', '["lead' || i || '.' || :prefix || '@example.com"]',
    {_REQUEST}, lower(hex(randomblob(32))),
    lower(hex(randomblob(32))),
    :prefix, 'lead' || i, 'intro', :batch, :state,
    CASE WHEN :state = 'accepted' THEN lower(hex(randomblob(16))) END,
    CASE WHEN :state = 'accepted' THEN {_SQLITE_RESULT} END,
    CASE WHEN :state = 'ready' THEN 0 ELSE 1 END,
    CASE WHEN :state = 'unknown' THEN :now - 60 END,
    :now - (:last - i) * :spacing, :now - (:last - i) * :spacing,
    CASE WHEN :state = 'ready' THEN NULL ELSE :now - (:last - i) * :spacing END
FROM n
"""
_SQLITE_RECIPIENTS = """
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r.value, o.content_fingerprint FROM operations o, json_each(o.recipients) r
"""
_PG_RECIPIENTS = """
INSERT INTO operation_recipients (operation_id, recipient, content_fingerprint)
SELECT o.id, r, o.content_fingerprint FROM operations o, jsonb_array_elements_text(o.recipients) AS r
"""
_SQLITE_EVENTS = """
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT id, created_at, NULL, 'sending', 'bench', 'intent recorded; forwarding'
FROM operations WHERE campaign_id = :prefix
UNION ALL
SELECT id, created_at, 'sending', 'accepted', 'bench', 'Hail accepted it' FROM operations WHERE campaign_id = :prefix
"""


def _pg(sql: str, names: tuple[str, ...]) -> str:
    """`:name` parameters as PostgreSQL's `$n`, in the order of `names`."""
    for position, name in enumerate(names, start=1):
        sql = sql.replace(f":{name}", f"${position}")
    return sql


_PG_NAMES = ("first", "last", "prefix", "batch", "state", "spacing")
_PG_FILL = _pg(
    f"""
INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,
    request_fingerprint, content_fingerprint, campaign_id, lead_id, message_id, batch_id, state, provider_id,
    result, attempts, next_check_at, created_at, updated_at, first_sent_at)
SELECT gen_random_uuid()::text, :prefix::text || ':lead' || i || ':email:intro', 'send_email', 'email',
    jsonb_build_array('lead' || i || '.' || :prefix::text || '@example.com'),
    ARRAY['lead' || i || '.' || :prefix::text || '@example.com'],
    {_PG_REQUEST}, md5(random()::text) || md5(random()::text),
    md5(random()::text) || md5(random()::text), :prefix::text, 'lead' || i, 'intro', :batch::text, :state::text,
    CASE WHEN :state::text = 'accepted' THEN md5(random()::text) END,
    CASE WHEN :state::text = 'accepted'
        THEN ({_PG_RESULT})::json END,
    CASE WHEN :state::text = 'ready' THEN 0 ELSE 1 END,
    CASE WHEN :state::text = 'unknown' THEN statement_timestamp() - interval '1 minute' END,
    statement_timestamp() - (:last::bigint - i) * :spacing::float8 * interval '1 second',
    statement_timestamp() - (:last::bigint - i) * :spacing::float8 * interval '1 second',
    CASE WHEN :state::text = 'ready' THEN NULL
        ELSE statement_timestamp() - (:last::bigint - i) * :spacing::float8 * interval '1 second' END
FROM generate_series(:first::bigint, :last::bigint) AS i
""",
    _PG_NAMES,
)
_PG_EVENTS = """
INSERT INTO events (operation_id, at, from_state, to_state, actor, reason)
SELECT id, created_at, NULL, 'sending', 'bench', 'intent recorded; forwarding'
FROM operations WHERE campaign_id = $1
UNION ALL
SELECT id, created_at, 'sending', 'accepted', 'bench', 'Hail accepted it' FROM operations WHERE campaign_id = $1
"""


@dataclass(frozen=True)
class Shape:
    history: int
    """Accepted operations already in the ledger."""
    work: int
    """Ready rows, due unknown rows and new sends: one per timed call of each operation."""


@dataclass
class Timings:
    rows: int
    samples: dict[str, list[float]]
    fill_seconds: float


async def fill(url: str, shape: Shape) -> float:
    """Write the history and the working set in bulk; returns how long it took."""
    started = time.perf_counter()
    async with open_ledger(url):
        pass  # creates and migrates it
    parts = [
        ("hist", None, "accepted", 1, shape.history),
        ("work", WORK_BATCH, "ready", 1, shape.work),
        ("lost", None, "unknown", shape.work + 1, 2 * shape.work),  # other recipients: an unknown send holds its own
    ]
    if url.startswith("sqlite"):
        _fill_sqlite(sqlite_path(url), parts)
    else:
        await _fill_postgres(url, parts)
    return time.perf_counter() - started


def _fill_sqlite(path: str, parts: list[tuple[str, str | None, str, int, int]]) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        now = db.execute(f"SELECT {_SQLITE_NOW}").fetchone()[0]
        db.execute("BEGIN")
        for prefix, batch, state, first, last in parts:
            params = {"first": first, "last": last, "prefix": prefix, "batch": batch, "state": state}
            db.execute(_SQLITE_FILL, {**params, "now": now, "spacing": 0.5})
        db.execute(_SQLITE_EVENTS, {"prefix": "hist"})
        db.execute(_SQLITE_RECIPIENTS)
        db.execute(
            f"INSERT INTO batches (id, name, created_by, created_at) VALUES (?, 'bench', 'bench', {_SQLITE_NOW})",
            (WORK_BATCH,),
        )
        db.executemany(
            f"INSERT INTO suppressions (recipient, channel, reason, source, created_at) "
            f"VALUES (?, 'email', 'bench', 'bench', {_SQLITE_NOW})",
            [(f"optout{n}@example.com",) for n in range(OPT_OUTS)],
        )
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()


async def _fill_postgres(url: str, parts: list[tuple[str, str | None, str, int, int]]) -> None:
    import asyncpg

    db = await asyncpg.connect(url)
    try:
        async with db.transaction():
            for prefix, batch, state, first, last in parts:
                await db.execute(_PG_FILL, first, last, prefix, batch, state, 0.5)
            await db.execute(_PG_EVENTS, "hist")
            await db.execute(_PG_RECIPIENTS)
            await db.execute(
                "INSERT INTO batches (id, name, created_by, created_at) VALUES ($1, 'bench', 'bench', now())",
                WORK_BATCH,
            )
            await db.executemany(
                "INSERT INTO suppressions (recipient, channel, reason, source, created_at) "
                "VALUES ($1, 'email', 'bench', 'bench', now())",
                [(f"optout{n}@example.com",) for n in range(OPT_OUTS)],
            )
        await db.execute("VACUUM ANALYZE")  # the steady state autovacuum keeps a grown ledger in
        # The fill's gigabyte is written back now, not under the timed fsyncs that follow (as SQLite's TRUNCATE);
        # a server named by HAIL_GUARD_TEST_POSTGRES_URL, as a role that may not, does its own checkpoints.
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            await db.execute("CHECKPOINT")
    finally:
        await db.close()


def new_intents(count: int, tag: str) -> list[Intent]:
    """New sends, prepared exactly as the guard prepares them (validated, keyed, fingerprinted)."""
    from hail_guard.sandbox.tools import input_schema

    schema = input_schema("send_email") or {}
    guard = Guard(ledger=None, upstream=None, settings=GuardSettings())  # type: ignore[arg-type]  # prepare needs neither
    return [guard.prepare("send_email", lead_email(n, tag), schema)[0] for n in range(count)]


async def time_operations(url: str, shape: Shape) -> dict[str, list[float]]:
    intents = new_intents(shape.work, f"new{shape.history}")
    keys = [f"hist:lead{random.randint(1, shape.history)}:email:intro" for _ in range(shape.work)]  # noqa: S311
    samples: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    async with open_ledger(url) as ledger:
        calls: dict[str, Callable[[int], Awaitable[Any]]] = {
            "begin_send": lambda n: ledger.begin_send(
                intents[n],
                owner="bench",
                lease_seconds=LEASE_SECONDS,
                rules=RULES,
            ),
            "claim_ready": lambda n: _claim_ready(ledger),
            "find_by_key": lambda n: ledger.find_by_key(keys[n]),
            "claim_unknown": lambda n: ledger.claim_unknown(owner="bench", lease_seconds=LEASE_SECONDS, limit=1),
        }
        for name, call in calls.items():
            for n in range(shape.work):
                started = time.perf_counter()
                found = await call(n)
                samples[name].append(time.perf_counter() - started)
                if not found:
                    raise RuntimeError(f"{name} found nothing on call {n}: the working set is too small")
    return samples


async def _claim_ready(ledger: Ledger) -> list[Any]:
    return await ledger.claim_ready(owner="bench", lease_seconds=LEASE_SECONDS, batch_id=WORK_BATCH, limit=1)


def figures(ledger: str, small: Timings, large: Timings) -> list[Figure]:
    result = []
    for name in OPERATIONS:
        big, base = ms(large.samples[name]), ms(small.samples[name])
        ratio = median(big) / median(base)
        p99_ratio = percentile(big, 0.99) / percentile(base, 0.99)
        result.append(
            Figure(
                case="growth",
                name=f"{name}, {large.rows:,} vs {small.rows:,} operations",
                ledger=ledger,
                unit="ms",
                median=median(big),
                p99=percentile(big, 0.99),
                baseline=median(base),
                ratio=ratio,
                target=f"ratio <= {RATIO_TARGET}",
                met=ratio <= RATIO_TARGET,
                note=f"p99 ratio {p99_ratio:.2f}; n={len(big)}; fill {large.fill_seconds:.0f} s",
            )
        )
    return result


# --- query plans ---------------------------------------------------------------------------------

_SQLITE = sql.statements("sqlite")
_SQLITE_QUERIES = {
    "claim_ready (one batch)": _SQLITE["claim_ready_in_batch"],
    "claim_ready (any batch)": _SQLITE["claim_ready_any"],
    "claim_unknown": _SQLITE["claim_unknown_due"],
    "find_by_key": _SQLITE["operation_by_key"],
    "begin_send: the same message to a recipient": _SQLITE["matches"],
    "begin_send: what holds a recipient": _SQLITE["holds"],
    "begin_send: other messages a recipient has": _SQLITE["near"],
    "expire leases": _SQLITE["expire_leases"],
}
_PG = sql.statements("postgres")


_FULL_SCAN_SQLITE = re.compile(r"\bSCAN (operations|events|suppressions|s)\b(?! USING)")
_FULL_SCAN_PG = re.compile(r"Seq Scan on (operations|events)\b")


def sqlite_plans(url: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(sqlite_path(url))
    try:
        plans = []
        for query, statement in _SQLITE_QUERIES.items():
            rows = db.execute(f"EXPLAIN QUERY PLAN {statement.text}", [None] * len(statement.names)).fetchall()
            lines = [f"{'  ' * _depth(rows, row)}{row[3]}" for row in rows]
            plans.append(
                {"query": query, "plan": lines, "uses_index": not any(_FULL_SCAN_SQLITE.search(x) for x in lines)}
            )
        return plans
    finally:
        db.close()


def _depth(rows: list[tuple[int, int, int, str]], row: tuple[int, int, int, str]) -> int:
    parents = {r[0]: r[1] for r in rows}
    depth, parent = 0, row[1]
    while parent in parents:
        depth, parent = depth + 1, parents[parent]
    return depth


async def postgres_plans(url: str) -> list[dict[str, Any]]:
    import asyncpg

    claim = {"owner": "bench", "lease_seconds": LEASE_SECONDS, "limit": 1}
    queries: dict[str, tuple[str, dict[str, Any]]] = {
        "claim_ready": (
            "claim_ready_in_batch",
            {**claim, "expired_reason": "bench", "hold_lead": True, "batch_id": WORK_BATCH},
        ),
        "claim_unknown": ("claim_unknown_due", {**claim, "batch_id": None}),
        "find_by_key": ("operation_by_key", {"idempotency_key": "hist:lead1:email:intro"}),
        "expire leases": ("expire_leases", {"expired_reason": "bench"}),
    }
    db = await asyncpg.connect(url)
    try:
        plans = []
        for query, (name, given) in queries.items():
            statement = _PG[name]
            lines = [row[0] for row in await db.fetch(f"EXPLAIN {statement.text}", *statement.values(given))]
            plans.append({"query": query, "plan": lines, "uses_index": not any(_FULL_SCAN_PG.search(x) for x in lines)})
        plans.extend(await _begin_send_plans(db))
        return plans
    finally:
        await db.close()


async def _begin_send_plans(db: Any) -> list[dict[str, Any]]:
    """The plan of every statement `begin_send` runs inside `hg_begin_send` (sql/postgres/begin_send.sql), as
    auto_explain reports them: a new key with the duplicate check, rolled back."""
    notices: list[str] = []
    db.add_log_listener(lambda _, message: notices.append(message.message))
    await db.execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on; "
        "SET auto_explain.log_format = json; SET auto_explain.log_level = notice"
    )
    [intent] = new_intents(1, "plan")
    transaction = db.transaction()
    await transaction.start()
    try:
        await db.fetchrow(*bound("begin_send", **begin_arguments(intent, "bench", LEASE_SECONDS, RULES, None)))
    finally:
        await transaction.rollback()
    plans = []
    for notice in notices:
        explained = json.loads(notice.split("plan:", 1)[1])
        statement = " ".join(explained["Query Text"].split())
        if "hg_begin_send(" in statement:
            continue  # the call itself: a function scan
        lines = list(_plan_lines(explained["Plan"]))
        plans.append(
            {
                "query": f"begin_send: {statement[:70]}",
                "plan": lines,
                "uses_index": not any(_FULL_SCAN_PG.search(x) for x in lines),
            }
        )
    return plans


def _plan_lines(node: dict[str, Any], depth: int = 0) -> Iterator[str]:
    using = f" using {node['Index Name']}" if "Index Name" in node else ""
    on = f" on {node['Relation Name']}" if "Relation Name" in node else ""
    condition = next((f"  ({k}: {node[k]})" for k in ("Index Cond", "Filter") if k in node), "")
    yield f"{'  ' * depth}{node['Node Type']}{using}{on}{condition}"
    for child in node.get("Plans", []):
        yield from _plan_lines(child, depth + 1)
