"""The one exception tree of hail-guard.

    HailGuardError
    ├── ConfigError            bad settings: fix the config file or the environment
    ├── LedgerError            the ledger cannot be read or written
    │   ├── LedgerUnavailable      cannot open, locked past the busy timeout, disk full, read-only
    │   │   └── OutcomeNotRecorded     Hail answered, but the answer could not be written down
    │   ├── SchemaTooNew           the ledger was migrated by a newer hail-guard
    │   └── LeaseLost              a fenced write lost its lease: another worker owns the operation
    ├── UpstreamError          talking to Hail went wrong
    │   ├── UpstreamUnavailable    nothing was sent: could not connect
    │   │   └── SignInRequired         nothing was sent: an operator must run `hail-guard login`
    │   └── UpstreamLost           the request may have left: timeout, dropped connection
    ├── BadInput               a value, file or confirmation that cannot be used: fix it; nothing was recorded
    │   └── BadRecipient           an address or number that cannot be read (`recipients`)
    ├── RefusedByPolicy        a rule refuses the request before anything is recorded
    │   ├── KeyConflict            an existing key with a different request
    │   ├── Suppressed             the recipient opted out
    │   ├── ProbableDuplicate      a new key for a message a recipient has, or may have (or nearly the same)
    │   └── Held                   a recipient (or lead) has a send that is not settled: nothing new goes yet
    ├── WebhookRefused         a webhook that is forged, stale or replayed (401), or unreadable (400)
    └── NotFound               no such operation

Every boundary maps foreign exceptions into this tree in one place, and a test walks every foreign
class it can meet: `ledger.sqlite.errors_mapped`, `ledger.postgres_errors.errors_mapped`,
`upstream.map_error`. What an agent is told for each error is one table (`policy.failure_of`); only
the server turns it into an MCP result. The command line exits 1 for any of them.
"""

from __future__ import annotations


class HailGuardError(Exception):
    """Root of every error hail-guard raises on purpose."""


class ConfigError(HailGuardError):
    """The configuration cannot be used as given."""


class LedgerError(HailGuardError):
    """The ledger could not do what was asked."""


class LedgerUnavailable(LedgerError):
    """The ledger cannot be opened or written right now; nothing was recorded."""


class OutcomeNotRecorded(LedgerUnavailable):
    """Hail answered a forwarded request, but the ledger refused every attempt to record the answer.

    The request has left: the agent must be told what Hail said and must not send it again."""

    def __init__(self, message: str, *, operation_id: str, state: str, provider_id: str | None) -> None:
        super().__init__(message)
        self.operation_id = operation_id
        self.state = state
        self.provider_id = provider_id


class SchemaTooNew(LedgerError):
    """The ledger's schema is newer than this version of hail-guard knows."""


class LeaseLost(LedgerError):
    """A fenced write found that another worker took the operation over."""


class UpstreamError(HailGuardError):
    """Talking to the upstream (Hail) failed."""


class UpstreamUnavailable(UpstreamError):
    """The upstream could not be reached; the request was not sent."""


class SignInRequired(UpstreamUnavailable):
    """The upstream needs a sign-in that hail-guard does not have (none, refused, revoked); nothing was sent."""


class UpstreamLost(UpstreamError):
    """The request was sent (or may have been) but no answer came back."""


class BadInput(HailGuardError):
    """What was given cannot be used: a value the schema or Hail refuses, a file that cannot be read, a
    confirmation not given. Nothing was recorded; the same call, corrected, may be made again."""


class RefusedByPolicy(HailGuardError):
    """A rule refuses the request (an opt-out, a repeat, a key in use, a changed tool, a review decision out
    of turn) before anything is recorded; the key stays free."""


class KeyConflict(RefusedByPolicy):
    """An existing idempotency key was used with a different request."""

    def __init__(self, message: str, *, differing_fields: list[str]) -> None:
        super().__init__(message)
        self.differing_fields = differing_fields


class Suppressed(RefusedByPolicy):
    """The recipient is on the suppression list; nothing is recorded or sent."""


class ProbableDuplicate(RefusedByPolicy):
    """A new key for content already sent (or maybe sent) within the duplicate window."""

    def __init__(self, message: str, *, operation_id: str) -> None:
        super().__init__(message)
        self.operation_id = operation_id


class Held(RefusedByPolicy):
    """A new send to a recipient (or lead) whose earlier send is `sending`, `unknown` or `needs_review`."""

    def __init__(self, message: str, *, operation_id: str) -> None:
        super().__init__(message)
        self.operation_id = operation_id


class WebhookRefused(HailGuardError):
    """A webhook request that is not taken; nothing was recorded. `status` is the HTTP answer."""

    def __init__(self, message: str, *, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class NotFound(HailGuardError):
    """No operation matches what was asked for."""
