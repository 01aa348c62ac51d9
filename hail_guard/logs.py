"""Logging: structlog to stderr (stdout belongs to the MCP protocol on stdio).

JSON lines by default, console rendering when stderr is a terminal; or, for an operator's command
(`configure_logging(text=True)`), one plain line per event, `hail-guard: warning: what happened (key=value)`,
control characters escaped. A redaction processor
masks tokens, keys and authorization values wherever they appear in an event. Records of the
standard `logging` module (uvicorn, asyncio, the MCP SDK) go through the same rendering and
redaction, so nothing reaches stderr as plain text.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

_SECRET_NAMES = re.compile(r"(token|secret|password|passwd|authorization|api[-_]?key|cookie|credential)", re.IGNORECASE)
_IN_TEXT = (
    re.compile(r"((?:Bearer|Basic)\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE),
    # name=value / "name": "value" pairs, as in URLs, headers and repr()s
    re.compile(
        r"((?:token|secret|password|api[-_]?key|authorization)[\"']?\s*[=:]\s*[\"']?)(?!Bearer\b|Basic\b)[^\s\"'&,;}]+",
        re.IGNORECASE,
    ),
)
_HINT = re.compile(r"bearer|basic|token|secret|password|api[-_]?key|authorization", re.IGNORECASE)
"""What every pattern of `_IN_TEXT` starts from: a text without any is left as it is, unscanned."""
REDACTED = "[redacted]"
_MAX_DEPTH = 8


def redact_secrets(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Mask secret-named fields (at any depth) and secret-looking text inside any string value."""
    for name, value in list(event.items()):
        event[name] = _redacted(name, value, 0)
    return event


def _redacted(name: object, value: Any, depth: int) -> Any:
    if isinstance(name, str) and _SECRET_NAMES.search(name) and value is not None:
        return REDACTED
    if isinstance(value, str):
        if _HINT.search(value) is None:
            return value
        for pattern in _IN_TEXT:
            value = pattern.sub(r"\1" + REDACTED, value)
        return value
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {key: _redacted(key, item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_redacted(None, item, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


class _CurrentStderr:
    """Whatever `sys.stderr` is at the time of writing (it is swapped by test runners and daemons)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=_CurrentStderr())  # type: ignore[arg-type]


class _LibraryRecords(logging.StreamHandler):  # type: ignore[type-arg]  # of _CurrentStderr
    """Records of the standard `logging` (uvicorn, asyncio, the MCP SDK), rendered like ours."""


def _route_library_logging(level: str, renderer: Any) -> None:
    """Libraries' records become the same lines as ours, redacted; else Python prints them as plain
    text on stderr (tracebacks included). Theirs below `warning` are dropped (chatter); those of our
    own modules that use `logging` (the sandbox) keep the configured level."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact_secrets,
            renderer,
        ],
    )
    handler = _LibraryRecords(_CurrentStderr())
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [existing for existing in root.handlers if isinstance(existing, _LibraryRecords)]:
        root.removeHandler(old)
    root.addHandler(handler)
    chosen = logging.getLevelNamesMapping()[level.upper()]
    root.setLevel(max(logging.WARNING, chosen))
    logging.getLogger("hail_guard").setLevel(chosen)


def text_line(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> str:
    """An event as one line of text for a person: its level, its message (else its name), its other fields;
    a traceback, when there is one, on the lines after. Control characters are shown as escapes."""
    level, name = event.pop("level", "info"), event.pop("event", "")
    message, trace = event.pop("message", None), event.pop("exception", None)
    for meta in ("timestamp", "logger", "logger_name"):
        event.pop(meta, None)
    fields = ", ".join(f"{key}={value}" for key, value in event.items() if value is not None)
    line = _printable(f"hail-guard: {level}: {message or name}" + (f" ({fields})" if fields else ""))
    return line if trace is None else "\n".join([line, *(_printable(part) for part in str(trace).splitlines())])


def _printable(text: str) -> str:
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


def configure_logging(level: str = "info", *, text: bool = False) -> None:
    """Logs at `level` and above on stderr: JSON lines (a terminal: console rendering), or `text_line`s."""
    renderer: Any = (
        text_line
        if text
        else structlog.dev.ConsoleRenderer()
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    _route_library_logging(level, renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_secrets,  # after format_exc_info: tracebacks are text too
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
