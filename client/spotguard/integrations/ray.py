"""spotguard inside Ray Train's ``train_loop_per_worker`` (``ray.train.torch.TorchTrainer``).

::

    from spotguard.integrations.ray import RayRun

    def train_loop_per_worker(config):
        model = ray.train.torch.prepare_model(Net())       # Ray set up the process group
        run = RayRun("/mnt/local/ckpt", model=model, optimizer=opt)
        for step in run.steps(config["steps"]):
            train_step(step)
        run.finish()        # reports the last commit to Ray; after a stop raises RayStopped

    TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="my-run", failure_config=FailureConfig(max_failures=-1)))

:class:`RayRun` is a :class:`~spotguard.run.Run` with what Ray changes:

* **Ranks and process group** come from Ray: TorchTrainer has initialised ``torch.distributed``
  before the loop runs, and Run agrees in its world group.
* **The job id** is ``ray-<experiment name>`` (``RunConfig(name=...)``): the same on every rank and
  at every restart of the worker group (a derived id would come from Ray's worker command line,
  which differs per restart and per rank). Give ``RunConfig(name=...)`` so that a resubmitted driver
  keeps it too; ``job_id=`` wins.
* **Signals.** Ray runs the loop in a thread of the worker actor, where no signal handler can be
  installed, and Ray's own SIGTERM handler ends the worker at once. RayRun installs spotguard's
  handlers for SIGTERM and the daemon's SIGUSR1 in the actor's main thread (through the actor's
  ``__ray_call__``), so a SIGTERM to a worker stops every rank at one step with a save, as
  outside Ray. :meth:`finish` puts Ray's handlers back.
* **A stop** ends the loop (``exit_on_stop=False``): every rank reports the committed checkpoint to
  Ray, then :meth:`finish` raises :class:`RayStopped`, so Ray's ``FailureConfig`` restarts the
  worker group, which resumes from spotguard's newest commit. Ray counts that restart against
  ``max_failures`` (its API has no "stopped cleanly, run me again"): size it as the preemptions you
  expect plus real failures, or -1.
* **Ray's checkpoints.** At the end and at a stop every rank calls ``ray.train.report``; rank 0
  adds a small pointer checkpoint (:data:`POINTER`: the newest commit's path, step, job id and
  digest, copied by Ray into its run directory as ``spotguard-step-N``), so Ray's "latest
  checkpoint" and UI name the same step. The committed directory itself is not copied (Ray refuses
  to register a directory outside its storage path without copying it; the daemon already uploads
  it to the durable store). Periodic commits finish asynchronously and on each rank at its own time, and
  ``report`` is a barrier every rank must reach equally often, so they are not reported one by one.
* **Ray's preemption information** (``ray.train.get_preemption_info``, alpha, where the installed
  Ray has it), asked every ``ray_preemption_every`` steps (a barrier across the workers), becomes a
  notice with Ray's deadline. What it lacks, and the daemon supplies: it covers only the nodes
  Ray's autoscaler is told about (KubeRay, Anyscale), not a cloud's own notice endpoint on a plain
  VM; it is polled (every 5 s), not pushed; and it says nothing of the SIGTERM a platform sends.

The daemon's notices reach the loop over ZeroMQ as anywhere else.
"""

from __future__ import annotations

import json
import logging
import signal
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from spotguard.protocol import Kind, Notice
from spotguard.run import Run

__all__ = ["RayRun", "RayStopped", "job_id_from_ray", "notice_from_ray", "POINTER"]

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_forward: dict[str, Any] = {"guard": None, "early": [], "previous": {}}
"""The guard the main thread's handlers hand signals to (one Run per worker process)."""
POINTER = "spotguard_checkpoint.json"
"""The file of the checkpoint RayRun reports to Ray: the committed directory's path, step, job
id and state digest (the directory itself stays spotguard's; the daemon uploads it)."""


class RayStopped(RuntimeError):
    """spotguard stopped the loop cleanly (a notice or a signal) and committed its step: Ray's
    ``FailureConfig`` restarts the workers, which resume from that commit."""


def job_id_from_ray(context: Any) -> str:
    """``ray-<experiment name>``: the same on every rank and at every restart of one run."""
    name = context.get_experiment_name()
    return "ray-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:200]


def notice_from_ray(info: Any) -> Notice:
    """A ``ray.train.PreemptionInfo`` as a notice: kind preempt, Ray's deadline (None when Ray has
    none), the nodes and ranks in its detail."""
    deadline = (datetime.fromtimestamp(info.deadline_ms / 1000, timezone.utc)
                if info.deadline_ms is not None else None)
    nodes = ", ".join(info.preempted_node_ids)
    return Notice(id=f"ray:preempt:{nodes}"[:256], platform="ray", kind=Kind.PREEMPT, source="ray",
                  received_at=datetime.now(timezone.utc), deadline=deadline,
                  detail=f"Ray Train: node(s) {nodes} preempted (ranks {info.preempted_ranks})"[:1024])


def _on_signal(signum: int, frame: object) -> None:
    guard = _forward["guard"]
    if guard is None:
        _forward["early"].append(signum)
    else:
        guard._on_signal(signum, frame)


def _install(_actor: Any) -> bool:
    """Runs in the worker actor's main thread (``__ray_call__``)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in _SIGNALS:
        _forward["previous"].setdefault(signum, signal.signal(signum, _on_signal))
    return True


def _attach(guard: Any) -> None:
    """Hand the main thread's signals to ``guard`` from now on, and those that came before it."""
    _forward["guard"] = guard
    while _forward["early"]:
        guard._on_signal(_forward["early"].pop(0), None)


def _restore(_actor: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        for signum, previous in _forward["previous"].items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        _forward["previous"].clear()


def _report(latest: Any, stopped: bool, job_id: str, rank0: bool) -> None:
    """``ray.train.report`` on every rank; rank 0 adds a pointer checkpoint to spotguard's commit."""
    import ray.train
    from ray.train import Checkpoint

    metrics = {"spotguard_step": latest.step if latest else 0, "stopped": stopped}
    if latest is None or not rank0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="spotguard-ray-") as pointer:
        Path(pointer, POINTER).write_text(json.dumps(
            {"path": str(latest.path), "step": latest.step, "job_id": job_id, "digest": latest.digest}))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(pointer),
                         checkpoint_dir_name=f"spotguard-{latest.path.name}")


def _in_main_thread(fn: Any) -> bool:
    import ray

    try:
        actor = ray.get_runtime_context().current_actor
        return bool(ray.get(actor.__ray_call__.remote(fn), timeout=30))
    except Exception as exc:  # noqa: BLE001 - the run goes on with the daemon's notices only
        log.warning("spotguard could not reach the Ray worker's main thread (%s): a SIGTERM to this "
                    "worker ends it without a save", exc)
        return False


class RayRun(Run):
    """A :class:`~spotguard.run.Run` inside ``train_loop_per_worker``; see the module docstring.

    :param root: The checkpoint directory (node-local disk; one per job).
    :param ray_preemption_every: Ask Ray's ``get_preemption_info`` every this many steps (a barrier
        across the workers; 0: never).
    :param kwargs: As for :class:`~spotguard.run.Run` (``exit_on_stop`` is always False).
    """

    def __init__(self, root: Any, *, ray_preemption_every: int = 0, **kwargs: Any) -> None:
        import ray.train

        context = ray.train.get_context()
        self.world_rank = context.get_world_rank()
        kwargs.setdefault("job_id", job_id_from_ray(context))
        kwargs["exit_on_stop"] = False
        self._handlers = _in_main_thread(_install)
        super().__init__(root, **kwargs)
        _attach(self.guard)
        self._ray_every = ray_preemption_every
        self._ray_notice = False

    def steps(self, total: int):  # type: ignore[override]
        for step in super().steps(total):
            yield step
            if self._ray_every and (step + 1) % self._ray_every == 0:
                self._ask_ray()

    def _ask_ray(self) -> None:
        import ray.train

        ask = getattr(ray.train, "get_preemption_info", None)
        info = ask() if ask is not None else None
        if info is None or self._ray_notice:
            return
        self._ray_notice = True
        self.guard._add_notice(notice_from_ray(info))

    def finish(self, *, at_boundary: bool = False) -> None:  # type: ignore[override]
        """Finish (or complete the stop), report the newest commit to Ray, put Ray's signal
        handlers back; raise :class:`RayStopped` after a stop."""
        if not self.stopped:
            super().finish(at_boundary=at_boundary)
        latest = self.checkpointer.latest()
        _report(latest, self.stopped, self.job_id, self.world_rank == 0)
        _forward["guard"] = None
        if self._handlers:
            _in_main_thread(_restore)
        if self.stopped:
            notice = self.guard.notice
            raise RayStopped(f"spotguard stopped at step {self.step} ({notice.detail if notice else 'stop'})"
                             f"; committed step {latest.step if latest else None}: Ray restarts the workers")
