"""How URLs are shown: scheme, host, port and path read back from parsed parts; never a password."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hail_guard.cli import main
from hail_guard.urls import UNREADABLE_HOST, display_url, masked, parse_url
from tests.conftest import missing

MARKER = "SECRET"
PASSWORD_TEXT = st.text(alphabet="abcXYZ019/#?@:%&=.-_~!$", max_size=12)
PASSWORDS = st.tuples(PASSWORD_TEXT, PASSWORD_TEXT).map(lambda pair: f"{pair[0]}{MARKER}{pair[1]}")
"""Passwords as people write them in URLs: with `/`, `#`, `?`, `@` and `:` left unescaped."""


@given(PASSWORDS)
def test_a_password_in_the_user_information_never_shows_whatever_characters_it_holds(password: str) -> None:
    assume("password=" not in password.lower())
    parts = parse_url(f"postgresql://hg:{password}@db.internal:5432/ledger?sslmode=require")
    assert parts.display == "postgresql://db.internal:5432/ledger"
    assert password in parts.secrets


@given(st.text(alphabet="abcXYZ019/?@:%=.-_~!$", max_size=12))
def test_a_password_in_the_query_never_shows_whatever_characters_it_holds(tail: str) -> None:
    password = MARKER + tail
    parts = parse_url(f"postgresql://hg@db.internal:5432/ledger?sslmode=require&password={password}")
    assert parts.display == "postgresql://db.internal:5432/ledger"
    assert password in parts.secrets


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://hg:pa/ss-SECRET@127.0.0.1:15432/hg", "postgresql://127.0.0.1:15432/hg"),
        ("postgresql://hg:pa%2Fss@[::1]:5432/hg", "postgresql://[::1]:5432/hg"),
        ("postgres://h1:5432,h2:5433/hg?target_session_attrs=read-write", "postgres://h1:5432,h2:5433/hg"),
        ("postgresql:///hg?host=/run/postgresql&password=SECRET", "postgresql:///hg"),
        ("sqlite:////var/lib/hail-guard/ledger.db", "sqlite:////var/lib/hail-guard/ledger.db"),
        ("sqlite:///ledger.db", "sqlite:///ledger.db"),
        ("ledger.db", "ledger.db"),
        ("https://user:SECRET@mcp.hail.so/mcp?token=SECRET#frag", "https://mcp.hail.so/mcp"),
        ("http://hail:8081/", "http://hail:8081/"),
        ("postgresql://hg:SECRET@notaport:x/hg", f"postgresql://{UNREADABLE_HOST}/hg"),
    ],
)
def test_ledger_and_upstream_urls_show_scheme_host_port_and_path_only(url: str, shown: str) -> None:
    assert display_url(url) == shown


def test_a_password_with_a_character_drivers_misread_makes_the_url_ambiguous() -> None:
    assert parse_url("postgresql://hg:pa/ss@h/db").ambiguous
    assert parse_url("postgresql://hg:p@ss@h/db").ambiguous
    assert not parse_url("postgresql://hg:pa%2Fss%40@h/db").ambiguous
    assert not parse_url("postgresql://hg@h/db?password=a/b@c").ambiguous


def test_status_names_the_ledger_without_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HAIL_GUARD_CONFIG", raising=False)
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger"] == f"sqlite:///{tmp_path / 'ledger.db'}"
    if importlib.util.find_spec("asyncpg") is None:
        missing("a postgresql:// ledger needs the `postgres` extra: pip install -e '.[dev,postgres]'")
    monkeypatch.setenv("HAIL_GUARD_LEDGER_URL", "postgresql://hg:pa/ss-SECRET@127.0.0.1:15432/hg")
    assert main(["status"]) == 1
    out, err = capsys.readouterr()
    assert "postgresql://127.0.0.1:15432/hg" in err
    assert "SECRET" not in out + err


@pytest.mark.parametrize(
    ("text", "secret", "shown"),
    [
        ("postgres at port 5432 refused hg:p@db", "p", "postgres at port 5432 refused hg:***@db"),
        ("https://u:pa55@h/mcp?password=pa55&x=1", "pa55", "https://u:***@h/mcp?password=***&x=1"),
        ("Bearer tok-1 sent; tok-12 is another", "tok-1", "Bearer *** sent; tok-12 is another"),
        ("near pw-123.", "pw-123", "near ***."),
    ],
)
def test_a_secret_is_masked_where_it_stands_whole_never_inside_a_word(text: str, secret: str, shown: str) -> None:
    assert masked(text, {secret}) == shown
