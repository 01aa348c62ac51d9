from __future__ import annotations

from pathlib import Path

import pytest

from hail_guard.config import Settings, load_settings
from hail_guard.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_no_config_means_the_sandbox_and_a_per_user_ledger() -> None:
    settings = load_settings(None, environ={})
    assert settings.upstream.kind == "sandbox"
    assert settings.ledger.url.startswith("sqlite:///")
    assert str(Path.cwd()) not in settings.ledger.url


def test_the_example_config_is_valid_and_states_the_defaults() -> None:
    example = load_settings(str(ROOT / "config.example.toml"), environ={})
    defaults = Settings()
    assert example.model_dump(exclude={"ledger": {"url"}}) == defaults.model_dump(exclude={"ledger": {"url"}})


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[upstream]\nurl = "http://file:8081/"\ntimeout_seconds = 10\n')
    settings = load_settings(
        str(path),
        environ={
            "HAIL_GUARD_UPSTREAM_URL": "https://mcp.hail.so",
            "HAIL_GUARD_LEDGER_URL": "sqlite:////tmp/l.db",
            "HAIL_GUARD_GUARD_GUARDED_TOOLS": "send_email,send_sms",
        },
    )
    assert (settings.upstream.url, settings.upstream.kind, settings.upstream.timeout_seconds) == (
        "https://mcp.hail.so",
        "http",
        10.0,
    )
    assert settings.ledger.url == "sqlite:////tmp/l.db"
    assert settings.guard.guarded_tools == ["send_email", "send_sms"]


def test_the_config_file_comes_from_the_environment_too(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[upstream]\ncommand = "python -m upstream --flag"\n')
    settings = load_settings(None, environ={"HAIL_GUARD_CONFIG": str(path)})
    assert settings.upstream.kind == "stdio"
    assert settings.upstream.command == ["python", "-m", "upstream", "--flag"]


def test_the_token_is_read_from_the_named_variable_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_HAIL_TOKEN", "secret-value")
    settings = load_settings(None, environ={"HAIL_GUARD_UPSTREAM_TOKEN_ENV": "MY_HAIL_TOKEN"})
    assert settings.upstream.token() == "secret-value"
    assert "secret-value" not in settings.model_dump_json()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[upstream\n", "not valid TOML"),
        ("[upstream]\ntimeout_seconds = -1\n", r"\[upstream.timeout_seconds\]"),
        ("[upstream]\ntransport = 'carrier-pigeon'\n", r"\[upstream.transport\]"),
        ("[ledger]\nurll = 'x'\n", r"\[ledger.urll\] Extra inputs are not permitted"),
        ("[guard]\nkey_template = 'static'\n", "no placeholders"),
    ],
)
def test_bad_config_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(str(path), environ={})


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_settings(str(tmp_path / "nope.toml"), environ={})


def test_the_http_token_comes_from_its_variable_first_then_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[http]\ntoken = "from-the-file"\ntoken_env = "MY_GUARD_TOKEN"\n')
    monkeypatch.delenv("MY_GUARD_TOKEN", raising=False)
    settings = load_settings(str(path), environ={})
    assert settings.http.bearer_token() == "from-the-file"
    assert "from-the-file" not in repr(settings)
    monkeypatch.setenv("MY_GUARD_TOKEN", "from-the-variable")
    assert settings.http.bearer_token() == "from-the-variable"


def test_http_lists_come_from_the_environment_comma_separated() -> None:
    settings = load_settings(
        None, environ={"HAIL_GUARD_HTTP_ALLOWED_HOSTS": "guard.internal,guard", "HAIL_GUARD_HTTP_PORT": "9000"}
    )
    assert settings.http.allowed_hosts == ["guard.internal", "guard"]
    assert settings.http.port == 9000
    assert settings.http.allowed_origins == []
