"""What the ``spotguard`` commands share: a failure as one line and an exit status, the settings
or exit 2, one request to a daemon over the client's protocol (and what to say when none answers),
durations with units (:class:`Duration`: ``90``, ``90s``, ``2m``, ``1h30m``), and a body run with
SIGINT and SIGTERM stopping it like Ctrl-C.

A leaf of the commands: each command imports it, never :mod:`~spotguard_daemon.commands.cli` (the
group, which imports every command). A command talks to a daemon only here, through
:mod:`spotguard.protocol`, as any other client does.

Exceptions: none escape; :func:`fail` exits.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from spotguard_daemon.core.settings import Settings, SettingsError, load_settings

__all__ = ["Duration", "daemon_status", "fail", "guarded", "held_interrupts", "no_daemon",
           "printable", "request", "seconds", "settings_or_exit"]

_CONTROL = {c: ascii(chr(c))[1:-1] for c in [*range(0x00, 0x20), *range(0x7f, 0xa0), 0x200e, 0x200f,
                                          *range(0x202a, 0x202f), *range(0x2066, 0x206a)] if c != 0x0a}


def printable(text: str) -> str:
    """``text`` for a terminal, line breaks kept: every other control character (an escape
    sequence's ESC, a bell, a carriage return, bidi overrides) shown as ``\\xNN``/``\\uNNNN``.
    For whatever a client or a store wrote (job ids, details) before it is printed."""
    return text.translate(_CONTROL)


START_DAEMON = ("start one with `spotguard daemon` (in a terminal of its own), or "
                "`systemctl enable --now spotguard` where the unit is installed")
"""How to start a daemon, for every command that found none."""


def no_daemon(endpoint: str, timeout: float) -> str:
    """The line a command that needs a daemon says when none answered on ``endpoint``."""
    return f"no daemon answered on {endpoint} within {timeout:g} s; {START_DAEMON}"


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|min|s|m|h|d)?\s*")


def seconds(text: str) -> float:
    """``text`` as seconds: a number (seconds) or numbers with units, ``500ms``, ``90s``, ``2m``,
    ``1.5h``, ``1h30m``, ``1d``; ValueError otherwise (a bare number only alone)."""
    total, at, parts, bare = 0.0, 0, 0, False
    text = text.lower()
    while at < len(text):
        part = _PART.match(text, at)
        if part is None or part.end() == at:
            raise ValueError(text)
        total += float(part.group(1)) * _UNITS[part.group(2) or "s"]
        bare, parts, at = bare or part.group(2) is None, parts + 1, part.end()
    if parts == 0 or (bare and parts > 1):
        raise ValueError(text)
    return total


class Duration(click.ParamType):
    """A click option's duration in seconds (:func:`seconds`), from ``low`` to ``high``."""

    name = "duration"

    def __init__(self, low: float = 0.0, high: float | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            result = float(value) if isinstance(value, (int, float)) else seconds(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a duration: seconds, or a number with a unit (90s, 2m, "
                      "1h)", param, ctx)
        if result < self.low or (self.high is not None and result > self.high):
            upper = f" and {self.high:g} s" if self.high is not None else ""
            self.fail(f"{value!r} is {result:g} s: give a duration between {self.low:g} s{upper}",
                      param, ctx)
        return result


def fail(status: int, message: str) -> NoReturn:
    """``spotguard: MESSAGE`` on stderr, then exit ``status``."""
    click.echo(f"spotguard: {message}", err=True)
    sys.exit(status)


def settings_or_exit(config: str | None, **overrides: Any) -> Settings:
    """The effective settings (``config``: a TOML file, else the default one); exit 2 naming the
    setting when they are invalid."""
    try:
        return load_settings(Path(config) if config else None, **overrides)
    except SettingsError as exc:
        fail(2, str(exc))


def request(endpoint: str, message: Any, timeout: float, *, strict: bool = True) -> Any:
    """Send one request to the daemon and return its :class:`Reply`, or None after ``timeout``.
    An invalid reply exits 1 with one line, or (``strict=False``, for a supervisor that must
    outlive a broken daemon) counts as no reply."""
    import zmq
    from spotguard.protocol import ProtocolError, decode_reply, encode

    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(encode(message))
        if not sock.poll(int(timeout * 1000)):
            return None
        try:
            return decode_reply(sock.recv())
        except ProtocolError as exc:
            if not strict:
                return None
            fail(1, f"the daemon at {endpoint} sent an invalid reply: {exc}")


def daemon_status(endpoint: str, timeout: float = 0.5) -> dict | None:
    """The daemon's ``status`` reply data, or None when nothing answered within ``timeout`` (at
    once for an ``ipc://`` socket that does not exist, or one in a directory another user could
    have made: :func:`spotguard._paths.untrusted`, which the caller reports)."""
    from spotguard._paths import untrusted
    from spotguard.protocol import StatusRequest

    if endpoint.startswith("ipc://") and not Path(endpoint[len("ipc://"):]).exists():
        return None
    if untrusted(endpoint):
        return None
    reply = request(endpoint, StatusRequest(), timeout, strict=False)
    return reply.data if reply is not None else None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals(handler: object) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` inside the block: :func:`_interrupt` while the command
    runs (SIGTERM stops it like Ctrl-C), ``SIG_IGN`` while it stops its children, so that a
    second Ctrl-C cannot leave them behind."""
    previous = {signum: signal.signal(signum, handler)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then raised again (their handlers run
    as usual): a block that starts a process and keeps it where the caller's clean-up finds it is
    never cut short in between (an interrupt as ``subprocess.Popen`` returns loses the process,
    left running). Outside the main thread, where no handler runs, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    try:
        with _signals(lambda signum, frame: came.append(signum)):
            yield
    finally:
        for signum in came[:1]:
            signal.raise_signal(signum)


def guarded(name: str, body: Callable[[], int], close: Callable[[int], None],
            failure: type[Exception]) -> int:
    """``body()``'s exit status, with SIGINT and SIGTERM stopping it like Ctrl-C: 1 after
    ``failure`` (its message on stderr), 130 after an interrupt. ``close(status)`` runs on every
    path, with both signals ignored so that a second Ctrl-C cannot leave children behind."""
    status = 1
    with _signals(_interrupt):
        try:
            status = body()
        except failure as exc:
            click.echo(f"spotguard {name}: failed: {exc}", err=True)
        except KeyboardInterrupt as exc:
            status = 130
            by = f" by {exc.args[0]}" if exc.args and exc.args[0] != "SIGINT" else " (Ctrl-C)"
            click.echo(f"spotguard {name}: interrupted{by}: stopping what it started", err=True)
        finally:
            with _signals(signal.SIG_IGN):
                close(status)
    return status
