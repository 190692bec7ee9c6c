"""Platform detection from DMI strings, and the watcher set built for each platform."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.core.watchers.base import Watcher
from spotguard_daemon.core.watchers.detect import AZURE_ASSET_TAG, build_watchers, detect_platform

TABLE = [
    ({"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge", "bios_vendor": "Amazon EC2"}, "aws"),
    ({"sys_vendor": "Xen", "product_name": "HVM domU", "bios_version": "4.11.amazon"}, "aws"),
    ({"sys_vendor": "Google", "product_name": "Google Compute Engine", "bios_vendor": "Google"}, "gcp"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": AZURE_ASSET_TAG}, "azure"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, "azure"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": "0000-local-hyper-v"}, "none"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Surface Laptop 5"}, "none"),
    ({"sys_vendor": "Alibaba Cloud", "product_name": "Alibaba Cloud ECS"}, "alibaba"),
    ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, "none"),
    ({"sys_vendor": "Dell Inc.", "product_name": "PowerEdge R750"}, "none"),
    ({}, "none"),
]


def dmi(tmp_path, values):
    for name, value in values.items():
        (tmp_path / name).write_text(value + "\n")
    return tmp_path


@pytest.mark.parametrize("values,expected", TABLE)
def test_detection_table(tmp_path, values, expected):
    assert detect_platform(Settings(), dmi_dir=dmi(tmp_path, values), environ={}) == expected


def test_explicit_setting_wins_over_dmi(tmp_path):
    gcp = dmi(tmp_path, {"sys_vendor": "Google", "product_name": "Google Compute Engine"})
    assert detect_platform(Settings(platform="azure"), dmi_dir=gcp, environ={}) == "azure"
    assert detect_platform(Settings(platform="none"), dmi_dir=gcp, environ={}) == "none"


def test_environment_only_consulted_without_dmi(tmp_path):
    missing = tmp_path / "absent"
    assert detect_platform(Settings(), missing, {"AWS_EXECUTION_ENV": "AWS_ECS_EC2"}) == "aws"
    assert detect_platform(Settings(), missing, {"AWS_EXECUTION_ENV": "AWS_ECS_FARGATE"}) == "none"
    qemu = dmi(tmp_path, {"sys_vendor": "QEMU"})
    assert detect_platform(Settings(), qemu, {"AWS_EXECUTION_ENV": "AWS_ECS_EC2"}) == "none"


def names(settings, platform, environ=None):
    async def build():
        async with httpx.AsyncClient() as http:
            watchers = build_watchers(settings, http, platform, environ or {})
            assert all(isinstance(w, Watcher) for w in watchers)
            return [w.name for w in watchers]

    return asyncio.run(build())


def test_watchers_per_platform():
    settings = Settings()
    assert names(settings, "aws") == ["aws.spot", "aws.rebalance", "aws.scheduled"]
    assert names(settings, "gcp") == ["gcp.preempted", "gcp.maintenance", "gcp.preemptible"]
    assert names(settings, "azure") == ["azure.scheduled"]
    assert names(settings, "alibaba") == ["alibaba.preempt"]
    assert names(settings, "none") == []
    with pytest.raises(ValueError):
        names(settings, "oracle")


def test_optional_watchers_follow_settings():
    settings = Settings(aws={"rebalance": False, "scheduled_events": False}, gcp={"preemptible": "no"})
    assert names(settings, "aws") == ["aws.spot"]
    assert names(settings, "gcp") == ["gcp.preempted", "gcp.maintenance"]


def test_slurm_watcher_added_inside_an_allocation_only():
    assert names(Settings(), "none", {"SLURM_JOB_ID": "42"}) == ["slurm.walltime"]
    assert names(Settings(), "aws", {"SLURM_JOB_ID": "42"})[-1] == "slurm.walltime"
    assert names(Settings(), "none", {}) == []
    assert names(Settings(slurm={"enabled": "no"}), "none", {"SLURM_JOB_ID": "42"}) == []
    assert names(Settings(slurm={"enabled": "yes"}), "none", {}) == ["slurm.walltime"]


def test_aws_watchers_share_one_token():
    async def build():
        async with httpx.AsyncClient() as http:
            return build_watchers(Settings(), http, "aws", {})

    spot, rebalance, scheduled = asyncio.run(build())
    assert spot._imds is rebalance._imds is scheduled._imds
