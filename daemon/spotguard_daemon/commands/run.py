"""``spotguard run [OPTIONS] -- COMMAND...``: run a training command, relaunch it after preemptions.

The command (``python train.py``, ``torchrun ...``, a shell script) runs in a session of its own
with the supervisor's stdin, stdout and stderr. When it ends:

* status 0 ends the run;
* status 75 (a clean stop after a notice), 76 (the forced-exit watchdog) or 77 (a peer rank or node
  of a multi-node job was lost) relaunches the identical command, unless the node is going away: a *terminating* notice from the platform (or the daemon's
  own SIGTERM) is pending and due within ``--useful-seconds``. Then the supervisor exits 75, so that
  the scheduler places the job elsewhere. A drill or manual notice (``spotguard notify``), a
  cancelled notice, or one due further away does not stop the relaunch; the ids of the manual ones
  are passed to the job (``$SPOTGUARD_HANDLED_NOTICES``), which the earlier launch already obeyed.
  A launcher's failure status after the job recorded a clean stop or a lost peer and no finish
  counts as 75 (``torchrun`` exits 1 when its workers exit 75 or 77). A launch that made no
  progress (its record shows no step past the one it resumed from; without a record, it ran under
  a minute) is relaunched after ``--backoff`` seconds doubled each time, and after three such
  launches in a row not at all;
* any other status ends the run, unless ``--max-restarts N``: then up to N relaunches, after
  ``--backoff`` seconds doubled each time up to ``--backoff-max``.

The supervisor exits with the last launch's status (a signal ``S`` counts as ``128 + S``, 127 when
the command does not exist). It reaches the node's daemon, or starts one on the same settings
(``--config``, the environment) when none answers, unless ``--no-daemon``; the one it starts is
stopped at the end, and one that cannot start leaves the job running without a daemon. It registers
the job's processes that catch the daemon's delivery signal (``delivery.signal``, SIGUSR1 by
default) with the daemon over its ``ipc://`` socket, so that jobs that do not import spotguard learn
of notices too, and reports them safe after their exit 75; the daemon accepts only the sender's own
descendants (:mod:`spotguard_daemon.core.peers`). Over ``tcp://`` nothing is registered (the daemon would
signal none of them), which it says at start. A socket directory another user could have made
(:func:`spotguard._paths.untrusted`) is refused at start: one line, exit 1, nothing launched.
What a launch leaves running after it exited (a background child) is ended before the next launch
and at the end: the supervisor is a subreaper, so every process under the command stays its
descendant. Python's multiprocessing helpers (a data loader's forkserver and resource tracker) are
given a few seconds to end by themselves and are not reported as leftovers. SIGTERM, SIGINT and SIGHUP to the supervisor are
forwarded to the command's process group (a launcher passes them on to its workers) and end the
relaunching; SIGUSR1 and SIGUSR2 are forwarded only. As PID 1 (a container's entry point) it reaps
orphans too.

At the end a one-line summary on stderr (:mod:`spotguard_daemon.commands.run_summary`); ``--json`` prints it
as one JSON object on the last line of stdout. ``$SPOTGUARD_RECORD`` is used when set, else a
private record file is given to the job and removed at the end (a supervisor killed before that
leaves it to the next one's start: :mod:`spotguard_daemon.commands.run_private`).

Exceptions: none escape; usage errors exit 2 (one line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
from spotguard._paths import untrusted
from spotguard._record import ENV as RECORD_ENV, RecordError, check_path, read_new
from spotguard.exit_codes import EXIT_PREEMPTED
from spotguard.guard import HANDLED_ENV
from spotguard.protocol import Notice

from spotguard_daemon.commands.common import Duration, daemon_status, settings_or_exit
from spotguard_daemon.commands.run_private import RECORD, Private
from spotguard_daemon.commands.run_summary import PREEMPTED, Launch, human, summary
from spotguard_daemon.commands.supervise import (STOP_S, CommandNotFound, LaunchError, Registrar,
                                        become_subreaper, command_after_options,
                                        killpg, leftovers, reap, signal_each, spawn, start_daemon,
                                        stop)
from spotguard_daemon.proctree import mp_helper

__all__ = ["run", "Supervisor"]

ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals to the supervisor that are forwarded and end the relaunching."""
FORWARDED = ENDING + (signal.SIGUSR1, signal.SIGUSR2)
POLL_S, SCAN_S = 0.05, 0.5
HELPER_S = 3.0
"""Seconds a launch's multiprocessing helpers get to end by themselves after it exited."""
GOING = "node going away"
FRESH_ENV = "SPOTGUARD_FRESH"
"""``spotguard._run_start.FRESH_ENV``: a fresh start, passed to the first launch only."""
STUCK = 3
"""Preempted launches in a row without progress after which relaunching stops."""
QUICK_S = 60.0
"""A preempted launch without a record made no progress when it ran shorter than this."""


def _say(message: str) -> None:
    click.echo(f"spotguard run: {message}", err=True)


def _without_progress(launch: Launch) -> bool:
    """A preempted launch that got nowhere: its record shows no step past the one it resumed from,
    or, without a record (a job that does not import spotguard), it ran under QUICK_S seconds."""
    if not launch.preempted:
        return False
    if launch.resumed_from is None:
        return launch.t_end - launch.t_start < QUICK_S
    return launch.reached == launch.resumed_from


class Supervisor:
    """The launches of one ``spotguard run``; see the module docstring."""

    def __init__(self, argv: list[str], env: dict[str, str], record: Path, endpoint: str | None,
                 delivery: int | None, *, useful_seconds: float, max_restarts: int, backoff: float,
                 backoff_max: float, max_preemptions: int) -> None:
        self.argv, self.env, self.record, self.endpoint = argv, env, record, endpoint
        self.useful, self.max_restarts = useful_seconds, max_restarts
        self.max_preemptions = max_preemptions
        self.backoff, self.backoff_max = backoff, backoff_max
        self.launches: list[Launch] = []
        self.handled: set[str] = set()
        self.ending: int | None = None
        """The ending signal the supervisor received, if any."""
        self.reason = ""
        self.others: list[subprocess.Popen] = []
        """Other children (a daemon it started), reaped by pid when the supervisor is PID 1."""
        self._signals: list[int] = []
        self.subreaper = False
        """Whether the command's orphans are reparented to the supervisor (set when it runs)."""
        self.registrar = Registrar(endpoint, delivery) if endpoint and delivery else None
        self._offset = record.stat().st_size if record.exists() else 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Launch until the command ends for good; return its status."""
        self.subreaper = become_subreaper()  # what a launch leaves behind stays below it
        while True:
            status = self._launch()
            delay = self._next(status)
            if delay is None:
                clean = self.launches[-1].preempted and status not in PREEMPTED  # torchrun's 1
                return EXIT_PREEMPTED if self.reason == GOING or clean else status
            if delay and not self._sleep(delay):
                self.reason = f"{signal.Signals(self.ending).name} received before the relaunch"
                return status

    def _next(self, status: int) -> float | None:
        """Seconds to wait before the next launch, or None to stop (``reason`` says why)."""
        self._take_signals(None)  # an ending signal that came after the command ended
        if self.reason:  # the command could not start: the same command would fail the same way
            return None
        if self.ending is not None:
            self.reason = f"{signal.Signals(self.ending).name} received"
        elif status == 0:
            self.reason = "the command succeeded"
        elif self.launches[-1].preempted:
            return self._after_preemption(status)
        else:
            return self._after_failure(status)
        return None

    def _after_failure(self, status: int) -> float | None:
        failures = sum(l.failed for l in self.launches)
        if failures <= self.max_restarts:
            delay = min(self.backoff * 2 ** (failures - 1), self.backoff_max)
            _say(f"the command failed with status {status}; restart {failures} of "
                 f"{self.max_restarts} in {delay:g} s")
            return delay
        self.reason = f"the command failed with status {status}"
        if self.max_restarts:
            self.reason = f"max restarts ({self.max_restarts}) reached; status {status}"
            _say(self.reason)
        return None

    def _after_preemption(self, status: int) -> float | None:
        preemptions = sum(l.preempted for l in self.launches)
        if preemptions > self.max_preemptions:
            self.reason = f"max preemptions ({self.max_preemptions}) reached"
        elif self._stuck():
            self.reason = f"{STUCK} launches in a row stopped without progress"
            _say(f"{self.reason}: not relaunching (is a notice the job cannot ignore pending?)")
        elif (notice := self._node_going()) is not None:
            left = notice.seconds_left()
            self.reason = GOING
            _say(f"notice {notice.id} ({notice.kind.value}, "
                 + ("no deadline" if left is None else f"due in {left:.0f} s")
                 + f") is pending for this node: exiting {EXIT_PREEMPTED} so that the scheduler "
                 "places the job elsewhere")
        else:
            why = "a peer was lost" if self.launches[-1].peer_lost else "a notice"
            idle = self._idle_in_a_row()
            delay = min(self.backoff * 2 ** (idle - 1), self.backoff_max) if idle else 0.0
            _say(f"the command stopped with status {status} after {why}; relaunching it"
                 + (f" in {delay:g} s ({idle} launch(es) in a row without progress)" if delay else ""))
            return delay
        return None

    def _idle_in_a_row(self) -> int:
        """How many of the last launches in a row were preempted without progress."""
        count = 0
        for launch in reversed(self.launches):
            if not _without_progress(launch):
                break
            count += 1
        return count

    def _stuck(self) -> bool:
        """The last STUCK launches were all preempted without progress."""
        return self._idle_in_a_row() >= STUCK

    def _node_going(self) -> Notice | None:
        """A pending terminating notice that is not manual and due within ``useful`` seconds."""
        data = daemon_status(self.endpoint, 2.0) if self.endpoint else None
        for raw in (data or {}).get("notices", []):
            try:
                notice = Notice.model_validate(raw)
            except ValueError:  # a daemon of another version: that notice cannot be judged
                continue
            if not notice.terminating:
                continue
            if notice.source == "manual":
                self.handled.add(notice.id)
                continue
            left = notice.seconds_left()
            if left is None or left <= self.useful:
                return notice
        return None

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False when an ending signal came meanwhile."""
        until = time.monotonic() + seconds
        while time.monotonic() < until and self.ending is None:
            self._take_signals(None)
            time.sleep(POLL_S)
        return self.ending is None

    # ------------------------------------------------------------------ one launch

    def _launch(self) -> int:
        launch = Launch(len(self.launches) + 1, t_start=time.time())
        self.launches.append(launch)
        env = dict(self.env)
        if launch.index > 1:  # a fresh start is the first launch's: the relaunches resume it
            env.pop(FRESH_ENV, None)
        if self.handled:
            env[HANDLED_ENV] = ",".join(sorted(self.handled))
        try:
            proc = spawn(self.argv, env)
        except CommandNotFound as exc:
            return self._not_started(launch, 127, str(exc))
        except LaunchError as exc:
            return self._not_started(launch, 126, str(exc))
        launch.pid = proc.pid
        launch.status = self._wait(proc)
        launch.t_end = time.time()
        self._end_leftovers(launch)
        launch.events = self._read_record()
        if self.registrar is not None and launch.status == EXIT_PREEMPTED:
            self.registrar.report_safe()
        return launch.status

    def _read_record(self) -> list[dict]:
        """The launch's valid record events; a malformed line or an untrusted file is said once per
        cause and left out, never a crash."""
        problems: list[str] = []
        try:
            events, self._offset = read_new(self.record, self._offset, problems)
        except RecordError as exc:
            events, problems = [], [str(exc)]
        for text in dict.fromkeys(problems):
            _say(f"ignored in the run record: {text}")
        return events

    def _not_started(self, launch: Launch, status: int, message: str) -> int:
        _say(message)
        launch.status, launch.t_end = status, time.time()
        self.reason = message
        return status

    def _end_leftovers(self, launch: Launch) -> None:
        """End what the launch left running (a background child, a worker its launcher did not
        stop) before the next launch or the exit: SIGTERM to each process under the supervisor
        but the daemon it started (and, where it cannot be a subreaper, of the launch's process
        group), SIGKILL after STOP_S seconds. A subreaper's orphans are its own children, so their
        pids cannot be reused before they are reaped here. Python's multiprocessing helpers (a
        loader's forkserver and resource tracker, :func:`mp_helper`) end by themselves once the
        job's pipes close: they get HELPER_S seconds to, and are not reported as the job's."""
        group = None if self.subreaper else launch.pid
        left = leftovers(group, [p.pid for p in self.others])
        if any(mp_helper(pid) for pid in left):
            until = time.monotonic() + HELPER_S
            while any(mp_helper(pid) for pid in left) and time.monotonic() < until:
                time.sleep(POLL_S)
                reap(self.others)
                left = leftovers(group, [p.pid for p in self.others])
        if not left:
            return
        job_left = sorted(pid for pid in left if not mp_helper(pid))
        if job_left:
            _say(f"launch {launch.index} left {len(job_left)} process(es) running after it exited "
                 f"(pids {', '.join(map(str, job_left))}): ending them")
        for signum in (signal.SIGTERM, signal.SIGKILL):
            signal_each(left, signum)  # by pid: the group's leader is reaped, its pgid may be reused
            until = time.monotonic() + STOP_S
            while left and time.monotonic() < until:
                time.sleep(POLL_S)
                reap(self.others)
                left = leftovers(group, [p.pid for p in self.others])
            if not left:
                return
        _say(f"could not end pids {', '.join(map(str, sorted(left)))} (still running)")

    def _wait(self, proc: subprocess.Popen) -> int:
        scan_at = 0.0
        while proc.poll() is None:
            self._take_signals(proc)
            reap([proc, *self.others])  # orphans reparented here (PID 1 or a subreaper)
            if time.monotonic() >= scan_at and self.registrar is not None:
                scan_at = time.monotonic() + SCAN_S
                self.registrar.scan(proc.pid)
            time.sleep(POLL_S)
        code = proc.returncode
        return 128 - code if code < 0 else code

    # ------------------------------------------------------------------ signals

    def on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)  # nothing else in a handler

    def _take_signals(self, proc: subprocess.Popen | None) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in ENDING and self.ending is None:
                self.ending = signum
                _say(f"{signal.Signals(signum).name} received: passing it on; no relaunch "
                     "after this")
            if proc is not None:
                killpg(proc, signum)  # the group only, as a terminal does: a launcher passes it on


# ---------------------------------------------------------------------- the command


def _daemon(settings, config: str | None, start: bool) -> tuple[bool, subprocess.Popen | None]:
    """Reach the node's daemon, or start one on ``settings`` when none answers and ``start``:
    (whether one answers, the one started)."""
    endpoint = settings.request_endpoint
    if daemon_status(endpoint, 1.0) is not None:
        return True, None
    if not start:
        _say(f"no daemon on {endpoint} (--no-daemon): signals and exit statuses only")
        return False, None
    try:
        args = ["--config", config] if config else []
        proc = start_daemon(args, dict(os.environ), None, endpoint)
    except LaunchError as exc:  # the job matters more than the daemon: run it without one
        _say(f"no daemon answered on {endpoint} and none could be started ({exc}): signals and "
             "exit statuses only")
        return False, None
    _say(f"no daemon answered on {endpoint}: started one (pid {proc.pid})")
    return True, proc


def _child_env(settings, record: Path) -> dict[str, str]:
    """The job's environment: the supervisor's, the record, and where the daemon is."""
    env = dict(os.environ)
    env.setdefault(RECORD_ENV, str(record))
    env.setdefault("SPOTGUARD_ZMQ__REQUEST_ENDPOINT", settings.request_endpoint)
    env.setdefault("SPOTGUARD_ZMQ__PUB_ENDPOINT", settings.pub_endpoint)
    env.pop(HANDLED_ENV, None)
    return env


def _delivery_signal(settings) -> int | None:
    """The signal whose handlers are registered with the daemon; None for none, and over
    ``tcp://``, where the daemon cannot prove who registers and so signals nobody (said once)."""
    name = settings.delivery.signal
    if name == "none":
        return None
    if settings.request_endpoint.startswith("tcp://"):
        _say(f"the daemon is reached over {settings.request_endpoint}, which cannot prove which "
             f"processes are the job's: it sends {name} to none of them, so a job that does not "
             "import spotguard hears no notice; to have it signalled, reach the daemon over "
             "ipc:// on a volume shared with it (SPOTGUARD_RUNTIME_DIR)")
        return None
    return int(signal.Signals[name])


def _refuse_untrusted(settings) -> None:
    """Exit 1 with one line when a socket's directory could have been made by another user (who
    would then serve a fake daemon: forged notices, a job stopped for nothing)."""
    for endpoint in (settings.request_endpoint, settings.pub_endpoint):
        if why := untrusted(endpoint):
            _say(why)
            sys.exit(1)


@click.command("run", context_settings={"ignore_unknown_options": True,
                                       "allow_interspersed_args": False})
@click.option("--config", metavar="PATH", help="TOML settings of the daemon to reach or start.")
@click.option("--no-daemon", is_flag=True,
              help="Do not start a daemon when none answers (signals and exit statuses only).")
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(0),
              help="Relaunches after a failure (a status other than 0, 75, 76, 77).")
@click.option("--backoff", default=1.0, show_default=True, type=Duration(0),
              help="Wait before the first relaunch after a failure, or after a preemption "
                   "without progress (seconds, or 500ms, 1m); doubled each time.")
@click.option("--backoff-max", default=60.0, show_default=True, type=Duration(0),
              help="Longest wait before a relaunch (seconds, or 2m, 1h).")
@click.option("--max-preemptions", default=1000, show_default=True, type=click.IntRange(0),
              help="Relaunches after a preemption (75, 76, 77) at most.")
@click.option("--useful-seconds", default=600.0, show_default=True, type=Duration(0),
              help="A pending platform notice due further away than this (seconds, or 10m) still "
                   "gets a relaunch.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout too.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(config: str | None, no_daemon: bool, as_json: bool, command: tuple[str, ...],
        **options) -> None:
    """Run COMMAND; relaunch it after preemptions (spotguard run [OPTIONS] -- COMMAND...).

    \b
    After status 75, 76 or 77 the identical command runs again, unless a platform
    notice for this node is pending (then it exits 75: place the job elsewhere).
    After any other failure only with --max-restarts. Exits with the last
    status of the command (127: not found; 128+N: killed by signal N).
    """
    command = command_after_options(command, "spotguard run [OPTIONS] -- COMMAND [ARGS]...")
    try:  # a record another user made (or a FIFO) could forge preemptions or hang the supervisor
        check_path(os.environ.get(RECORD_ENV) or "")
    except RecordError as exc:
        raise click.UsageError(f"${RECORD_ENV}: {exc}") from exc
    settings = settings_or_exit(config)
    _refuse_untrusted(settings)
    private = Private()  # removes those of supervisors killed before they could
    started = time.time()
    daemon = None
    try:
        reached, daemon = _daemon(settings, config, not no_daemon)
        sup = Supervisor(list(command), _child_env(settings, private.path / RECORD),
                         Path(os.environ.get(RECORD_ENV) or private.path / RECORD),
                         settings.request_endpoint if reached else None,
                         _delivery_signal(settings) if reached else None,
                         **options)
        sup.others = [daemon] if daemon else []
        for signum in FORWARDED:
            signal.signal(signum, sup.on_signal)
        status = sup.run()
    finally:
        if daemon is not None:
            stop(daemon, 60.0)
        private.close()
    figures = summary(sup.launches, status, time.time() - started, sup.reason)
    _say(human(figures))
    if as_json:
        click.echo(json.dumps(figures))
    sys.exit(status)
