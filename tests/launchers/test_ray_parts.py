"""The parts of spotguard.integrations.ray that need no Ray cluster (the end-to-end test on a local
Ray cluster is test_ray_train.py): a Guard made in a thread, as Ray runs the training loop, gets the
SIGTERM that the main thread's handlers take (one that came before the Guard existed too); Ray's
handler comes back; the job id stays the same across restarts and ranks; Ray's preemption
information becomes a notice with its deadline."""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime, timezone

import pytest
from spotguard.guard import Guard
from spotguard.integrations import ray as sg_ray
from spotguard.protocol import Kind


def test_signal_in_the_main_thread_reaches_a_guard_made_in_a_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert sg_ray._install(None)  # what RayRun runs in the worker actor's main thread
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # before the Guard exists: kept
        made: list[Guard] = []
        thread = threading.Thread(target=lambda: made.append(Guard(daemon=False, force_exit=False)))
        thread.start()
        thread.join()
        (guard,) = made
        try:
            assert not guard.stop_requested
            sg_ray._attach(guard)
            assert guard.stop_requested
            assert "SIGTERM received" in guard.notice.detail
        finally:
            sg_ray._forward["guard"] = None
            guard.close()
    finally:
        sg_ray._restore(None)
    assert signal.getsignal(signal.SIGTERM) is before


def test_install_outside_the_main_thread_does_nothing() -> None:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(sg_ray._install(None)))
    thread.start()
    thread.join()
    assert result == [False] and not sg_ray._forward["previous"]


class _Context:  # what job_id_from_ray reads of ray.train.get_context()
    def __init__(self, name: str) -> None:
        self.name = name

    def get_experiment_name(self) -> str:
        return self.name


def test_job_id_is_the_experiment_name() -> None:
    assert sg_ray.job_id_from_ray(_Context("my run/2")) == "ray-my-run-2"


def test_ray_preemption_info_becomes_a_notice() -> None:
    preemption = pytest.importorskip("ray.train.v2.api.preemption")
    deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
    info = preemption.PreemptionInfo(deadline_ms=int(deadline.timestamp() * 1000),
                                     preempted_node_to_ranks={"node-b": [1], "node-a": [0]})
    notice = sg_ray.notice_from_ray(info)
    assert notice.kind is Kind.PREEMPT and notice.deadline == deadline
    assert notice.id == "ray:preempt:node-a, node-b" and "ranks [0, 1]" in notice.detail
    assert sg_ray.notice_from_ray(preemption.PreemptionInfo(None, {"n": [0]})).deadline is None
