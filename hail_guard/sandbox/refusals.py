"""Hail's refusals, worded as its tools word them (docs/explanation/hail.md, "How its failures read").

Two layers refuse. The tool layer checks a request before any API call (nothing is saved, the key
stays free): `tool_layer_error` returns `<field>: <message>`, or the bare message for a rule over
several fields. The API refuses after the key check (`send_refusal`); those answers are saved under
the key and replayed, except a 503 on `place_call`, which releases it. `api_error` turns an API
status into the tool result.
"""

from __future__ import annotations

import re
from typing import Any, Final

from hail_guard.sandbox.faults import DEFAULT_RETRY_AFTER_SECONDS, Fault

E164: Final = re.compile(r"^\+[1-9]\d{1,14}$")
SUBJECT_MAX_CHARS: Final = 998
SMS_MAX_CHARS: Final = 1600

CONSENT_REFUSED: Final = str(
    [
        {
            "loc": ["body", "recipient_consent"],
            "msg": "recipient_consent must be true to send",
            "type": "value_error",
        }
    ]
)
MARKETING_WITHOUT_SOURCE: Final = str(
    [
        {
            "loc": ["body", "consent_source"],
            "msg": "marketing sends require a non-empty consent_source",
            "type": "value_error",
        }
    ]
)
NO_CALLER_NUMBER: Final = "no shared caller number is free right now; retry shortly"
"""The 503 detail of `place_call`; that 503 releases the key."""

_DETAILS: Final = {
    402: "insufficient credit",
    403: "sending to this recipient is blocked by compliance rules",
    404: "not found",
    409: "request conflicts with the current state of the resource",
    422: str([{"loc": ["body"], "msg": "request rejected by the provider", "type": "value_error"}]),
    429: "rate limit exceeded",
    503: "service temporarily unavailable",
}


def api_error(status: int, retry_after_seconds: int = DEFAULT_RETRY_AFTER_SECONDS) -> dict[str, Any]:
    """The tool result for an API answer with `status`."""
    detail = _DETAILS.get(status, "request failed")
    if status == 401:
        return {"error": "auth failed: token rejected by Hail API"}
    if status == 404:
        return {"error": "resource not found"}
    if status == 429:
        return {"error": f"hail api error 429: {detail} (retry after {retry_after_seconds} seconds)"}
    if status in (409, 422, 503):
        return {"error": detail}
    if 500 <= status < 600:
        return {"error": f"hail upstream error: {status}"}
    return {"error": f"hail api error {status}: {detail}"}


def gateway_error(status: int) -> dict[str, Any]:
    """A 5xx from the gateway in front of the API, whatever the API did: `hail upstream error`."""
    return {"error": f"hail upstream error: {status}"}


def _length(field: str, text: str, most: int) -> str | None:
    if len(text) < 1:
        return f"{field}: String should have at least 1 character"
    if len(text) > most:
        return f"{field}: String should have at most {most} characters"
    return None


def _number(field: str, text: str) -> str | None:
    if E164.match(text) is None:
        return f"{field}: String should match pattern '{E164.pattern}'"
    return None


def _email_error(args: dict[str, Any]) -> str | None:
    if not args["to"]:
        return "to: List should have at least 1 item after validation, not 0"
    for index, address in enumerate(args["to"]):
        if "@" not in address:
            return f"to.{index}: value is not a valid email address: An email address must have an @-sign."
    if not (args.get("body_text") or args.get("body_html")):
        return "body_text or body_html is required"
    return _length("subject", args["subject"], SUBJECT_MAX_CHARS)


def _call_error(args: dict[str, Any]) -> str | None:
    modes = [name for name in ("system_prompt", "llm", "agent_id") if args.get(name)]
    if len(modes) != 1:
        return "exactly one of system_prompt, llm or agent_id is required"
    return _number("to", args["to"])


def tool_layer_error(tool: str, args: dict[str, Any]) -> str | None:
    """What Hail's tool layer refuses before calling the API, or None."""
    if tool == "send_email":
        return _email_error(args)
    if tool == "send_sms":
        return _number("to", args["to"]) or _length("body", args["body"], SMS_MAX_CHARS)
    if tool == "place_call":
        return _call_error(args)
    if tool == "create_contact":
        if not (args.get("email") or args.get("phone")):
            return "email or phone is required"
        if args.get("phone"):
            return _number("phone", args["phone"])
    return None


def send_refusal(tool: str, body: dict[str, Any], scripted: Fault | None) -> tuple[dict[str, Any], bool] | None:
    """The API's refusal of a send as (tool result, saved under the key?), or None to accept it."""
    if body.get("recipient_consent") is not True:
        return {"error": CONSENT_REFUSED}, True
    if body.get("message_type") == "marketing" and not str(body.get("consent_source") or "").strip():
        return {"error": MARKETING_WITHOUT_SOURCE}, True
    if scripted is None:
        return None
    status = scripted.arg or 500
    if status == 503 and tool == "place_call":
        return {"error": NO_CALLER_NUMBER}, False
    return api_error(status, scripted.retry_after_seconds), True
