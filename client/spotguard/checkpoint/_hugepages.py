"""Large checkpoint buffers in transparent huge pages, where they pay.

A restore reads each file ``O_DIRECT`` into a fresh buffer, and those buffers become the staging
copy of the next saves. Two costs of that memory follow the page size:

* **The disk's requests.** An ``O_DIRECT`` request covers a run of physically contiguous memory, so
  fresh 4 KiB pages cut a read into requests of 0.5-1 MiB where the device takes 4 MiB. A disk that
  serves one request at a time (a VM's virtio disk) then reads at half its speed: 1 GiB of files
  in 0.70-0.78 s into 4 KiB pages, 0.33 s into 2 MiB pages, as fast as ``dd`` (benchmarks/README.md,
  "Huge pages").
* **The faults.** 1 GiB of 4 KiB pages is 262,144 faults (0.41 s here); of 2 MiB pages, 512 (0.07 s).

So a buffer of at least :data:`HUGE` gets a 2 MiB-aligned mapping of its own, and its whole 2 MiB
pages are advised ``MADV_HUGEPAGE`` (the kernel's ``madvise`` mode, the common default, gives huge
pages only where asked). Its tail stays in 4 KiB pages, so a buffer's resident size is its own, never
rounded up to 2 MiB.

Huge pages can also cost more than they save: a kernel may have to compact memory to find a free
2 MiB block, and a VM whose host backs its memory only on first touch pays the host for each block
its free page reporting handed back (here 2.3 ms of CPU a MiB, against 0.04 for a backed block and
0.4 for 4 KiB pages). So a buffer's huge pages are faulted in as it is made, each timed in the
thread's CPU time (which a loaded machine inflates alike for every kind of page), against what 2 MiB
of 4 KiB pages cost: every :data:`DECIDE_S` a buffer of two huge pages or more probes, its first
2 MiB faulted in as 4 KiB pages. The first huge page that costs more ends huge pages until the next
probe, the rest of its buffer included (``MADV_NOHUGEPAGE``): a free 2 MiB block costs that much
once at most per probe. Transparent huge pages off (``never``), a kernel without them, or
``SPOTGUARD_HUGE_PAGES=0`` keep plain pages.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
import weakref

import torch

__all__ = ["DECIDE_S", "ENV", "HUGE", "available", "bounce_buffer", "huge_range", "keep_from_forks", "map_budget",
           "mapped_bytes", "state"]

HUGE = 2 << 20
"""The huge page size (x86-64's and arm64's PMD with 4 KiB pages)."""
DECIDE_S = 10.0
"""How long a verdict holds (a probe's, or a slow huge page's) before a buffer probes again."""
ENV = "SPOTGUARD_HUGE_PAGES"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_PAGE = mmap.PAGESIZE

_lock = threading.Lock()
_own: dict[int, "weakref.ref[mmap.mmap]"] = {}
"""Start address -> mapping, of the mappings :func:`mapped_bytes` made that are still mapped."""
_huge: dict[int, tuple[int, int]] = {}
"""Start address of a mapping -> the addresses its huge pages span, ``[first, end)``."""
_verdict: list = [None, 0.0, None]
"""[huge pages pay (None before a probe), when the verdict expires (monotonic), the last probe's
(4 KiB, huge) CPU seconds]."""


def available() -> bool:
    """Whether huge pages may be asked for: Linux with transparent huge pages in ``always`` or
    ``madvise`` mode, and not turned off by ``SPOTGUARD_HUGE_PAGES=0``."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _thp_mode() in ("always", "madvise")


def state() -> dict[str, object]:
    """What the policy knows: whether huge pages may be asked for, the verdict in force (None before
    a probe or once it expired) and the last probe's CPU seconds (4 KiB pages, huge page)."""
    with _lock:
        pays, until, last = _verdict
    return {"available": available(), "pays": pays if time.monotonic() < until else None, "last_probe": last}


_mode: list[str | None] = []


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``/``madvise``/``never``), read once."""
    if not _mode:
        try:
            with open(_THP_ENABLED) as file:
                text = file.read()
            _mode.append(text[text.index("[") + 1 : text.index("]")])
        except (OSError, ValueError):
            _mode.append(None)
    return _mode[0]


_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_budget: list[int] = []


def map_budget() -> int:
    """How many mappings of its own this module keeps at most: a quarter of the kernel's per-process
    limit (``vm.max_map_count``, 65,530 by default), read once. A state of tens of thousands of
    tensors (a mixture of experts, each expert's matrices apart) would otherwise use up the limit,
    and then every ``mmap`` of the process fails, the allocator's and CUDA's included."""
    if not _budget:
        try:
            with open(_MAX_MAP_COUNT) as file:
                _budget.append(max(64, int(file.read()) // 4))
        except (OSError, ValueError):
            _budget.append(16384)
    return _budget[0]


def mapped_bytes(nbytes: int, *, private: bool = False) -> torch.Tensor | None:
    """A uint8 tensor of ``nbytes`` in a mapping of its own (unmapped with the last tensor on it):
    on a 2 MiB boundary with its whole 2 MiB pages huge and faulted in where huge pages are asked
    for (:func:`available`, and the verdict in force says they pay, or a probe is due), else page
    aligned and untouched. ``private``: kept from forked children (:func:`keep_from_forks`). None
    where the mapping fails, or :func:`map_budget` mappings are held already."""
    with _lock:
        if len(_own) >= map_budget():
            return None
    whole = nbytes // HUGE * HUGE
    huge = probe = False
    last = None
    if whole and available():
        with _lock:
            pays, until, last = _verdict
            probe = time.monotonic() >= until and whole >= 2 * HUGE
            if probe:
                _verdict[1] = time.monotonic() + DECIDE_S  # one probe at a time; others keep the verdict
        huge = probe or bool(pays and time.monotonic() < until)
    try:
        region = mmap.mmap(-1, nbytes + (HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(region)
        base = ctypes.addressof(anchor)
        del anchor  # the export would keep the mapping from closing
        start = -base % HUGE if huge else 0
        first = HUGE if probe else 0
        if probe:
            region.madvise(mmap.MADV_NOHUGEPAGE, start, HUGE)
        if huge:
            region.madvise(mmap.MADV_HUGEPAGE, start + first, whole - first)
        if private:
            region.madvise(mmap.MADV_DONTFORK)
    except (OSError, ValueError, AttributeError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping; unmapped with the tensor
    with _lock:
        _own[base] = ref = weakref.ref(region)
    weakref.finalize(region, _forget, base, ref)
    buf = raw[start : start + nbytes]
    if not huge:
        return buf
    small = _fault(buf[:HUGE], _PAGE) if probe else (last[0] if last else math.inf)
    end = whole
    for offset in range(first, whole, HUGE):  # each huge page timed: a free 2 MiB block may cost more
        cost = _fault(buf[offset : offset + HUGE], HUGE)
        pays = cost < small
        if not pays or (probe and offset == first):
            with _lock:
                _verdict[:] = [pays, time.monotonic() + DECIDE_S, (small, cost)]
        if not pays:  # the rest in 4 KiB pages, faulted where first written, as without this module
            end = offset + HUGE
            if end < whole:
                try:
                    region.madvise(mmap.MADV_NOHUGEPAGE, start + end, whole - end)
                except OSError:
                    pass
            break
    if end > first:
        with _lock:
            _huge[base] = (buf.data_ptr() + first, buf.data_ptr() + end)
    return buf


def huge_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of ``tensor`` (offsets from its start, ``[first, end)``) that lie in huge pages of
    the mapping :func:`mapped_bytes` made for it; ``(0, 0)`` for any other memory, or none given."""
    with _lock:
        first, end = _huge.get(tensor.untyped_storage().data_ptr(), (0, 0))
    here = tensor.data_ptr()
    return (max(0, first - here), end - here) if end > here else (0, 0)


def bounce_buffer() -> torch.Tensor | None:
    """One huge page (:data:`HUGE` bytes, 2 MiB-aligned, faulted in, kept from forked children) for
    a reader to fill ``O_DIRECT`` and copy out of; None where huge pages may not be asked for
    (:func:`available`) or the mapping fails. Asked for whatever the verdict: a reused buffer pays
    its first touch once, and the disk then serves a read into it in one request of 2 MiB, where a
    read into fresh 4 KiB pages is cut at every physical discontinuity (:mod:`.load`)."""
    if not available():
        return None
    try:
        region = mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(region)
        start = -ctypes.addressof(anchor) % HUGE
        del anchor
        region.madvise(mmap.MADV_HUGEPAGE, start, HUGE)
        region.madvise(mmap.MADV_DONTFORK)
    except (OSError, ValueError, AttributeError):
        return None
    buf = torch.frombuffer(region, dtype=torch.uint8)[start : start + HUGE]
    buf[::_PAGE].zero_()
    return buf


def _forget(base: int, ref: "weakref.ref[mmap.mmap]") -> None:
    with _lock:
        if _own.get(base) is ref:
            del _own[base]
            _huge.pop(base, None)


def keep_from_forks(tensor: torch.Tensor) -> bool:
    """Keep the mapping under ``tensor`` (one :func:`mapped_bytes` made) out of forked children
    (``MADV_DONTFORK``); False where it is no such mapping. Only for memory no child may touch."""
    with _lock:
        ref = _own.get(tensor.untyped_storage().data_ptr())
    region = ref() if ref is not None else None
    if region is None:
        return False
    try:
        region.madvise(mmap.MADV_DONTFORK)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _fault(part: torch.Tensor, every: int) -> float:
    """CPU seconds to fault ``part`` in, one write every ``every`` bytes (one write faults a whole
    huge page in). CPU time: a loaded machine or a reniced thread must not look slow."""
    began = time.thread_time()
    part[::every].zero_()
    return time.thread_time() - began
