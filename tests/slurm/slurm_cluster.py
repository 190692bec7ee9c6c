"""A real one-node Slurm cluster for tests and benchmarks: munged, slurmctld and slurmd as subprocesses.

Everything lives in one private directory: a fresh munge key and munged socket (munged runs as the
``munge`` user), a ``slurm.conf`` with free ports, the state and spool directories and the logs.
The node is this host (``slurmd -C`` gives its real CPUs and memory) in two partitions: ``low``
(``PriorityTier=1``, ``GraceTime``) and ``high`` (``PriorityTier=10``), with
``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE`` and
``SlurmctldParameters=preempt_send_user_signal``, so a job in ``high`` preempts one in ``low`` and
the preempted job gets its ``--signal`` at once, ``GraceTime`` seconds before it is killed.

Needs root (slurmd runs jobs as their user, munged as ``munge``) and Debian's ``slurm-wlm`` and
``munge`` packages (``scripts/install-system-packages.sh``); :func:`missing` says what is lacking.
The daemons are stopped by pid in :meth:`Cluster.stop`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

__all__ = ["Cluster", "missing", "tool", "wait_for"]

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
SBIN = "/usr/sbin:/usr/bin:/sbin:/bin"
GRACE_TIME = 20
"""The ``low`` partition's GraceTime: seconds between the preemption signal and the kill."""
BUSY = {"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING", "SUSPENDED"}
"""Job states that hold the node. A preempted job shows SIGNALING for a moment, not RUNNING."""
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}
T = TypeVar("T")


def missing() -> str | None:
    """Why no cluster can run here (not root, a program or the munge user missing), else None."""
    if os.geteuid() != 0:
        return "not root: slurmd and munged need root"
    lacking = [p for p in PROGRAMS if shutil.which(p, path=f"{os.environ.get('PATH', '')}:{SBIN}") is None]
    if lacking:
        return f"{', '.join(lacking)} not installed (Debian packages slurm-wlm and munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (Debian package munge)"
    return None


def wait_for(what: str, check: Callable[[], T], timeout: float, interval: float = 0.2) -> T:
    """Poll ``check`` until it returns something true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def tool(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}") or name


class Cluster:
    """One node, two partitions; :meth:`start` returns once ``sinfo`` shows the node idle."""

    def __init__(self, base: Path | None = None, *, grace_time: int = GRACE_TIME, kill_wait: int = 30) -> None:
        self.base = Path(base or tempfile.mkdtemp(prefix="sg-slurm-", dir="/tmp"))
        self.grace_time, self.kill_wait = grace_time, kill_wait
        self.conf = self.base / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{os.environ.get('PATH', '')}:{SBIN}"}
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> "Cluster":
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)  # munged (user munge) must reach its own directory below
        for name in ("state", "spool", "log", "tmp"):
            (self.base / name).mkdir(exist_ok=True)
        try:
            self._start_munged()
            self._write_conf()
            self._spawn("slurmctld", [tool("slurmctld"), "-D", "-f", str(self.conf)])
            self._spawn("slurmd", [tool("slurmd"), "-D", "-f", str(self.conf)])
            wait_for(f"node {self.node} idle in sinfo ({self.log_tail()})", self._idle, timeout, 0.3)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job (a slurmstepd outlives its slurmd), then SIGTERM each daemon by pid (slurmd
        first) and SIGKILL what is left after 10 s."""
        if all(name in self.procs and self.procs[name].poll() is None for name in ("slurmctld", "slurmd")):
            try:
                self.cancel_all()
            except (AssertionError, subprocess.SubprocessError) as exc:
                print(f"slurm cluster {self.base}: jobs left behind: {exc}")
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], **kwargs) -> None:
        log = open(self.base / "log" / f"{name}.out", "ab")
        with log:
            self.procs[name] = subprocess.Popen(argv, cwd=self.base, env=self.env, stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, **kwargs)

    def _start_munged(self) -> None:
        munge = self.base / "munge"
        munge.mkdir(mode=0o755, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        user = pwd.getpwnam("munge")
        for path in (munge, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        self.munge_socket = munge / "munge.sock"
        self._spawn("munged", [tool("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
                               f"--log-file={munge / 'munged.log'}"], user=user.pw_uid, group=user.pw_gid,
                    extra_groups=[])
        wait_for("munged's socket", self.munge_socket.exists, 15)

    def _write_conf(self) -> None:
        node_line = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True, check=True,
                                   env=self.env).stdout.splitlines()[0]
        ctld_port, slurmd_port = _free_ports(2)
        b = self.base
        self.conf.write_text(f"""\
ClusterName=spotguard
SlurmctldHost={self.node}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
JobRequeue=1
ReturnToService=2
MinJobAge=600
KillWait={self.kill_wait}
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{node_line} State=UNKNOWN
PartitionName=low Nodes={self.node} Default=YES PriorityTier=1 GraceTime={self.grace_time} MaxTime=INFINITE State=UP
PartitionName=high Nodes={self.node} PriorityTier=10 MaxTime=INFINITE State=UP
""")

    def _idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}: {self.log_tail()}")
        out = self.run("sinfo", "-h", "-n", self.node, "-p", "low", "-o", "%t", check=False)
        return out.strip() == "idle"

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for path in sorted((self.base / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # ------------------------------------------------------------------ client commands

    def run(self, *argv: str, check: bool = True, env: dict | None = None) -> str:
        """A Slurm client command against this cluster; its stdout."""
        done = subprocess.run([tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=30,
                              env={**self.env, **(env or {})})
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *argv: str, cwd: Path, env: dict | None = None) -> str:
        """Submit; the job id."""
        done = subprocess.run([tool("sbatch"), "--parsable", *argv], capture_output=True, text=True,
                              timeout=30, cwd=cwd, env={**self.env, **(env or {})})
        if done.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Reason, Restarts, ExitCode, ...); {} when unknown."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        for word in out.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def states(self, job_id: str | None = None) -> list[str] | None:
        """The states (``RUNNING``, ``PENDING``, ...) of the jobs squeue lists (or of ``job_id``); None
        when squeue failed (slurmctld busy on a loaded machine), so that a poll never takes an error
        for an empty queue."""
        done = subprocess.run([tool("squeue"), "-h", "-o", "%T", *(["-j", job_id] if job_id else [])],
                              capture_output=True, text=True, timeout=30, env=self.env)
        return done.stdout.split() if done.returncode == 0 else None

    def busy(self, job_id: str) -> bool | None:
        """Whether the job holds the node (running or completing); None when squeue failed."""
        states = self.states(job_id)
        return None if states is None else any(s in BUSY for s in states)

    def release(self, job_id: str) -> None:
        """Start a requeued job now: Slurm holds one back for 120 s (``BeginTime``) after a requeue."""
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def cancel_all(self) -> None:
        """Cancel every job, and wait until none is pending, running or completing."""
        def gone() -> bool:
            states = self.states()
            if states is not None and set(states) <= ENDED:
                return True
            self.run("scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name, check=False)
            return False
        wait_for(f"every job gone ({self.log_tail()})", gone, 30, 1.0)
