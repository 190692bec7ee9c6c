"""``spotguard demo``: the README's first command. A training job rides out a preemption, locally.

No cloud account, no root, 15-40 s on 2 cores (more when the machine is loaded). In a private workspace:

1. *node 1*: a daemon (``--platform none``, durable store ``file://<workspace>/durable``) starts;
2. the example job (:mod:`spotguard_examples.train_plain`) starts beside it; its first checkpoint
   is committed locally and the daemon makes it durable;
3. a drill notice (a ``NotifyRequest``, as ``spotguard notify`` sends) makes the job save an
   emergency checkpoint and exit 75 (``EXIT_PREEMPTED``); the daemon makes that one durable too;
4. node 1 is reclaimed: its daemon drains and stops, and the local checkpoints are deleted;
5. *node 2*: a fresh daemon; the newest checkpoint is restored from the durable store and the
   identical command resumes from it and finishes;
6. an uninterrupted reference run, beside step 5; both final digests (sha256 of the model's and
   the optimizer's state) must match.

Why a second node: a daemon keeps a notice pending until long after its deadline, so a job
relaunched beside the daemon that announced it would stop again at once. On a real spot machine
the relaunch happens on a new machine anyway, with nothing but the durable store.

Exit statuses: 0 the digests match; 1 they differ or a step failed (the reason on stderr, the
workspace kept); 2 usage; 130 interrupted. Every child is stopped on every path, Ctrl-C and SIGTERM
included: SIGTERM, then SIGKILL after ``STOP_TIMEOUT``.

Exceptions::

    DemoError    a step did not happen as expected (the command turns it into exit status 1)
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Callable

import click

from spotguard_daemon.commands.common import Duration, guarded

__all__ = ["DemoError", "Timeline", "demo", "verdict"]

JOB_MODULE = "spotguard_examples.train_plain"
JOB_ID = "default"
"""The durable store's name for a job that reports no job id (as the example does)."""
NOTICE_DEADLINE = 20.0
STOP_TIMEOUT = 10.0
EXIT_PREEMPTED = 75


class DemoError(RuntimeError):
    """A step of the demo did not happen as expected; the message names the log to read."""


class Child:
    """A subprocess in its own session (Ctrl-C reaches only the demo, which stops it in order),
    its merged output copied to ``log`` and queued line by line for :meth:`expect`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log, self.lines = name, log, queue.Queue()
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid, self.ended = self.proc.pid, False
        threading.Thread(target=self._pump, name=f"demo-{name}", daemon=True).start()

    def _pump(self) -> None:
        with open(self.log, "w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, pattern: str, timeout: float) -> re.Match:
        """The next line that matches ``pattern``; DemoError after ``timeout`` or at exit."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        while not self.ended and (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.ended = line is None
            if line is not None and (match := regex.search(line)):
                return match
        why = f"exited with status {self.proc.wait()}" if self.ended \
            else f"printed nothing expected within {timeout:g} s"
        raise self.failed(why)

    def failed(self, why: str) -> DemoError:
        """A DemoError naming this child, with the last lines of its log."""
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-3:]
        except OSError:
            tail = []
        return DemoError("\n    ".join([f"{self.name} {why}; see {self.log}", *tail]))

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` while this child runs; DemoError when it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise self.failed(f"did not {what}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self.failed(f"did not exit within {timeout:g} s") from None

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; a no-op once it exited."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Timeline:
    """Prints one line per event, in seconds since the demo started."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def event(self, text: str) -> None:
        click.echo(f"{time.monotonic() - self.t0:5.1f}s  {text}")


class Workspace:
    """The demo's private directories (0700); sockets live apart, under a short /tmp path."""

    def __init__(self, workdir: Path | None) -> None:
        if workdir is not None and workdir.exists() and any(workdir.iterdir()):
            raise click.BadParameter(f"{workdir} is not empty", param_hint="'--workdir'")
        self.root = workdir or Path(tempfile.mkdtemp(prefix="spotguard-demo-"))
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sockets = Path(tempfile.mkdtemp(prefix="sg-demo-", dir="/tmp"))
        self.ckpt_root, self.logs = self.root / "ckpt", self.root / "logs"
        self.job_dir, self.durable = self.ckpt_root / "job", self.root / "durable"
        for path in (self.ckpt_root, self.logs, self.durable):
            path.mkdir(mode=0o700)
        self.store_url = f"file://{self.durable}"
        self.config = self.root / "spotguard.toml"
        self.config.write_text(f"[storage]\nurl = {json.dumps(self.store_url)}\n"
                               "[metrics]\nenabled = false\n[signal]\ngrace = 5.0\n")

    def remove(self, keep: bool) -> None:
        shutil.rmtree(self.sockets, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


class Demo:
    """The steps of the story, each a few lines; children are stopped by :meth:`close`."""

    def __init__(self, ws: Workspace, steps: int, step_sleep: float) -> None:
        self.ws, self.tl, self.children = ws, Timeline(), []
        self.job_args = ["--steps", str(steps), "--save-every", str(max(1, steps // 4))]
        self.step_sleep = step_sleep

    def spawn(self, name: str, argv: list[str], runtime: Path) -> Child:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env["SPOTGUARD_RUNTIME_DIR"] = str(runtime)
        env["SPOTGUARD_JOB_ID"] = JOB_ID  # the job's checkpoints in the store, restored by _restore
        child = Child(name, [sys.executable, "-m", *argv], env, self.ws.logs / f"{name}.log")
        self.children.append(child)
        return child

    def start_daemon(self, node: str) -> tuple[Child, str]:
        runtime = self.ws.sockets / node
        daemon = self.spawn(f"daemon-{node}", [
            "spotguard_daemon", "daemon", "--config", str(self.ws.config), "--platform", "none",
            "--runtime-dir", str(runtime), "--state-dir", str(self.ws.root / node / "state"),
            "--checkpoint-root", str(self.ws.ckpt_root)], runtime)
        endpoint = f"ipc://{runtime}/requests.sock"
        daemon.wait_for(lambda: _status(endpoint) is not None, 30.0, "answer status")
        self.tl.event(f"{node}: daemon started (pid {daemon.pid}, platform none; "
                      f"sockets in {runtime})")
        return daemon, endpoint

    def start_job(self, name: str, runtime: Path, ckpt_dir: Path, step_sleep: float) -> Child:
        return self.spawn(name, [JOB_MODULE, *self.job_args, "--ckpt-dir", str(ckpt_dir),
                                 "--step-sleep", str(step_sleep)], runtime)

    def wait_durable(self, daemon: Child, endpoint: str, step: int) -> None:
        daemon.wait_for(lambda: _durable_step(endpoint) >= step, 30.0, f"make step {step} durable")
        self.tl.event(f"step {step} durable in {self.ws.store_url} "
                      "(daemon status: uploads.durable)")

    def first_run(self) -> int:
        """Node 1: the job runs, commits, gets a notice, saves, exits 75; return its last step."""
        daemon, endpoint = self.start_daemon("node-1")
        job = self.start_job("job-1", self.ws.sockets / "node-1", self.ws.job_dir, self.step_sleep)
        job.expect(r"start step=0\b", 60.0)
        self.tl.event(f"job started from scratch (pid {job.pid})")
        first = int(job.expect(r"^checkpoint step=(\d+)", 60.0)[1])
        self.tl.event(f"checkpoint committed at step {first}")
        self.wait_durable(daemon, endpoint, first)
        _notify(endpoint)
        self.tl.event(f"notice: drill, deadline in {NOTICE_DEADLINE:g} s "
                      "(as `spotguard notify` sends)")
        saved = self.preempted(job)
        self.wait_durable(daemon, endpoint, saved)
        daemon.stop(STOP_TIMEOUT)
        shutil.rmtree(self.ws.job_dir)
        self.tl.event("node-1 reclaimed: daemon drained and stopped, local checkpoints gone")
        return saved

    def preempted(self, job: Child) -> int:
        """Read the job's lines up to its stop; it must exit 75. Return the step it stopped at."""
        saved = None
        pattern = r"^(?:checkpoint step=(\d+)|rank=0 stopped step=(\d+)|final step=(\d+))"
        while (match := job.expect(pattern, 30.0))[1]:
            saved = int(match[1])
        if match[3]:
            raise DemoError(f"the job finished (step {match[3]}) before the notice reached it; "
                            "give it more time with --steps or --step-sleep")
        step, status = int(match[2]), job.wait(30.0)
        if status != EXIT_PREEMPTED:
            raise job.failed(f"exited with status {status}, not {EXIT_PREEMPTED}")
        how = "saved an emergency checkpoint" if saved == step else "stopped, already saved,"
        self.tl.event(f"job {how} at step {step} and exited with status 75 (EXIT_PREEMPTED)")
        return step

    def second_run(self, saved: int) -> str:
        """Node 2: restore from the durable store, relaunch the same command; return its digest."""
        self.start_daemon("node-2")
        restored = _restore(self.ws.store_url, self.ws.job_dir)
        self.tl.event(f"step {restored} restored from the durable store into {self.ws.job_dir}")
        job = self.start_job("job-2", self.ws.sockets / "node-2", self.ws.job_dir, self.step_sleep)
        self.tl.event(f"identical command relaunched (pid {job.pid})")
        resumed = int(job.expect(r"start step=(\d+)", 60.0)[1])
        if resumed != saved:
            raise job.failed(f"resumed at step {resumed}, not at {saved}")
        self.tl.event(f"job resumed at step {resumed}")
        return self.finished(job, "job")

    def finished(self, job: Child, what: str) -> str:
        match = job.expect(r"^final step=(\d+) digest=([0-9a-f]+)", 120.0)
        if (status := job.wait(30.0)) != 0:
            raise job.failed(f"({what}) exited with status {status}")
        self.tl.event(f"{what} finished at step {match[1]}")
        return match[2]

    def start_reference(self) -> Child:
        """The same job, never interrupted, without a daemon and without pacing; it runs beside
        the relaunched job (2 cores), which is what makes the demo take seconds, not minutes."""
        job = self.start_job("reference", self.ws.sockets / "none", self.ws.root / "reference", 0.0)
        self.tl.event(f"uninterrupted reference run started (pid {job.pid}, no daemon)")
        return job

    def close(self) -> None:
        for child in reversed(self.children):  # jobs before the daemons they report to
            child.stop(STOP_TIMEOUT)


def verdict(resumed: str, reference: str) -> int:
    """Print the result line; 0 when the digests match, else 1 with both digests on stderr."""
    if resumed == reference:
        click.echo("result: final weights identical to an uninterrupted run "
                   f"(sha256 {resumed[:16]}) {_mark()}")
        return 0
    click.echo(f"result: MISMATCH: the resumed run ended with sha256 {resumed}, the uninterrupted "
               f"run with {reference}", err=True)
    return 1


def _mark() -> str:
    try:
        "\u2714".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "OK"
    return "\u2714"


def _status(endpoint: str) -> dict | None:
    from spotguard.protocol import StatusRequest
    from spotguard_daemon.commands.common import request

    reply = request(endpoint, StatusRequest(), 0.5)
    return reply.data if reply is not None else None


def _durable_step(endpoint: str) -> int:
    uploads = (_status(endpoint) or {}).get("uploads") or {}
    return max((entry["step"] for entry in uploads.get("durable", {}).values()), default=-1)


def _notify(endpoint: str) -> None:
    from spotguard.protocol import Kind, NotifyRequest
    from spotguard_daemon.commands.common import request

    reply = request(endpoint, NotifyRequest(kind=Kind.DRILL, deadline_seconds=NOTICE_DEADLINE,
                                            detail="spotguard demo"), 5.0)
    if reply is None or not reply.ok:
        why = reply.error if reply else "no reply"
        raise DemoError(f"the daemon did not accept the notice: {why}")


def _restore(store_url: str, job_dir: Path) -> int:
    from spotguard.storage import Durable, StoreError, StoreOptions, open_store

    durable = Durable(open_store(store_url, StoreOptions()))
    try:
        durable.restore(JOB_ID, job_dir)
        return durable.latest(JOB_ID)
    except StoreError as exc:
        raise DemoError(f"restoring from {store_url} failed: {exc}") from exc


@click.command("demo")
@click.option("--steps", default=200, show_default=True, type=click.IntRange(20, 1_000_000),
              help="Optimizer steps of the example job.")
@click.option("--step-sleep", default=0.02, show_default=True, type=Duration(0, 10),
              help="Extra seconds per step, so that the notice lands mid-run.")
@click.option("--keep", is_flag=True, help="Keep the workspace (logs, checkpoints, durable store).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Use (and keep) this new or empty directory as the workspace.")
def demo(steps: int, step_sleep: float, keep: bool, workdir: Path | None) -> None:
    """Show a training job riding out a preemption, locally: no cloud account, no root."""
    ws = Workspace(workdir)
    click.echo(f"spotguard demo: a training job rides out a preemption (workspace {ws.root})")
    run = Demo(ws, steps, step_sleep)

    def story() -> int:
        saved = run.first_run()
        reference = run.start_reference()
        resumed = run.second_run(saved)
        return verdict(resumed, run.finished(reference, "uninterrupted reference run"))

    def close(status: int) -> None:
        run.close()
        ws.remove(keep=keep or workdir is not None or status != 0)

    status = guarded("demo", story, close, DemoError)
    if status != 0:
        click.echo(f"spotguard demo: workspace kept in {ws.root}", err=True)
    sys.exit(status)
