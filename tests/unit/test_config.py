from __future__ import annotations

from pathlib import Path

import pytest

from hail_guard.config import Settings, load_settings
from hail_guard.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


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
        ("[ledger]\nurll = 'x'\n", r'unknown key "urll" in \[ledger\]; did you mean "url"\?'),
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


def test_an_unknown_key_in_the_file_names_the_nearest_key_and_the_example(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[upstream]\ntimeout = 10\n")
    expected = (
        'unknown key "timeout" in [upstream]; did you mean "timeout_seconds"? (config.example.toml lists every key)'
    )
    with pytest.raises(ConfigError) as raised:
        load_settings(str(path), environ={})
    assert expected in str(raised.value)
    assert "Extra inputs" not in str(raised.value)


def test_an_unknown_variable_names_the_variable_it_meant() -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(None, environ={"HAIL_GUARD_UPSTREAM_TIMEOUT": "10"})
    assert (
        'unknown variable HAIL_GUARD_UPSTREAM_TIMEOUT: [upstream] has no key "timeout"; '
        "did you mean HAIL_GUARD_UPSTREAM_TIMEOUT_SECONDS? (config.example.toml lists every key)"
    ) in str(raised.value)


def test_an_unknown_section_and_a_key_like_no_other_are_named_too(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[upstreams]\nurl = 'x'\n[guard]\nzzz = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(str(path), environ={})
    assert "unknown section [upstreams]; did you mean [upstream]?" in str(raised.value)
    assert 'unknown key "zzz" in [guard] (config.example.toml lists every key)' in str(raised.value)


def test_variables_of_other_tools_and_of_unknown_sections_are_left_alone() -> None:
    settings = load_settings(None, environ={"HAIL_GUARD_TOKEN": "t", "HAIL_GUARD_CRASH_AT": "x", "HAIL_GUARD_X_Y": "1"})
    assert settings.model_dump() == Settings().model_dump()


@pytest.mark.parametrize(
    ("given", "made"),
    [
        ("ledger.db", "{folder}/ledger.db"),
        ("data/../ledger.db", "{folder}/ledger.db"),
        ("sqlite:///ledger.db", "sqlite:///{folder}/ledger.db"),
        ("sqlite:///data/ledger.db", "sqlite:///{folder}/data/ledger.db"),
        ("sqlite:////srv/hail/ledger.db", "sqlite:////srv/hail/ledger.db"),
        ("postgresql://db:5432/hg", "postgresql://db:5432/hg"),
    ],
)
def test_a_relative_ledger_path_is_taken_from_the_config_files_folder_not_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, made: str
) -> None:
    folder, elsewhere = tmp_path / "config", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "hail-guard.toml").write_text(f'[ledger]\nurl = "{given}"\n')
    monkeypatch.chdir(elsewhere)  # a desktop client starts `serve` in a folder of its own choosing
    assert load_settings("../config/hail-guard.toml", environ={}).ledger.url == made.format(folder=folder)


def test_a_relative_ledger_path_in_a_variable_is_taken_from_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config" / "hail-guard.toml"
    config.parent.mkdir()
    config.write_text('[ledger]\nurl = "ignored.db"\n')
    monkeypatch.chdir(tmp_path)
    settings = load_settings(str(config), environ={"HAIL_GUARD_LEDGER_URL": "sqlite:///here.db"})
    assert settings.ledger.url == f"sqlite:///{tmp_path / 'here.db'}"
    assert load_settings(None, environ={"HAIL_GUARD_LEDGER_URL": "~/l.db"}).ledger.url == str(Path.home() / "l.db")
