"""``spotguard drill -- COMMAND...``: prove that a training job survives preemptions, on the job itself.

The command runs as given, twice over:

1. an uninterrupted *reference run* (``--no-reference`` skips it), without a daemon; its
   checkpoint directory is then moved into the report directory, so that the drill starts fresh.
   The drill stops there, in one line, when the reference fails (a missing script: its log's last
   line is shown) or resumed (its checkpoint directory was not empty);
2. the *drill*: the same command under ``--preemptions`` interruptions, of four kinds in turn
   (shuffled): ``notice`` (a daemon notice whose deadline leaves room to save and makes the job
   stop now), ``short-notice`` (a deadline too close to save: the last commit must stand),
   ``sigterm`` (no daemon, as Kubernetes or RunPod stop a pod) and ``sigkill`` (no warning at
   all, as on vast.ai). So that commits come early, the drilled launches get
   ``$SPOTGUARD_SAVE_EVERY`` (:data:`spotguard._run_parts.SAVE_EVERY_ENV`), steps between saves
   from the reference's length, which a ``Run`` given no cadence of its own follows (a job that
   sets its own is told which argument to pass). When and how, and only as many preemptions as
   fit the job's measured length: :mod:`spotguard_daemon.commands.drill_plan`. Signals go to the command's process group and to every descendant
   seen, each checked to still be the process seen (:mod:`spotguard_daemon.commands.drill_tree`).
   Whatever survives a deadline is killed. The identical command is relaunched after each until
   it ends.
3. when the job turns out not to be reproducible run to run, a second reference, to measure how
   far apart two uninterrupted runs end, in parameters and in the last loss
   (:mod:`spotguard_daemon.commands.drill_spread`).

``--resize N`` relaunches a ``torchrun`` command on ``N`` ranks and on its own number in turn, with
no reference (nothing on another world size ends bit-identical to it), and judges the loaded state,
the sample sequence and the loss curve (:mod:`spotguard_daemon.commands.drill_resize`).

Notices come from a private daemon (``--platform none``, embedded default settings, its sockets
and state in private temporary directories), started for each launch that gets one and stopped
after it: a daemon keeps a notice pending past its deadline, and a relaunch on a real spot
machine meets a fresh node anyway. A daemon already running on the node is never used: its notice
would stop every job on the node. The private daemon gets ``--parent-pid`` (the drill's pid), so
that it stops by itself within a second when the drill dies even of a SIGKILL, which no handler
sees.

A launch that hangs is killed, its whole process group and every descendant seen, with SIGKILL,
and the drill fails naming it, what its record last showed, how long it waited and the last lines
of its output: after ``--launch-timeout``, or, for a launch that recorded its finish and does not
exit (a thread, a child or a pool left running after training), ``EXIT_GRACE_S`` plus twice what the
reference took from its finish to its exit.

The verdict comes only from the run records the library writes (``$SPOTGUARD_RECORD``, one file
per launch), never from what the job prints; see :mod:`spotguard_daemon.commands.drill_checks`. Output: a
live timeline with a progress bar, a one-screen summary, and ``report.json`` plus
``timeline.svg`` in the report directory (:mod:`spotguard_daemon.commands.drill_report`); ``--json``
prints the report on stdout's last line too. The report directory must be the user's own and
writable by no one else (:func:`~spotguard_daemon.commands.drill_tree.private_dir`).

Exit statuses: 0 PASSED; 1 FAILED (a check failed, the diagnosis on stderr); 2 usage; 3
INCONCLUSIVE (nothing failed, but fewer preemptions took effect than asked, or the final states
could not be compared: what to change is printed); 130 interrupted (SIGINT or SIGTERM: the
running launch and the daemon are stopped and the temporary directory removed first). Every
process the drill started is stopped on every path. A drill that dies without its clean-up (a
SIGKILL, the OOM killer) leaves nothing running either: its reaper, a small process of its own
started first and told of each launch over a pipe, sees the pipe close, stops the running launch as
``close()`` would (SIGTERM to its group, SIGKILL after ``STOP_S``, then its descendants seen, each
checked to still be the process seen) and removes the temporary directory
(:mod:`spotguard_daemon.commands.drill_reaper`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from spotguard._audit import ELASTIC_ENV
from spotguard._record import RecordError, read_new
from spotguard._run_parts import SAVE_EVERY_ENV
from spotguard_daemon.commands.common import Duration, guarded, held_interrupts
from spotguard_daemon.commands.drill_checks import KINDS, Launch, judge, reproducible, SPREAD_FACTOR
from spotguard_daemon.commands.drill_diff import differences
from spotguard_daemon.commands.drill_plan import Planning
from spotguard_daemon.commands.drill_reaper import Reaper
from spotguard_daemon.commands.drill_report import Live, write_report
from spotguard_daemon.commands.drill_resize import PROMISE, nproc, resize_checks, with_nproc
from spotguard_daemon.commands.drill_spread import distance, entry_of, final_loss, loss_distance
from spotguard_daemon.commands.drill_tree import Tree, new_file, private_dir
from spotguard_daemon.commands.supervise import LaunchError, command_after_options, killpg, spawn, start_daemon, stop

__all__ = ["drill", "KINDS", "EXIT_INCONCLUSIVE"]

POLL_S = 0.05
STOP_S = 10.0
"""Seconds a launch gets after SIGTERM before SIGKILL, when the drill stops it."""
EXIT_GRACE_S = 60.0
"""Seconds a launch that recorded its finish gets to exit, beyond twice what the reference took
from its finish to its exit, before the drill calls it hung at exit."""
TAIL_LINES = 5
"""Lines of a hung launch's output the drill's message shows."""
EXIT_INCONCLUSIVE = 3


class DrillError(RuntimeError):
    """The drill itself could not go on (a daemon did not start, a launch ran past its time)."""


class Drill(Planning):
    """The launches of one drill; :meth:`close` stops whatever still runs."""

    def __init__(self, argv: list[str], report: Path, preemptions: int, seed: int | None,
                 timeout: float, live: Live, resize: int | None = None) -> None:
        self.argv, self.report, self.live, self.timeout = argv, report, live, timeout
        self.sizes = (nproc(argv), resize) if resize else None
        """``--resize``: the command's ranks and the other number, launch by launch in turn."""
        self.seed = random.randrange(2**31) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.kinds = [KINDS[i % len(KINDS)] for i in range(preemptions)]
        self.rng.shuffle(self.kinds)
        self.slots = [(i + self.rng.uniform(0.2, 0.8)) / preemptions for i in range(preemptions)]
        """Where in the span of steps that can be preempted each preemption falls (0..1)."""
        self.sockets = Path(tempfile.mkdtemp(prefix="sg-drill-", dir="/tmp"))
        try:
            self.reaper = Reaper(self.sockets, STOP_S)
            """Stops the launches and removes :attr:`sockets` should the drill die unclosed."""
        except BaseException:
            shutil.rmtree(self.sockets, ignore_errors=True)
            raise
        self.procs: list[subprocess.Popen] = []
        self.root: Path | None = None
        """The job's checkpoint directory, from the reference's start: the drill's daemons watch it
        alone, never the working directory, where the moved reference checkpoints would be found,
        uploaded and restored by a relaunch that has no local checkpoint yet."""
        self.tree = Tree()
        """The running launch's descendants, by identity: torchrun starts its workers in sessions
        of their own, and they outlive a torchrun killed with SIGKILL."""
        self.measured: Launch | None = None
        """The run whose step time and save cost plan the preemptions: the reference, else the
        first launch."""
        self.save_every: int | None = None
        """Steps between saves the drilled launches are given (``$SPOTGUARD_SAVE_EVERY``), from
        the reference's length; None without a measured reference."""
        self.fitted = False
        """Whether the plan was fitted to the job's length (:meth:`_fit`)."""
        self.first: int | None = None
        """The first committed step the preemptions are spread after (set at the first plan)."""
        self.delivered = 0
        """Preemptions delivered before the running launch."""
        self.problems: list[str] = []

    # ------------------------------------------------------------------ phases

    def reference(self, name: str = "reference") -> Launch:
        """An uninterrupted run; its checkpoints are moved aside so the drill starts fresh."""
        self.live.phase(f"{name} run: the command, never interrupted, no daemon")
        launch = Launch(0, label=name)
        self.run_launch(launch, None, name)
        if name == "reference":
            self._reference_ran(launch)
        start = launch.first("start")
        if start and self.root is None:
            self.root = Path(start["root"])
        self.measured = self.measured or launch
        if start and start.get("resumed_from") is None:
            self.move_aside(launch, f"{name}-checkpoints")
        return launch

    def _reference_ran(self, launch: Launch) -> None:
        """Stop the drill (DrillError) when the reference failed: nothing after it would mean
        anything. Else choose the drilled launches' steps between saves: about two saves per
        preemption asked, so that the first commit comes early, and no closer than one save's cost
        in steps."""
        if launch.status != 0 or launch.first("finish") is None:
            how = (f"exited with status {launch.status}" if launch.status != 0 else
                   "exited 0 without finishing a spotguard run")
            if not launch.started:
                how += " before it started a spotguard run (no start event)"
            said = _cause_line(launch.log)
            raise DrillError(f"the reference run (the command, uninterrupted) {how}"
                             + (f": {said!r}" if said else "") + f"; see {launch.log}. Fix the "
                             "command first: nothing was drilled")
        self.save_every = self.every(launch)

    def move_aside(self, launch: Launch, name: str) -> None:
        """Move the launch's checkpoint root into the report directory, once it is shown to be the
        directory the job itself used (see :meth:`_own_root`); else leave it and say why."""
        root = Path((launch.first("start") or {}).get("root", ""))
        why = self._own_root(launch, root)
        if why is None:
            shutil.move(str(root), self.report / name)
        else:
            self.live.line(f"checkpoints left in place: {why}")

    def _own_root(self, launch: Launch, root: Path) -> str | None:
        """Why ``root`` is not the checkpoint directory of this launch's job, or None when it is: a
        real directory of this user, no one else's to write, neither the working directory, the
        report directory nor one above them, written by the launch's own process (its start
        event's pid), and holding every commit the launch recorded."""
        try:
            info = os.lstat(root)
        except OSError as exc:
            return f"{root}: {exc.strerror}"
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return f"{root} is not a directory of this user that no one else can write"
        real = root.resolve()
        for place in (Path.cwd(), self.report, Path.home()):
            if real == place.resolve() or real in place.resolve().parents:
                return f"{root} is, or holds, {place}"
        start = launch.first("start") or {}
        if start.get("pid") not in {launch.pid, *launch.pids}:
            return f"the record's start came from pid {start.get('pid')}, not from the launch"
        paths = [Path(c["path"]) for c in launch.of("commit") if c.get("path")]
        if any(real not in path.resolve().parents for path in paths):
            return f"the launch's commits are not all under {root}"
        return None

    def drill(self) -> list[Launch]:
        """Launch, preempt, relaunch, until the job ends or cannot go on."""
        self.live.phase(f"drill: {len(self.kinds)} preemptions (--seed {self.seed} repeats them)")
        launches: list[Launch] = []
        while True:
            done = self.delivered = sum(launch.preempted for launch in launches)
            launch = Launch(len(launches) + 1, self.kinds[done] if done < len(self.kinds) else None)
            if self.sizes:
                launch.ranks = self.sizes[(launch.index - 1) % 2]
            launches.append(launch)
            self.run_launch(launch, self._daemon(launch) if launch.kind in ("notice", "short-notice")
                            else None)
            self.measured = self.measured or launch
            if not launch.preempted or launch.first("finish") or len(launches) > 2 * len(self.kinds) + 2:
                return launches
            if launch.index == 1 and (launch.first("start") or {}).get("resumed_from") is not None:
                return launches  # not a fresh start: nothing after it would mean anything

    def spread(self, launches: list[Launch], reference: Launch) -> dict | None:
        """For a job not reproducible run to run: a second reference, and the distances of the
        drilled and the second final parameters from the first reference's."""
        if reproducible(launches, reference)[0] is not False or self.root is None:
            return None
        self.live.line("the job is not reproducible run to run: a second reference measures "
                       "how far apart two uninterrupted runs end")
        if launches[-1].first("finish") is None:
            return {"why": "the drilled run did not finish"}
        self.move_aside(launches[-1], "drill-checkpoints")
        if not (self.report / "drill-checkpoints").is_dir():
            return {"why": "the drilled run's checkpoints could not be moved aside"}
        second = self.reference("reference-2")
        base = self.report / "reference-checkpoints"
        try:
            figures = {"reference": distance(self.report / "reference-2-checkpoints", base),
                       "drill": distance(self.report / "drill-checkpoints", base)}
        except (ValueError, OSError) as exc:
            return {"why": str(exc), "second": second.point()}
        figures["threshold"] = max(SPREAD_FACTOR * figures["reference"], 1e-6)
        figures["second"] = second.point()
        figures["loss"] = _loss_spread(launches[-1], reference, second)
        return figures

    # ------------------------------------------------------------------ one launch

    def run_launch(self, launch: Launch, daemon: tuple[subprocess.Popen, str] | None,
                   name: str | None = None) -> None:
        name = name or f"launch-{launch.index:02d}"
        record, launch.log = self.report / f"{name}.record.jsonl", self.report / f"{name}.log"
        runtime = self.sockets / (f"d{launch.index}" if daemon else "none")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(SPOTGUARD_RECORD=str(record), SPOTGUARD_RUNTIME_DIR=str(runtime))
        if self.save_every and launch.index > 0:
            env[SAVE_EVERY_ENV] = str(self.save_every)
        if self.sizes:
            env[ELASTIC_ENV] = "1"
        launch.t_launch = time.time()
        with new_file(launch.log) as log:
            proc = self._spawn(with_nproc(self.argv, launch.ranks) if launch.ranks else self.argv, env, log)
        launch.pid = proc.pid
        self.live.launch(launch, proc.pid)
        try:
            self._watch(launch, proc, record, daemon[1] if daemon else None)
        finally:
            stop(proc, STOP_S)
            self.reaper.ended(proc.pid)
            launch.pids |= set(self.tree.known)
            self.tree.signal(signal.SIGKILL)  # workers orphaned by a killed launcher
            self.tree.clear()
            self.reaper.cleared()
            if daemon:
                stop(daemon[0], STOP_S)
                self.reaper.ended(daemon[0].pid)
        launch.t_end, launch.status = time.time(), proc.returncode
        self.live.ended(launch)

    def _watch(self, launch: Launch, proc: subprocess.Popen, record: Path, endpoint: str | None) -> None:
        offset, kill_at, started = 0, None, time.monotonic()
        give_up, finished_at = started + self.timeout, None
        while True:
            running = proc.poll() is None
            offset = self._read(launch, record, offset)
            self._refuse_resumed(launch)
            if not running:
                return
            self.reaper.seen(self.tree.note(proc.pid))
            if launch.kind and not launch.preempted and self._due(launch):
                kill_at = self._preempt(launch, proc, endpoint)
            now = time.monotonic()
            if finished_at is None and launch.first("finish") is not None:
                finished_at = now
            if now > give_up:
                self._hung(launch, proc, f"ran longer than --launch-timeout ({self.timeout:g} s)")
            if finished_at is not None and kill_at is None and now > finished_at + self.exit_grace():
                self._hung(launch, proc, f"had not exited {now - finished_at:.0f} s after it "
                                         f"recorded its finish ({now - started:.0f} s in)")
            if kill_at is not None and time.monotonic() >= kill_at:
                launch.killed, kill_at = True, None
                self._kill(proc, signal.SIGKILL)
            self.live.bar(launch)
            time.sleep(POLL_S)

    def exit_grace(self) -> float:
        """Seconds a launch that recorded its finish gets to exit: :data:`EXIT_GRACE_S`, plus twice
        what the measured run (the reference) took from its finish to its exit, so that a job that
        evaluates or exports after training is given the time it showed it needs."""
        finish = self.measured.first("finish") if self.measured else None
        after = self.measured.t_end - finish["t"] if finish and self.measured.t_end else 0.0
        return EXIT_GRACE_S + 2 * max(0.0, after)

    def _hung(self, launch: Launch, proc: subprocess.Popen, how: str) -> None:
        """Kill the hung launch at once (SIGKILL to its process group and to every descendant
        seen: nothing of it is judged any more) and raise DrillError saying which launch, what it
        was doing by its record, how long the drill waited and the last lines of its output."""
        launch.killed = True
        self._kill(proc, signal.SIGKILL)
        name, finish, stop_ = self.live.name(launch), launch.first("finish"), launch.first("stop")
        if launch.index == 0:
            role = "the uninterrupted run, never preempted"
        else:
            role = "the first launch" if launch.index == 1 else "a relaunch"
            role += (f", preempted ({launch.kind}) at step {launch.preempted_step}" if launch.preempted
                     else f", its {launch.kind} preemption not yet delivered" if launch.kind
                     else ", no preemption planned: the run to the end")
        if finish is not None:
            state = (f"it recorded its finish at step {finish['step']}, so it hangs at exit (a "
                     "thread, a child process or a pool left running after training?)")
        elif stop_ is not None:
            state = f"it recorded its stop at step {stop_['step']} and did not exit"
        elif launch.started:
            state = (f"its record last showed step {launch.reached}"
                     + (f" (resumed from step {launch.resumed_from})" if launch.resumed_from else ""))
        else:
            state = "it recorded no spotguard event (it never started a spotguard run)"
        tail = _last_lines(launch.log, TAIL_LINES)
        output = ("; its last output:\n" + "\n".join(f"    | {line}" for line in tail) if tail
                  else "; it printed nothing")
        raise DrillError(f"{name} {how}. It was {role}; {state}. Its process group and every "
                         f"descendant were killed (pid {proc.pid}){output}\nsee {launch.log}")

    def _refuse_resumed(self, launch: Launch) -> None:
        """The drill's first run (the reference, else launch 1) resumed: its checkpoint directory
        was not empty, and the drill must see the whole run. DrillError at once, in one line."""
        start = launch.first("start") or {}
        if launch.index > 1 or launch.label not in (None, "reference") or (
                launch.index == 1 and self.measured is not None):
            return
        if start.get("resumed_from") is not None:
            raise DrillError(f"{start.get('root')} already holds checkpoints: the "
                             f"{self.live.name(launch)} run resumed from step "
                             f"{start['resumed_from']}. Point the job at an empty checkpoint "
                             "directory, or move that one away: nothing was drilled")

    def _read(self, launch: Launch, record: Path, offset: int) -> int:
        """Take the launch's new record events; a malformed line is said once and left out."""
        problems: list[str] = []
        try:
            events, offset = read_new(record, offset, problems)
        except RecordError as exc:
            raise DrillError(str(exc)) from exc
        for event in events:
            launch.events.append(event)
            self.live.event(launch, event)
        for text in problems:
            if text not in self.problems:
                self.problems.append(text)
                self.live.line(f"{self.live.name(launch)}: malformed record line left out: {text}")
        return offset

    def _preempt(self, launch: Launch, proc: subprocess.Popen, endpoint: str | None) -> float | None:
        """Deliver the preemption; return the monotonic time of the kill that follows, if any."""
        launch.preempted_at, launch.preempted_step = time.time(), launch.reached
        self.live.preempt(launch)
        if launch.kind == "sigkill":
            launch.killed = True
            self._kill(proc, signal.SIGKILL)
            return None
        if launch.kind == "sigterm":
            self._kill(proc, signal.SIGTERM)
        else:
            _notify(endpoint, launch.deadline)
        return time.monotonic() + launch.deadline

    # ------------------------------------------------------------------ processes

    def _spawn(self, argv: list[str], env: dict[str, str], log: object) -> subprocess.Popen:
        """Start a launch, known to :meth:`close` and to the reaper before an interrupt lands."""
        with held_interrupts():
            try:
                proc = spawn(argv, env, log, subprocess.STDOUT)
            except LaunchError as exc:
                raise DrillError(str(exc)) from exc
            self.procs.append(proc)
            self.reaper.launch(proc.pid)
        return proc

    def _daemon(self, launch: Launch) -> tuple[subprocess.Popen, str]:
        runtime, state = self.sockets / f"d{launch.index}", self.sockets / f"s{launch.index}"
        config = self.sockets / "daemon.toml"
        config.write_text("[metrics]\nenabled = false\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        endpoint = f"ipc://{runtime}/requests.sock"
        with new_file(self.report / f"daemon-{launch.index:02d}.log") as log:
            try:
                proc = start_daemon(["--config", str(config), "--platform", "none", "--runtime-dir",
                                     str(runtime), "--state-dir", str(state), "--checkpoint-root",
                                     str(self.root or os.getcwd()), "--parent-pid", str(os.getpid())],
                                    env, log, endpoint,
                                    spawned=lambda proc: self.reaper.launch(proc.pid, daemon=True))
            except LaunchError as exc:
                raise DrillError(f"the drill's daemon did not start: {exc}") from exc
        self.procs.append(proc)
        return proc, endpoint

    def _kill(self, proc: subprocess.Popen, signum: int) -> None:
        """``signum`` to the launch's process group (its leader not yet reaped, so the group is
        still its) and to every descendant that is still the process seen, as a platform stops a
        whole machine."""
        self.reaper.seen(self.tree.note(proc.pid))
        killpg(proc, signum)
        self.tree.signal(signum)

    def close(self) -> None:
        """Stop every launch and daemon still running (each one's group: SIGTERM, SIGKILL after
        ``STOP_S``), kill the descendants of the launch seen last (an interrupt may have cut its
        own clean-up short), remove the temporary directory, and let the reaper go (it stops
        nothing then)."""
        for proc in reversed(self.procs):
            stop(proc, STOP_S)
        self.tree.signal(signal.SIGKILL)
        self.tree.clear()
        shutil.rmtree(self.sockets, ignore_errors=True)
        self.reaper.close()


def _last_lines(log: Path | None, count: int) -> list[str]:
    """The last ``count`` non-empty lines of a launch's log (each at most 300 characters, control
    characters shown escaped), or []."""
    from spotguard_daemon.commands.common import printable

    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 64 * 1024))
            text = file.read().decode(errors="replace")
    except (OSError, TypeError):
        return []
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [printable(line[:300]) for line in lines[-count:]]


_LAUNCHER_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
"""A line of torchrun's own log (glog's prefix: level, date, time)."""
_CAUSE = re.compile(r"^(spotguard: (?!job \S+: )|[A-Za-z_][\w.]*(Error|Exception|Exit)\b)")
"""A line that names a failure: a refusal spotguard printed (its start line excepted), or the last
line of a Python traceback."""


def _cause_line(log: Path | None) -> str:
    """The line of a failed launch's log that names why it failed: the last refusal or exception
    its own processes printed, else its last line with words in it. torchrun's report of a failed
    worker (its traceback, its boxed summary) and its log lines name none, so they are skipped."""
    lines = _last_lines(log, 200)
    failed = next((i for i in range(len(lines) - 1, -1, -1) if "ChildFailedError" in lines[i]), None)
    if failed is not None:  # drop the launcher's traceback, which ends in ChildFailedError
        lines = lines[:max((i for i in range(failed) if lines[i].startswith("Traceback (most recent")),
                           default=failed)]
    lines = [line for line in lines if not _LAUNCHER_LOG.match(line) and any(c.isalnum() for c in line)]
    return next((line for line in reversed(lines) if _CAUSE.match(line)), lines[-1] if lines else "")


def _loss_spread(last: Launch, reference: Launch, second: Launch) -> dict:
    """The final losses' relative distances from the reference's: the second reference's and
    the drilled run's, and the threshold (as for the parameters); ``why`` when not recorded."""
    base = final_loss(reference.events)
    spread = loss_distance(final_loss(second.events), base)
    drilled = loss_distance(final_loss(last.events), base)
    if spread is None or drilled is None:
        return {"why": "the record holds no final loss (the job calls no Tensor.backward on a scalar, "
                       "or its library records none)"}
    return {"reference": spread, "drill": drilled, "threshold": max(SPREAD_FACTOR * spread, 1e-6)}


def _final_differs(launches: list[Launch], reference: Launch | None) -> bool:
    """Both runs finished, with different final digests."""
    mine, theirs = launches[-1].first("finish"), reference and reference.first("finish")
    return bool(mine and theirs and mine.get("digest") != theirs.get("digest"))


def _last_commit(launches: list[Launch]) -> Path | None:
    paths = [c["path"] for launch in launches for c in launch.of("commit") if c.get("path")]
    return Path(paths[-1]) if paths else None


def _layout(launches: list[Launch], reference: Launch | None) -> dict | None:
    """The ``ddp_layout`` entry of the job's last commit (a DDP job's bucket layout, and whether a
    resume can restore it), read only when the final state differs from the reference's."""
    last = _last_commit(launches) if _final_differs(launches, reference) else None
    value = entry_of(last, "ddp_layout") if last else None
    return value if isinstance(value, dict) else None


def _differing(launches: list[Launch], reference: Launch | None, report: Path) -> tuple[list, bool] | None:
    """Where the drilled final state differs from the reference's, read from both final commits
    (:mod:`.drill_diff`) when their digests differ; None when they match or cannot be read."""
    if not _final_differs(launches, reference):
        return None
    mine, theirs = _last_commit(launches), _last_commit([reference])
    if mine is None or theirs is None:
        return None
    try:  # the reference's checkpoints were moved into the report directory
        return differences(mine, report / "reference-checkpoints" / theirs.name)
    except ValueError:
        return None


def _notify(endpoint: str | None, deadline: float) -> None:
    from spotguard.protocol import Kind, NotifyRequest
    from spotguard_daemon.commands.common import request

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
              help="New or empty directory of yours, writable by no one else, for the report, "
                   "logs and records (default ./spotguard-drill-<time>).")
@click.option("--launch-timeout", default=3600.0, show_default=True, type=Duration(1),
              help="How long one launch may run before the drill kills it and fails (seconds, "
                   "or 30m, 2h).")
@click.option("--json", "as_json", is_flag=True,
              help="Print report.json on the last line of stdout too (for CI).")
@click.option("--resize", type=click.IntRange(1, 4096), metavar="N",
              help="Relaunch a torchrun command on N ranks (its --nproc-per-node) and on its own "
                   "number in turn; judged by the state loaded, the sample sequence and the loss "
                   "curve, not bit-identity (no reference run).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill(preemptions: int, no_reference: bool, seed: int | None, report_dir: Path | None,
          launch_timeout: float, as_json: bool, resize: int | None, command: tuple[str, ...]) -> None:
    """Run COMMAND under random preemptions and prove it resumes exactly (spotguard drill -- CMD).

    \b
    Exit status: 0 PASSED, 1 FAILED (or the reference run failed), 2 usage error,
    3 INCONCLUSIVE (a kind of preemption never took effect: what to change is
    printed), 130 interrupted.
    """
    command = tuple(command_after_options(command, "spotguard drill [OPTIONS] -- COMMAND [ARGS]..."))
    try:
        if resize is not None and nproc(list(command)) == resize:
            raise ValueError(f"the command already runs {resize} ranks: --resize needs another number")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--resize'") from exc
    report = report_dir or Path(f"spotguard-drill-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        private_dir(report)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--report-dir'") from exc
    live = Live(sys.stdout.isatty())
    run = Drill(list(command), report.absolute(), preemptions, seed, launch_timeout, live, resize)
    resized = (f"{run.sizes[0]} -> {run.sizes[1]} ranks at the first relaunch (and back, in turn); "
               f"{PROMISE}") if run.sizes else None

    def body() -> int:
        if resized:
            live.phase(f"no reference run: {resized}")
        reference = None if no_reference or resized else run.reference()
        launches = run.drill()
        layout = _layout(launches, reference)  # before spread() moves the checkpoints aside
        differing = _differing(launches, reference, report)
        spread = run.spread(launches, reference) if reference else None
        checks = judge(launches, reference, len(run.kinds), spread, layout,
                       save_every=run.save_every or run.every(launches[0]), differing=differing)
        checks += resize_checks(launches) if resized else []
        return write_report(report, list(command), launches, reference, checks, live,
                            spread=spread, problems=run.problems, as_json=as_json, resize=resized)

    sys.exit(guarded("drill", body, lambda status: run.close(), DrillError))
