"""A :class:`~spotguard.storage.base.Store` wrapper that counts requests and bytes read (benchmarks)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

_BYTES_READ = {"get_bytes"}


class CountingStore:
    """Forwards every call to ``store``; ``counts[method]``, ``bytes_read`` (get_bytes bodies) and
    ``put_times[key]`` (when each ``put_bytes``, or ``put_bytes_if_absent`` that wrote, of a key returned) are what the benchmark reads."""

    def __init__(self, store: Any) -> None:
        self._store, self._lock = store, threading.Lock()
        self.counts: Counter[str] = Counter()
        self.bytes_read = 0
        self.put_times: dict[str, list[float]] = {}

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.bytes_read = 0
            self.put_times.clear()

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if name == "list":  # a listing is one request per 1000 keys (S3's page), counted as read
                result = list(result)
            with self._lock:
                self.counts[name] += max(1, len(result) // 1000 + 1) if name == "list" else 1
                if name in _BYTES_READ:
                    self.bytes_read += len(result)
                if name == "put_bytes" or (name == "put_bytes_if_absent" and result):  # a write that landed
                    self.put_times.setdefault(args[0], []).append(time.monotonic())
            return result

        return counted
