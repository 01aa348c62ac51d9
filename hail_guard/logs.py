"""Logging: structlog to stderr (stdout belongs to the MCP protocol on stdio).

JSON lines by default, console rendering when stderr is a terminal. A redaction processor
masks tokens, keys and authorization values wherever they appear in an event.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_NAMES = re.compile(r"(token|secret|password|authorization|api_key|apikey)", re.IGNORECASE)
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
REDACTED = "[redacted]"


def redact_secrets(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Mask secret-named fields and bearer tokens inside any string value."""
    for name, value in list(event.items()):
        if _SECRET_NAMES.search(name):
            event[name] = REDACTED
        elif isinstance(value, str):
            event[name] = _BEARER.sub(r"\1" + REDACTED, value)
    return event


def configure_logging(level: str = "info") -> None:
    renderer: Any = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
