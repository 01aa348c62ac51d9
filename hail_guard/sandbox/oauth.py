"""The sandbox's OAuth authorization server, beside the fake Hail: how hosted Hail signs clients in.

With it (`hail-guard sandbox --oauth`), every MCP request needs a token it issued for this resource;
without one the answer is HTTP 401 with `WWW-Authenticate: Bearer error="invalid_token",
resource_metadata="<base>/.well-known/oauth-protected-resource"`. It lives at the sandbox's own origin
(the issuer is the sandbox's base URL) and serves:

    GET  /.well-known/oauth-protected-resource     RFC 9728: the resource and its authorization server
    GET  /.well-known/oauth-authorization-server   RFC 8414
    POST /register                                 RFC 7591: public clients with loopback redirects (RFC 8252)
    GET  /authorize                                approves at once (no person): 302 to the redirect with
                                                   code, state and iss (RFC 9207); `approving = False` denies
    POST /token                                    authorization_code (PKCE S256 checked, RFC 8707 resource),
                                                   refresh_token (rotated: each is good for one use)
    POST /revoke                                   RFC 7009

A spent refresh token presented again is taken as stolen and revokes its grant (OAuth 2.1's reuse
detection), as strict servers do; two clients renewing with one refresh token at once lose the grant.
`revoke_all` is the tests' switch. Lifetimes follow the sandbox's clock; hosted Hail's are the defaults.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final
from urllib.parse import parse_qs, urlencode

import httpx2
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from hail_guard.sandbox.clock import Clock, system_clock

ACCESS_TOKEN_SECONDS: Final = 30 * 24 * 3600
REFRESH_TOKEN_SECONDS: Final = 180 * 24 * 3600
CODE_SECONDS: Final = 600
PROTECTED_RESOURCE_PATH: Final = "/.well-known/oauth-protected-resource"
_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})
_NO_STORE: Final = {"Cache-Control": "no-store"}


@dataclass
class _Grant:
    client_id: str
    resource: str
    refresh_expires_at: datetime
    revoked: bool = False


@dataclass(frozen=True)
class _Code:
    client_id: str
    redirect_uri: str
    challenge: str
    resource: str
    expires_at: datetime


class OAuthError(Exception):
    """An RFC 6749 error answer: `error` is its code."""

    def __init__(self, error: str, description: str) -> None:
        super().__init__(description)
        self.error = error


class AuthorizationServer:
    """Clients, codes, grants and tokens of the sandbox's sign-in, in memory (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Clock = system_clock,
        access_token_seconds: float = ACCESS_TOKEN_SECONDS,
        refresh_token_seconds: float = REFRESH_TOKEN_SECONDS,
    ) -> None:
        self._clock = clock
        self._access_lifetime = timedelta(seconds=access_token_seconds)
        self._refresh_lifetime = timedelta(seconds=refresh_token_seconds)
        self._clients: dict[str, list[str]] = {}
        self._codes: dict[str, _Code] = {}
        self._access: dict[str, tuple[_Grant, datetime]] = {}
        self._refresh: dict[str, _Grant] = {}
        self._spent: dict[str, _Grant] = {}
        self.approving = True
        """False: `/authorize` answers `access_denied`, as when a person clicks Deny."""
        self.refreshes = 0
        """Refresh grants answered with new tokens."""
        self.reuses = 0
        """Spent refresh tokens presented again (each revoked its grant)."""
        self.issued: list[str] = []
        """Every code and token handed out, oldest first (tests look for them where they must not be)."""

    def revoke_all(self) -> None:
        """Revoke every grant at once: no token issued so far works any more."""
        for grant, _ in self._access.values():
            grant.revoked = True
        for grant in self._refresh.values():
            grant.revoked = True

    def accepts(self, authorization: str, resource: str) -> bool:
        """Whether an `Authorization` header carries a live access token issued for `resource`."""
        scheme, _, token = authorization.partition(" ")
        found = self._access.get(token) if scheme.lower() == "bearer" else None
        if found is None:
            return False
        grant, expires_at = found
        return not grant.revoked and grant.resource == resource and self._clock() < expires_at

    def challenge(self, request: Request) -> Response:
        """The 401 the MCP endpoint answers without a valid token (RFC 9728 section 5.1)."""
        metadata = f"{_base(request).rstrip('/')}{PROTECTED_RESOURCE_PATH}"
        header = f'Bearer error="invalid_token", resource_metadata="{metadata}"'
        body = {"error": "invalid_token", "error_description": "a valid access token is required"}
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": header})

    def routes(self) -> list[Route]:
        return [
            Route(PROTECTED_RESOURCE_PATH, self._resource_metadata, methods=["GET"]),
            Route("/.well-known/oauth-authorization-server", self._server_metadata, methods=["GET"]),
            Route("/register", self._register, methods=["POST"]),
            Route("/authorize", self._authorize, methods=["GET"]),
            Route("/token", self._token, methods=["POST"]),
            Route("/revoke", self._revoke, methods=["POST"]),
        ]

    async def _resource_metadata(self, request: Request) -> Response:
        base = _base(request)
        body = {"resource": base, "authorization_servers": [base], "bearer_methods_supported": ["header"]}
        return JSONResponse({**body, "resource_name": "Hail sandbox"})

    async def _server_metadata(self, request: Request) -> Response:
        base = _base(request)
        return JSONResponse(
            {
                "issuer": base,
                "authorization_endpoint": f"{base}authorize",
                "token_endpoint": f"{base}token",
                "registration_endpoint": f"{base}register",
                "revocation_endpoint": f"{base}revoke",
                "response_types_supported": ["code"],
                "grant_types_supported": ["authorization_code", "refresh_token"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["none"],
                "revocation_endpoint_auth_methods_supported": ["none"],
                "authorization_response_iss_parameter_supported": True,
            }
        )

    async def _register(self, request: Request) -> Response:
        try:
            metadata = _client_metadata(await request.body())
        except OAuthError as refused:
            return _error(refused)
        uris = metadata["redirect_uris"]
        client_id = f"sbx-client-{secrets.token_hex(8)}"
        self._clients[client_id] = list(uris)
        answer = {
            "client_id": client_id,
            "client_id_issued_at": int(self._clock().timestamp()),
            "client_name": str(metadata.get("client_name") or "")[:100] or None,
            "redirect_uris": uris,
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        }
        return JSONResponse(answer, status_code=201)

    async def _authorize(self, request: Request) -> Response:
        query = request.query_params
        client_id, redirect_uri = query.get("client_id", ""), query.get("redirect_uri", "")
        if not any(_same_redirect(redirect_uri, known) for known in self._clients.get(client_id, [])):
            return _error(OAuthError("invalid_request", "unknown client_id, or a redirect_uri it did not register"))
        answer: dict[str, str] = {"iss": _base(request)}
        if query.get("state") is not None:
            answer["state"] = query["state"]
        if not self.approving:
            answer["error"] = "access_denied"
        elif query.get("response_type") != "code":
            answer["error"] = "unsupported_response_type"
        elif query.get("code_challenge_method") != "S256" or not query.get("code_challenge"):
            answer["error"] = "invalid_request"
        elif query.get("resource", _base(request)) != _base(request):
            answer["error"] = "invalid_target"
        else:
            code = self._mint("sbx_code_")
            resource = query.get("resource", _base(request))
            expires = self._clock() + timedelta(seconds=CODE_SECONDS)
            self._codes[code] = _Code(client_id, redirect_uri, query["code_challenge"], resource, expires)
            answer["code"] = code
        return RedirectResponse(f"{redirect_uri}?{urlencode(answer)}", status_code=302)

    async def _token(self, request: Request) -> Response:
        form = {name: values[0] for name, values in parse_qs((await request.body()).decode()).items()}
        grants = {"authorization_code": self._redeem, "refresh_token": self._rotate}
        grant_type = form.get("grant_type", "")
        if grant_type not in grants:
            return _error(OAuthError("unsupported_grant_type", f"grant_type {grant_type!r} is not supported"))
        try:
            return self._tokens(grants[grant_type](form))
        except OAuthError as refused:
            return _error(refused)

    def _redeem(self, form: dict[str, str]) -> _Grant:
        code = self._codes.pop(form.get("code", ""), None)
        if code is None or self._clock() >= code.expires_at:
            raise OAuthError("invalid_grant", "unknown, used or expired code")
        if form.get("client_id") != code.client_id or form.get("redirect_uri") != code.redirect_uri:
            raise OAuthError("invalid_grant", "the code was issued to another client or redirect_uri")
        digest = hashlib.sha256(form.get("code_verifier", "").encode()).digest()
        if base64.urlsafe_b64encode(digest).decode().rstrip("=") != code.challenge:
            raise OAuthError("invalid_grant", "the code_verifier does not match the code_challenge")
        if form.get("resource", code.resource) != code.resource:
            raise OAuthError("invalid_target", "resource differs from the authorization request's")
        return _Grant(code.client_id, code.resource, self._clock() + self._refresh_lifetime)

    def _rotate(self, form: dict[str, str]) -> _Grant:
        token = form.get("refresh_token", "")
        if (spent := self._spent.get(token)) is not None:
            spent.revoked = True
            self.reuses += 1
            raise OAuthError("invalid_grant", "refresh token already used: the grant is revoked")
        grant = self._refresh.get(token)
        if grant is None or grant.revoked or self._clock() >= grant.refresh_expires_at:
            raise OAuthError("invalid_grant", "unknown, revoked or expired refresh token")
        if form.get("client_id") != grant.client_id:
            raise OAuthError("invalid_grant", "the refresh token was issued to another client")
        if form.get("resource", grant.resource) != grant.resource:
            raise OAuthError("invalid_target", "resource differs from the grant's")
        self._spent[token] = self._refresh.pop(token)
        self.refreshes += 1
        return grant

    def _tokens(self, grant: _Grant) -> Response:
        access, refresh = self._mint("sbx_at_"), self._mint("sbx_rt_")
        self._access[access] = (grant, self._clock() + self._access_lifetime)
        self._refresh[refresh] = grant
        seconds = int(self._access_lifetime.total_seconds())
        body = {"access_token": access, "token_type": "Bearer", "expires_in": seconds, "refresh_token": refresh}
        return JSONResponse(body, headers=_NO_STORE)

    async def _revoke(self, request: Request) -> Response:
        form = {name: values[0] for name, values in parse_qs((await request.body()).decode()).items()}
        token = form.get("token", "")
        grant = self._refresh.get(token) or (self._access.get(token) or (None, None))[0]
        if grant is not None:
            grant.revoked = True
        return Response(status_code=200)

    def _mint(self, prefix: str) -> str:
        value = f"{prefix}{secrets.token_urlsafe(24)}"
        self.issued.append(value)
        return value


def _base(request: Request) -> str:
    return str(request.base_url)


def _error(refused: OAuthError) -> Response:
    return JSONResponse({"error": refused.error, "error_description": str(refused)}, 400, headers=_NO_STORE)


def _client_metadata(body: bytes) -> dict[str, Any]:
    """A registration request (RFC 7591) this server takes: a public client with loopback redirects."""
    try:
        metadata = json.loads(body)
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise OAuthError("invalid_client_metadata", "the body must be a JSON object")
    uris = metadata.get("redirect_uris")
    if not isinstance(uris, list) or not uris or not all(_loopback(uri) for uri in uris):
        raise OAuthError("invalid_redirect_uri", "redirect_uris must be loopback http URLs")
    if metadata.get("token_endpoint_auth_method", "none") != "none":
        raise OAuthError("invalid_client_metadata", "only public clients (token_endpoint_auth_method none)")
    return metadata


def _loopback(uri: Any) -> bool:
    if not isinstance(uri, str):
        return False
    try:
        url = httpx2.URL(uri)
    except httpx2.InvalidURL:
        return False
    return url.scheme == "http" and url.host in _LOOPBACK_HOSTS


def _same_redirect(given: str, registered: str) -> bool:
    """Equal, except that a loopback redirect may use any port (RFC 8252 section 7.3)."""
    if given == registered:
        return True
    if not (_loopback(given) and _loopback(registered)):
        return False
    a, b = httpx2.URL(given), httpx2.URL(registered)
    return (a.host, a.path, a.query) == (b.host, b.path, b.query)
