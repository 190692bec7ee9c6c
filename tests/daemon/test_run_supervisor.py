"""``spotguard run`` with a job that does not import spotguard (``run_job.py``): real subprocesses,
real signals, a real daemon and simulator where the case needs one.

Each test reads the supervisor's ``--json`` summary and checks that every process it started is
gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotguard.protocol import NotifyRequest, Reply, StatusRequest, encode

JOB = Path(__file__).with_name("run_job.py")
RUN = [sys.executable, "-m", "spotguard_daemon", "run"]


class Supervised:
    """``spotguard run [options] -- python run_job.py DIR [job options]`` in the background."""

    def __init__(self, tmp: Path, options: list[str], job: list[str], env: dict | None = None) -> None:
        self.dir, self.out, self.err = tmp / "job", tmp / "run.out", tmp / "run.err"
        self.dir.mkdir(parents=True, exist_ok=True)
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
                    **(env or {})}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([*RUN, "--json", *options, "--", sys.executable, str(JOB),
                                          str(self.dir), *job], env=full_env, stdout=out, stderr=err)

    def wait_file(self, name: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while not (self.dir / name).exists():
            assert self.proc.poll() is None or (self.dir / name).exists(), self.stderr()
            assert time.monotonic() < deadline, f"no {name}: {self.stderr()}"
            time.sleep(0.02)
        return (self.dir / name).read_text()

    def finish(self, timeout: float = 30.0) -> tuple[int, dict]:
        status, figures = finished(self.proc, self.out, timeout)
        for pid in self.launches():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        return status, figures

    def launches(self) -> list[int]:
        path = self.dir / "launches"
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def stderr(self) -> str:
        return self.err.read_text()


def finished(proc: subprocess.Popen, out: Path, timeout: float) -> tuple[int, dict]:
    """The supervisor's status and its ``--json`` summary (the last line of ``out``); killed when
    it does not end within ``timeout``."""
    try:
        status = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return status, json.loads(out.read_text().splitlines()[-1])


def wait_registered(daemon, pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid not in [c["pid"] for c in daemon.request(StatusRequest()).data["clients"]]:
        assert time.monotonic() < deadline, f"pid {pid} never registered: {daemon.output()[-2000:]}"
        time.sleep(0.05)


def runtime(daemon) -> dict:
    return {"SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}


def test_no_command_is_a_one_line_usage_error():
    done = subprocess.run(RUN, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "spotguard: spotguard run: no command given (spotguard run [OPTIONS] -- COMMAND [ARGS]...)"]


def test_an_unknown_option_is_a_usage_error_not_a_command():
    done = subprocess.run([*RUN, "--bogus", "--", "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "spotguard: spotguard run: no such option: --bogus"


def test_a_command_that_does_not_exist_exits_127_with_one_clear_line(tmp_path):
    done = subprocess.run([*RUN, "--no-daemon", "--max-restarts", "3", "--", "no-such-command-sg"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    assert done.returncode == 127
    assert "spotguard run: no-such-command-sg: command not found" in done.stderr
    assert "1 run(s)" in done.stderr  # no relaunch: the same command cannot start either


def test_failures_end_the_run_unless_restarts_are_asked_for_then_bounded_with_backoff(tmp_path):
    env = {"SPOTGUARD_RUNTIME_DIR": str(tmp_path)}
    once = Supervised(tmp_path / "a", ["--no-daemon"], ["--fail", "3"], env)
    status, figures = once.finish()
    assert status == 3 and figures["launches"] == 1 and figures["failures"] == 1

    bounded = Supervised(tmp_path, ["--no-daemon", "--max-restarts", "2", "--backoff", "0.05"],
                         ["--fail", "3"], {**env, "SPOTGUARD_FRESH": "1"})
    status, figures = bounded.finish()
    assert status == 3 and len(bounded.launches()) == 3
    assert (bounded.dir / "fresh").read_text().split() == ["1", "-", "-"]  # a fresh start, then resumes
    assert figures["launches"] == 3 and figures["failures"] == 3 and figures["preemptions"] == 0
    err = bounded.stderr()
    assert "restart 1 of 2 in 0.05 s" in err and "restart 2 of 2 in 0.1 s" in err  # doubled
    assert "max restarts (2) reached; status 3" in err


def test_a_plain_job_gets_the_daemon_signal_and_is_relaunched(tmp_path, daemon_factory):
    daemon = daemon_factory()
    run = Supervised(tmp_path, [], [], runtime(daemon))
    run.wait_file("ready-1")
    wait_registered(daemon, run.launches()[0])
    assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
    assert run.wait_file("got-1") == "SIGUSR1"
    status, figures = run.finish()
    assert status == 0, run.stderr()
    assert len(run.launches()) == 2 and figures["launches"] == 2 and figures["preemptions"] == 1
    assert figures["runs"][0]["status"] == 75 and figures["runs"][1]["status"] == 0
    assert "relaunching it" in run.stderr()
    assert "cancelled: every registered client reported safe" in daemon.output()  # by the supervisor
    assert daemon.request(StatusRequest()).data["notices"] == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_reaches_the_child_group_and_ends_the_relaunching(tmp_path, signum):
    run = Supervised(tmp_path, ["--no-daemon"], ["--grandchild"], {"SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    run.wait_file("ready-1")
    grandchild = int(run.wait_file("grandchild"))
    run.proc.send_signal(signum)
    assert run.wait_file("got-1") == signum.name
    status, figures = run.finish()
    assert status == 75 and figures["launches"] == 1
    assert figures["reason"] == f"{signum.name} received"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and "Z" not in _state(grandchild):
        assert time.monotonic() < deadline, f"the grandchild did not get the {signum.name}"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow  # a daemon started and stopped, two supervisors: about 6 s
def test_it_starts_its_own_daemon_when_none_runs_and_stops_it(tmp_path, sock_dir, ask):
    """On the settings of ``--config``; then ``--no-daemon`` starts none."""
    config = tmp_path / "spotguard.toml"
    config.write_text(f'platform = "none"\nruntime_dir = "{sock_dir}/run"\nstate_dir = "{tmp_path}/state"\n'
                      '[metrics]\nenabled = false\n')
    endpoint = f"ipc://{sock_dir}/run/requests.sock"
    run = Supervised(tmp_path, ["--config", str(config)], [])
    run.wait_file("ready-1")
    started = int(run.stderr().split("started one (pid ")[1].split(")")[0])
    status = ask(endpoint, StatusRequest())
    assert status.ok and status.data["pid"] == started
    deadline = time.monotonic() + 10
    while not ask(endpoint, StatusRequest()).data["clients"]:
        assert time.monotonic() < deadline, run.stderr()
        time.sleep(0.05)
    assert ask(endpoint, NotifyRequest(deadline_seconds=60)).ok
    status, figures = run.finish()
    assert status == 0 and figures["preemptions"] == 1, run.stderr()
    with pytest.raises(ProcessLookupError):
        os.kill(started, 0)

    alone = Supervised(tmp_path / "b", ["--no-daemon", "--config", str(config)], ["--finish-at", "1"])
    status, _ = alone.finish()
    assert status == 0 and "(--no-daemon): signals and exit statuses only" in alone.stderr()
    assert "started one" not in alone.stderr()


def test_a_daemon_that_cannot_start_leaves_the_job_running_without_one(tmp_path, sock_dir):
    (sock_dir / "file").write_text("where the daemon's runtime directory should go")
    run = Supervised(tmp_path, [], ["--finish-at", "1"], {
        "SPOTGUARD_RUNTIME_DIR": str(sock_dir / "file" / "run"), "SPOTGUARD_STATE_DIR": str(tmp_path / "state"),
        "SPOTGUARD_METRICS__ENABLED": "false"})
    status, figures = run.finish()
    assert status == 0 and figures["launches"] == 1, run.stderr()
    assert "none could be started" in run.stderr() and "signals and exit statuses only" in run.stderr()


def test_launches_that_stop_again_without_progress_are_not_relaunched_forever(tmp_path):
    """A job that records its start and stops at once (as one would under a notice it cannot
    ignore) is launched three times, not a thousand."""
    script = ("import os, sys, json, time; line = dict(v=1, event='start', t=time.time(), pid=os.getpid(), "
              "rank=0, job='', resumed_from=7); open(os.environ['SPOTGUARD_RECORD'], 'a')"
              ".write(json.dumps(line) + '\\n'); sys.exit(75)")
    done = subprocess.run([*RUN, "--json", "--no-daemon", "--", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    figures = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 75 and figures["launches"] == 3 and figures["preemptions"] == 3
    assert "3 launches in a row stopped without progress: not relaunching" in done.stderr


def test_a_daemon_that_answers_garbage_does_not_stop_the_supervisor(tmp_path, sock_dir):
    """The first status is answered, every later request gets an invalid reply: the supervisor
    treats that as no answer and goes on (and, having found a daemon, starts none)."""
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{sock_dir}/requests.sock")
    stop = threading.Event()

    def serve() -> None:
        answers = [encode(Reply(ok=True, data={}))]
        while not stop.is_set():
            if router.poll(50):
                ident, *_ = router.recv_multipart()
                router.send_multipart([ident, b"", answers.pop() if answers else b"\xff not a reply"])

    server = threading.Thread(target=serve)
    server.start()
    try:
        run = Supervised(tmp_path, ["--max-preemptions", "1"], ["--fail", "75"],
                         {"SPOTGUARD_RUNTIME_DIR": str(sock_dir)})
        status, figures = run.finish()
    finally:
        stop.set()
        server.join(10)
        ctx.destroy(linger=0)
    assert status == 75 and figures["launches"] == 2, run.stderr()
    assert figures["reason"] == "max preemptions (1) reached" and "started one" not in run.stderr()


def test_sigterm_during_the_backoff_ends_the_run_with_the_failure_status(tmp_path):
    run = Supervised(tmp_path, ["--no-daemon", "--max-restarts", "5", "--backoff", "30"], ["--fail", "3"],
                     {"SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    deadline = time.monotonic() + 20
    while "restart 1 of 5 in 30 s" not in run.stderr():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr()
        time.sleep(0.02)
    run.proc.send_signal(signal.SIGTERM)
    status, figures = run.finish()
    assert status == 3 and figures["launches"] == 1
    assert figures["reason"] == "SIGTERM received before the relaunch"


PEER_LOST_ONCE = """\
import json, os, sys, time
from pathlib import Path
launches = Path(sys.argv[1])
launches.write_text(launches.read_text() + "x" if launches.exists() else "x")
if len(launches.read_text()) > 1:
    sys.exit(0)
if sys.argv[2] != "plain":  # as spotguard records a lost peer (77) or a hung stop (76) before it exits
    line = dict(v=1, event=sys.argv[2], t=time.time(), pid=os.getpid(), rank=0, job="", step=3)
    open(os.environ["SPOTGUARD_RECORD"], "a").write(json.dumps(line) + "\\n")
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("how, status", [("plain", 77), ("peer_lost", 1), ("forced_exit", 1)],
                         ids=["exit-77", "torchrun-1", "torchrun-1-after-76"])
def test_a_lost_peer_relaunches_the_command_like_a_preemption(tmp_path, how, status):
    """Exit 77, or a launcher's 1 after the job recorded a lost peer: relaunched without
    ``--max-restarts``, counted as a preemption, not a failure."""
    job = tmp_path / "job.py"
    job.write_text(PEER_LOST_ONCE)
    done = subprocess.run([*RUN, "--json", "--no-daemon", "--", sys.executable, str(job),
                           str(tmp_path / "launches"), how, str(status)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    figures = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0, done.stderr
    assert figures["launches"] == 2 and figures["preemptions"] == 1 and figures["failures"] == 0
    assert [r["status"] for r in figures["runs"]] == [status, 0]
    why = "a notice" if how == "forced_exit" else "a peer was lost"
    assert f"stopped with status {status} after {why}; relaunching it" in done.stderr


def test_a_job_that_exits_75_at_once_without_a_record_backs_off_and_stops_after_three(tmp_path):
    """Exit 75 at once, no record (a job that does not import spotguard, under a notice it cannot
    ignore): three launches, the relaunches --backoff seconds apart and doubling, then it stops."""
    starts = tmp_path / "starts"
    script = f"import sys, time; open({str(starts)!r}, 'a').write(f'{{time.time()}}\\n'); sys.exit(75)"
    done = subprocess.run([*RUN, "--json", "--no-daemon", "--backoff", "0.5", "--", sys.executable, "-c",
                           script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    figures = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 75 and figures["launches"] == 3, done.stderr
    assert figures["reason"] == "3 launches in a row stopped without progress"
    first, second, third = (float(t) for t in starts.read_text().split())
    assert second - first >= 0.5 and third - second >= 1.0, (first, second, third)
    assert "relaunching it in 0.5 s (1 launch(es) in a row without progress)" in done.stderr
    assert "relaunching it in 1 s (2 launch(es) in a row without progress)" in done.stderr


LEAVES_A_CHILD = """\
echo $$ >> "$1/launches"
sleep 1000 & echo $! >> "$1/left"
setsid sleep 1000 & echo $! >> "$1/left"
launch=$(wc -l < "$1/launches")
[ "$launch" -ge 2 ] || exit 75
for pid in $(head -n 2 "$1/left"); do kill -0 "$pid" 2>/dev/null && echo "$pid" >> "$1/overlap"; done
exit 0
"""


def test_what_a_launch_leaves_running_is_ended_before_the_relaunch_and_at_the_exit(tmp_path):
    """Each launch starts two background sleeps (one in its own session) and exits: the first
    launch's are gone before the second starts, the second's before the supervisor exits."""
    job = tmp_path / "job.sh"
    job.write_text(LEAVES_A_CHILD)
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: a leftover holds no pipe open
        proc = subprocess.Popen([*RUN, "--json", "--no-daemon", "--backoff", "0", "--", "sh", str(job),
                                 str(tmp_path)], stdout=stdout, stderr=stderr,
                                env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    try:
        status, figures = finished(proc, out, 60)
    finally:
        left = [int(pid) for pid in (tmp_path / "left").read_text().split()]
        alive = [pid for pid in left if Path(f"/proc/{pid}").exists()]
        for pid in alive:  # the test's own cleanup, before any assertion
            os.kill(pid, signal.SIGKILL)
    assert status == 0 and figures["launches"] == 2, err.read_text()
    assert len(left) == 4 and not alive, f"still running: {alive}"
    assert not (tmp_path / "overlap").exists(), "the first launch's children ran beside the second"
    assert err.read_text().count("left 2 process(es) running after it exited") == 2, err.read_text()


def test_over_tcp_it_says_at_start_that_the_job_is_not_signalled_and_registers_nothing(tmp_path, daemon_factory):
    """The sidecar's tcp:// endpoints: the daemon cannot prove which processes are the job's, so
    it would never signal them. One line at start says so and names the fix."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    endpoints = {"SPOTGUARD_ZMQ__PUB_ENDPOINT": f"tcp://127.0.0.1:{ports[0]}",
                 "SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"tcp://127.0.0.1:{ports[1]}"}
    daemon = daemon_factory(env=endpoints)
    run = Supervised(tmp_path, [], [], endpoints)
    run.wait_file("ready-1")  # its SIGUSR1 handler is installed: over ipc:// it would be registered
    until = time.monotonic() + 4 * 0.5  # four of the supervisor's scans
    while time.monotonic() < until:
        assert daemon.request(StatusRequest()).data["clients"] == [], "registered, never signalled"
        time.sleep(0.1)
    run.proc.send_signal(signal.SIGTERM)
    status, figures = run.finish()
    assert status == 75 and figures["launches"] == 1, run.stderr()
    line = [l for l in run.stderr().splitlines() if "cannot prove which processes" in l]
    assert len(line) == 1 and "sends SIGUSR1 to none of them" in line[0], run.stderr()
    assert "ipc:// on a volume shared with it (SPOTGUARD_RUNTIME_DIR)" in line[0]
    assert "started one" not in run.stderr()


MP_HELPERS_JOB = """\
import multiprocessing, os, sys
from pathlib import Path

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    lock = ctx.Lock()  # a named semaphore: the resource tracker starts
    worker = ctx.Process(target=os.getpid)
    worker.start()
    worker.join()
    from multiprocessing import forkserver, resource_tracker
    Path(sys.argv[1]).write_text(f"{forkserver._forkserver._forkserver_pid} "
                                 f"{resource_tracker._resource_tracker._pid}")
    os._exit(0)  # at once: both helpers are still running when the supervisor looks
"""


def test_a_loaders_forkserver_and_resource_tracker_are_not_reported_as_leftovers(tmp_path):
    """The job's multiprocessing helpers outlive it by a moment (they end when its pipes close):
    they are not the job's leftovers. A forked worker is told from the server by its parent."""
    from spotguard_daemon.proctree import mp_helper, stat_fields

    job, pids = tmp_path / "job.py", tmp_path / "helpers"
    job.write_text(MP_HELPERS_JOB)
    done = subprocess.run([*RUN, "--no-daemon", "--", sys.executable, str(job), str(pids)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(tmp_path)})
    assert done.returncode == 0 and pids.read_text(), done.stderr
    assert "left" not in done.stderr and "could not end" not in done.stderr, done.stderr
    assert not [pid for pid in map(int, pids.read_text().split())
                if (fields := stat_fields(pid)) and fields[0] not in "ZX"]  # ended (init reaps)

    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.SimpleQueue()
    worker = ctx.Process(target=queue.put, args=("ready",))
    worker.start()
    try:
        assert queue.get() == "ready"
        assert mp_helper(forkserver._forkserver._forkserver_pid) == "forkserver"
        assert mp_helper(resource_tracker._resource_tracker._pid) == "resource tracker"
        assert mp_helper(worker.pid) is None and mp_helper(os.getpid()) is None
    finally:
        worker.join()
        forkserver._forkserver._stop()
