"""Logging set-up for the daemon's entry point: text for people, JSON lines for collectors.

Only the entry point calls :func:`configure`; library modules use ``logging.getLogger(__name__)``
and never install handlers. Calling it again replaces the handler it installed before (tests and
the CLI may call it more than once) and leaves other handlers alone.

Exceptions: none.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

__all__ = ["configure", "JsonFormatter"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_spotguard_handler"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and ``exc`` when present."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Send the ``spotguard*`` loggers' records of ``level`` and above to stderr in ``fmt``."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _MARK, True)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
