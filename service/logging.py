"""Structured logs: one JSON object per line, with the request id of the request being served.

Loggers are ordinary `logging` loggers under "opfuse.service"; pass context as `extra={...}`
(e.g. `extra={"job_id": job.id}`) and it becomes fields of the JSON object. Fields bound to the
request being served with `bind_log_fields` (a job id, a worker id) are on every line it logs.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

request_id_var: ContextVar[str | None] = ContextVar("opfuse_request_id", default=None)
# One dict per request, made by the request middleware; mutated in place, so fields bound in a
# threadpool (where sync routes run, in a copy of the context) reach the request's own log line.
log_fields_var: ContextVar[dict[str, Any] | None] = ContextVar("opfuse_log_fields", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"opfuse.service.{name}")


def bind_log_fields(**fields: Any) -> None:
    """Add fields (e.g. job_id, worker_id) to every later log line of the current request."""
    bound = log_fields_var.get()
    if bound is not None:
        bound.update({k: v for k, v in fields.items() if v is not None})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update(log_fields_var.get() or {})
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key != "color_message":
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Send every log record (ours, uvicorn's, alembic's) to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "alembic"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
