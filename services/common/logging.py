"""Structured logging: one JSON object per line, the same fields in every service.

    setup_logging("scheduler", "info")
    log = logging.getLogger(__name__)
    with request_context("req-42"):
        log.info("admitted", extra={"prompt_tokens": 17})
    # {"ts": "2026-...Z", "level": "info", "service": "scheduler", "logger": "...",
    #  "msg": "admitted", "request_id": "req-42", "prompt_tokens": 17}

The request id lives in a contextvar, so every log line written while serving
a request carries it, across awaits and in tasks spawned from that context,
without passing it around. Likewise, a line written while a span is current
(tracing on: services/common/tracing.py) carries `trace_id` and `span_id` as
hex, the ids trace viewers search by. Keys given through `extra=` become
top-level fields.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import sys
from typing import IO, Any, Iterator

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "radixmesh_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Tag log lines written inside the block (and tasks created in it) with request_id."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; values JSON cannot encode are str()-ed."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid is not None:
            out["request_id"] = rid
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"], out["span_id"] = f"{span.trace_id:032x}", f"{span.span_id:016x}"
        for key, value in vars(record).items():
            if key not in _RESERVED and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(service: str, level: str = "info", stream: IO[str] | None = None) -> None:
    """Route all logging (root logger) to `stream` (default stderr) as JSON lines.

    Replaces the root logger's handlers, so calling it again (e.g. in tests)
    reconfigures rather than duplicates. Raises ValueError for an unknown level.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
