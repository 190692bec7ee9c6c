"""``spotguard drill -- COMMAND...``: prove that a training job survives preemptions, on the job itself.

The command runs as given, twice over:

1. an uninterrupted *reference run* (``--no-reference`` skips it), without a daemon; its
   checkpoint directory is then moved into the report directory, so that the drill starts fresh;
2. the *drill*: the same command under ``--preemptions`` interruptions at random steps, of four
   kinds in turn (shuffled): ``notice`` (a daemon notice whose deadline leaves room to save),
   ``short-notice`` (a deadline too close to save: the last commit must stand), ``sigterm`` (no
   daemon, as Kubernetes or RunPod stop a pod) and ``sigkill`` (no warning at all, as on vast.ai).
   Signals go to the command's process group and to every descendant seen (``torchrun`` starts
   its workers in sessions of their own). Whatever survives a deadline is killed. The identical command is relaunched after each until it ends.

Notices come from a private daemon (``--platform none``, embedded default settings, its sockets
and state in private temporary directories), started for each launch that gets one and stopped
after it: a daemon keeps a notice pending past its deadline, and a relaunch on a real spot
machine meets a fresh node anyway. A daemon already running on the node is never used: its notice
would stop every job on the node.

The verdict comes only from the run records the library writes (``$SPOTGUARD_RECORD``, one file
per launch), never from what the job prints; see :mod:`spotguard_daemon.drill_checks`. Output: a
live timeline with a progress bar, a one-screen summary, and ``report.json`` plus
``timeline.svg`` in the report directory (:mod:`spotguard_daemon.drill_report`).

Exit statuses: 0 every check passed; 1 a check failed (the diagnosis on stderr); 2 usage;
130 interrupted. Every process the drill started is stopped on every path.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from spotguard._record import read_new
from spotguard_daemon.cli_demo import guarded
from spotguard_daemon.drill_checks import Launch, judge
from spotguard_daemon.drill_report import Live, write_report
from spotguard_daemon.supervise import (LaunchError, command_after_options, descendants, killpg,
                                         signal_each, spawn, start_daemon, stop)

__all__ = ["drill", "KINDS"]

KINDS = ("notice", "short-notice", "sigterm", "sigkill")
ROOM_S = 30.0
"""Deadline of a notice that leaves room to save, and grace after SIGTERM before the kill."""
SHORT_S = 1.0
"""Deadline of a notice too close to save (the library keeps a 2 s margin)."""
POLL_S = 0.05
STOP_S = 10.0
"""Seconds a launch gets after SIGTERM before SIGKILL, when the drill stops it."""


class DrillError(RuntimeError):
    """The drill itself could not go on (a daemon did not start, a launch ran past its time)."""


class Drill:
    """The launches of one drill; :meth:`close` stops whatever still runs."""

    def __init__(self, argv: list[str], report: Path, preemptions: int, seed: int | None,
                 timeout: float, live: Live) -> None:
        self.argv, self.report, self.live, self.timeout = argv, report, live, timeout
        self.seed = random.randrange(2**31) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.kinds = [KINDS[i % len(KINDS)] for i in range(preemptions)]
        self.rng.shuffle(self.kinds)
        self.fractions = sorted(self.rng.uniform(0.05, 0.9) for _ in range(preemptions))
        self.sockets = Path(tempfile.mkdtemp(prefix="sg-drill-", dir="/tmp"))
        self.procs: list[subprocess.Popen] = []
        self.root: Path | None = None
        """The job's checkpoint directory, from the reference's start: the drill's daemons watch it
        alone, never the working directory, where the moved reference checkpoints would be found,
        uploaded and restored by a relaunch that has no local checkpoint yet."""
        self.tree: set[int] = set()
        """Every descendant of the running launch seen so far: torchrun starts its workers in
        sessions of their own, and they outlive a torchrun killed with SIGKILL."""

    # ------------------------------------------------------------------ phases

    def reference(self) -> Launch:
        """The uninterrupted run; its checkpoints are moved aside so the drill starts fresh."""
        self.live.phase("reference run: the command, never interrupted, no daemon")
        launch = Launch(0)
        self.run_launch(launch, None)
        start = launch.first("start")
        if start:
            self.root = Path(start["root"])
        if start and start.get("resumed_from") is None and Path(start["root"]).is_dir():
            shutil.move(start["root"], self.report / "reference-checkpoints")
        return launch

    def drill(self) -> list[Launch]:
        """Launch, preempt, relaunch, until the job ends or cannot go on."""
        self.live.phase(f"drill: {len(self.kinds)} preemptions at random steps "
                        f"(--seed {self.seed} repeats them)")
        launches: list[Launch] = []
        while True:
            done = sum(launch.preempted for launch in launches)
            launch = Launch(len(launches) + 1, self.kinds[done] if done < len(self.kinds) else None)
            launches.append(launch)
            self.run_launch(launch, self._daemon(launch) if launch.kind in ("notice", "short-notice")
                            else None)
            if not launch.preempted or launch.first("finish") or len(launches) > 2 * len(self.kinds) + 2:
                return launches
            if launch.index == 1 and (launch.first("start") or {}).get("resumed_from") is not None:
                return launches  # not a fresh start: nothing after it would mean anything

    # ------------------------------------------------------------------ one launch

    def run_launch(self, launch: Launch, daemon: tuple[subprocess.Popen, str] | None) -> None:
        name = "reference" if launch.index == 0 else f"launch-{launch.index:02d}"
        record, launch.log = self.report / f"{name}.record.jsonl", self.report / f"{name}.log"
        runtime = self.sockets / (f"d{launch.index}" if daemon else "none")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(SPOTGUARD_RECORD=str(record), SPOTGUARD_RUNTIME_DIR=str(runtime))
        launch.t_launch = time.time()
        with open(launch.log, "w") as log:
            proc = self._spawn(self.argv, env, log)
        self.live.launch(launch, proc.pid)
        try:
            self._watch(launch, proc, record, daemon[1] if daemon else None)
        finally:
            stop(proc, STOP_S)
            signal_each(self.tree, signal.SIGKILL)  # workers orphaned by a killed launcher
            self.tree = set()
            if daemon:
                stop(daemon[0], STOP_S)
        launch.t_end, launch.status = time.time(), proc.returncode
        self.live.ended(launch)

    def _watch(self, launch: Launch, proc: subprocess.Popen, record: Path, endpoint: str | None) -> None:
        offset, kill_at, give_up = 0, None, time.monotonic() + self.timeout
        while True:
            running = proc.poll() is None
            events, offset = read_new(record, offset)
            for event in events:
                launch.events.append(event)
                self.live.event(launch, event)
            if not running:
                return
            self.tree |= descendants(proc.pid)
            if launch.kind and not launch.preempted and self._due(launch):
                kill_at = self._preempt(launch, proc, endpoint)
            if time.monotonic() > give_up:
                raise DrillError(f"launch {launch.index} ran longer than --launch-timeout "
                                 f"({self.timeout:g} s); see {launch.log}")
            if kill_at is not None and time.monotonic() >= kill_at:
                launch.killed, kill_at = True, None
                self._kill(proc, signal.SIGKILL)
            self.live.bar(launch)
            time.sleep(POLL_S)

    def _due(self, launch: Launch) -> bool:
        """Whether the launch reached its random target step (chosen once its start is known)."""
        start = launch.first("start")
        if start is None or not start.get("total"):
            return False
        if launch.target is None:
            fraction = self.fractions.pop(0) if self.fractions else 0.5
            launch.target = max(int(fraction * start["total"]), launch.resumed_from + 1)
        return launch.target < start["total"] and launch.reached >= launch.target

    def _preempt(self, launch: Launch, proc: subprocess.Popen, endpoint: str | None) -> float | None:
        """Deliver the preemption; return the monotonic time of the kill that follows, if any."""
        launch.preempted_at = time.time()
        self.live.preempt(launch)
        if launch.kind == "sigkill":
            launch.killed = True
            self._kill(proc, signal.SIGKILL)
            return None
        if launch.kind == "sigterm":
            self._kill(proc, signal.SIGTERM)
            return time.monotonic() + ROOM_S
        deadline = ROOM_S if launch.kind == "notice" else SHORT_S
        _notify(endpoint, deadline)
        return time.monotonic() + deadline

    # ------------------------------------------------------------------ processes

    def _spawn(self, argv: list[str], env: dict[str, str], log: object) -> subprocess.Popen:
        try:
            proc = spawn(argv, env, log, subprocess.STDOUT)
        except LaunchError as exc:
            raise DrillError(str(exc)) from exc
        self.procs.append(proc)
        return proc

    def _daemon(self, launch: Launch) -> tuple[subprocess.Popen, str]:
        runtime, state = self.sockets / f"d{launch.index}", self.sockets / f"s{launch.index}"
        config = self.sockets / "daemon.toml"
        config.write_text("[metrics]\nenabled = false\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        endpoint = f"ipc://{runtime}/requests.sock"
        with open(self.report / f"daemon-{launch.index:02d}.log", "w") as log:
            try:
                proc = start_daemon(["--config", str(config), "--platform", "none", "--runtime-dir",
                                     str(runtime), "--state-dir", str(state), "--checkpoint-root",
                                     str(self.root or os.getcwd())], env, log, endpoint)
            except LaunchError as exc:
                raise DrillError(f"the drill's daemon did not start: {exc}") from exc
        self.procs.append(proc)
        return proc, endpoint

    def _kill(self, proc: subprocess.Popen, signum: int) -> None:
        """``signum`` to the launch's process group and to every descendant, as a platform stops
        a whole machine."""
        self.tree |= descendants(proc.pid)
        killpg(proc, signum)
        signal_each(self.tree, signum)

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, STOP_S)
        shutil.rmtree(self.sockets, ignore_errors=True)


def _notify(endpoint: str | None, deadline: float) -> None:
    from spotguard.protocol import Kind, NotifyRequest
    from spotguard_daemon.cli import request

    reply = request(endpoint, NotifyRequest(kind=Kind.DRILL, deadline_seconds=deadline,
                                            detail="spotguard drill"), 5.0)
    if reply is None or not reply.ok:
        raise DrillError(f"the drill's daemon refused the notice: {reply.error if reply else 'no reply'}")


@click.command("drill", context_settings={"ignore_unknown_options": True,
                                         "allow_interspersed_args": False})
@click.option("--preemptions", "-n", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Interruptions of the drilled run, of mixed kinds.")
@click.option("--no-reference", is_flag=True,
              help="Skip the uninterrupted run (then the final state is not compared).")
@click.option("--seed", type=int, help="Seed of the random steps and kinds (default: random).")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path),
              help="New or empty directory for the report, logs and records "
                   "(default ./spotguard-drill-<time>).")
@click.option("--launch-timeout", default=3600.0, show_default=True, type=click.FloatRange(1),
              help="Seconds one launch may run before the drill kills it and fails.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill(preemptions: int, no_reference: bool, seed: int | None, report_dir: Path | None,
          launch_timeout: float, command: tuple[str, ...]) -> None:
    """Run COMMAND under random preemptions and prove it resumes exactly (spotguard drill -- CMD)."""
    command = tuple(command_after_options(command, "spotguard drill [OPTIONS] -- COMMAND [ARGS]..."))
    report = report_dir or Path(f"spotguard-drill-{time.strftime('%Y%m%d-%H%M%S')}")
    if report.exists() and any(report.iterdir()):
        raise click.BadParameter(f"{report} is not empty", param_hint="'--report-dir'")
    report.mkdir(mode=0o700, parents=True, exist_ok=True)
    live = Live(sys.stdout.isatty())
    run = Drill(list(command), report.absolute(), preemptions, seed, launch_timeout, live)

    def body() -> int:
        reference = None if no_reference else run.reference()
        launches = run.drill()
        return write_report(report, list(command), launches, reference, judge(launches, reference), live)

    sys.exit(guarded("drill", body, lambda status: run.close(), DrillError))
