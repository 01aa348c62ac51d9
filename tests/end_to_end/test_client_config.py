"""`hail-guard client-config CLIENT [--write]`: a block that starts this install, merged without losing anything."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from mcp import Client, StdioServerParameters

from hail_guard.cli import main
from hail_guard.cli.clients import TOKEN_PLACEHOLDER, install_command

OTHER = {"command": "npx", "args": ["-y", "some-other-server"]}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def _no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HAIL_GUARD_CONFIG", "HAIL_GUARD_UPSTREAM_URL", "HAIL_GUARD_UPSTREAM_TOKEN_ENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HAIL_GUARD_UPSTREAM_SIGNIN_DIR", str(tmp_path / "signin"))


def test_the_block_names_this_install_by_its_absolute_path_and_hosted_hail_needs_a_sign_in_not_a_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "client-config", "claude-desktop")
    entry = json.loads(out)["mcpServers"]["hail"]
    command, arguments = install_command()
    assert code == 0
    assert Path(entry["command"]).is_absolute()
    assert Path(entry["command"]).exists()
    assert [entry["command"], *entry["args"]] == [command, *arguments, "serve"]
    assert entry["env"] == {"HAIL_GUARD_UPSTREAM_URL": "https://mcp.hail.so"}
    assert "next: run `hail-guard login` as this user, then restart the client" in err


def test_a_self_hosted_hail_gets_the_key_variable_with_a_placeholder_never_the_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAIL_API_KEY", "the-real-key")
    code, out, err = run(capsys, "client-config", "cursor", "--upstream-url", "http://hail.internal:8081/")
    entry = json.loads(out)["mcpServers"]["hail"]
    assert code == 0
    assert entry["env"] == {"HAIL_GUARD_UPSTREAM_URL": "http://hail.internal:8081/", "HAIL_API_KEY": TOKEN_PLACEHOLDER}
    assert "the-real-key" not in out + err
    assert f"replace {TOKEN_PLACEHOLDER}" in err
    hosted = json.loads(run(capsys, "client-config", "cursor", "--api-key")[1])["mcpServers"]["hail"]
    assert hosted["env"]["HAIL_API_KEY"] == TOKEN_PLACEHOLDER


def test_an_upstream_signed_in_to_needs_no_key_and_no_reminder_to_sign_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from datetime import UTC, datetime

    from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

    from hail_guard.oauth import SignInRecord, TokenStore

    url = "http://hail.internal:8081/"
    client = OAuthClientInformationFull(client_id="hg", redirect_uris=["http://127.0.0.1/callback"])
    record = SignInRecord(
        upstream=url, tokens=OAuthToken(access_token="a"), client=client, signed_in_at=datetime.now(UTC)
    )
    TokenStore(url, tmp_path / "signin").save(record)
    code, out, err = run(capsys, "client-config", "vscode", "--upstream-url", url)
    block = json.loads(out)
    assert code == 0
    assert block == {"servers": {"hail": {**block["servers"]["hail"], "env": {"HAIL_GUARD_UPSTREAM_URL": url}}}}
    assert "next: restart the client" in err


def test_the_configured_upstream_and_config_file_are_carried_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hail-guard.toml"
    config.write_text('[upstream]\nurl = "http://hail.internal:8081/"\ntoken_env = "MY_HAIL_TOKEN"\n')  # self-hosted
    code, out, _ = run(capsys, "client-config", "vscode", "--config", str(config))
    block = json.loads(out)
    entry = block["servers"]["hail"]
    assert (code, entry["type"]) == (0, "stdio")
    assert entry["args"][-3:] == ["serve", "--config", str(config)]
    assert entry["env"] == {
        "HAIL_GUARD_UPSTREAM_URL": "http://hail.internal:8081/",
        "HAIL_GUARD_UPSTREAM_TOKEN_ENV": "MY_HAIL_TOKEN",
        "MY_HAIL_TOKEN": "${input:hail-token}",
    }
    assert block["inputs"] == [
        {"type": "promptString", "id": "hail-token", "description": "Hail token", "password": True}
    ]


def test_claude_code_gets_a_shell_line_that_reads_the_token_from_the_shell(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "client-config", "claude-code", "--api-key")
    words = shlex.split(out)
    assert (code, words[:4]) == (0, ["claude", "mcp", "add", "hail"])
    assert '--env HAIL_API_KEY="$HAIL_API_KEY"' in out
    command, arguments = install_command()
    assert words[words.index("--") + 1 :] == [command, *arguments, "serve"]


def test_write_merges_into_an_existing_file_keeping_other_servers_and_a_backup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "claude_desktop_config.json"
    original = {"mcpServers": {"other": OTHER}, "theme": "dark"}
    path.write_text(json.dumps(original))
    code, out, _ = run(capsys, "client-config", "claude-desktop", "--write", "--file", str(path))
    written = json.loads(path.read_text())
    assert code == 0
    assert written["theme"] == "dark"
    assert set(written["mcpServers"]) == {"other", "hail"}
    assert written["mcpServers"]["other"] == OTHER
    [backup] = tmp_path.glob("claude_desktop_config.json.*.bak")
    assert json.loads(backup.read_text()) == original
    assert str(backup) in out


def test_write_creates_a_private_file_when_there_is_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new" / ".cursor" / "mcp.json"
    code, _, _ = run(capsys, "client-config", "cursor", "--write", "--file", str(path))
    assert code == 0
    assert set(json.loads(path.read_text())["mcpServers"]) == {"hail"}
    assert path.stat().st_mode & 0o777 == 0o600
    assert list(path.parent.glob("*.bak")) == []


def test_a_server_of_the_same_name_is_replaced_only_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"hail": OTHER}}))
    code, _, err = run(capsys, "client-config", "cursor", "--write", "--file", str(path))
    assert code == 1
    assert "already has a server named 'hail': pass --force" in err
    assert json.loads(path.read_text()) == {"mcpServers": {"hail": OTHER}}
    assert list(tmp_path.glob("*.bak")) == []
    code, _, _ = run(capsys, "client-config", "cursor", "--write", "--file", str(path), "--force")
    assert code == 0
    assert json.loads(path.read_text())["mcpServers"]["hail"]["args"][-1] == "serve"
    assert len(list(tmp_path.glob("*.bak"))) == 1


def test_writing_the_same_server_again_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mcp.json"
    argv = ("client-config", "vscode", "--api-key", "--write", "--file", str(path))
    assert run(capsys, *argv)[0] == 0
    before = path.read_text()
    code, out, _ = run(capsys, *argv)
    assert (code, path.read_text()) == (0, before)
    assert "nothing to write" in out
    assert len(json.loads(before)["inputs"]) == 1


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"mcpServers": []}'])
def test_a_file_that_cannot_be_merged_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(content)
    code, _, err = run(capsys, "client-config", "cursor", "--write", "--file", str(path))
    assert code == 1
    assert "nothing was written" in err
    assert path.read_text() == content
    assert [p.name for p in tmp_path.iterdir()] == ["mcp.json"]


async def test_the_written_server_starts_and_serves_the_sandbox(tmp_path: Path) -> None:
    """What a client does with the block: spawn the command with its arguments and environment."""
    path = tmp_path / "mcp.json"
    argv = ["client-config", "cursor", "--sandbox", "--write", "--file", str(path)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    entry: dict[str, Any] = json.loads(path.read_text())["mcpServers"]["hail"]
    assert "env" not in entry
    env = {"HAIL_GUARD_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}", "HOME": os.environ.get("HOME", "")}
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=env, cwd=str(tmp_path))
    async with Client(params, mode="legacy") as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
    assert {"send_email", "reconcile"} <= names


def command_config(tmp_path: Path, command: list[str]) -> Path:
    config = tmp_path / "hail-guard.toml"
    config.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
        f"[upstream]\ncommand = {json.dumps(command)}\n"
        'profile = "resend"\n'
        "[upstream.env]\n"
        'RESEND_BASE_URL = "https://api.resend.test"\n'
        'SENDER_EMAIL_ADDRESS = "hello@acme.test"\n'
        'REPLY_TO_EMAIL_ADDRESSES = "${REPLY_TO}"\n'
        "[delivery]\npoll = false\n"
    )
    return config


def test_a_command_upstream_is_written_as_configured_with_absolute_paths_never_as_hosted_hail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: for `command = [...]` with profile resend it wrote HAIL_GUARD_UPSTREAM_URL=https://mcp.hail.so
    and said to run `hail-guard login`; the command's bare name was not found on a desktop client's PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npx").write_text("#!/bin/sh\n")
    (bin_dir / "npx").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HAIL_GUARD_CONFIG", str(command_config(tmp_path, ["npx", "-y", "resend-mcp"])))
    code, out, err = run(capsys, "client-config", "claude-desktop")
    entry = json.loads(out)["mcpServers"]["resend"]
    env = entry["env"]
    assert code == 0
    assert "HAIL_GUARD_UPSTREAM_URL" not in env
    assert shlex.split(env["HAIL_GUARD_UPSTREAM_COMMAND"]) == [str(bin_dir / "npx"), "-y", "resend-mcp"]
    assert env["PATH"].split(os.pathsep)[0] == str(bin_dir)  # npx finds node beside it
    assert env["HAIL_GUARD_UPSTREAM_PROFILE"] == "resend"
    assert json.loads(env["HAIL_GUARD_UPSTREAM_ENV"]) == {
        "RESEND_BASE_URL": "https://api.resend.test",
        "SENDER_EMAIL_ADDRESS": "${SENDER_EMAIL_ADDRESS}",  # a secret: its own variable, never its value
        "REPLY_TO_EMAIL_ADDRESSES": "${REPLY_TO}",
    }
    assert (env["RESEND_API_KEY"], env["SENDER_EMAIL_ADDRESS"]) == (
        "PASTE-YOUR-RESEND_API_KEY",
        "PASTE-YOUR-SENDER_EMAIL_ADDRESS",
    )
    assert env["REPLY_TO"] == "PASTE-YOUR-REPLY_TO"
    assert "hello@acme.test" not in out
    assert "login" not in err
    assert "your Resend key" in err


async def test_the_written_command_entry_starts_and_serves_the_configured_upstream(tmp_path: Path) -> None:
    """What a desktop client does with the entry: spawn it with its environment and little else."""
    fake = [sys.executable, "-m", "hail_guard", "fake", "--profile", "resend", "--stdio"]
    path = tmp_path / "mcp.json"
    argv = ["--config", str(command_config(tmp_path, fake)), "client-config", "cursor", "--write", "--file", str(path)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    entry: dict[str, Any] = json.loads(path.read_text())["mcpServers"]["resend"]
    env = {name: value.replace("PASTE-YOUR-", "pasted-") for name, value in entry["env"].items()}
    env |= {"HAIL_GUARD_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}", "HOME": os.environ.get("HOME", "")}
    params = StdioServerParameters(command=entry["command"], args=entry["args"], env=env, cwd=str(tmp_path))
    async with Client(params, mode="legacy") as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
    assert {"send-email", "send-batch-emails", "reconcile"} <= names
