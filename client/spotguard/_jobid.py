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

Every rank of every node must use one id (the store keys checkpoints by it), yet nodes launched
from different working directories derive different ones: :func:`agree` makes every rank take
rank 0's, and refuses ranks that were *given* different ids.

Exceptions: :class:`~spotguard.checkpoint.CheckpointError` from :func:`check_matches`; ``ValueError``
from :func:`agree`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from spotguard._gloo_release import released
from spotguard.checkpoint import CheckpointError

__all__ = ["derive", "resolve", "agree", "check_matches", "mismatch_message", "LEGACY_JOB", "ENV"]

ENV = "SPOTGUARD_JOB_ID"
"""An explicit job id from the environment (a scheduler or wrapper sets it); ``job_id=`` wins."""

LEGACY_JOB = "default"
"""The id every job without ``job_id`` had before ids were derived."""

MAX_LENGTH = 256
"""The longest id the daemon's protocol takes (``RegisterRequest.job_id``)."""

log = logging.getLogger("spotguard")


def derive(argv: Sequence[str] | None = None, cwd: str | None = None,
           env: Mapping[str, str] | None = None) -> str:
    """``<script name>-<10 hex digits>``, stable for the same command, directory and array task."""
    argv = list(sys.argv if argv is None else argv) or ["python"]
    cwd = os.getcwd() if cwd is None else cwd
    env = os.environ if env is None else env
    script = os.path.normpath(os.path.join(cwd, argv[0])) if argv[0] not in ("", "-c") else argv[0]
    parts = {"argv": [script, *argv[1:]], "cwd": cwd, "array_task": env.get("SLURM_ARRAY_TASK_ID", "")}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(script).stem)[:40]
    stem = stem.lstrip("-_.") or "job"  # the store takes ids that begin with a letter or digit
    return f"{stem}-{digest}"


def resolve(job_id: str = "") -> tuple[str, bool]:
    """(the id, whether it was given): ``job_id``, else ``$SPOTGUARD_JOB_ID``, else :func:`derive`'s.
    Every integration names its job this way, so none stores under an empty or shared id."""
    given = job_id or os.environ.get(ENV, "")
    return (given, True) if given else (derive(), False)


def agree(job_id: str, *, given: bool, process_group: Any = None) -> str:
    """Rank 0's ``job_id``, on every rank of ``process_group`` (collective; ``job_id`` itself when
    torch.distributed is not running). Ids the ranks *derived* may differ (each node derives from
    its own working directory): rank 0's wins, logged once on a rank whose own differed. Ids the
    ranks were *given* (``job_id=``, ``$SPOTGUARD_JOB_ID``) must be equal: ``ValueError`` otherwise,
    on every rank, naming both."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # no torch, no ranks
        return job_id
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return job_id
    encoded = job_id.encode()
    if len(encoded) > MAX_LENGTH:
        raise ValueError(f"job_id is {len(encoded)} bytes long; the most is {MAX_LENGTH}")
    from spotguard.distributed import collective_device

    device = collective_device(process_group)
    header = (int(given), len(encoded) >> 8, len(encoded) & 0xFF)  # whether given, the length
    mine = torch.zeros(len(header) + MAX_LENGTH, dtype=torch.uint8)
    mine[:len(header) + len(encoded)] = torch.tensor([*header, *encoded], dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, mine, group=process_group)
    released(mine, *gathered)  # gloo's worker let go of them (see spotguard._gloo_release)
    ids = []
    for row in (g.cpu().tolist() for g in gathered):
        length = row[1] << 8 | row[2]
        ids.append((bool(row[0]), bytes(row[3:3 + length]).decode(errors="replace")))
    given_ids = sorted({i for was_given, i in ids if was_given})
    if len(given_ids) > 1 or (given_ids and any(not was_given for was_given, _ in ids)):
        raise ValueError(f"the ranks of this job were given different job ids ({_spread(ids)}): give "
                         "every rank the same job_id= (or $SPOTGUARD_JOB_ID), or none")
    chosen = ids[0][1]
    if chosen != job_id:
        log.info("job id %s: rank 0's, used on every rank (this rank derived %s: its node launched the "
                 "command from another working directory)", chosen, job_id)
    return chosen


def _spread(ids: list[tuple[bool, str]]) -> str:
    """``'a' on ranks 0,1; 'b' (derived) on rank 2``, for a refusal message."""
    ranks: dict[tuple[bool, str], list[int]] = {}
    for rank, key in enumerate(ids):
        ranks.setdefault(key, []).append(rank)
    return "; ".join(f"{job!r}{'' if given else ' (derived)'} on rank{'s' if len(r) > 1 else ''} "
                     f"{','.join(map(str, r))}" for (given, job), r in ranks.items())


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
