"""A training job submitted as a user would: deploy/slurm/train.sbatch running examples/train_loader.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from slurm_cluster import Cluster, wait_for

__all__ = ["EXAMPLE", "Job", "SBATCH_SCRIPT", "read_record"]

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "deploy" / "slurm" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_loader.py"


def read_record(path: Path, name: str | None = None) -> list[dict]:
    """The events of a run record (``$SPOTGUARD_RECORD``), only those called ``name`` when given."""
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if name is None or e.get("event") == name]


class Job:
    """A copy of deploy/slurm/train.sbatch and examples/train_loader.py (as train.py) in ``workdir``,
    submitted as a user would; ``record`` is its ``$SPOTGUARD_RECORD``."""

    def __init__(self, cluster: Cluster, workdir: Path, env: dict | None = None) -> None:
        self.cluster, self.workdir = cluster, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        shutil.copy(SBATCH_SCRIPT, workdir / "train.sbatch")
        shutil.copy(EXAMPLE, workdir / "train.py")
        self.record = workdir / "record.jsonl"
        self.env = {"SPOTGUARD_RECORD": str(self.record), "PYTHONUNBUFFERED": "1",
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "TMPDIR": str(cluster.base / "tmp"), **(env or {})}  # removed with the cluster
        self.id = ""

    def submit(self, *sbatch_options: str, args: tuple[str, ...] = ()) -> str:
        self.id = self.cluster.sbatch(*sbatch_options, "--output", "job.out", "train.sbatch", *args,
                                      cwd=self.workdir, env=self.env)
        return self.id

    def events(self, name: str | None = None) -> list[dict]:
        return read_record(self.record, name)

    def stopped_at_checkpoint(self, stop: dict) -> dict:
        """The commit of the step ``stop`` stopped at, checked: an emergency save when the stop says it
        saved, else the periodic one that had just been committed at that step (nothing to save)."""
        commit = self.events("commit")[-1]
        assert commit["step"] == stop["step"], (commit, stop)
        assert (commit["kind"] == "emergency") is stop["saved"], (commit, stop)
        return commit

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
            return self.state() if self.cluster.busy(self.id) is False else None
        return wait_for(f"job {self.id} settled\n{self.output()}", settled, timeout)

    def wait_state(self, *states: str, timeout: float) -> str:
        return wait_for(f"job {self.id} in {states}\n{self.output()}",
                        lambda: (lambda s: s if s in states else None)(self.state()), timeout)
