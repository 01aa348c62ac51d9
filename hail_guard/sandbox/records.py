"""What the fake Hail has on file: emails, SMS, calls, their delivery progress, and contacts.

Acceptance is not delivery. Each message is created with a script of steps, one every
`delivery_delay_seconds`, and its status and events are read against the clock, so time moves
delivery along without any background task and a test moves it by advancing its clock.

    email  sent -> delivered (-> opened, when it has an HTML body)
    SMS    sent -> delivered
    call   dialing -> ringing -> in_progress -> completed

Special recipients (the first `to` address of an email decides; `+tag` suffixes are allowed):

    bounce@<any domain>       email: sent -> bounced
    complaint@<any domain>    email: sent -> delivered -> complained
    delayed@<any domain>      email: sent -> delivery_delayed -> delivered
    +15005550001              SMS: refused by the carrier in the send: failed, error_code 30007
    +15005550002              SMS: sent -> undelivered, error_code 30003
    +15005550003              call: dialing -> busy
    +15005550004              call: dialing -> ringing -> no_answer
    +15005550005              call: dialing -> failed
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal

Channel = Literal["email", "sms", "call"]
CHANNELS: Final[tuple[Channel, ...]] = ("email", "sms", "call")

SMS_CARRIER_REFUSED: Final = "+15005550001"
SMS_UNDELIVERED: Final = "+15005550002"
CALL_BUSY: Final = "+15005550003"
CALL_NO_ANSWER: Final = "+15005550004"
CALL_FAILED: Final = "+15005550005"

SPECIAL_ADDRESSES: Final[dict[str, str]] = {
    "bounce@<any domain>": "email: sent, then bounced",
    "complaint@<any domain>": "email: sent, delivered, then complained",
    "delayed@<any domain>": "email: sent, delivery_delayed, then delivered",
    SMS_CARRIER_REFUSED: "SMS: refused by the carrier in the send call: status failed, error_code 30007",
    SMS_UNDELIVERED: "SMS: sent, then undelivered with error_code 30003",
    CALL_BUSY: "call: dialing, then busy",
    CALL_NO_ANSWER: "call: dialing, ringing, then no_answer",
    CALL_FAILED: "call: dialing, then failed",
}
"""Recipients that misbehave on purpose, and how."""

ORG_ID: Final = "0b7e5b1c-7d6a-4c3e-9a53-5a4d2b9f0e11"
DEFAULT_FROM: Final[dict[Channel, str]] = {
    "email": "sandbox@hail.test",
    "sms": "+15005550006",
    "call": "+15005550006",
}

Step = tuple[int, str, str | None]
"""(delays after creation, event type, status it sets or None)."""

_EMAIL_SCRIPTS: Final[dict[str, list[Step]]] = {
    "bounce": [(0, "sent", "sent"), (1, "bounced", "bounced")],
    "complaint": [(0, "sent", "sent"), (1, "delivered", "delivered"), (2, "complained", "complained")],
    "delayed": [(0, "sent", "sent"), (1, "delivery_delayed", None), (2, "delivered", "delivered")],
}
_SMS_SCRIPTS: Final[dict[str, list[Step]]] = {
    SMS_CARRIER_REFUSED: [(0, "failed", "failed")],
    SMS_UNDELIVERED: [(0, "sent", "sent"), (1, "undelivered", "undelivered")],
}
_CALL_SCRIPTS: Final[dict[str, list[Step]]] = {
    CALL_BUSY: [(0, "dialing", "dialing"), (1, "busy", "busy")],
    CALL_NO_ANSWER: [(0, "dialing", "dialing"), (1, "ringing", "ringing"), (2, "no_answer", "no_answer")],
    CALL_FAILED: [(0, "dialing", "dialing"), (1, "failed", "failed")],
}
_ERROR_CODES: Final = {("sms", "failed"): "30007", ("sms", "undelivered"): "30003"}
_EVENT_NAMESPACE: Final = uuid.UUID("6f1d8c7e-2b1a-4e8f-9d3c-1a2b3c4d5e6f")


def channel_named(text: str) -> Channel | None:
    return next((channel for channel in CHANNELS if channel == text), None)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _script(channel: Channel, body: dict[str, Any]) -> list[Step]:
    if channel == "email":
        local = str(body["to"][0]).split("@", 1)[0].split("+", 1)[0].lower()
        html = [(2, "opened", None)] if body.get("body_html") else []
        return _EMAIL_SCRIPTS.get(local, [(0, "sent", "sent"), (1, "delivered", "delivered"), *html])
    if channel == "sms":
        return _SMS_SCRIPTS.get(body["to"], [(0, "sent", "sent"), (1, "delivered", "delivered")])
    default = [(0, "dialing", "dialing"), (1, "ringing", "ringing"), (2, "in_progress", "in_progress")]
    return _CALL_SCRIPTS.get(body["to"], [*default, (3, "completed", "completed")])


@dataclass
class Message:
    """One email, SMS or call as Hail keeps it."""

    channel: Channel
    id: str
    created_at: datetime
    fields: dict[str, Any]
    script: list[Step]
    step_seconds: float

    def _reached(self, now: datetime) -> list[tuple[datetime, str, str | None]]:
        happened = []
        for steps, event, status in self.script:
            moment = self.created_at + timedelta(seconds=steps * self.step_seconds)
            if moment <= now or steps == 0:
                happened.append((moment, event, status))
        return happened

    def status(self, now: datetime) -> str:
        return [status for _, _, status in self._reached(now) if status is not None][-1]

    def view(self, now: datetime) -> dict[str, Any]:
        """The record as `get_*` answers it at `now`."""
        reached = self._reached(now)
        status = self.status(now)
        record: dict[str, Any] = {"id": self.id, "status": status, **self.fields}
        record["updated_at"] = _iso(reached[-1][0])
        for moment, event, _ in reached:
            record.setdefault(f"{event}_at", _iso(moment))
        if (code := _ERROR_CODES.get((self.channel, status))) is not None:
            record["error_code"] = code
        return record

    def events(self, now: datetime) -> list[dict[str, Any]]:
        """Events so far, oldest first."""
        return [
            {
                "id": str(uuid.uuid5(_EVENT_NAMESPACE, f"{self.id}:{index}")),
                "resource": f"{self.channel}:{self.id}",
                "type": event,
                "occurred_at": _iso(moment),
            }
            for index, (moment, event, _) in enumerate(self._reached(now))
        ]


def _fields(channel: Channel, body: dict[str, Any], created: str) -> dict[str, Any]:
    common = {
        "message_type": body.get("message_type", "informational"),
        "metadata": body.get("metadata") or {},
        "requested_at": created,
        "created_at": created,
    }
    sender = body.get("from_") or DEFAULT_FROM[channel]
    if channel == "email":
        return {
            "direction": "outbound",
            "from_address": sender,
            "from_name": body.get("from_name"),
            "to_addresses": list(body["to"]),
            "cc_addresses": list(body.get("cc") or []),
            "bcc_addresses": list(body.get("bcc") or []),
            "reply_to": body.get("reply_to"),
            "subject": body["subject"],
            **common,
        }
    if channel == "sms":
        segments = max(1, -(-len(body["body"]) // 153)) if len(body["body"]) > 160 else 1
        return {
            "from_number": sender,
            "to_number": body["to"],
            "body": body["body"],
            "segment_count": segments,
            **common,
        }
    return {"from_number": sender, "to_number": body["to"], "first_message": body.get("first_message"), **common}


@dataclass
class Records:
    """Every message and contact of the sandbox organisation, in creation order."""

    step_seconds: float
    messages: dict[Channel, dict[str, Message]] = field(default_factory=lambda: {c: {} for c in CHANNELS})
    contacts: list[dict[str, Any]] = field(default_factory=list)

    def create(self, channel: Channel, body: dict[str, Any], now: datetime) -> Message:
        message = Message(
            channel=channel,
            id=str(uuid.uuid4()),
            created_at=now,
            fields=_fields(channel, body, _iso(now)),
            script=_script(channel, body),
            step_seconds=self.step_seconds,
        )
        self.messages[channel][message.id] = message
        return message

    def find(self, channel: Channel, message_id: str) -> Message | None:
        return self.messages[channel].get(message_id)

    def page(self, channel: Channel, now: datetime, arguments: dict[str, Any]) -> dict[str, Any]:
        """A page of records, newest first, filtered by `status` and `to`, after `cursor`."""
        newest_first = list(reversed(self.messages[channel].values()))
        wanted_status, wanted_to = arguments.get("status"), arguments.get("to")
        rows = [
            message.view(now)
            for message in newest_first
            if (wanted_status is None or message.status(now) == wanted_status)
            and (wanted_to is None or wanted_to in _recipients(message))
        ]
        return paginate(rows, arguments.get("cursor"), int(arguments.get("limit") or 50))

    def all_events(self, now: datetime, channel: Channel | None) -> list[dict[str, Any]]:
        """Every event of the organisation (or of one channel), newest first."""
        events = [
            event
            for each in (CHANNELS if channel is None else (channel,))
            for message in self.messages[each].values()
            for event in message.events(now)
        ]
        return sorted(events, key=lambda event: event["occurred_at"], reverse=True)

    def add_contact(self, arguments: dict[str, Any], now: datetime) -> dict[str, Any]:
        contact = {
            "id": str(uuid.uuid4()),
            "name": arguments.get("name"),
            "email": arguments.get("email"),
            "phone": arguments.get("phone"),
            "metadata": arguments.get("metadata") or {},
            "created_at": _iso(now),
        }
        self.contacts.append(contact)
        return contact


def _recipients(message: Message) -> list[str]:
    if message.channel == "email":
        return list(message.fields["to_addresses"])
    return [message.fields["to_number"]]


def paginate(rows: list[dict[str, Any]], cursor: str | None, limit: int) -> dict[str, Any]:
    """`limit` rows after the one whose id is `cursor`, with the cursor of the next page."""
    start = 0
    if cursor is not None:
        ids = [row["id"] for row in rows]
        start = ids.index(cursor) + 1 if cursor in ids else len(rows)
    page = rows[start : start + limit]
    more = start + limit < len(rows)
    return {"data": page, "has_more": more, "next_cursor": page[-1]["id"] if more and page else None}
