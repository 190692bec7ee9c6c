"""Large checkpoint buffers (spotguard.checkpoint._hugepages): mappings of their own, in transparent
huge pages where they pay, the staging ones kept from forked children.

What the kernel made of each buffer is read back from /proc/self/smaps (its mappings' huge pages
and madvise flags), on real memory. The probe's verdict depends on the machine (a VM whose host
backs memory on first touch makes huge pages lose), so the tests that need one verdict set it; the
one that needs a losing probe gives the module a clock on which the huge page took longer.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from spotguard.checkpoint import Checkpointer, _hugepages
from spotguard.checkpoint.errors import CheckpointCorruptError
from spotguard.checkpoint.load import READERS, read_entries, read_manifest
from spotguard.checkpoint.staging import aligned_bytes

HUGE = _hugepages.HUGE

needs_thp = pytest.mark.skipif(not _hugepages.available(),
                               reason="transparent huge pages are off (never) on this kernel")


def mappings(buf: torch.Tensor) -> list[dict]:
    """The mappings of /proc/self/smaps that overlap ``buf``: start, end, huge KiB, flags."""
    return mappings_in(buf.data_ptr(), buf.data_ptr() + max(1, buf.numel() * buf.element_size()))


def mappings_in(lo: int, hi: int) -> list[dict]:
    found, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                current = {"start": start, "end": end, "huge_kib": 0, "flags": []} if start < hi and end > lo else None
                if current is not None:
                    found.append(current)
            elif current is not None and head == "AnonHugePages:":
                current["huge_kib"] = int(line.split()[1])
            elif current is not None and head == "VmFlags:":
                current["flags"] = line.split()[1:]
    return found


@pytest.fixture
def verdict(monkeypatch):
    """Set the policy's verdict in force for this test (restored after it)."""
    monkeypatch.setattr(_hugepages, "_verdict", [None, 0.0, None])

    def set_to(pays: bool | None) -> None:
        _hugepages._verdict[:] = [pays, time.monotonic() + (3600 if pays is not None else -1), None]
    return set_to


@needs_thp
def test_a_buffer_where_huge_pages_pay_is_aligned_advised_and_faulted_in_huge_pages(verdict):
    verdict(True)
    nbytes = 3 * HUGE + 12345  # whole huge pages and a tail
    buf = aligned_bytes(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8 and buf.data_ptr() % HUGE == 0
    assert _hugepages.huge_range(buf) == (0, 3 * HUGE) and _hugepages.huge_range(buf[HUGE + 5:]) == (0, 2 * HUGE - 5)
    assert _hugepages.huge_range(buf[3 * HUGE:]) == (0, 0)
    assert sum(m["huge_kib"] for m in mappings(buf)) >= HUGE // 1024  # faulted in as it was made
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * nbytes
    maps = mappings(buf)
    advised = [m for m in maps if "hg" in m["flags"]]
    assert advised and min(m["start"] for m in advised) == buf.data_ptr()
    assert max(m["end"] for m in advised) == buf.data_ptr() + 3 * HUGE  # the tail is not advised
    assert sum(m["huge_kib"] for m in maps) >= HUGE // 1024, maps  # the kernel gave huge pages
    view = buf[:1]  # a view keeps the mapping
    del buf, maps, advised
    gc.collect()
    assert int(view) == 7 and any("hg" in m["flags"] for m in mappings(view))
    address = view.data_ptr()
    del view
    gc.collect()
    assert not any("hg" in m["flags"] for m in mappings_in(address, address + 1))  # unmapped with it


def test_no_huge_pages_where_they_do_not_pay_are_off_or_for_small_buffers(verdict, monkeypatch):
    def plain(buf: torch.Tensor) -> bool:  # a mapping of its own, page aligned, nothing advised
        # The kernel may merge a fresh mapping with an adjacent one of the same flags (an
        # allocator's), so "its own" is the module's record, not a VMA boundary in smaps.
        return (buf.data_ptr() % 4096 == 0 and buf.untyped_storage().data_ptr() in _hugepages._own
                and not any({"hg", "nh"} & set(m["flags"]) for m in mappings(buf)))
    verdict(False)
    assert plain(buf := aligned_bytes(8 * HUGE)) and _hugepages.huge_range(buf) == (0, 0)
    verdict(None)  # no verdict yet, and a buffer too small to probe: plain pages
    assert plain(aligned_bytes(HUGE + 4096)) and plain(aligned_bytes(HUGE - 4096))
    verdict(True)
    monkeypatch.setenv(_hugepages.ENV, "0")
    assert not _hugepages.available() and plain(aligned_bytes(8 * HUGE))


@needs_thp
def test_a_probe_times_both_page_sizes_and_its_verdict_holds_until_it_expires(verdict):
    verdict(None)
    buf = _hugepages.mapped_bytes(5 * HUGE)
    assert buf is not None
    state = _hugepages.state()
    small, huge = state["last_probe"]
    assert small > 0 and huge > 0 and state["pays"] is not None
    first = [m for m in mappings(buf) if m["start"] <= buf.data_ptr() < m["end"]][0]
    assert "nh" in first["flags"] and first["end"] == buf.data_ptr() + HUGE  # the 4 KiB half of the probe
    second = _hugepages.mapped_bytes(5 * HUGE)  # within DECIDE_S: no probe, the verdict decides
    advised = [m for m in mappings(second) if m["start"] <= second.data_ptr() < m["end"]][0]["flags"]
    assert ("hg" in advised) == state["pays"] and "nh" not in advised


class Clock:
    """The module's clock, with thread CPU times given in turn (two readings a timed fault-in)."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self, *readings: float) -> None:
        self.readings = iter(readings)

    def thread_time(self) -> float:
        return next(self.readings)


@needs_thp
def test_a_losing_probe_keeps_the_rest_of_its_buffer_and_the_next_ones_in_small_pages(verdict, monkeypatch):
    """As on a VM whose host backs each freed 2 MiB block again on its first touch: the huge page
    cost more CPU than 512 small ones."""
    verdict(None)
    monkeypatch.setattr(_hugepages, "time", Clock(0.0, 0.001, 0.001, 0.010))  # 4 KiB 1 ms, huge 9 ms
    buf = _hugepages.mapped_bytes(6 * HUGE)
    assert buf is not None and _hugepages.state()["pays"] is False
    rest = [m for m in mappings(buf) if m["start"] >= buf.data_ptr() + 2 * HUGE]
    assert rest and all("nh" in m["flags"] and "hg" not in m["flags"] for m in rest)
    buf.fill_(1)
    assert sum(m["huge_kib"] for m in mappings(buf)) <= HUGE // 1024  # the probe's one huge page at most
    assert not any("hg" in m["flags"] for m in mappings(aligned_bytes(6 * HUGE)))  # the next: small pages


@needs_thp
def test_a_slow_huge_page_after_a_winning_probe_ends_huge_pages_from_there(verdict, monkeypatch):
    """A free pool of mixed blocks (some backed, some handed back to the host): the probe's huge page
    was cheap, a later one is not; the buffer keeps what it faulted in and the rest is small pages."""
    verdict(None)
    fast, slow = 0.0001, 0.005
    readings = [0.0, 0.001]  # the probe's 4 KiB pages: 1 ms
    for cost in (fast, fast, slow):  # huge pages 1 and 2 (the probe's) fast, page 3 slow
        readings += [1.0, 1.0 + cost]
    monkeypatch.setattr(_hugepages, "time", Clock(*readings))
    buf = _hugepages.mapped_bytes(8 * HUGE)
    assert buf is not None and _hugepages.state()["pays"] is False
    assert _hugepages.state()["last_probe"] == pytest.approx((0.001, slow))
    maps = mappings(buf)
    advised = [m for m in maps if "hg" in m["flags"]]
    assert [(m["start"] - buf.data_ptr(), m["end"] - buf.data_ptr()) for m in advised] == [(HUGE, 4 * HUGE)]
    assert _hugepages.huge_range(buf) == (HUGE, 4 * HUGE)  # what a restore reads into directly
    assert all("nh" in m["flags"] for m in maps if m["start"] >= buf.data_ptr() + 4 * HUGE)
    assert not any("hg" in m["flags"] for m in mappings(aligned_bytes(8 * HUGE)))


def checkpointed(root, model: torch.nn.Module) -> dict:
    """``model`` saved at step 1 under ``root``; its values, then the model zeroed."""
    ck = Checkpointer(root, keep=1)
    ck.save(1, {"model": model}, blocking=True)
    ck.close()
    values = {k: v.clone() for k, v in model.state_dict().items()}
    zeroed(model)
    return values


def zeroed(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


@needs_thp
def test_a_restore_reads_into_huge_pages_which_become_the_staging_copy_and_loads_exactly(tmp_path, verdict):
    verdict(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # 4 MiB weight
    saved = checkpointed(tmp_path, model)
    again = Checkpointer(tmp_path, keep=1)
    try:
        again.load_latest({"model": model})
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
        staged = [b for b in again._stager.buffers if b.numel() * b.element_size() >= 2 * HUGE]
        assert staged, "the restore's large read buffer was not adopted as the staging copy"
        assert all(b.data_ptr() % HUGE == 0 for b in staged)
        assert sum(m["huge_kib"] for b in staged for m in mappings(b)) >= HUGE // 1024
    finally:
        again.close()


@needs_thp
def test_a_restore_into_small_pages_reads_through_huge_bounce_buffers_and_loads_exactly(tmp_path, verdict,
                                                                                        monkeypatch):
    """Where huge pages do not pay for the read buffers (this VM as it is), each reader reads through
    a bounce buffer in one huge page, so the disk gets 2 MiB requests; where the buffers are huge,
    none is made; with huge pages off, neither. The restored state is exact every way, and a flipped
    byte is still caught."""
    made: list[tuple[torch.Tensor, int]] = []

    def bounce_buffer():
        buf = make()
        if buf is not None:
            made.append((buf, sum(m["huge_kib"] for m in mappings(buf))))
        return buf
    make = _hugepages.bounce_buffer
    monkeypatch.setattr(_hugepages, "bounce_buffer", bounce_buffer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2049), torch.nn.Linear(2049, 7))  # 8 MiB + a tail
    saved = checkpointed(tmp_path, model)

    def restored(pays: bool, huge_pages: str = "1", root=tmp_path) -> int:
        verdict(pays)
        monkeypatch.setenv(_hugepages.ENV, huge_pages)
        made.clear()
        zeroed(model)
        again = Checkpointer(root, keep=1)
        try:
            again.load_latest({"model": model})
        finally:
            again.close()
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
        return len(made)
    assert 1 <= restored(False) <= READERS
    assert all(huge_kib == HUGE // 1024 and buf.data_ptr() % HUGE == 0 for buf, huge_kib in made), made
    assert restored(True) == 0  # read straight into the huge pages
    assert restored(False, huge_pages="0") == 0
    if os.path.isdir("/dev/shm"):  # tmpfs: an O_DIRECT read there is a copy already
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            shutil.copytree(tmp_path, Path(shm) / "ck")
            assert restored(False, root=Path(shm) / "ck") == 0
    weight = max((p for p in (tmp_path).rglob("*.bin")), key=lambda p: p.stat().st_size)
    data = bytearray(weight.read_bytes())
    data[3 * HUGE + 17] ^= 1
    weight.write_bytes(bytes(data))
    verdict(False)
    monkeypatch.setenv(_hugepages.ENV, "1")
    path = weight.parents[2]
    with pytest.raises(CheckpointCorruptError, match="xxh3 of bytes 0\\+ mismatch"):
        read_entries(path, read_manifest(path), "rank-0", verify=True)


def test_staging_buffers_are_kept_from_forked_children_so_a_snapshot_after_a_fork_copies_nothing(tmp_path):
    """A loader forks its workers (each epoch, by default): memory they share copy-on-write makes
    the parent's next write fault and copy every page. The staging buffers (the adopted read
    buffers of a restore too) are not inherited, so the snapshot after a fork takes no such fault;
    the child itself starts with none."""
    import os
    import resource

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 2 x 4 MiB
    ck = Checkpointer(tmp_path, keep=1)
    ck.save(1, {"model": model}, blocking=True)
    ck.close()
    again = Checkpointer(tmp_path, keep=1)
    try:
        again.load_latest({"model": model})  # read buffers adopted as the staging copy
        staged = [b for b in again._stager.buffers if b.numel() * b.element_size() >= 1 << 20]
        assert len(staged) == 2 and all("dc" in m["flags"] for b in staged for m in mappings(b))
        pid = os.fork()
        if pid == 0:  # the child: no staging buffer, no mapping of theirs
            gone = not again._stager.buffers and not any(mappings_in(b.data_ptr(), b.data_ptr() + 1) for b in staged)
            os._exit(0 if gone else 1)
        try:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            again._stager.snapshot({"model": model})  # writes every page of both buffers
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        finally:
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert faults < 2 * (4 << 20) // 4096 // 4, faults  # shared, it would fault all 2,048 pages
    finally:
        again.close()


def test_past_the_mapping_budget_buffers_come_from_the_allocator_and_work_the_same(monkeypatch):
    """A state of very many large tensors must not use up the process's vm.max_map_count, after
    which every mmap fails (the allocator's, CUDA's): past a quarter of it, buffers are plain."""
    assert _hugepages.map_budget() >= 64
    held = [aligned_bytes(1 << 20)]
    assert _hugepages.keep_from_forks(held[0])  # a mapping of its own
    monkeypatch.setattr(_hugepages, "_budget", [len(_hugepages._own)])
    over = aligned_bytes((1 << 20) + 4096)
    assert over.numel() == (1 << 20) + 4096 and over.data_ptr() % 4096 == 0
    assert not _hugepages.keep_from_forks(over)  # from the allocator
    over.fill_(3)
    assert int(over.sum()) == 3 * over.numel()
    held.clear()
    gc.collect()
    assert _hugepages.keep_from_forks(aligned_bytes(1 << 20))  # one freed: room again
