"""The Slurm tests' cluster: one real one-node cluster per pytest process, its jobs cancelled after each test.

``slurm`` yields a :class:`~slurm_cluster.Cluster` started on first use and stopped by pid when the
session ends. Under pytest-xdist each worker that runs a Slurm test has its own cluster (its own
munged, slurmctld, slurmd, ports and directories), so the workers never see each other's jobs: a
preemption test's high-priority job finds the node busy with its own low-priority job only.

Without root or without the Debian packages (``scripts/install-system-packages.sh`` installs them as
root) every test here is skipped with a WARNING saying so.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import Cluster, missing  # noqa: E402
from slurm_job import Job  # noqa: E402


@pytest.fixture(scope="session")
def _session_cluster():
    why = missing()
    if why:
        message = f"WARNING: Slurm tests SKIPPED: {why}; run scripts/install-system-packages.sh as root"
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    cluster = Cluster().start()
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.base, ignore_errors=True)


@pytest.fixture
def slurm(_session_cluster):
    """The cluster; every job cancelled after the test."""
    try:
        yield _session_cluster
    finally:
        _session_cluster.cancel_all()


@pytest.fixture
def make_job(slurm, tmp_path):
    def make(name: str = "job", env: dict | None = None) -> Job:
        return Job(slurm, tmp_path / name, env)
    return make
