"""The time formats the platforms print, from epoch seconds (always UTC, whole seconds)."""

from __future__ import annotations

import time
from email.utils import formatdate

__all__ = ["rfc3339", "rfc1123", "aws_event_time"]

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def rfc3339(ts: float) -> str:
    """``2017-09-18T08:22:00Z`` (AWS spot, Alibaba)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def rfc1123(ts: float) -> str:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` (Azure Scheduled Events)."""
    return formatdate(int(ts), usegmt=True)


def aws_event_time(ts: float) -> str:
    """``21 Jan 2019 09:00:43 GMT`` (AWS scheduled maintenance events); locale-independent."""
    t = time.gmtime(ts)
    return f"{t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
