"""Which cloud this machine runs on, and the watchers to start for it.

:func:`detect_platform` never probes a metadata address (a probe to 169.254.169.254 on the wrong
cloud, or on a laptop, hangs or reaches something else): an explicit ``platform`` setting wins, else
the firmware's DMI strings decide (readable without root in ``/sys/class/dmi/id``):

========================  =====================================================
``aws``                   ``sys_vendor`` or ``bios_vendor`` "Amazon EC2"; Xen-era ``bios_version``
                          containing "amazon"
``gcp``                   ``product_name`` "Google Compute Engine" or ``sys_vendor`` "Google"
``azure``                 ``sys_vendor`` "Microsoft Corporation" and ``product_name`` "Virtual
                          Machine" (and, when readable, Azure's ``chassis_asset_tag``, which tells
                          Azure from a local Hyper-V VM)
``alibaba``               ``sys_vendor`` or ``product_name`` starting "Alibaba Cloud"
========================  =====================================================

Where DMI is unreadable (some containers), ``AWS_EXECUTION_ENV`` tells ECS on EC2 (``aws``) from
Fargate (``none``: Fargate Spot announces itself with SIGTERM only). Anything else is ``none``.

:func:`build_watchers` returns the platform's watchers (AWS's three share one IMDSv2 token) plus
the Slurm watcher when ``slurm.enabled`` is ``yes``, or ``auto`` inside an allocation. The daemon
core adds the signal and manual sources itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

import httpx

from ..settings import Settings
from .alibaba import AlibabaPreemptWatcher
from .aws import AwsRebalanceWatcher, AwsScheduledWatcher, AwsSpotWatcher, Imds
from .azure import AzureScheduledWatcher
from .base import Watcher
from .gcp import GcpMaintenanceWatcher, GcpPreemptedWatcher, GcpPreemptibleWatcher
from .slurm import SlurmWalltimeWatcher

__all__ = ["detect_platform", "build_watchers", "AZURE_ASSET_TAG"]

log = logging.getLogger(__name__)

AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
_DMI_FILES = ("sys_vendor", "product_name", "bios_vendor", "bios_version", "chassis_asset_tag")


def _read_dmi(dmi_dir: Path) -> dict[str, str]:
    values = {}
    for name in _DMI_FILES:
        try:
            values[name] = (dmi_dir / name).read_text(errors="replace").strip()
        except OSError:
            values[name] = ""
    return values


def _from_dmi(dmi: dict[str, str]) -> str | None:
    vendor, product, bios = dmi["sys_vendor"], dmi["product_name"], dmi["bios_vendor"]
    if "Amazon EC2" in (vendor, bios) or "amazon" in dmi["bios_version"].lower():
        return "aws"
    if product == "Google Compute Engine" or vendor == "Google":
        return "gcp"
    if vendor == "Microsoft Corporation" and product == "Virtual Machine":
        tag = dmi["chassis_asset_tag"]
        return "azure" if not tag or tag == AZURE_ASSET_TAG else None
    if vendor.startswith("Alibaba Cloud") or product.startswith("Alibaba Cloud"):
        return "alibaba"
    return None


def detect_platform(settings: Settings, dmi_dir: Path = Path("/sys/class/dmi/id"),
                    environ: Mapping[str, str] = os.environ) -> str:
    """``aws``, ``gcp``, ``azure``, ``alibaba`` or ``none``; see the module docstring."""
    if settings.platform != "auto":
        return settings.platform
    dmi = _read_dmi(dmi_dir)
    platform = _from_dmi(dmi)
    if platform is None and not any(dmi.values()):
        platform = {"AWS_ECS_EC2": "aws"}.get(environ.get("AWS_EXECUTION_ENV", ""))
    log.info("platform: %s (sys_vendor %r, product_name %r)", platform or "none",
             dmi["sys_vendor"], dmi["product_name"])
    return platform or "none"


def slurm_enabled(settings: Settings, environ: Mapping[str, str] = os.environ) -> bool:
    """``slurm.enabled`` is ``yes``, or ``auto`` with ``SLURM_JOB_ID`` set."""
    return settings.slurm.enabled == "yes" or (
        settings.slurm.enabled == "auto" and bool(environ.get("SLURM_JOB_ID")))


def build_watchers(settings: Settings, http: httpx.AsyncClient, platform: str,
                   environ: Mapping[str, str] = os.environ) -> list[Watcher]:
    """The watchers to run for ``platform`` (as returned by :func:`detect_platform`), plus Slurm's."""
    watchers: list[Watcher] = []
    if platform == "aws":
        imds = Imds(http, settings)
        watchers.append(AwsSpotWatcher(imds, settings))
        if settings.aws.rebalance:
            watchers.append(AwsRebalanceWatcher(imds, settings))
        if settings.aws.scheduled_events:
            watchers.append(AwsScheduledWatcher(imds, settings))
    elif platform == "gcp":
        watchers += [GcpPreemptedWatcher(http, settings), GcpMaintenanceWatcher(http, settings)]
        if settings.gcp.preemptible != "no":
            watchers.append(GcpPreemptibleWatcher(http, settings))
    elif platform == "azure":
        watchers.append(AzureScheduledWatcher(http, settings))
    elif platform == "alibaba":
        watchers.append(AlibabaPreemptWatcher(http, settings))
    elif platform != "none":
        raise ValueError(f"unknown platform {platform!r}")
    if slurm_enabled(settings, environ):
        watchers.append(SlurmWalltimeWatcher(settings, environ))
    return watchers
