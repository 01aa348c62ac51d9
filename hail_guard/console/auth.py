"""Who may use the console, and how a browser proves it on every request.

- An operator signs in at `POST /console/login` with the operators' token (the variable
  `[console] token_env` names, `HAIL_GUARD_OPERATOR_TOKEN`) and a name, or with a one-time link
  that `hail-guard console` prints. The agents' token never signs anyone in: an agent must not
  decide its own reviews (and a console whose operator token equals the agents' is refused).
- A session is a random id in an HttpOnly, SameSite=Strict cookie (Secure over https). The ledger
  keeps it (`Ledger.start_session`) by a SHA-256 of the id only, with its expiry by the database's
  clock: every `serve` sharing the ledger serves it, a restart keeps it, and signing out ends it
  everywhere. The id itself is in the operator's cookie alone, never in the ledger or a log. Its name
  is who every decision is recorded as.
- Every form carries the session's CSRF token, derived from the session id (an HMAC: the ledger
  holds nothing it could be made from); the sign-in form a cookie-bound one of its own. A POST
  without it is refused, except signing out, which always ends the session it names: it can only
  take access away. Host and Origin are checked as on the MCP routes (`gate`), so a page of another
  site can neither read the console nor post to it, a sign-out included.
- What an action did is shown once on the next page: kept in a cookie signed with the session's key
  (`Notices`), so the page that shows it may come from another `serve`.
- Sign-in attempts are rate-limited per client address (`gate.RateLimiter`), and one-time links live
  in the memory of the `hail-guard console` process that prints and serves them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field

from hail_guard.config import ConsoleSettings
from hail_guard.errors import ConfigError
from hail_guard.gate import RateLimiter
from hail_guard.ledger import Sessions

SESSION_COOKIE = "hg_console"
LOGIN_COOKIE = "hg_console_login"
"""Binds the sign-in form's CSRF token to the browser that loaded the form."""
NOTICE_COOKIE = "hg_console_notice"
"""What the last action did, until the next page shows it."""
LINK_SECONDS = 15 * 60.0
"""A one-time sign-in link that nobody opened expires after this."""
MAX_NAME_CHARACTERS = 64
MAX_NOTICE_CHARACTERS = 600
"""A notice longer than this is cut: a cookie holds 4 KB."""
MAX_NOTICES = 4


@dataclass
class Session:
    name: str
    """The operator, as every decision made in this session is recorded."""
    csrf: str
    notice_key: bytes = field(repr=False)
    """Signs the notices cookie (derived from the session id)."""
    notices: list[tuple[str, str]] = field(default_factory=list)
    """(kind, text) shown once, on the next page: what the last action did."""

    def notice(self, kind: str, text: str) -> None:
        shown = text if len(text) <= MAX_NOTICE_CHARACTERS else text[:MAX_NOTICE_CHARACTERS] + "…"
        self.notices = [*self.notices, (kind, shown)][-MAX_NOTICES:]

    def take_notices(self) -> list[tuple[str, str]]:
        shown, self.notices = self.notices, []
        return shown


class Operators:
    """The console's sign-ins: the token check, sessions (kept in the ledger), one-time links, the rate limit."""

    def __init__(self, settings: ConsoleSettings, ledger: Sessions, *, agent_token: str | None) -> None:
        self.token = settings.operator_token()
        if self.token is not None and agent_token is not None and hmac.compare_digest(self.token, agent_token):
            raise ConfigError(
                f"{settings.token_env} equals the agents' token: an agent could then decide its own reviews. "
                "Give the operators a token of their own"
            )
        self.ledger = ledger
        self.session_seconds = settings.session_hours * 3600.0
        self.limiter = RateLimiter(settings.sign_ins_per_minute)
        self._links: dict[str, tuple[str, float]] = {}

    def token_accepted(self, given: str) -> bool:
        """True for the operators' token only (compared in constant time); never the agents'."""
        if self.token is None or not given:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def start(self, name: str) -> tuple[str, Session]:
        """A new session for `name`, kept in the ledger: (the cookie's value, the session)."""
        session_id = secrets.token_urlsafe(32)
        await self.ledger.start_session(_digest(session_id), name=name, seconds=self.session_seconds)
        return session_id, _session(session_id, name)

    async def find(self, session_id: str | None) -> Session | None:
        """The live session this cookie value names (in the ledger: any `serve` sharing it may have started it)."""
        if not session_id:
            return None
        kept = await self.ledger.find_session(_digest(session_id))
        return _session(session_id, kept.name) if kept is not None else None

    async def end(self, session_id: str | None) -> None:
        if session_id:
            await self.ledger.end_session(_digest(session_id))

    def issue_link(self, name: str) -> str:
        """A one-time sign-in token for `name` (`hail-guard console` prints it in a link)."""
        token = secrets.token_urlsafe(32)
        self._links[_digest(token)] = (name, time.monotonic() + LINK_SECONDS)
        return token

    def redeem_link(self, token: str) -> str | None:
        """The name a one-time token was issued for, once; None when unknown, used or expired."""
        name, expires_at = self._links.pop(_digest(token), ("", 0.0))
        return name if name and expires_at > time.monotonic() else None


def _session(session_id: str, name: str) -> Session:
    csrf = hmac.new(session_id.encode(), b"hail-guard console csrf", hashlib.sha256).hexdigest()
    notice_key = hmac.new(session_id.encode(), b"hail-guard console notices", hashlib.sha256).digest()
    return Session(name=name, csrf=csrf, notice_key=notice_key)


def notices_cookie(session: Session) -> str:
    """The session's notices as a cookie value: JSON, base64url, and an HMAC by the session's key."""
    body = base64.urlsafe_b64encode(json.dumps(session.notices, ensure_ascii=True).encode()).decode()
    return f"{body}.{_signature(session.notice_key, body)}"


def read_notices(session: Session, value: str | None) -> list[tuple[str, str]]:
    """The notices a cookie carries, if this session signed it; none otherwise (another session's, or forged)."""
    body, _, signature = (value or "").partition(".")
    if not body or not hmac.compare_digest(signature, _signature(session.notice_key, body)):
        return []
    try:
        return [(str(kind), str(text)) for kind, text in json.loads(base64.urlsafe_b64decode(body.encode()))]
    except (binascii.Error, ValueError, TypeError):
        return []


def _signature(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()[:32]


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
