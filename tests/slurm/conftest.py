"""The Slurm tests' cluster: one real one-node cluster per pytest process, used by one test at a time.

``slurm`` yields a :class:`~slurm_cluster.Cluster` started on first use and stopped by pid when the
session ends. Under pytest-xdist each worker that runs a Slurm test has its own cluster (their own
ports and directories), and an exclusive file lock shared by the workers lets only one test drive a
cluster at a time: a preemption test's high-priority job must find the node busy with its own job
only, and the two cores are not shared with another test's training job.

Without root or without the Debian packages (``scripts/install-system-packages.sh`` installs them as
root) every test here is skipped with a WARNING saying so.
"""

from __future__ import annotations

import fcntl
import shutil
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import Cluster, missing  # noqa: E402
from slurm_job import Job  # noqa: E402


@pytest.fixture(scope="session")
def _session_cluster(tmp_path_factory):
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
def slurm(_session_cluster, tmp_path_factory, worker_id):
    """The cluster, held exclusively (across xdist workers) for this test; its jobs cancelled after."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if worker_id != "master" else shared
    with open(shared / "slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield _session_cluster
        finally:
            _session_cluster.cancel_all()


@pytest.fixture
def make_job(slurm, tmp_path):
    def make(name: str = "job", env: dict | None = None) -> Job:
        return Job(slurm, tmp_path / name, env)
    return make
