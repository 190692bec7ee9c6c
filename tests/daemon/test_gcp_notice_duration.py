"""GCP Spot VMs with a metadata preemption notice before the ACPI soft-off
(``scheduling.preemptionNoticeDuration``): the deadline is that duration plus the 30 s soft-off
window, from the ``gcp.preemption_notice_duration`` setting; 30 s without it. Against the metadata
simulator over real HTTP, and through a real daemon's status."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import httpx
import pytest
from spotguard.protocol import Kind, Notice, StatusRequest, utcnow
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.core.watchers.gcp import GcpPreemptedWatcher
from spotguard_daemon.simulator import Simulator


def settings_for(url: str, **gcp) -> Settings:
    return Settings(gcp={"endpoint": f"{url}/computeMetadata/v1", "interval": 0.1, "long_poll_timeout": 1,
                         **gcp}, runner={"request_timeout": 0.5})


def first_notice(settings: Settings) -> tuple[datetime, Notice]:
    async def main():
        async with httpx.AsyncClient() as http:
            started = utcnow()
            notices = await GcpPreemptedWatcher(http, settings).poll()
            return started, notices[0]

    return asyncio.run(main())


@pytest.mark.parametrize("duration", [120.0, 0.0])
def test_the_preemption_deadline_is_the_notice_duration_plus_the_soft_off_window(duration):
    with Simulator("gcp", preemption_notice_duration=duration) as sim:
        event = sim.schedule("preempt")  # the simulator's VM goes 30 s after its own notice duration
        started, notice = first_notice(settings_for(sim.url, preemption_notice_duration=duration))
    assert notice.kind is Kind.PREEMPT and notice.terminating
    lead = (notice.deadline - started).total_seconds()
    assert duration + 29 < lead < duration + 32
    assert abs(event["deadline"] - event["flip_at"] - (duration + 30)) < 1e-6
    if duration:
        assert f"{duration:g} s" in notice.detail


def test_a_setting_out_of_range_is_refused_by_name():
    with pytest.raises(ValueError, match="gcp.preemption_notice_duration"):
        Settings(gcp={"preemption_notice_duration": -1})


@pytest.mark.slow
def test_a_daemon_on_a_spot_vm_with_a_120_s_notice_shows_a_150_s_deadline(daemon_factory, simulator):
    url = simulator("gcp")
    daemon = daemon_factory("--platform", "gcp", env={"SPOTGUARD_GCP__ENDPOINT": f"{url}/computeMetadata/v1",
                                                      "SPOTGUARD_GCP__PREEMPTION_NOTICE_DURATION": "120",
                                                      "SPOTGUARD_GCP__PREEMPTIBLE": "no"})
    httpx.post(f"{url}/_sim/schedule", json={"kind": "preempt"}, timeout=5).raise_for_status()
    deadline = time.monotonic() + 30
    notices = []
    while not notices and time.monotonic() < deadline:
        notices = daemon.request(StatusRequest()).data["notices"]
        time.sleep(0.1)
    notice = Notice.model_validate(notices[0])
    assert 145 < notice.seconds_left() <= 150
