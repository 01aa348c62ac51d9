"""Who may use the console, and how a browser proves it on every request.

- An operator signs in at `POST /console/login` with the operators' token (the variable
  `[console] token_env` names, `HAIL_GUARD_OPERATOR_TOKEN`) and a name, or with a one-time link
  that `hail-guard console` prints. The agents' token never signs anyone in: an agent must not
  decide its own reviews (and a console whose operator token equals the agents' is refused).
- A session is a random id in an HttpOnly, SameSite=Strict cookie (Secure over https), held in
  this process's memory only: a restart signs everyone out. Its name is who every decision is
  recorded as.
- Every form carries the session's CSRF token (the sign-in form a cookie-bound one of its own);
  a POST without it is refused. Host and Origin are checked as on the MCP routes (`gate`), so a
  page of another site can neither read the console nor post to it.
- Sign-in attempts are rate-limited per client address (`gate.RateLimiter`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

from hail_guard.config import ConsoleSettings
from hail_guard.errors import ConfigError
from hail_guard.gate import RateLimiter

SESSION_COOKIE = "hg_console"
LOGIN_COOKIE = "hg_console_login"
"""Binds the sign-in form's CSRF token to the browser that loaded the form."""
LINK_SECONDS = 15 * 60.0
"""A one-time sign-in link that nobody opened expires after this."""
MAX_NAME_CHARACTERS = 64
_MAX_SESSIONS = 1_000


@dataclass
class Session:
    name: str
    """The operator, as every decision made in this session is recorded."""
    csrf: str
    expires_at: float
    notices: list[tuple[str, str]] = field(default_factory=list)
    """(kind, text) shown once, on the next page: what the last action did."""

    def notice(self, kind: str, text: str) -> None:
        self.notices.append((kind, text))

    def take_notices(self) -> list[tuple[str, str]]:
        shown, self.notices = self.notices, []
        return shown


class Operators:
    """The console's sign-ins: the token check, sessions, one-time links and the sign-in rate limit."""

    def __init__(self, settings: ConsoleSettings, *, agent_token: str | None) -> None:
        self.token = settings.operator_token()
        if self.token is not None and agent_token is not None and hmac.compare_digest(self.token, agent_token):
            raise ConfigError(
                f"{settings.token_env} equals the agents' token: an agent could then decide its own reviews. "
                "Give the operators a token of their own"
            )
        self.session_seconds = settings.session_hours * 3600.0
        self.limiter = RateLimiter(settings.sign_ins_per_minute)
        self._sessions: dict[str, Session] = {}
        self._links: dict[str, tuple[str, float]] = {}

    def token_accepted(self, given: str) -> bool:
        """True for the operators' token only (compared in constant time); never the agents'."""
        if self.token is None or not given:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def start(self, name: str) -> tuple[str, Session]:
        """A new session for `name`: (the cookie's value, the session)."""
        self._forget_expired()
        session_id = secrets.token_urlsafe(32)
        session = Session(name=name, csrf=secrets.token_urlsafe(32), expires_at=time.monotonic() + self.session_seconds)
        self._sessions[_digest(session_id)] = session
        return session_id, session

    def find(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._sessions.get(_digest(session_id))
        if session is None or session.expires_at <= time.monotonic():
            return None
        return session

    def end(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_digest(session_id), None)

    def issue_link(self, name: str) -> str:
        """A one-time sign-in token for `name` (`hail-guard console` prints it in a link)."""
        token = secrets.token_urlsafe(32)
        self._links[_digest(token)] = (name, time.monotonic() + LINK_SECONDS)
        return token

    def redeem_link(self, token: str) -> str | None:
        """The name a one-time token was issued for, once; None when unknown, used or expired."""
        name, expires_at = self._links.pop(_digest(token), ("", 0.0))
        return name if name and expires_at > time.monotonic() else None

    def _forget_expired(self) -> None:
        now = time.monotonic()
        if len(self._sessions) >= _MAX_SESSIONS:
            self._sessions = {key: s for key, s in self._sessions.items() if s.expires_at > now}
        if len(self._sessions) >= _MAX_SESSIONS:  # all live: the oldest sign-in goes
            oldest = min(self._sessions, key=lambda key: self._sessions[key].expires_at)
            del self._sessions[oldest]


def operator_name(text: str) -> str | None:
    """A name to record decisions under: trimmed, printable, 1 to 64 characters; None when it is not one."""
    name = " ".join(text.split())
    if not name or len(name) > MAX_NAME_CHARACTERS or not name.isprintable():
        return None
    return name


def same_token(given: str, expected: str) -> bool:
    return bool(given) and bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def _digest(value: str) -> str:
    """Sessions and links are kept by a hash of their secret, never the secret itself."""
    return hashlib.sha256(value.encode()).hexdigest()
