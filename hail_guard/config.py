"""Settings, read once at the edge: a TOML file plus `HAIL_GUARD_*` environment overrides.

The file comes from `--config` or `HAIL_GUARD_CONFIG`; without one every setting has a default:
the in-process sandbox as upstream (nothing real is sent) and a ledger in the per-user data folder.
A relative SQLite ledger path (`ledger.db`, `sqlite:///ledger.db`) is taken from the folder of the
config file that names it, else (from a variable) from the working folder, and made absolute here:
a desktop client starts `serve` in a folder of its own choosing.
Environment overrides are `HAIL_GUARD_<SECTION>_<KEY>` (e.g. `HAIL_GUARD_LEDGER_URL`,
`HAIL_GUARD_UPSTREAM_URL`, `HAIL_GUARD_UPSTREAM_TIMEOUT_SECONDS`). The upstream token is never stored
here: `token_env` names the variable that holds it (unset: the one the profile names, `key_env`: HAIL_API_KEY,
RESEND_API_KEY...); without a token, an HTTP upstream gets the sign-in that `hail-guard login` kept in
`signin_dir`. A stdio upstream also gets `[upstream.env]`, each `${NAME}` in it filled from hail-guard's own
environment (`resolved_env`: a missing one is an error that names it). The HTTP server's own token comes from
the variable `[http] token_env` names (default `HAIL_GUARD_TOKEN`), else from `[http] token`; the variable wins.
Hail's webhook signing secret likewise lives only in the variable `[webhooks] secret_env` names.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from hail_guard import keys
from hail_guard.errors import ConfigError

ENV_PREFIX = "HAIL_GUARD_"
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""`${NAME}` in an `[upstream.env]` value: hail-guard's own variable NAME."""
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LIST_KEYS = frozenset({"guarded_tools", "allowed_hosts", "allowed_origins", "trusted_proxies"})
"""Settings given in the environment as comma-separated lists."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def default_ledger_url() -> str:
    import platformdirs  # here: only a ledger left unset needs it

    return f"sqlite:///{Path(platformdirs.user_data_dir('hail-guard')) / 'ledger.db'}"


class LedgerSettings(_Section):
    url: str = Field(default_factory=default_ledger_url)
    busy_timeout_seconds: float = Field(default=5.0, gt=0)


class UpstreamSettings(_Section):
    transport: Literal["http", "sse", "stdio", "sandbox"] | None = None
    """None: `http` when `url` is set, `stdio` when `command` is, else the sandbox."""
    url: str | None = None
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    """Variables for a stdio command (`[upstream.env]`: `RESEND_BASE_URL`, `SENDER_EMAIL_ADDRESS`...); a value
    `${NAME}` is taken from hail-guard's environment. Secrets in logs and `status`, unless they are URLs."""
    token_env: str = "HAIL_API_KEY"  # noqa: S105  (the name of a variable, not a secret)
    timeout_seconds: float = Field(default=45.0, gt=0, le=3600)
    profile: str = Field(default="hail", min_length=1)
    """The upstream's contract: a built-in profile (`hail`, `resend`, `agentmail`) or a profile file (a path
    relative to the config file it is set in, else to the working folder)."""
    key_retention_hours: float | None = Field(default=None, gt=0)
    """How long the upstream keeps a key; None: as the profile says (Hail: 24)."""
    sandbox_outbox: str | None = None
    """With the built-in sandbox: append what it "sent" to this JSON Lines file."""
    pin_tools: bool = False
    """Refuse a guarded tool whose description or schema changed until `hail-guard upstream accept`."""
    record_tools: bool = True
    """Record the upstream's tools in the ledger (pinning); the drill's spawned `serve` turns it off."""
    signin_dir: str | None = None
    """Where `hail-guard login` keeps its tokens (one file per upstream); None: `signin/` in the user's data folder."""

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: object) -> object:
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, given in value.items():
            if not _VARIABLE.match(name):
                raise ValueError(f"{name!r} is not a variable name (letters, digits and _, not first a digit)")
            if "\x00" in given:
                raise ValueError(f"{name}: a variable cannot hold a NUL character")
        return value

    def resolved_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """`[upstream.env]` with each `${NAME}` taken from `environ` (hail-guard's); a missing one is refused."""
        environ = os.environ if environ is None else environ
        missing = sorted({name for value in self.env.values() for name in _REFERENCE.findall(value)} - set(environ))
        if missing:
            users = [name for name, value in self.env.items() if set(_REFERENCE.findall(value)) & set(missing)]
            raise ConfigError(
                f"[upstream.env] {', '.join(users)} take {', '.join('${' + name + '}' for name in missing)} from "
                f"hail-guard's environment, where {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "not set: set it before hail-guard starts, or write the value itself; nothing was started"
            )
        return {name: _REFERENCE.sub(lambda found: environ[found[1]], value) for name, value in self.env.items()}

    def command_problem(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Why the stdio command cannot be started (not found on the PATH, a variable missing), else None."""
        if self.kind != "stdio" or not self.command:
            return None
        try:
            self.resolved_env(environ)
        except ConfigError as exc:
            return str(exc)
        path = (os.environ if environ is None else environ).get("PATH")
        if shutil.which(self.command[0], path=path) is None:
            return f"{self.command[0]!r} is not found on the PATH ({path or 'unset'}): give its absolute path"
        return None

    @property
    def kind(self) -> Literal["http", "sse", "stdio", "sandbox"]:
        if self.transport is not None:
            return self.transport
        if self.url and self.command:
            raise ConfigError(
                "[upstream] has both a url and a command (a url from HAIL_GUARD_UPSTREAM_URL, say): remove the "
                'one not meant, or name the transport ([upstream] transport = "stdio" or "http")'
            )
        if self.url:
            return "http"
        return "stdio" if self.command else "sandbox"

    def token(self) -> str | None:
        return os.environ.get(self.token_env) or None

    def token_warning(self, *, signed_in: bool = False) -> str | None:
        """Why sends may be refused (HTTP 401): an upstream URL is set, but the token variable is empty or unset
        and (for Streamable HTTP) there is no sign-in either (`signed_in`: `hail-guard login` kept one)."""
        if self.kind not in ("http", "sse") or self.token() or (self.kind == "http" and signed_in):
            return None
        from hail_guard.policy import upstream_name  # here: only a warning names the upstream

        fix = f"set {self.token_env}" + (", or run `hail-guard login`" if self.kind == "http" else "")
        name = upstream_name()
        return (
            f"{self.token_env} is not set: hail-guard sends {name} no token, and a {name} that checks tokens "
            f"refuses every send (HTTP 401); {fix}"
        )


class GuardSection(_Section):
    guarded_tools: list[str] | None = None
    """None: every upstream tool whose schema takes an `idempotency_key`."""
    key_template: str | None = None
    lease_seconds: float | None = Field(default=None, gt=0)
    max_reconcile_attempts: int = Field(default=5, ge=1)
    require_approval: bool = False
    """Batches start `planned` and wait for `hail-guard batch approve`."""
    duplicate_window_hours: float = Field(default=24.0, ge=0)
    """Settled sends (accepted, or closed by an operator after they may have left) are compared with a new send
    while they first left within this many hours; unresolved and waiting sends are compared at any age. 0:
    settled sends are not compared, nothing more."""
    similarity_threshold: float = Field(default=0.85, ge=0, le=1)
    """A new text at least this similar to one a recipient has on the channel (within the window) is refused as a
    probable duplicate (a paraphrased retry); 0: texts are not compared."""
    hold_lead_across_channels: bool = True
    """While a send to a lead (the metadata's campaign_id and lead_id) is unresolved, nothing new goes to that lead
    on any channel."""
    default_region: str | None = None
    """Where a phone number written without its country code is read (ISO 3166 code, e.g. `GB`); unset: such a
    number is refused."""

    @field_validator("key_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        if value is not None:
            keys.template_fields(value)
        return value

    @field_validator("default_region")
    @classmethod
    def _check_region(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import phonenumbers  # here: only a region given needs it

        region = value.strip().upper()
        if region not in phonenumbers.SUPPORTED_REGIONS:
            raise ValueError(f"{value!r} is not a region phone numbers are known for; give an ISO 3166 code like GB")
        return region


MIN_TOKEN_CHARACTERS = 32
"""The shortest agents' token accepted on an address other hosts can reach."""


class HttpSettings(_Section):
    """`hail-guard serve` over SSE and Streamable HTTP (see `hail_guard.web`)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    token_env: str = "HAIL_GUARD_TOKEN"  # noqa: S105  (the name of a variable, not a secret)
    token: SecretStr | None = None
    """Agents' bearer token, when not given in the `token_env` variable (which wins)."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host header names (optionally `:port`) besides the loopback names and `host`; `*`: any."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser origins (`scheme://host[:port]`) besides loopback ones; `*`: any."""
    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    rate_limit_per_minute: int = Field(default=120, ge=0)
    """Tool calls and session starts (`initialize`) per minute per client address (bursts up to this many)."""
    trusted_proxies: list[str] = Field(default_factory=list)
    """Reverse proxies (addresses or networks; `*`: any) whose `X-Forwarded-For` names the client;
    none: the connection's own address is the client, whatever headers say."""
    header_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    """A request's headers must arrive within this long of the connection (or of the previous answer)."""
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """A request's body must arrive, whole, within this long of its headers."""
    max_connections: int = Field(default=100, ge=1)
    """Connections open at once (open SSE streams included); past it a new one is answered 503 and closed."""
    max_streams_per_client: int = Field(default=10, ge=1)
    """Open streams (`GET /sse`, `GET /mcp`) per client address; past it a new one gets 429."""
    max_streams: int | None = Field(default=None, ge=1)
    """Open streams in all (the agents' one token: the cap per token); None: half of `max_connections`,
    so streams never hold every connection. Past it a new one gets 503."""
    max_sessions: int = Field(default=100, ge=1)
    """Live Streamable HTTP sessions; past it a new `initialize` gets 503 until one ends or expires."""
    session_idle_seconds: float = Field(default=900.0, gt=0)
    """A Streamable HTTP session with no request for this long ends (its client starts a new one)."""
    shutdown_grace_seconds: float = Field(default=10.0, ge=0, le=600)
    """On shutdown, how long in-flight requests may run on before they are cancelled."""

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: list[str]) -> list[str]:
        entries = [entry.strip() for entry in value]
        if entries == ["*"]:
            return entries
        for entry in entries:
            try:
                ipaddress.ip_network(entry)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an address or a network (e.g. 10.0.0.5, 10.0.0.0/8), and * stands alone"
                ) from None
        return entries

    def stream_cap(self) -> int:
        """Open streams allowed in all: `max_streams`, never more than `max_connections` less one."""
        return min(self.max_streams or max(1, self.max_connections // 2), max(1, self.max_connections - 1))

    def bearer_token(self) -> str | None:
        """The token agents must present; None when neither the variable nor `token` gives one."""
        from_env = os.environ.get(self.token_env)
        if from_env:
            return from_env
        return self.token.get_secret_value() if self.token is not None and self.token.get_secret_value() else None

    def token_problem(self, *, loopback: bool) -> str | None:
        """Why the agents' token cannot guard a server on this address (None: it can)."""
        token, source = self.bearer_token(), f"{self.token_env} (or [http] token)"
        if token is None:
            if loopback:
                return None
            return (
                f"refusing to listen on {self.host}: agents on other hosts could send without a token. Set "
                f"{source}, or listen on 127.0.0.1 and put a proxy in front."
            )
        if not all("!" <= char <= "~" for char in token):
            return f"the token in {source} must be printable ASCII without spaces: an HTTP header cannot carry it"
        if not loopback and len(token) < MIN_TOKEN_CHARACTERS:
            return (
                f"refusing to listen on {self.host} with a {len(token)}-character token: off loopback it must have at "
                f"least {MIN_TOKEN_CHARACTERS} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return None


class WorkerSettings(_Section):
    concurrency: int = Field(default=4, ge=1, le=256)
    poll_seconds: float = Field(default=1.0, gt=0)
    """How long an idle worker waits before looking for new work."""
    shutdown_seconds: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long in-flight sends may take before they are cut off (and recorded unknown)."""


class DeliverySettings(_Section):
    """Delivery tracking by polling Hail (`hail_guard.tracker`), beside `serve` and `worker`."""

    poll: bool = True
    poll_interval_seconds: float = Field(default=30.0, gt=0)
    """How often the tracker looks for messages to check, and the wait after a message's first check."""
    backoff_factor: float = Field(default=2.0, ge=1)
    """Each later check of the same message waits this many times longer..."""
    max_backoff_seconds: float = Field(default=3600.0, gt=0)
    """...up to this."""
    max_age_hours: float = Field(default=72.0, gt=0)
    """Messages first sent longer ago than this are no longer polled."""


class WebhookSettings(_Section):
    """`POST /webhooks/hail` on the HTTP transport (see `hail_guard.webhooks`)."""

    secret_env: str = "HAIL_WEBHOOK_SECRET"  # noqa: S105  (the name of a variable, not a secret)
    """The variable holding Hail's webhook signing secret; without it the route answers 503."""
    tolerance_seconds: float = Field(default=300.0, gt=0)
    """A signature whose timestamp is further than this from now is stale (401)."""

    def secret(self) -> str | None:
        return os.environ.get(self.secret_env) or None


class ReviewSettings(_Section):
    expose_to_agent: bool = False
    """Offer the review queue to the agent as tools (`review_list`, `review_resolve`, `review_resend`)."""


class ConsoleSettings(_Section):
    """The operator console (`hail_guard.console`): at `/console` beside `/mcp`, or alone (`hail-guard console`)."""

    token_env: str = "HAIL_GUARD_OPERATOR_TOKEN"  # noqa: S105  (the name of a variable, not a secret)
    """The variable holding the operators' token (never the agents' token); unset: the console signs nobody in
    with a token, and `hail-guard console` offers its one-time link only."""
    port: int = Field(default=8766, ge=0, le=65535)
    """Where `hail-guard console` listens, on 127.0.0.1."""
    session_hours: float = Field(default=12.0, gt=0, le=24 * 30)
    """How long a sign-in lasts."""
    sign_ins_per_minute: int = Field(default=10, ge=1)
    """Sign-in attempts per minute per client address (bursts up to this many); more get 429."""

    def operator_token(self) -> str | None:
        return os.environ.get(self.token_env) or None


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class Settings(_Section):
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    guard: GuardSection = Field(default_factory=GuardSection)
    http: HttpSettings = Field(default_factory=HttpSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    delivery: DeliverySettings = Field(default_factory=DeliverySettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    review: ReviewSettings = Field(default_factory=ReviewSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    log: LogSettings = Field(default_factory=LogSettings)


def load_settings(path: str | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read the file (if any) and apply environment overrides; errors say what to fix."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(f"{ENV_PREFIX}CONFIG")
    data: dict[str, Any] = _read_toml(path) if path else {}
    variables: dict[tuple[str, str], str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        section, _, key = name.removeprefix(ENV_PREFIX).lower().partition("_")
        if section in Settings.model_fields and key:
            data.setdefault(section, {})[key] = _from_variable(name, key, value)
            variables[(section, key)] = name
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_problem(error, variables) for error in exc.errors())
        raise ConfigError(f"the configuration is not valid ({path or 'defaults and environment'}): {problems}") from exc
    upstream = settings.upstream
    if path and ("upstream", "profile") not in variables and _is_relative_file(upstream.profile):
        upstream.profile = str(Path(path).parent / upstream.profile)  # beside the file that names it
    if "token_env" not in upstream.model_fields_set:  # the profile's, and still not said by the config
        upstream.token_env = _key_env(upstream.profile) or upstream.token_env
        upstream.model_fields_set.discard("token_env")
    base = Path(path).absolute().parent if path and ("ledger", "url") not in variables else None
    settings.ledger.url = absolute_ledger_url(settings.ledger.url, base)
    return settings


def absolute_ledger_url(url: str, base: Path | None) -> str:
    """A SQLite ledger's path made absolute (`~` expanded; a relative one taken from `base`, else the working
    folder), in the form it was given (a plain path, or `sqlite:///`); any other URL as it is."""
    scheme = "sqlite:///" if url.startswith("sqlite:///") else ""
    path = url.removeprefix(scheme)
    if "://" in path or path in ("", ":memory:"):
        return url  # PostgreSQL, or something the ledger refuses with its own words
    return f"{scheme}{os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(path)))}"


def _key_env(profile: str) -> str | None:
    """The variable the profile says holds the upstream's key; None when it says none (or does not read:
    loading it for real says why)."""
    from hail_guard.profiles import load_profile  # here: the profiles load only when a config names one

    try:
        return load_profile(profile).key_env
    except ConfigError:
        return None


def _from_variable(name: str, key: str, value: str) -> Any:
    """A setting as a variable gives it: a list comma-separated, `[upstream.env]` a JSON object, else text."""
    if key in _LIST_KEYS:
        return [v for v in value.split(",") if v]
    if key != "env":
        return value
    import json  # here: only HAIL_GUARD_UPSTREAM_ENV needs it

    try:
        table = json.loads(value)
    except ValueError:
        table = None
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f'{name} must be a JSON object of texts, such as {{"RESEND_BASE_URL": "https://..."}}')
    return table


def _is_relative_file(profile: str) -> bool:
    from hail_guard.profiles import BUILT_IN  # here: the profiles load only when a file names one

    return profile not in BUILT_IN and not Path(profile).expanduser().is_absolute()


def _problem(error: Any, variables: Mapping[tuple[str, str], str]) -> str:
    """One validation error in words; an unknown key names the nearest known one (and its variable)."""
    where = tuple(str(part) for part in error["loc"])
    if error["type"] != "extra_forbidden":
        return f"[{'.'.join(where)}] {error['msg']}"
    if len(where) == 1:
        near = _nearest(where[0], Settings.model_fields)
        return f"unknown section [{where[0]}]" + (f"; did you mean [{near}]?" if near else "") + _SEE_EXAMPLE
    section, key = where[0], where[1]
    model = Settings.model_fields[section].annotation
    near = _nearest(key, model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else None
    variable = variables.get((section, key))
    if variable is None:
        return f'unknown key "{key}" in [{section}]' + (f'; did you mean "{near}"?' if near else "") + _SEE_EXAMPLE
    hint = f"; did you mean {ENV_PREFIX}{section.upper()}_{near.upper()}?" if near else ""
    return f'unknown variable {variable}: [{section}] has no key "{key}"{hint}{_SEE_EXAMPLE}'


_SEE_EXAMPLE = " (config.example.toml lists every key)"


def _nearest(name: str, known: Mapping[str, Any]) -> str | None:
    import difflib  # here: only a misspelt setting needs it

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return close[0] if close else None


def _read_toml(path: str) -> dict[str, Any]:
    import tomllib  # here: only a config file needs it

    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path} is not valid TOML: {exc}") from exc
