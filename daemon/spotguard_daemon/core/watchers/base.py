"""The watcher protocol: one platform event source, one poll at a time.

A watcher knows one endpoint and how to read it; it owns no loop. Each call of :meth:`Watcher.poll`
does one request (or one long-poll step) and returns the notices *currently pending* from that source,
a snapshot. The :class:`~spotguard_daemon.core.watchers.runner.Runner` owns the loop, timeouts, backoff with
jitter, error counting and logging, and hands each snapshot to the notice store, which decides what is
new and what was cancelled (an id that was in the last snapshot and is not in this one).

A poll that cannot tell the state raises :class:`WatcherError` (or lets an ``httpx.HTTPError`` escape):
the runner then keeps the previous snapshot, so a failing endpoint never produces a false notice and
never cancels a real one.

Exceptions::

    WatcherError             one poll failed; the runner backs off and tries again
     +-- BadPayload          the endpoint answered with something we cannot parse
"""

from __future__ import annotations

from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Protocol, Sequence, runtime_checkable

from spotguard.protocol import Notice

__all__ = ["Watcher", "WatcherError", "BadPayload", "PollObserver", "parse_time"]


class WatcherError(Exception):
    """One poll failed in a way the runner should count, log once, and retry after backoff."""


class BadPayload(WatcherError):
    """The endpoint answered 200 with a body that is not what the platform documents."""


@runtime_checkable
class Watcher(Protocol):
    name: str
    """Source name, ``platform.channel`` (e.g. ``aws.spot``); also the metrics label."""
    platform: str
    interval: float
    """Seconds between the starts of two polls; 0 for a long-poll that paces itself."""

    async def poll(self) -> Sequence[Notice]:
        """Do one poll and return the notices pending now (empty when none)."""
        ...

    async def aclose(self) -> None:
        """Release connections; called once when the daemon stops."""
        ...


_AWS_EVENT_FORMAT = "%d %b %Y %H:%M:%S %Z"  # "21 Jan 2019 09:00:43 GMT"


def parse_time(text: str) -> datetime:
    """Parse the time formats platforms use into an aware UTC datetime.

    RFC 3339 (``2017-09-18T08:22:00Z``), RFC 1123 (``Mon, 19 Sep 2016 18:29:47 GMT``) and the
    AWS scheduled-event style (``21 Jan 2019 09:00:43 GMT``). Raises :class:`BadPayload`.
    """
    text = text.strip()
    if not text:
        raise BadPayload("empty time")
    parsed: datetime | None = None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        try:
            parsed = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            try:
                parsed = datetime.strptime(text, _AWS_EVENT_FORMAT)
            except ValueError:
                raise BadPayload(f"unrecognised time {text[:64]!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


class PollObserver(Protocol):
    """Told the outcome of every poll (the metrics implement it; tests may record it).

    ``outcome`` is one of ``ok``, ``http_error``, ``timeout``, ``connect_error``, ``bad_payload``,
    ``error``: a small fixed set, safe as a metrics label.
    """

    def poll_done(self, watcher: Watcher, outcome: str, seconds: float) -> None: ...
