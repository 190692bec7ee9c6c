"""What a run says on stderr when the program configured no logging.

``import spotguard`` attaches one handler, :data:`handler`, to the ``spotguard`` logger (as
Lightning does for ``lightning.pytorch``); the root logger is left alone. It prints, as bare
messages on the current ``sys.stderr``:

* spotguard's warnings and errors, as Python's last-resort handler did before it;
* the few lines of the ``spotguard.console`` logger (INFO, rank 0 only): the run's start (job id,
  resumed from which step and from where, or a fresh start; the MTBF its cadence assumes) and the
  end of an interrupted run.

It stays silent once logging is configured (the root logger, or a logger between the record's and
``spotguard``, has a handler): those handlers print the same records, so no line appears twice.
To silence the start lines: ``logging.getLogger("spotguard.console").setLevel(logging.WARNING)``;
to drop the handler: ``logging.getLogger("spotguard").removeHandler(spotguard.console_handler)``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["ConsoleHandler", "console", "handler", "start_line"]

console = logging.getLogger("spotguard.console")
console.setLevel(logging.INFO)


class ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Bare messages on the current ``sys.stderr``, only while nothing else would print them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr  # the current one (a test's capture, a redirected stderr)

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def handle(self, record: logging.LogRecord) -> Any:
        if record.levelno < logging.WARNING and not record.name.startswith(console.name):
            return False
        if logging.getLogger().handlers or _configured(record.name):
            return False
        return super().handle(record)


def _configured(name: str) -> bool:
    """Whether a logger from ``name`` up to ``spotguard`` (excluded) has a handler of its own, or
    ``spotguard`` one besides this module's."""
    while "." in name:
        logger = logging.Logger.manager.loggerDict.get(name)
        if isinstance(logger, logging.Logger) and logger.handlers:
            return True
        name = name.rsplit(".", 1)[0]
    return any(h is not handler for h in logging.getLogger("spotguard").handlers)


def _install() -> ConsoleHandler:
    top = logging.getLogger("spotguard")
    for existing in top.handlers:  # a module reloaded: keep the one handler
        if type(existing).__name__ == ConsoleHandler.__name__:
            return existing  # type: ignore[return-value]
    made = ConsoleHandler()
    top.addHandler(made)
    return made


handler = _install()


def start_line(job_id: str, step: int, resumed: Any, source: str | None, plan: str | None) -> str:
    """``job J: resumed from step N (where)`` or ``job J: fresh start``, and the cadence's plan."""
    if resumed is None:
        begun = "fresh start at step 0 (no checkpoint to resume from)"
    else:
        begun = f"resumed from step {step} ({source or 'local checkpoint'} {getattr(resumed, 'path', resumed)})"
    return f"spotguard: job {job_id}: {begun}" + (f"; {plan}" if plan else "")
