"""Named SQL parameters: every statement writes `:name`; its numbered text (`$n`, `?n`) is made once, at load.

The translation (`sql.parsed`) reads past casts, strings, quoted names, dollar quotes and comments; a call that
leaves out a name or gives one the statement does not use is refused before anything reaches the database.
"""

from __future__ import annotations

import importlib
import sqlite3
from types import ModuleType

import pytest

from hail_guard.ledger import sql
from tests.conftest import missing

BACKENDS_OWN = {"claim_ready_any", "claim_ready_in_batch", "expire_leases"}
"""Send-path statements each backend writes its own way (PostgreSQL's also expire leases, with their reason)."""


def _asyncpg() -> ModuleType:
    try:
        return importlib.import_module("asyncpg")
    except ImportError:
        missing("the PostgreSQL ledger needs the `postgres` extra: pip install -e '.[dev,postgres]'")


def test_postgres_placeholders_are_numbered_in_the_order_names_first_appear() -> None:
    statement = sql.parsed("pick", "SELECT * FROM t WHERE b = :second_seen OR a = :first", "postgres")
    assert statement.text == "SELECT * FROM t WHERE b = $1 OR a = $2"
    assert statement.names == ("second_seen", "first")
    assert statement.values({"first": 1, "second_seen": 2}) == (2, 1)


def test_sqlite_placeholders_are_numbered_alike_and_a_statement_of_one_name_gets_a_tuple() -> None:
    statement = sql.parsed("pick", "SELECT :b + :a", "sqlite")
    assert statement.text == "SELECT ?1 + ?2"
    assert statement.values({"a": 1, "b": 2}) == (2, 1)
    assert sql.parsed("one", "SELECT :a", "sqlite").values({"a": 1}) == (1,)
    assert sql.parsed("none", "SELECT 1", "sqlite").values({}) == ()


def test_a_name_used_twice_is_one_parameter_given_once() -> None:
    statement = sql.parsed("twice", "SELECT :id, x FROM t WHERE :id IS NULL OR id = :id", "postgres")
    assert statement.text == "SELECT $1, x FROM t WHERE $1 IS NULL OR id = $1"
    assert statement.names == ("id",)
    assert statement.values({"id": "op-1"}) == ("op-1",)


def test_casts_are_not_parameters() -> None:
    statement = sql.parsed("cast", "SELECT :when::float8, x::int, ARRAY(SELECT :keys::jsonb)::text[]", "postgres")
    assert statement.text == "SELECT $1::float8, x::int, ARRAY(SELECT $2::jsonb)::text[]"
    assert statement.names == ("when", "keys")


def test_strings_and_quoted_names_are_not_read() -> None:
    written = """SELECT ':not_one', 'it''s :still_not', "odd:name", col LIKE :pattern ESCAPE '\\' AND c = :after"""
    statement = sql.parsed("quoted", written, "postgres")
    assert statement.text == """SELECT ':not_one', 'it''s :still_not', "odd:name", col LIKE $1 ESCAPE '\\' AND c = $2"""
    assert statement.names == ("pattern", "after")


def test_comments_are_not_read() -> None:
    written = "-- :not_one, a line comment\nSELECT :wanted /* :nor_this,\n across lines */ -- :nor_that\n"
    statement = sql.parsed("commented", written, "postgres")
    assert statement.text == "-- :not_one, a line comment\nSELECT $1 /* :nor_this,\n across lines */ -- :nor_that\n"
    assert statement.names == ("wanted",)


def test_dollar_quoted_text_is_not_read() -> None:
    written = "SELECT $$ :not_one $$, $body$ :nor_this $body$, :wanted"
    statement = sql.parsed("dollars", written, "postgres")
    assert statement.text == "SELECT $$ :not_one $$, $body$ :nor_this $body$, $1"
    assert statement.names == ("wanted",)


@pytest.mark.parametrize(
    ("dialect", "written"), [("postgres", "SELECT $1"), ("sqlite", "SELECT ?1"), ("sqlite", "SELECT ? + 1")]
)
def test_a_positional_parameter_is_refused_when_the_file_is_loaded(dialect: str, written: str) -> None:
    with pytest.raises(ValueError, match=r"statement 'old_style' uses [$?]1?: name its parameters"):
        sql.parsed("old_style", written, dialect)


def test_a_question_mark_is_postgres_jsonb_operator_not_a_parameter() -> None:
    statement = sql.parsed("has_key", "SELECT :doc::jsonb ? 'to'", "postgres")
    assert statement.text == "SELECT $1::jsonb ? 'to'"
    assert statement.names == ("doc",)


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_a_parameter_the_call_does_not_give_is_refused_naming_the_statement_and_the_parameter(dialect: str) -> None:
    statement = sql.statements(dialect)["link_resend"]
    given = {"id": "op-2"}
    with pytest.raises(TypeError, match=r"statement 'link_resend': it uses :resend_of, which the call does not give"):
        statement.values(given)


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_a_parameter_the_statement_does_not_use_is_refused_naming_the_statement_and_the_parameter(
    dialect: str,
) -> None:
    statement = sql.statements(dialect)["batch_name"]
    given = {"batch_id": "B1", "bacth_id": "B1"}
    with pytest.raises(TypeError, match=r"statement 'batch_name': the call gives :bacth_id, which it does not use"):
        statement.values(given)
    misspelt = r"statement 'batch_name': it uses :batch_id, which the call does not give; the call gives :bacth_id"
    with pytest.raises(TypeError, match=misspelt):  # as many names as it uses, one of them wrong
        statement.values({"bacth_id": "B1"})


async def test_a_mismatched_call_is_refused_before_it_reaches_the_database(postgres_url: str) -> None:
    """The connection is closed: any statement sent would fail as a connection error, not as this `TypeError`."""
    asyncpg = _asyncpg()
    from hail_guard.ledger.postgres_group import Tx

    db = await asyncpg.connect(postgres_url)
    await db.close()
    with pytest.raises(TypeError, match=r"statement 'batch_name': it uses :batch_id, which the call does not give"):
        await Tx(db).rows("batch_name", id="B1")


def test_sqlite_runs_a_statement_with_a_name_twice_a_string_and_a_comment() -> None:
    statement = sql.parsed("sum", "SELECT :a + :a AS twice, ':a' AS literal -- :b\n", "sqlite")
    db = sqlite3.connect(":memory:")
    try:
        assert db.execute(statement.text, statement.values({"a": 2})).fetchall() == [(4, ":a")]
    finally:
        db.close()


async def test_postgres_runs_a_translated_statement_with_casts_a_name_twice_a_string_and_a_comment(
    postgres_url: str,
) -> None:
    asyncpg = _asyncpg()
    written = "SELECT :a::int + :a::int AS twice, ':a'::text AS literal, :b::text AS b -- :c\n"
    statement = sql.parsed("sum", written, "postgres")
    db = await asyncpg.connect(postgres_url)
    try:
        row = await db.fetchrow(statement.text, *statement.values({"b": "x", "a": 2}))
    finally:
        await db.close()
    assert (row["twice"], row["literal"], row["b"]) == (4, ":a", "x")


def test_a_statement_of_one_name_takes_the_same_parameters_on_both_dialects() -> None:
    sqlite, postgres = sql.statements("sqlite"), sql.statements("postgres")
    shared = set(sqlite) & set(postgres) - BACKENDS_OWN
    assert len(shared) > 80  # the core's, the console's, planning's, the backfills'
    differing = {name: (sqlite[name].names, postgres[name].names) for name in sorted(shared)}
    assert {name: names for name, names in differing.items() if set(names[0]) != set(names[1])} == {}
