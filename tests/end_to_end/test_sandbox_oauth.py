"""The sandbox's OAuth authorization server over HTTP, spoken to by hand: what hosted Hail's sign-in does."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import httpx2

from hail_guard.sandbox import ManualClock, Sandbox, serve_http
from hail_guard.sandbox.oauth import AuthorizationServer

REDIRECT = "http://127.0.0.1:4321/callback"
VERIFIER = "v" * 64
CHALLENGE = base64.urlsafe_b64encode(hashlib.sha256(VERIFIER.encode()).digest()).decode().rstrip("=")


@dataclass
class Hail:
    url: str
    auth: AuthorizationServer
    clock: ManualClock
    http: httpx2.AsyncClient

    async def client(self, redirect: str = REDIRECT) -> str:
        registered = await self.http.post(f"{self.url}register", json={"redirect_uris": [redirect]})
        assert registered.status_code == 201
        client_id: str = registered.json()["client_id"]
        return client_id

    async def authorize(self, client_id: str, **changes: str) -> dict[str, str]:
        asked = {
            "response_type": "code",
            "client_id": client_id,
            "redirect_uri": REDIRECT,
            "state": "the-state",
            "code_challenge": CHALLENGE,
            "code_challenge_method": "S256",
            "resource": self.url,
            **changes,
        }
        answer = await self.http.get(f"{self.url}authorize", params=asked)
        assert answer.status_code == 302
        location = urlsplit(answer.headers["location"])
        assert f"{location.scheme}://{location.netloc}{location.path}" == asked["redirect_uri"]
        return {name: values[0] for name, values in parse_qs(location.query).items()}

    async def token(self, **form: str) -> httpx2.Response:
        return await self.http.post(f"{self.url}token", data=form)

    async def signed_in(self) -> tuple[str, dict[str, Any]]:
        client_id = await self.client()
        code = (await self.authorize(client_id))["code"]
        tokens = await self.token(
            grant_type="authorization_code",
            code=code,
            client_id=client_id,
            redirect_uri=REDIRECT,
            code_verifier=VERIFIER,
        )
        assert tokens.status_code == 200
        return client_id, tokens.json()

    async def lets_in(self, access_token: str) -> bool:
        """Whether the MCP endpoint takes the token (a request past the gate may still be a bad request)."""
        answer = await self.http.post(self.url, headers={"Authorization": f"Bearer {access_token}"}, json={})
        return answer.status_code != 401


@asynccontextmanager
async def hosted_hail() -> AsyncIterator[Hail]:
    clock = ManualClock()
    auth = AuthorizationServer(clock=clock, access_token_seconds=3600)
    async with anyio.create_task_group() as tg, httpx2.AsyncClient() as http:
        url = await tg.start(partial(serve_http, Sandbox(), "127.0.0.1", 0, None, oauth=auth))
        yield Hail(url, auth, clock, http)
        tg.cancel_scope.cancel()


async def test_without_a_valid_token_mcp_answers_401_naming_the_resource_metadata() -> None:
    async with hosted_hail() as hail:
        refused = await hail.http.post(hail.url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize"})
        forged = await hail.lets_in("sbx_at_forged")
        resource = (await hail.http.get(f"{hail.url}.well-known/oauth-protected-resource")).json()
        server = (await hail.http.get(f"{hail.url}.well-known/oauth-authorization-server")).json()
    metadata = f"{hail.url}.well-known/oauth-protected-resource"
    assert refused.status_code == 401
    assert not forged
    assert refused.headers["WWW-Authenticate"] == f'Bearer error="invalid_token", resource_metadata="{metadata}"'
    assert (resource["resource"], resource["authorization_servers"]) == (hail.url, [hail.url])
    assert (server["issuer"], server["registration_endpoint"]) == (hail.url, f"{hail.url}register")
    assert server["code_challenge_methods_supported"] == ["S256"]


async def test_registration_takes_only_loopback_redirects() -> None:
    async with hosted_hail() as hail:
        remote = await hail.http.post(f"{hail.url}register", json={"redirect_uris": ["https://evil.test/cb"]})
        garbage = await hail.http.post(f"{hail.url}register", content=b"[1]")
    assert (remote.status_code, remote.json()["error"]) == (400, "invalid_redirect_uri")
    assert (garbage.status_code, garbage.json()["error"]) == (400, "invalid_client_metadata")


async def test_authorize_redirects_with_the_state_and_refuses_without_s256() -> None:
    async with hosted_hail() as hail:
        client_id = await hail.client("http://127.0.0.1:9/callback")  # any loopback port later (RFC 8252)
        approved = await hail.authorize(client_id)
        plain = await hail.authorize(client_id, code_challenge_method="plain")
        hail.auth.approving = False
        denied = await hail.authorize(client_id)
        unknown = await hail.http.get(f"{hail.url}authorize", params={"client_id": "nobody", "redirect_uri": REDIRECT})
    assert (approved["state"], approved["iss"]) == ("the-state", hail.url)
    assert approved["code"].startswith("sbx_code_")
    assert plain["error"] == "invalid_request"
    assert denied["error"] == "access_denied"
    assert unknown.status_code == 400  # never redirected to an address nobody registered


async def test_a_code_needs_its_pkce_verifier_and_is_taken_once() -> None:
    async with hosted_hail() as hail:
        client_id = await hail.client()
        form = {"grant_type": "authorization_code", "client_id": client_id, "redirect_uri": REDIRECT}
        wrong = await hail.token(**form, code=(await hail.authorize(client_id))["code"], code_verifier="w" * 64)
        code = (await hail.authorize(client_id))["code"]
        right = await hail.token(**form, code=code, code_verifier=VERIFIER)
        again = await hail.token(**form, code=code, code_verifier=VERIFIER)
        works = await hail.lets_in(right.json()["access_token"])
    assert (wrong.status_code, wrong.json()["error"]) == (400, "invalid_grant")
    assert right.status_code == 200
    assert right.headers["cache-control"] == "no-store"
    assert {name: right.json()[name] for name in ("token_type", "expires_in")} == {
        "token_type": "Bearer",
        "expires_in": 3600,
    }
    assert (again.status_code, again.json()["error"]) == (400, "invalid_grant")
    assert works


async def test_refresh_tokens_rotate_and_a_spent_one_revokes_the_grant() -> None:
    async with hosted_hail() as hail:
        client_id, first = await hail.signed_in()
        hail.clock.advance(3600)
        expired = await hail.lets_in(first["access_token"])
        renew = {"grant_type": "refresh_token", "client_id": client_id, "resource": hail.url}
        second = (await hail.token(**renew, refresh_token=first["refresh_token"])).json()
        renewed = await hail.lets_in(second["access_token"])
        reused = await hail.token(**renew, refresh_token=first["refresh_token"])
        after_reuse = await hail.lets_in(second["access_token"])
    assert (expired, renewed, after_reuse) == (False, True, False)
    assert second["refresh_token"] != first["refresh_token"]
    assert (reused.status_code, reused.json()["error"]) == (400, "invalid_grant")
    assert (hail.auth.refreshes, hail.auth.reuses) == (1, 1)


async def test_revocation_and_the_switch_end_a_grant() -> None:
    async with hosted_hail() as hail:
        _, revoked = await hail.signed_in()
        answer = await hail.http.post(f"{hail.url}revoke", data={"token": revoked["refresh_token"]})
        after_revoke = await hail.lets_in(revoked["access_token"])
        client_id, switched = await hail.signed_in()
        hail.auth.revoke_all()
        after_switch = await hail.lets_in(switched["access_token"])
        renew = await hail.token(
            grant_type="refresh_token", client_id=client_id, refresh_token=switched["refresh_token"]
        )
    assert (answer.status_code, after_revoke, after_switch) == (200, False, False)
    assert (renew.status_code, renew.json()["error"]) == (400, "invalid_grant")
