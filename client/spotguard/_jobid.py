"""Job ids: which run a checkpoint (and its copy in the durable store) belongs to.

A job id names a run's checkpoints in the durable store and in the daemon's upload queue: the
``job_id=`` given to ``Run``, else ``$SPOTGUARD_JOB_ID``, else :func:`derive`'s. Without one, every job used to share ``default``: a new experiment restored another run's checkpoint on a
fresh node. :func:`derive` gives a run without ``job_id=`` a stable id from what stays the same
when the identical command is launched again (on this node or a new one) and differs between
experiments:

* the command line (``sys.argv``, the script made absolute against the working directory);
* the working directory;
* ``SLURM_ARRAY_TASK_ID`` (the tasks of one array run the same command).

Left out on purpose: ``SLURM_JOB_ID`` (a job resubmitted after a preemption gets a new one and must
resume), ``TORCHELASTIC_RUN_ID`` (``torchrun --standalone`` draws a random one per launch), the
hostname and the rank (every node and rank of one job must agree). A job whose command changes
between launches (a new flag) must pass ``job_id=`` to keep its checkpoints.

:func:`check_matches` refuses a restored checkpoint whose entries do not fit the state (another
model or another run in the same root) with a message naming the fix.

Exceptions: :class:`~spotguard.checkpoint.CheckpointError` from :func:`check_matches`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from spotguard.checkpoint import CheckpointError

__all__ = ["derive", "check_matches", "mismatch_message", "LEGACY_JOB", "ENV"]

ENV = "SPOTGUARD_JOB_ID"
"""An explicit job id from the environment (a scheduler or wrapper sets it); ``job_id=`` wins."""

LEGACY_JOB = "default"
"""The id every job without ``job_id`` had before ids were derived."""


def derive(argv: Sequence[str] | None = None, cwd: str | None = None,
           env: Mapping[str, str] | None = None) -> str:
    """``<script name>-<10 hex digits>``, stable for the same command, directory and array task."""
    argv = list(sys.argv if argv is None else argv) or ["python"]
    cwd = os.getcwd() if cwd is None else cwd
    env = os.environ if env is None else env
    script = os.path.normpath(os.path.join(cwd, argv[0])) if argv[0] not in ("", "-c") else argv[0]
    parts = {"argv": [script, *argv[1:]], "cwd": cwd, "array_task": env.get("SLURM_ARRAY_TASK_ID", "")}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(script).stem)[:40] or "job"
    return f"{stem}-{digest}"


def check_matches(manifest: Mapping[str, Any], state: Mapping[str, Any], job_id: str, path: Path) -> None:
    """Raise CheckpointError when the checkpoint at ``path`` holds none of the state's entries
    (``rng`` aside) while holding entries the state lacks: it belongs to another run."""
    saved = {e for e in manifest.get("entries") or [] if isinstance(e, str)} - {"rng"}
    wanted = set(state) - {"rng"}
    if saved and wanted and not saved & wanted:
        raise CheckpointError(mismatch_message(path, manifest, job_id,
                                               f"it holds {sorted(saved)}, this run has {sorted(wanted)}"))


def mismatch_message(path: Path, manifest: Mapping[str, Any], job_id: str, why: str) -> str:
    owner = manifest.get("job_id") or LEGACY_JOB
    return (f"the checkpoint {path} (job {owner!r}, step {manifest.get('step')}) does not fit this run "
            f"(job {job_id!r}): {why}. It belongs to another run or model: give this run its own "
            f"checkpoint root (and its own job_id= if it shares a store), or move {path.parent} away "
            "to start fresh")
