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
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import Cluster, missing, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "deploy" / "slurm" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_loader.py"


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


class Job:
    """A copy of deploy/slurm/train.sbatch and examples/train_loader.py (as train.py) in ``workdir``,
    submitted as a user would; ``record`` is its ``$SPOTGUARD_RECORD``."""

    def __init__(self, cluster: Cluster, workdir: Path, env: dict | None = None) -> None:
        self.cluster, self.workdir = cluster, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        shutil.copy(SBATCH_SCRIPT, workdir / "train.sbatch")
        shutil.copy(EXAMPLE, workdir / "train.py")
        self.record = workdir / "record.jsonl"
        self.env = {"SPOTGUARD_RECORD": str(self.record), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.id = ""

    def submit(self, *sbatch_options: str, args: tuple[str, ...] = ()) -> str:
        self.id = self.cluster.sbatch(*sbatch_options, "--output", "job.out", "train.sbatch", *args,
                                      cwd=self.workdir, env=self.env)
        return self.id

    def events(self, name: str | None = None) -> list[dict]:
        if not self.record.exists():
            return []
        lines = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        return [e for e in lines if name is None or e.get("event") == name]

    def output(self) -> str:
        path = self.workdir / "job.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> str:
        return self.cluster.job(self.id).get("JobState", "")

    def wait_event(self, name: str, timeout: float, count: int = 1) -> list[dict]:
        return wait_for(f"{count} {name} event(s) of job {self.id}\n{self.output()}",
                        lambda: (lambda found: found if len(found) >= count else None)(self.events(name)),
                        timeout)

    def wait_settled(self, timeout: float) -> str:
        """Wait until the job is neither running nor completing (pending again, or ended); its state."""
        def settled() -> str | None:
            busy = self.cluster.run("squeue", "-h", "-j", self.id, "-t", "R,CG,CF", "-o", "%i", check=False)
            return None if busy.strip() else self.state()
        return wait_for(f"job {self.id} settled\n{self.output()}", settled, timeout)

    def wait_state(self, *states: str, timeout: float) -> str:
        return wait_for(f"job {self.id} in {states}\n{self.output()}",
                        lambda: (lambda s: s if s in states else None)(self.state()), timeout)


@pytest.fixture
def make_job(slurm, tmp_path):
    def make(name: str = "job", env: dict | None = None) -> Job:
        return Job(slurm, tmp_path / name, env)
    return make
