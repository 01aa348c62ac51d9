"""Hail's webhooks over real HTTP: signed events become delivery; forged, stale and replayed ones change nothing."""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx2
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from hail_guard import delivery, webhooks
from hail_guard.batch import PlannedSend
from hail_guard.config import HttpSettings, WebhookSettings
from hail_guard.errors import WebhookRefused
from hail_guard.listener import listening, serve_app
from hail_guard.metrics import Metrics
from hail_guard.models import DeliveryState, State, WebhookOutcome
from hail_guard.web import build_http_app
from tests.conftest import Harness, data, email, open_harness
from tests.end_to_end.test_web import sample
from tests.ledger.test_storage_faults import ReadOnlyLedger

SECRET = "whsec-test-0123456789abcdef"
SECRET_ENV = "HAIL_GUARD_TEST_WEBHOOK_SECRET"
TOKEN_ENV = "HAIL_GUARD_TEST_WEBHOOK_AGENT_TOKEN"
NUMBER = "+14155550100"


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@dataclass
class Receiver:
    url: str
    harness: Harness
    metrics: Metrics
    http: httpx2.AsyncClient

    async def post(
        self,
        event_type: str,
        body_data: dict[str, Any],
        *,
        delivery_id: str,
        secret: str = SECRET,
        at: float | None = None,
        signature: str | None = None,
        body: bytes | None = None,
    ) -> httpx2.Response:
        """A webhook as Hail sends it: signed now (or `at`), with its delivery id; no bearer token."""
        body = body if body is not None else json.dumps({"type": event_type, "data": body_data}).encode()
        signature = signature or hail_signature(secret, body, int(at if at is not None else time.time()))
        headers = {"X-Hail-Signature": signature, "X-Hail-Delivery": delivery_id, "Content-Type": "application/json"}
        return await self.http.post(f"{self.url}webhooks/hail", content=body, headers=headers)

    async def operation(self, operation_id: str) -> dict[str, Any]:
        return data(await self.harness.call("get_operation", {"operation_id": operation_id}))


def hail_signature(secret: str, body: bytes, timestamp: int) -> str:
    """`X-Hail-Signature` as Hail makes it, written here from its definition (never with `webhooks.sign`):
    `t=<unix seconds>,v1=<hex of HMAC-SHA256(secret, "<t>.<raw body>")>`."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


VECTOR_BODY = b'{"type":"email.delivered","data":{"id":"em_01J9ZQ"}}'
VECTOR_TIME = 1_767_225_600
VECTOR = "t=1767225600,v1=6653145b43cfbd5d30d1bd780af2c59a4a5699759b6ce6d48d98e81713205a5b"
"""The header for SECRET, VECTOR_BODY and VECTOR_TIME, computed outside hail-guard and Python:
`printf '%s' '1767225600.<body>' | openssl dgst -sha256 -hmac 'whsec-test-0123456789abcdef'`."""


@asynccontextmanager
async def receiving(
    tmp_path: Path, *faults: str, ledger_url: str | None = None, **http: Any
) -> AsyncIterator[Receiver]:
    """hail-guard's HTTP app on a real uvicorn (a free port), over the in-process sandbox (with `faults`)."""
    settings = HttpSettings(token=SecretStr("agent-token"), token_env=TOKEN_ENV, shutdown_grace_seconds=0, **http)
    async with (
        open_harness(tmp_path, *faults, ledger_url=ledger_url) as harness,
        httpx2.AsyncClient() as client,
        anyio.create_task_group() as tg,
    ):
        metrics = Metrics()
        app = build_http_app(
            harness.proxy,
            settings,
            ledger=harness.ledger,
            metrics=metrics,
            hooks=WebhookSettings(secret_env=SECRET_ENV),
        )
        scope = anyio.CancelScope()

        async def serve(*, task_status: anyio.abc.TaskStatus[str]) -> None:
            with scope, listening("127.0.0.1", 0) as sock:
                await serve_app(app, sock, settings=settings, task_status=task_status)

        url = await tg.start(serve)
        yield Receiver(url, harness, metrics, client)
        scope.cancel()


async def accepted(receiver: Receiver, tool: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """Send through hail-guard; (operation id, Hail's id)."""
    view = data(await receiver.harness.call(tool, arguments))["hail_guard"]
    assert view["state"] == "accepted"
    operation = await receiver.harness.ledger.get(view["operation_id"])
    assert operation.provider_id is not None
    return operation.id, operation.provider_id


async def test_a_bounce_arrives_as_delivery_bounced_while_the_state_stays_accepted(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        operation_id, provider_id = await accepted(receiver, "send_email", email(to=["bounce@example.com"]))
        bounced = {"id": provider_id, "occurred_at": "2030-01-01T09:00:05Z", "reason": "mailbox unknown"}
        response = await receiver.post("email.bounced", bounced, delivery_id="dlv-1")
        assert (response.status_code, response.json()["status"]) == (200, "applied")
        shown = await receiver.operation(operation_id)
    assert (shown["state"], shown["delivery_state"]) == ("accepted", "bounced")
    [event] = shown["delivery_events"]
    assert (event["state"], event["source"], event["detail"]) == ("bounced", "webhook", "dlv-1")
    assert delivery.parse_time(event["occurred_at"]) == delivery.parse_time("2030-01-01T09:00:05Z")
    assert [entry["to_state"] for entry in shown["history"]] == ["sending", "accepted"]


async def test_duplicate_and_out_of_order_webhooks_leave_the_right_final_delivery_state(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        mail, mail_id = await accepted(receiver, "send_email", email())
        sms, sms_id = await accepted(receiver, "send_sms", {"to": NUMBER, "body": "Hi", "recipient_consent": True})
        sent = [
            ("email.delivered", mail_id, "d-2"),
            ("email.opened", mail_id, "d-3"),
            ("email.delivery_delayed", mail_id, "d-1"),  # late
            ("email.delivered", mail_id, "d-2"),  # Hail's retry: the same delivery id, signed anew
            ("sms.undelivered", sms_id, "d-5"),
            ("sms.delivered", sms_id, "d-4"),  # late, and contradicted: a final state stays
            ("sms.undelivered", sms_id, "d-5"),
        ]
        outcomes = []
        for n, (event, provider_id, delivery_id) in enumerate(sent):
            response = await receiver.post(event, {"id": provider_id}, delivery_id=delivery_id, at=time.time() + n)
            assert response.status_code == 200
            outcomes.append(response.json()["status"])
        mail_view, sms_view = await receiver.operation(mail), await receiver.operation(sms)
    assert outcomes == ["applied", "applied", "applied", "duplicate", "applied", "applied", "duplicate"]
    assert (mail_view["state"], mail_view["delivery_state"]) == ("accepted", "opened")
    assert [e["state"] for e in mail_view["delivery_events"]] == ["delivered", "opened", "delivery_delayed"]
    assert (sms_view["state"], sms_view["delivery_state"]) == ("accepted", "undelivered")
    assert [e["state"] for e in sms_view["delivery_events"]] == ["undelivered", "delivered"]


async def test_stop_by_sms_cancels_pending_sends_to_that_number(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        texts = [
            PlannedSend("send_sms", {"to": to, "body": body, "recipient_consent": True}, f"send {n}")
            for n, (to, body) in enumerate([(NUMBER, "one"), (NUMBER, "two"), ("+14155550111", "three")], start=1)
        ]
        batch_id = await receiver.harness.proxy.batches.plan(texts, name="spring")
        reply = {"id": "in-1", "from": NUMBER, "to": "+15005550006", "body": " Stop "}
        response = await receiver.post("sms.received", reply, delivery_id="in-dlv-1")
        assert (response.status_code, response.json()["status"]) == (200, "opted_out")
        counts = (await receiver.harness.ledger.batch_status(batch_id)).counts
        later = await receiver.harness.call("send_sms", {"to": NUMBER, "body": "three", "recipient_consent": True})
        [opt_out] = await receiver.harness.ledger.list_suppressions()
    assert counts == {State.CANCELLED: 2, State.READY: 1}
    assert later.is_error
    assert "opted out" in data(later)["error"]
    assert (opt_out.recipient, opt_out.channel, opt_out.reason) == (NUMBER, "sms", 'replied "STOP" by SMS')
    assert "in-dlv-1" in opt_out.source
    assert receiver.harness.sandbox.outbox == []


@pytest.mark.parametrize("sender", ["Bob's phone", "4155550100", "+1 415"])
async def test_a_stop_from_a_sender_that_cannot_be_read_is_refused_loudly_and_kept_for_review(
    tmp_path: Path, sender: str
) -> None:
    reply = {"id": "in-9", "from": sender, "body": "STOP"}
    async with receiving(tmp_path) as receiver:
        with capture_logs() as logs:
            response = await receiver.post("sms.received", reply, delivery_id="in-dlv-9")
        suppressions = await receiver.harness.ledger.list_suppressions()
        body = json.dumps({"type": "sms.received", "data": reply}).encode()
        with pytest.raises(webhooks.UnreadableOptOut) as refused:
            webhooks.parse(body, delivery_id="in-dlv-9", signature="x")
        kept = await receiver.harness.ledger.record_webhook(refused.value.webhook)
    assert (response.status_code, response.json()["status"]) == (422, "refused")
    assert "whose sender cannot be read, so nobody was suppressed" in response.json()["message"]
    assert "hail-guard suppress add NUMBER --channel sms" in response.json()["message"]
    assert suppressions == []
    assert kept is WebhookOutcome.DUPLICATE  # it was recorded, for review
    [logged] = [entry for entry in logs if entry["event"] == "webhook_opt_out_unreadable"]
    assert (logged["log_level"], logged["delivery_id"]) == ("error", "in-dlv-9")


async def test_other_inbound_sms_and_unknown_event_types_are_recorded_and_ignored(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        chat = {"id": "in-2", "from": NUMBER, "body": "stop by tomorrow?"}
        assert (await receiver.post("sms.received", chat, delivery_id="in-2")).json()["status"] == "ignored"
        assert (await receiver.post("email.clicked", {"id": "x"}, delivery_id="c-1")).json()["status"] == "ignored"
        assert await receiver.harness.ledger.list_suppressions() == []


async def test_a_webhook_for_an_id_no_operation_has_is_kept_and_changes_no_other_operation(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        operation_id, _ = await accepted(receiver, "send_email", email())
        first = await receiver.post("email.bounced", {"id": "not-ours"}, delivery_id="u-1")
        again = await receiver.post("email.bounced", {"id": "not-ours"}, delivery_id="u-1", at=time.time() + 1)
        shown = await receiver.operation(operation_id)
    assert (first.status_code, first.json()["status"]) == (200, "parked")
    assert (again.status_code, again.json()["status"]) == (200, "duplicate")  # it was recorded
    assert (shown["delivery_state"], shown["delivery_events"]) == (None, [])


async def test_a_webhook_that_comes_before_reconcile_records_its_message_id_is_applied_by_the_reconcile(
    tmp_path: Path, ledger_url: str
) -> None:
    async with receiving(tmp_path, "send_email:1:drop_after_accept", ledger_url=ledger_url) as receiver:
        view = data(await receiver.harness.call("send_email", email()))["hail_guard"]
        assert view["state"] == "unknown"  # Hail accepted it; the answer, with its id, was lost
        hail_id = receiver.harness.sandbox.outbox[-1]["id"]
        bounced = {"id": hail_id, "occurred_at": "2030-01-01T09:00:05Z"}
        early = await receiver.post("email.bounced", bounced, delivery_id="early-1")
        retried = await receiver.post("email.bounced", bounced, delivery_id="early-1", at=time.time() + 1)
        assert (await receiver.operation(view["operation_id"]))["delivery_state"] is None
        settled = data(await receiver.harness.call("reconcile", {"operation_id": view["operation_id"]}))
        shown = await receiver.operation(view["operation_id"])
    assert (early.status_code, early.json()["status"]) == (200, "parked")
    assert (retried.status_code, retried.json()["status"]) == (200, "duplicate")
    assert settled["reconciled"][0]["state"] == "accepted"
    assert (shown["state"], shown["provider_id"], shown["delivery_state"]) == ("accepted", hail_id, "bounced")
    [event] = shown["delivery_events"]
    assert (event["state"], event["source"], event["detail"]) == ("bounced", "webhook", "early-1")
    assert delivery.parse_time(event["occurred_at"]) == delivery.parse_time("2030-01-01T09:00:05Z")


async def test_forged_stale_and_replayed_webhooks_get_401_and_change_nothing(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        operation_id, provider_id = await accepted(receiver, "send_email", email())
        bounce = {"id": provider_id}
        good = json.dumps({"type": "email.delivered", "data": {"id": provider_id}}).encode()
        signature = webhooks.sign(SECRET, good, int(time.time()))
        assert (await receiver.post("", {}, delivery_id="g-1", body=good, signature=signature)).status_code == 200
        refused = [
            await receiver.post("email.bounced", bounce, delivery_id="f-1", secret="guessed-secret"),
            await receiver.post("email.bounced", bounce, delivery_id="f-2", signature=signature),  # another body
            await receiver.post("email.bounced", bounce, delivery_id="s-1", at=time.time() - 301),
            await receiver.post("email.bounced", bounce, delivery_id="s-2", at=time.time() + 301),
            await receiver.post("email.bounced", bounce, delivery_id="m-1", signature="v1=abc"),
            await receiver.post("", {}, delivery_id="g-1", body=good, signature=signature),  # replayed as is
            await receiver.post("", {}, delivery_id="g-2", body=good, signature=signature),  # replayed, new id
        ]
        shown = await receiver.operation(operation_id)
        page = (await receiver.http.get(f"{receiver.url}metrics")).text
    assert [response.status_code for response in refused] == [401] * 7
    assert refused[-1].json()["status"] == "replayed"
    assert (shown["delivery_state"], [e["state"] for e in shown["delivery_events"]]) == ("delivered", ["delivered"])
    assert sample(page, "hail_guard_webhooks_total", outcome="refused") == 5
    assert sample(page, "hail_guard_webhooks_total", outcome="replayed") == 2
    assert sample(page, "hail_guard_webhooks_total", outcome="applied") == 1


async def test_unreadable_oversized_and_unconfigured_webhooks_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with receiving(tmp_path, max_body_bytes=512) as receiver:
        not_json = await receiver.post("", {}, delivery_id="b-1", body=b"not json")
        no_type = await receiver.post("", {}, delivery_id="b-2", body=b'{"data": {}}')
        no_id = await receiver.post("email.delivered", {"id": "x"}, delivery_id="")
        too_big = await receiver.post("email.delivered", {"id": "x", "pad": "x" * 600}, delivery_id="b-3")
        monkeypatch.delenv(SECRET_ENV)
        unconfigured = await receiver.post("email.delivered", {"id": "x"}, delivery_id="b-4")
    statuses = [r.status_code for r in (not_json, no_type, no_id, too_big, unconfigured)]
    assert statuses == [400, 400, 400, 413, 503]
    assert SECRET_ENV in unconfigured.json()["message"]


@pytest.mark.parametrize(
    "header",
    ["", "t=1", "v1=abc", "t=abc,v1=abc", "t=1,t=2,v1=abc"],
)
def test_a_malformed_signature_header_is_refused(header: str) -> None:
    with pytest.raises(WebhookRefused) as refused:
        webhooks.verify(SECRET, b"{}", header, now=1.0, tolerance_seconds=300)
    assert refused.value.status == 401


def test_any_of_several_signatures_may_match_while_a_secret_is_rotated() -> None:
    body = b'{"type": "email.delivered", "data": {"id": "e-1"}}'
    new = webhooks.sign(SECRET, body, 1_000).split("v1=")[1]
    assert webhooks.verify(SECRET, body, f"t=1000,v1=deadbeef,v1={new}", now=1_100.0, tolerance_seconds=300) == new
    hook = webhooks.parse(body, delivery_id="d", signature=new)
    assert hook.observation is not None
    assert (hook.provider_id, hook.observation.state) == ("e-1", DeliveryState.DELIVERED)


def test_the_documented_signature_vector_is_what_hail_guard_signs_and_accepts() -> None:
    assert hail_signature(SECRET, VECTOR_BODY, VECTOR_TIME) == VECTOR  # the test's signer agrees with openssl
    assert webhooks.sign(SECRET, VECTOR_BODY, VECTOR_TIME) == VECTOR
    digest = VECTOR.split("v1=")[1]
    accepted = webhooks.verify(SECRET, VECTOR_BODY, VECTOR, now=VECTOR_TIME + 299.0, tolerance_seconds=300)
    assert accepted == digest
    for forged in (
        VECTOR_BODY.replace(b"em_01J9ZQ", b"em_01J9ZR"),  # one byte of the body
        VECTOR_BODY + b" ",  # the raw body is signed, not its JSON meaning
    ):
        with pytest.raises(WebhookRefused, match="signature"):
            webhooks.verify(SECRET, forged, VECTOR, now=VECTOR_TIME, tolerance_seconds=300)
    later = VECTOR.replace("1767225600", "1767225601")  # the time is signed too
    with pytest.raises(WebhookRefused, match="signature"):
        webhooks.verify(SECRET, VECTOR_BODY, later, now=VECTOR_TIME, tolerance_seconds=300)
    with pytest.raises(WebhookRefused, match="signature"):
        webhooks.verify(SECRET + "x", VECTOR_BODY, VECTOR, now=VECTOR_TIME, tolerance_seconds=300)


async def test_the_body_a_webhook_arrived_with_is_recorded_byte_for_byte(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        _, provider_id = await accepted(receiver, "send_email", email())
        said = '{ "data" : {"id": "%s", "note": "caf\\u00e9 \u2014 ok"},\n  "type": "email.delivered" }'
        body = (said % provider_id).encode()  # escapes, a raw em dash, spacing and key order kept as sent
        response = await receiver.post("", {}, delivery_id="raw-1", body=body)
        assert (response.status_code, response.json()["status"]) == (200, "applied")
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        [(stored,)] = db.execute("SELECT payload FROM webhook_deliveries WHERE delivery_id = 'raw-1'").fetchall()
    assert stored == body.decode("utf-8")


async def test_a_webhook_the_ledger_cannot_record_gets_503_and_hails_retry_is_applied(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        operation_id, provider_id = await accepted(receiver, "send_email", email())
        storage = ReadOnlyLedger(tmp_path)
        storage.inflict()
        try:
            refused = await receiver.post("email.delivered", {"id": provider_id}, delivery_id="ro-1")
        finally:
            storage.mend()
        retried = await receiver.post("email.delivered", {"id": provider_id}, delivery_id="ro-1", at=time.time() + 1)
        shown = await receiver.operation(operation_id)
    assert (refused.status_code, refused.json()["status"]) == (503, "unrecorded")
    assert "retry later" in refused.json()["message"]
    assert (retried.status_code, retried.json()["status"]) == (200, "applied")  # nothing was recorded the first time
    assert [event["detail"] for event in shown["delivery_events"]] == ["ro-1"]


async def test_an_sms_stop_suppresses_sms_only_leaving_email_and_calls_to_the_sender(tmp_path: Path) -> None:
    async with receiving(tmp_path) as receiver:
        reply = {"id": "in-3", "from": NUMBER, "body": "STOP"}
        assert (await receiver.post("sms.received", reply, delivery_id="in-3")).json()["status"] == "opted_out"
        call = {"to": NUMBER, "first_message": "Hi, it is Ada", "agent_id": "a1", "recipient_consent": True}
        called = await receiver.harness.call("place_call", call)
        mailed = await receiver.harness.call("send_email", email(to=["lead@example.com"]))
        texted = await receiver.harness.call("send_sms", {"to": NUMBER, "body": "Hi", "recipient_consent": True})
        [opt_out] = await receiver.harness.ledger.list_suppressions()
    assert (opt_out.recipient, opt_out.channel) == (NUMBER, "sms")
    assert data(called)["hail_guard"]["state"] == "accepted"
    assert data(mailed)["hail_guard"]["state"] == "accepted"
    assert texted.is_error
    assert f"{NUMBER} opted out of sms" in data(texted)["error"]
    assert [line["tool"] for line in receiver.harness.sandbox.outbox] == ["place_call", "send_email"]
