"""No fork cuts through a piece of torch work in one of spotguard's threads (spotguard._forkgate).

A child forked while another thread held a lock inherits it held for ever; a loader worker forked
while the staging preparation of a fresh start was inside torch hung on its first sample (3 runs in
about 120 of the README's job on a loaded machine). The children here report what the parent's
thread was doing at the instant they were forked, through a pipe.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from spotguard import _forkgate
from spotguard.checkpoint import commit, staging
from spotguard.checkpoint.staging import Stager, tensor_specs


def _fork_and_read(flag: dict[str, bool]) -> tuple[bytes, float]:
    """Fork; the child writes ``flag["inside"]`` as it saw it and exits. The byte, and the seconds
    ``os.fork()`` took in the parent."""
    r, w = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, b"1" if flag["inside"] else b"0")
        finally:
            os._exit(0)
    took = time.monotonic() - started
    os.close(w)
    try:
        return os.read(r, 1), took
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def _piece_in_thread(flag: dict[str, bool], seconds: float) -> threading.Thread:
    """A thread inside a piece for ``seconds`` (returned once it is inside)."""
    entered = threading.Event()

    def piece() -> None:
        with _forkgate.torch_work():
            flag["inside"] = True
            entered.set()
            time.sleep(seconds)
            flag["inside"], flag["ended"] = False, time.monotonic()

    thread = threading.Thread(target=piece)
    thread.start()
    assert entered.wait(5)
    return thread


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the at-fork warning of a fork with threads
def test_a_fork_waits_for_the_piece_of_torch_work_another_thread_is_in():
    flag = {"inside": False}
    thread = _piece_in_thread(flag, 0.4)
    seen, took = _fork_and_read(flag)
    thread.join()
    assert seen == b"0", "the child was forked while the other thread was inside its piece"
    assert took >= 0.2, took


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_piece_begun_while_a_fork_waits_starts_after_it():
    """The fork waits for the first piece (0.3 s); a piece begun meanwhile waits for the fork, so it
    starts only once the first has ended (without the hold-back it would start at 0.1 s)."""
    flag, times = {"inside": False}, {}
    thread = _piece_in_thread(flag, 0.3)

    def later() -> None:
        time.sleep(0.1)  # the fork is waiting by now
        with _forkgate.torch_work():
            times["second began"] = time.monotonic()

    second = threading.Thread(target=later)
    second.start()
    seen, _ = _fork_and_read(flag)
    thread.join()
    second.join()
    assert seen == b"0"
    assert times["second began"] >= flag["ended"], (times, flag)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_fork_from_inside_a_piece_does_not_wait_for_itself_and_the_child_can_use_the_gate():
    r, w = os.pipe()
    started = time.monotonic()
    with _forkgate.torch_work():
        pid = os.fork()
        if pid == 0:
            try:
                with _forkgate.torch_work():  # the child's own gate is not held by gone threads
                    os.write(w, b"ok")
            finally:
                os._exit(0)
    took = time.monotonic() - started
    os.close(w)
    assert os.read(r, 2) == b"ok"
    os.close(r)
    os.waitpid(pid, 0)
    assert took < 2.0
    with _forkgate.torch_work():  # and the parent's is free again
        pass


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_piece_that_never_ends_delays_a_fork_by_the_bound_only_and_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(_forkgate, "WAIT_S", 0.3)
    monkeypatch.setattr(_forkgate, "_warned", False)
    flag = {"inside": False}
    thread = _piece_in_thread(flag, 2.0)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        seen, took = _fork_and_read(flag)
        seen_again, took_again = _fork_and_read(flag)
    thread.join()
    assert seen == seen_again == b"1"  # it went on: a fork never waits for ever
    assert 0.25 <= took < 1.5 and took_again < 1.5, (took, took_again)
    said = [r.getMessage() for r in caplog.records if "still inside torch" in r.getMessage()]
    assert len(said) == 1, said
    assert "a fork went on after 0.3 s" in said[0], said


def _depth() -> int:
    return getattr(_forkgate._local, "depth", 0)


def test_the_staging_preparation_and_a_saves_tensor_bytes_run_as_pieces(monkeypatch):
    """Every torch call the preparation thread makes (a buffer made, a page range touched) and the
    persist's view of a tensor's bytes run inside a piece (a fork waits for them)."""
    made, touched, viewed = [], [], []
    stager = Stager(False, 1 << 20)
    new_buffer = stager._new_buffer
    monkeypatch.setattr(stager, "_new_buffer", lambda spec: (made.append(_depth()), new_buffer(spec))[1])
    zero_range = staging._zero_range
    monkeypatch.setattr(staging, "_zero_range", lambda *a: (touched.append(_depth()), zero_range(*a))[1])
    state = {"model": {"w": torch.randn(512, 1024), "b": torch.randn(1024)}}  # 2 MiB: a large one
    stager.prepare(tensor_specs(state))
    assert stager.wait_prepared(30)
    assert made and touched and all(made) and all(touched), (made, touched)

    numpy = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda t, *a: (viewed.append(_depth()), numpy(t, *a))[1])
    assert bytes(commit.tensor_bytes(torch.arange(4, dtype=torch.uint8))) == bytes([0, 1, 2, 3])
    assert viewed == [1], viewed
    assert _depth() == 0
