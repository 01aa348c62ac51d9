"""A fake of Resend's public REST API (https://resend.com/docs/api-reference), for the real `resend-mcp` to call.

The endpoints resend-mcp 2.22.0's send and read tools call (read in its `node_modules`): `POST /emails`,
`POST /emails/batch`, `GET /emails/{id}`, `GET /emails`, `POST /broadcasts/{id}/send`, `GET /broadcasts/{id}`,
`POST /events/send`. Idempotency as Resend documents it: the same `Idempotency-Key` with the same body answers
the first answer again (for 24 hours), with another body a 409 `invalid_idempotent_request`. Scripted faults,
by the number of the request to a path (1 is the first):

    hang_after_accept   the email is accepted (and the key saved), then no answer comes until the fake closes
    error_after_accept  accepted (key saved), then a 502 from "a gateway": the caller cannot know it was sent
    rate_limit          a 429 before anything is accepted (nothing saved: the same key is safe later)

`outbox` holds every email accepted, once, however often it was asked for; `delivered()` counts them per
recipient (to, cc and bcc alike). It is served by `tests.resend_api.serving` at an `http://127.0.0.1:PORT` URL:
resend-mcp reads it from `RESEND_BASE_URL`.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hail_guard.sandbox.http import serve_app

Fault = Literal["hang_after_accept", "error_after_accept", "rate_limit"]


@dataclass
class ResendApi:
    faults: dict[tuple[str, int], Fault] = field(default_factory=dict)
    """By (path kind, request number): `emails`, `batch`, `broadcast`, `event`."""
    outbox: list[dict[str, Any]] = field(default_factory=list)
    broadcasts_sent: list[str] = field(default_factory=list)
    events_sent: list[dict[str, Any]] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    keys: dict[str, tuple[str, int, Any]] = field(default_factory=dict)
    arrived: anyio.Event = field(default_factory=anyio.Event)
    """Set (and replaced) whenever a request arrives."""
    released: anyio.Event = field(default_factory=anyio.Event)

    def fault(self, kind: str, nth: int, fault: Fault) -> None:
        self.faults[(kind, nth)] = fault

    def delivered(self) -> Counter[str]:
        """Accepted emails per recipient, to, cc and bcc alike (addresses compared case-folded)."""
        count: Counter[str] = Counter()
        for email in self.outbox:
            for part in ("to", "cc", "bcc"):
                value = email.get(part) or []
                for recipient in value if isinstance(value, list) else [value]:
                    count[str(recipient).strip().casefold()] += 1
        return count

    async def wait_for(self, kind: str, count: int) -> None:
        """Return once `count` requests of `kind` arrived (bound it with `anyio.fail_after`)."""
        while self.requests[kind] < count:
            await self.arrived.wait()

    # The HTTP side.

    def http_app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/emails", self._send_email, methods=["POST"]),
                Route("/emails", self._list_emails, methods=["GET"]),
                Route("/emails/batch", self._send_batch, methods=["POST"]),
                Route("/emails/{id}", self._get_email, methods=["GET"]),
                Route("/broadcasts/{id}/send", self._send_broadcast, methods=["POST"]),
                Route("/broadcasts/{id}", self._get_broadcast, methods=["GET"]),
                Route("/events/send", self._send_event, methods=["POST"]),
            ]
        )

    async def _send_email(self, request: Request) -> Response:
        return await self._send(request, "emails", lambda body: {"id": self._accept(body)})

    async def _send_batch(self, request: Request) -> Response:
        return await self._send(request, "batch", lambda body: {"data": [{"id": self._accept(e)} for e in body]})

    async def _send_broadcast(self, request: Request) -> Response:
        broadcast = request.path_params["id"]

        def sent(body: Any) -> dict[str, Any]:
            self.broadcasts_sent.append(broadcast)
            return {"id": broadcast}

        return await self._send(request, "broadcast", sent)

    async def _send_event(self, request: Request) -> Response:
        def sent(body: Any) -> dict[str, Any]:
            self.events_sent.append(body)
            return {"object": "event", "id": str(uuid.uuid4())}

        return await self._send(request, "event", sent)

    async def _send(self, request: Request, kind: str, accept: Any) -> Response:
        refused = _unauthorised(request)
        if refused is not None:
            return refused
        self.requests[kind] += 1
        nth = self.requests[kind]
        self.arrived.set()
        self.arrived = anyio.Event()
        raw = await request.body()
        body = json.loads(raw or b"null")
        fault = self.faults.get((kind, nth))
        if fault == "rate_limit":
            return _error(429, "rate_limit_exceeded", "Too many requests. You can only make 2 requests per second.")
        key = request.headers.get("idempotency-key")
        canonical = json.dumps(body, sort_keys=True)
        if key is not None and key in self.keys:
            saved_body, status, saved = self.keys[key]
            if saved_body != canonical:
                return _error(409, "invalid_idempotent_request", "Same idempotency key used with a different payload.")
            return JSONResponse(saved, status_code=status)
        answer = accept(body)
        if key is not None:
            self.keys[key] = (canonical, 200, answer)
        if fault == "hang_after_accept":
            await self.released.wait()
            return _error(504, "application_error", "The fake was closed.")
        if fault == "error_after_accept":
            return Response("<html><body>502 Bad Gateway</body></html>", status_code=502, media_type="text/html")
        return JSONResponse(answer)

    def _accept(self, body: dict[str, Any]) -> str:
        email = {
            "object": "email",
            "id": str(uuid.uuid4()),
            "created_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f+00"),
            "last_event": "delivered",
            **{name: body.get(name) for name in ("from", "to", "cc", "bcc", "subject", "text", "html")},
            "reply_to": body.get("reply_to") or body.get("replyTo"),
            "scheduled_at": None,
        }
        email["message_id"] = f"<{email['id']}@resend.test>"
        self.outbox.append(email)
        return str(email["id"])

    async def _get_email(self, request: Request) -> Response:
        wanted = request.path_params["id"]
        found = next((email for email in self.outbox if email["id"] == wanted), None)
        if found is None:
            return _error(404, "not_found", "Email not found")
        return JSONResponse(found)

    async def _list_emails(self, request: Request) -> Response:
        limit = int(request.query_params.get("limit") or 20)
        newest = list(reversed(self.outbox))[:limit]
        listed = [{k: v for k, v in email.items() if k not in ("text", "html")} for email in newest]
        return JSONResponse({"object": "list", "has_more": len(self.outbox) > limit, "data": listed})

    async def _get_broadcast(self, request: Request) -> Response:
        wanted = request.path_params["id"]
        if wanted not in self.broadcasts_sent:
            return _error(404, "not_found", "Broadcast not found")
        now = datetime.now(UTC).isoformat()
        fields = dict.fromkeys(("audience_id", "from", "subject", "reply_to", "preview_text", "scheduled_at", "html"))
        return JSONResponse(
            {
                "object": "broadcast",
                "id": wanted,
                "name": "news",
                **fields,
                "status": "sent",
                "created_at": now,
                "sent_at": now,
                "text": "hello",
            }
        )


def _unauthorised(request: Request) -> Response | None:
    if not request.headers.get("authorization", "").startswith("Bearer re_"):
        return _error(401, "missing_api_key", "Missing API key in the authorization header.")
    return None


def _error(status: int, name: str, message: str) -> JSONResponse:
    return JSONResponse({"statusCode": status, "name": name, "message": message}, status_code=status)


@asynccontextmanager
async def serving(api: ResendApi) -> AsyncIterator[str]:
    """Serve `api` on a free loopback port while the block runs; yields its base URL (no trailing slash)."""
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_app, api.http_app(), "127.0.0.1", 0)
        try:
            yield str(url).rstrip("/")
        finally:
            api.released.set()
            tg.cancel_scope.cancel()
