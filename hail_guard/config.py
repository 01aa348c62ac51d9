"""Settings, read once at the edge: a TOML file plus `HAIL_GUARD_*` environment overrides.

The file comes from `--config` or `HAIL_GUARD_CONFIG`; without one every setting has a default:
the in-process sandbox as upstream (nothing real is sent) and a ledger in the per-user data folder.
Environment overrides are `HAIL_GUARD_<SECTION>_<KEY>` (e.g. `HAIL_GUARD_LEDGER_URL`,
`HAIL_GUARD_UPSTREAM_URL`, `HAIL_GUARD_UPSTREAM_TIMEOUT_SECONDS`). Secrets are never stored here:
`token_env` names the variable that holds the upstream token.
"""

from __future__ import annotations

import os
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hail_guard import keys
from hail_guard.errors import ConfigError

ENV_PREFIX = "HAIL_GUARD_"
_LIST_KEYS = frozenset({"guarded_tools"})
"""Settings given in the environment as comma-separated lists."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def default_ledger_url() -> str:
    return f"sqlite:///{Path(platformdirs.user_data_dir('hail-guard')) / 'ledger.db'}"


class LedgerSettings(_Section):
    url: str = Field(default_factory=default_ledger_url)
    busy_timeout_seconds: float = Field(default=5.0, gt=0)


class UpstreamSettings(_Section):
    transport: Literal["http", "sse", "stdio", "sandbox"] | None = None
    """None: `http` when `url` is set, `stdio` when `command` is, else the sandbox."""
    url: str | None = None
    command: list[str] | None = None
    token_env: str = "HAIL_API_KEY"  # noqa: S105  (the name of a variable, not a secret)
    timeout_seconds: float = Field(default=45.0, gt=0, le=3600)
    key_retention_hours: float = Field(default=24.0, gt=0)
    sandbox_outbox: str | None = None
    """With the built-in sandbox: append what it "sent" to this JSON Lines file."""

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: object) -> object:
        return shlex.split(value) if isinstance(value, str) else value

    @property
    def kind(self) -> Literal["http", "sse", "stdio", "sandbox"]:
        if self.transport is not None:
            return self.transport
        if self.url:
            return "http"
        return "stdio" if self.command else "sandbox"

    def token(self) -> str | None:
        return os.environ.get(self.token_env) or None


class GuardSection(_Section):
    guarded_tools: list[str] | None = None
    """None: every upstream tool whose schema takes an `idempotency_key`."""
    key_template: str | None = None
    lease_seconds: float | None = Field(default=None, gt=0)
    max_reconcile_attempts: int = Field(default=5, ge=1)

    @field_validator("key_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        if value is not None:
            keys.template_fields(value)
        return value


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class Settings(_Section):
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    guard: GuardSection = Field(default_factory=GuardSection)
    log: LogSettings = Field(default_factory=LogSettings)


def load_settings(path: str | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read the file (if any) and apply environment overrides; errors say what to fix."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(f"{ENV_PREFIX}CONFIG")
    data: dict[str, Any] = _read_toml(path) if path else {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        section, _, key = name.removeprefix(ENV_PREFIX).lower().partition("_")
        if section in Settings.model_fields and key:
            data.setdefault(section, {})[key] = value.split(",") if key in _LIST_KEYS else value
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"[{'.'.join(str(p) for p in error['loc'])}] {error['msg']}" for error in exc.errors())
        raise ConfigError(f"the configuration is not valid ({path or 'defaults and environment'}): {problems}") from exc


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path} is not valid TOML: {exc}") from exc
