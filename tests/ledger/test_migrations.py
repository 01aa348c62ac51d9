"""Upgrading a ledger written by an older hail-guard.

SQLite 5 -> 6 and PostgreSQL 7 -> 8: the rows an older version wrote (recipients as given, `to`
alone, opt-outs trimmed and lower-cased, content fingerprints over the whole request) are recomputed
from their stored requests, so the new rules hold for them too: an opt-out in an old spelling stops
the sends it names, a retry of an old send is recognised by meaning, and every recipient field of an
old send is checked. SQLite 6 -> 7 and PostgreSQL 8 -> 9: the sends an old ledger holds are counted
per hour, and the counts follow them on. SQLite 7 -> 8 and PostgreSQL 9 -> 10: webhooks that come before
their message's id, the console's sign-ins and the heartbeats of senders are kept.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hail_guard import keys, same_send
from hail_guard.errors import Suppressed
from hail_guard.ledger import Heartbeat, Ledger, open_ledger
from hail_guard.ledger import postgres as postgres_ledger
from hail_guard.ledger import sqlite as sqlite_ledger
from hail_guard.models import DeliveryObservation, DeliveryState, Intent, Outcome, State, Webhook, WebhookOutcome
from hail_guard.profiles import hail
from hail_guard.same_send import Rules
from tests.postgres import PostgresServer

CC_SEND = {
    "to": ["Ada@Example.com "],
    "cc": ["Élodie <ÉLODIE@example.com>"],
    "subject": "Hello",
    "body_text": "Hi  there",
    "recipient_consent": True,
    "idempotency_key": "old:ada:email:intro",
}
"""Written by the old version with recipients ["Ada@Example.com "] (`to` alone)."""
SMS_SEND = {"to": "+14155550190", "body": "Hi", "recipient_consent": True, "idempotency_key": "old:sms"}
OLD_OPT_OUTS = [("+1 (415) 555-0190", "sms"), (" élodie@example.com", "email"), ("ada@example.com", "all")]
"""As the old version stored them (its normal form was trimmed and lower-cased, so these ones it wrote
as typed by hand into the database, or as a webhook gave them)."""


def _legacy_rows() -> list[dict[str, Any]]:
    rows = []
    for tool, channel, request, recipients, state in (
        ("send_email", "email", CC_SEND, ["Ada@Example.com "], "accepted"),
        ("send_sms", "sms", SMS_SEND, ["+14155550190"], "ready"),
    ):
        text = keys.canonical_json(request)
        rows.append(
            {
                "id": str(uuid.uuid4()),
                "idempotency_key": request["idempotency_key"],
                "tool": tool,
                "channel": channel,
                "recipients": json.dumps(recipients),
                "request": text,
                "request_fingerprint": keys.fingerprint(text),
                "content_fingerprint": keys.fingerprint("the old whole-request form"),
                "state": state,
            }
        )
    return rows


def _at_version(path: Path, version: int) -> None:
    """A SQLite ledger as hail-guard at schema `version` left it, with the legacy rows."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for number, sql in sqlite_ledger.migrations():
            if number <= version:
                db.executescript(sql)
        db.execute(f"PRAGMA user_version = {version}")
        for row in _legacy_rows():
            db.execute(
                "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, request, request_fingerprint,"
                " content_fingerprint, state, created_at, updated_at) VALUES (:id, :idempotency_key, :tool, :channel,"
                " :recipients, :request, :request_fingerprint, :content_fingerprint, :state,"
                " unixepoch('now'), unixepoch('now'))",
                row,
            )
        db.executemany(
            "INSERT INTO suppressions (recipient, channel, reason, source, created_at) "
            "VALUES (?, ?, 'STOP', 'old', unixepoch('now'))",
            OLD_OPT_OUTS,
        )
    finally:
        db.close()


async def _postgres_at_version(url: str, version: int, *, legacy: bool = True) -> None:
    """A PostgreSQL ledger as hail-guard at schema `version` left it, with the legacy rows (`legacy`)."""
    import asyncpg

    db = await asyncpg.connect(url)
    try:
        await db.execute(postgres_ledger.CREATE_SCHEMA_TABLE)
        for number, sql in postgres_ledger.migrations():
            if number <= version:
                await db.execute(sql)
                await db.execute("INSERT INTO hail_guard_schema_version (version) VALUES ($1)", number)
        if not legacy:
            return
        for row in _legacy_rows():
            await db.execute(
                "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,"
                " request_fingerprint, content_fingerprint, state, created_at, updated_at) VALUES ($1, $2, $3, $4,"
                " $5::jsonb, ARRAY(SELECT lower(btrim(r)) FROM jsonb_array_elements_text($5::jsonb) r), $6, $7, $8,"
                " $9, now(), now())",
                *(row[name] for name in ("id", "idempotency_key", "tool", "channel", "recipients", "request")),
                row["request_fingerprint"],
                row["content_fingerprint"],
                row["state"],
            )
        await db.executemany(
            "INSERT INTO suppressions (recipient, channel, reason, source, created_at) VALUES ($1, $2, 'STOP', 'old', "
            "now())",
            OLD_OPT_OUTS,
        )
    finally:
        await db.close()


async def _upgraded_rows_follow_the_new_rules(ledger: Ledger) -> None:
    email = await ledger.find_by_key("old:ada:email:intro")
    assert email is not None
    assert email.recipients == ["ada@example.com", "élodie@example.com"]
    assert email.content_fingerprint == same_send.content_fingerprint(hail().spec("send_email"), CC_SEND)
    assert email.sender == {}
    opt_outs = {(s.recipient, s.channel) for s in await ledger.list_suppressions()}
    assert opt_outs == {("+14155550190", "sms"), ("élodie@example.com", "email"), ("ada@example.com", "all")}
    assert await ledger.claim_ready(owner="w", lease_seconds=60) == []  # the old SMS to an opted-out number waits
    assert await ledger.is_suppressed(email.recipients, "email")
    retry = {**CC_SEND, "idempotency_key": "a new key", "body_text": "Hi there", "cc": ["élodie@example.com"]}
    text = keys.canonical_json(retry)
    intent = Intent(
        idempotency_key="a new key",
        tool="send_email",
        channel="email",
        recipients=("ada@example.com", "élodie@example.com"),
        request=text,
        request_fingerprint=keys.fingerprint(text),
        content_fingerprint=same_send.content_fingerprint(hail().spec("send_email"), retry),
    )
    with pytest.raises(Suppressed):  # Élodie (in cc) opted out
        await ledger.begin_send(intent, owner="w", lease_seconds=60, rules=Rules(window_seconds=3600))
    await ledger.remove_suppression("élodie@example.com", "email")
    await ledger.remove_suppression("ada@example.com", "all")
    again = await ledger.begin_send(intent, owner="w", lease_seconds=60, rules=Rules(window_seconds=3600))
    assert (again.claimed, again.operation.id, again.operation.state) == (False, email.id, State.ACCEPTED)


async def test_a_sqlite_ledger_of_schema_5_is_upgraded_by_its_stored_requests(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    _at_version(path, 5)
    async with open_ledger(f"sqlite:///{path}") as ledger:
        await _upgraded_rows_follow_the_new_rules(ledger)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == sqlite_ledger.migrations()[-1][0]


async def test_a_postgresql_ledger_of_schema_7_is_upgraded_by_its_stored_requests(
    postgres_server: PostgresServer,
) -> None:
    async with postgres_server.database(migrated=False) as url:
        await _postgres_at_version(url, 7)
        async with open_ledger(url) as ledger:
            await _upgraded_rows_follow_the_new_rules(ledger)


async def test_begin_send_is_recreated_when_its_text_changes(postgres_server: PostgresServer) -> None:
    import asyncpg

    async with postgres_server.database() as url:
        db = await asyncpg.connect(url)
        try:
            await db.execute("UPDATE hail_guard_functions SET checksum = 'an older text' WHERE name = 'begin_send'")
            await db.execute("DROP FUNCTION hg_begin_send")
            assert await postgres_ledger.migrate(url) == postgres_ledger.migrations()[-1][0]
            checksum = await db.fetchval("SELECT checksum FROM hail_guard_functions WHERE name = 'begin_send'")
            assert checksum == postgres_ledger.function_texts()["begin_send"][0]
            assert await db.fetchval("SELECT count(*) FROM pg_proc WHERE proname = 'hg_begin_send'") == 1
        finally:
            await db.close()


SENT_BEFORE = [  # (key, state, delivery state, hours before the current one it first left; None: never)
    ("old:1", "accepted", "delivered", 3),
    ("old:2", "accepted", None, 3),
    ("old:3", "failed", None, 30),
    ("old:4", "unknown", None, 2),
    ("old:5", "ready", None, None),
]
"""Operations an older hail-guard recorded, before the ledger counted sends per hour."""


def _sent_rows(now: float) -> list[tuple[Any, ...]]:
    """(id, key, request, state, delivery state, first sent at) of `SENT_BEFORE`, as epoch seconds from `now`."""
    hour = now - now % 3600
    rows = []
    for key, state, delivered, back in SENT_BEFORE:
        request = keys.canonical_json({**SMS_SEND, "idempotency_key": key})
        sent_at = hour - back * 3600 + 125.5 if back is not None else None
        rows.append((str(uuid.uuid4()), key, request, state, delivered, sent_at))
    return rows


async def _counts_start_from_the_operations_and_follow_them(ledger: Ledger) -> None:
    hour = (await ledger.now()).replace(minute=0, second=0, microsecond=0)

    async def counted() -> dict[int, tuple[int, dict[State, int], dict[str, int]]]:
        found = await ledger.sends_by_hour(hour - timedelta(hours=48))
        return {
            round((hour - h.start).total_seconds() / 3600): (
                h.sent,
                h.states,
                {d.value: n for d, n in h.deliveries.items()},
            )
            for h in found
        }

    assert await counted() == {
        30: (1, {State.FAILED: 1}, {}),
        3: (2, {State.ACCEPTED: 2}, {"delivered": 1}),
        2: (1, {State.UNKNOWN: 1}, {}),
    }
    later = await ledger.find_by_key("old:2")
    assert later is not None
    await ledger.record_delivery(later.id, [DeliveryObservation(state=DeliveryState.BOUNCED, source="webhook")])
    [unknown] = await ledger.claim_unknown(owner="r", lease_seconds=60)
    accepted = Outcome(state=State.ACCEPTED, reason="found", provider_id="s-1", result={"id": "s-1"})
    await ledger.record_outcome(unknown.id, owner="r", outcome=accepted, actor="r")
    assert await counted() == {
        30: (1, {State.FAILED: 1}, {}),
        3: (2, {State.ACCEPTED: 2}, {"delivered": 1, "bounced": 1}),
        2: (1, {State.ACCEPTED: 1}, {}),
    }


async def test_a_sqlite_ledger_of_schema_6_counts_the_sends_it_holds_per_hour(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for number, sql in sqlite_ledger.migrations():
            if number <= 6:
                db.executescript(sql)
        db.execute("PRAGMA user_version = 6")
        now = db.execute("SELECT (julianday('now') - 2440587.5) * 86400.0").fetchone()[0]
        db.executemany(
            "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, request, request_fingerprint,"
            " content_fingerprint, state, delivery_state, first_sent_at, created_at, updated_at)"
            " VALUES (?1, ?2, 'send_sms', 'sms', '[\"+14155550190\"]', ?3, ?2, ?2, ?4, ?5, ?6, ?7, ?7)",
            [(*row, now) for row in _sent_rows(now)],
        )
    finally:
        db.close()
    async with open_ledger(f"sqlite:///{path}") as ledger:
        await _counts_start_from_the_operations_and_follow_them(ledger)


async def test_a_postgresql_ledger_of_schema_8_counts_the_sends_it_holds_per_hour(
    postgres_server: PostgresServer,
) -> None:
    import asyncpg

    async with postgres_server.database(migrated=False) as url:
        await _postgres_at_version(url, 8, legacy=False)
        db = await asyncpg.connect(url)
        try:
            now = await db.fetchval("SELECT extract(epoch FROM statement_timestamp())::float8")
            await db.executemany(
                "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, request, request_fingerprint,"
                " recipient_keys, content_fingerprint, state, delivery_state, first_sent_at, created_at, updated_at)"
                " VALUES ($1, $2, 'send_sms', 'sms', '[\"+14155550190\"]', $3, $2, ARRAY['+14155550190'], $2, $4, $5,"
                " to_timestamp($6), now(), now())",
                _sent_rows(float(now)),
            )
        finally:
            await db.close()
        async with open_ledger(url) as ledger:
            await _counts_start_from_the_operations_and_follow_them(ledger)


async def _kept_beside_the_operations(ledger: Ledger) -> None:
    """SQLite 7 -> 8, PostgreSQL 9 -> 10: a webhook recorded before the upgrade stays recorded (a retry of it is a
    duplicate); one that comes before its message's id is now kept and applied when the id is recorded; sign-ins
    and heartbeats are kept."""
    retried = Webhook(
        delivery_id="old-1", signature="sig-again", event_type="email.bounced", provider_id="e-old", payload="{}"
    )
    assert await ledger.record_webhook(retried) is WebhookOutcome.DUPLICATE
    observed = DeliveryObservation(state=DeliveryState.DELIVERED, source="webhook", detail="new-1")
    early = Webhook(
        delivery_id="new-1", signature="sig-new", event_type="email.delivered", provider_id="s-9", payload="{}"
    )
    assert await ledger.record_webhook(early.model_copy(update={"observation": observed})) is WebhookOutcome.PARKED
    [unknown] = await ledger.claim_unknown(owner="r", lease_seconds=60)
    found = Outcome(state=State.ACCEPTED, reason="found", provider_id="s-9", result={"id": "s-9"})
    recorded = await ledger.record_outcome(unknown.id, owner="r", outcome=found, actor="r")
    assert recorded.delivery_state is DeliveryState.DELIVERED
    await ledger.start_session("a-digest", name="Ada", seconds=60)
    assert (await ledger.find_session("a-digest")) is not None
    await ledger.record_heartbeat(Heartbeat("b-1", "host:1", "worker"))
    assert [beat.who for beat in await ledger.heartbeats()] == ["host:1"]
    assert (await ledger.prune(older_than_seconds=1.0)).webhook_deliveries == 0


async def test_a_sqlite_ledger_of_schema_7_keeps_early_webhooks_sign_ins_and_heartbeats(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for number, sql in sqlite_ledger.migrations():
            if number <= 7:
                db.executescript(sql)
        db.execute("PRAGMA user_version = 7")
        request = keys.canonical_json(SMS_SEND)
        db.execute(
            "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, request, request_fingerprint,"
            " content_fingerprint, state, created_at, updated_at) VALUES ('u-1', 'old:sms', 'send_sms', 'sms',"
            " '[\"+14155550190\"]', ?1, 'f', 'f', 'unknown', unixepoch('now'), unixepoch('now'))",
            (request,),
        )
        db.execute(
            "INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome, received_at,"
            " payload) VALUES ('old-1', 'sig-old', 'email.bounced', 'e-old', 'unknown_operation', unixepoch('now'),"
            " '{}')"
        )
    finally:
        db.close()
    async with open_ledger(f"sqlite:///{path}") as ledger:
        await _kept_beside_the_operations(ledger)


async def test_a_postgresql_ledger_of_schema_9_keeps_early_webhooks_sign_ins_and_heartbeats(
    postgres_server: PostgresServer,
) -> None:
    import asyncpg

    async with postgres_server.database(migrated=False) as url:
        await _postgres_at_version(url, 9, legacy=False)
        db = await asyncpg.connect(url)
        try:
            await db.execute(
                "INSERT INTO operations (id, idempotency_key, tool, channel, recipients, recipient_keys, request,"
                " request_fingerprint, content_fingerprint, state, created_at, updated_at) VALUES ('u-1', 'old:sms',"
                " 'send_sms', 'sms', '[\"+14155550190\"]', ARRAY['+14155550190'], $1, 'f', 'f', 'unknown', now(),"
                " now())",
                keys.canonical_json(SMS_SEND),
            )
            await db.execute(
                "INSERT INTO webhook_deliveries (delivery_id, signature, event_type, provider_id, outcome,"
                " received_at, payload) VALUES ('old-1', 'sig-old', 'email.bounced', 'e-old', 'unknown_operation',"
                " now(), '{}')"
            )
        finally:
            await db.close()
        async with open_ledger(url) as ledger:
            await _kept_beside_the_operations(ledger)
