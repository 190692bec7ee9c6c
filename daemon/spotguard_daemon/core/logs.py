"""Logging set-up for the daemon's entry point: text for people, JSON lines for collectors.

Only the entry point calls :func:`configure`; library modules use ``logging.getLogger(__name__)``
and never install handlers. Calling it again replaces the handler it installed before (tests and
the CLI may call it more than once) and leaves other handlers alone.

Every record that reaches the handler, at every level, passes :class:`RedactFilter` first, so no
secret (see :mod:`spotguard_daemon.core.redact`) reaches the log, whichever module wrote the line. The
cloud SDKs' own loggers stay at WARNING or above even at DEBUG: they dump request headers.

Exceptions: none.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

from .redact import redact_text

__all__ = ["configure", "JsonFormatter", "RedactFilter"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_spotguard_handler"
_NOISY = ("httpx", "httpcore", "asyncio", "botocore", "boto3", "s3transfer", "urllib3", "azure",
          "google", "requests")


class RedactFilter(logging.Filter):
    """Masks secrets in the message and the traceback of every record (it never drops one)."""

    _plain = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_text(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._plain.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and ``exc`` when present."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info or record.exc_text:
            doc["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Send the ``spotguard*`` loggers' records of ``level`` and above to stderr in ``fmt``."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _MARK, True)
    handler.addFilter(RedactFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
