"""What ``spotguard drill`` and ``spotguard run`` trust, tried the way another local user (or an
unlucky pid reuse) would: a report directory or a run record someone else made or can write, a FIFO
where the record should be, a symbolic link planted where the report goes, malformed record lines,
and a pid that once named a process of the launch and now names an unrelated one.

The cases that need another user's files run as root only (the file is chowned to nobody).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from spotguard._record import RecordError, check_path, read_new
from spotguard_daemon.commands.drill_tree import Tree, private_dir, write_private

DRILL = [sys.executable, "-m", "spotguard_daemon", "drill"]
RUN = [sys.executable, "-m", "spotguard_daemon", "run"]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's files")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}


@pytest.mark.parametrize("owner, mode, error", [
    (None, 0o777, "can be written by others (mode 0777)"),
    (None, 0o1777, "can be written by others (mode 1777)"),
    pytest.param(NOBODY, 0o700, f"belongs to uid {NOBODY}, not to this user", marks=as_root)])
def test_a_report_dir_another_user_could_fill_is_refused_and_nothing_runs(tmp_path, owner, mode, error):
    report = tmp_path / "shared"
    report.mkdir()
    report.chmod(mode)
    if owner is not None:
        os.chown(report, owner, owner)
    marker = tmp_path / "ran"
    done = subprocess.run([*DRILL, "--no-reference", "--report-dir", str(report), "--", "touch",
                           str(marker)], capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert error in done.stderr
    assert not marker.exists() and list(report.iterdir()) == []


def test_report_files_replace_a_planted_link_never_write_through_it(tmp_path):
    report = private_dir(tmp_path / "report")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (report / "report.json").symlink_to(victim)
    write_private(report / "report.json", "{}\n")
    assert victim.read_text() == "precious\n"
    assert not (report / "report.json").is_symlink() and (report / "report.json").read_text() == "{}\n"
    assert [p.name for p in report.iterdir()] == ["report.json"]  # no temporary file left


def test_a_fifo_or_a_writable_record_is_refused_at_once(tmp_path):
    fifo = tmp_path / "record"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(RecordError, match="not a regular file"):
        read_new(fifo, 0)
    assert time.monotonic() - started < 5  # never blocks on a FIFO without a writer
    shared = tmp_path / "shared.jsonl"
    shared.write_text("")
    shared.chmod(0o666)
    with pytest.raises(RecordError, match="can be written by others"):
        check_path(shared)
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(RecordError, match="symbolic link"):
        read_new(link, 0)


@pytest.mark.parametrize("kind, error", [
    ("fifo", "is not a regular file"), ("writable", "can be written by others (mode 0666)"),
    pytest.param("nobody", f"belongs to uid {NOBODY}, not to this user", marks=as_root)])
def test_spotguard_run_refuses_a_record_it_cannot_trust(tmp_path, kind, error):
    record = tmp_path / "record.jsonl"
    if kind == "fifo":
        os.mkfifo(record)
    else:  # forged stops: the job below exits 1, which they would have turned into preemptions
        record.write_text(json.dumps({"v": 1, "event": "stop", "t": time.time(), "pid": 1,
                                      "rank": 0, "step": 5}) + "\n")
        record.chmod(0o666)
        if kind == "nobody":
            record.chmod(0o600)
            os.chown(record, NOBODY, NOBODY)
    done = subprocess.run([*RUN, "--no-daemon", "--", sys.executable, "-c", "raise SystemExit(1)"],
                          capture_output=True, text=True, timeout=60,
                          env={**_env(), "SPOTGUARD_RECORD": str(record)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "$SPOTGUARD_RECORD" in done.stderr and error in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_spotguard_run_reports_a_malformed_record_line_and_keeps_the_job_status(tmp_path):
    job = ("import json, os, time\n"
           "line = {'v': 1, 'event': 'progress', 't': 'x', 'pid': os.getpid(), 'rank': 0, 'step': 1}\n"
           "stop = {'v': 1, 'event': 'stop', 't': time.time(), 'pid': os.getpid(), 'rank': 0}\n"
           "with open(os.environ['SPOTGUARD_RECORD'], 'a') as f:\n"
           "    f.write(json.dumps(line) + '\\n' + json.dumps(stop) + '\\n')\n")
    done = subprocess.run([*RUN, "--no-daemon", "--json", "--", sys.executable, "-c", job],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ignored in the run record: progress event with t='x' (not a time)" in done.stderr
    assert "ignored in the run record: stop event without 'step'" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["preemptions"] == 0


def test_the_drill_signals_a_pid_only_while_it_names_the_process_it_saw(tmp_path):
    """A launch's worker and, under a pid the drill noted, a process that is no longer the one
    noted (its start time differs: the pid was reused). Only the real worker is signalled."""
    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    unrelated = subprocess.Popen(["sleep", "60"])
    try:
        tree = Tree()
        deadline = time.monotonic() + 10
        while len(tree.known) < 2 and time.monotonic() < deadline:
            tree.note(launcher.pid)
            time.sleep(0.05)
        worker, reused = sorted(tree.known)
        tree.known[unrelated.pid] = tree.known.pop(reused) + 1  # another process's start time
        assert tree.signal(signal.SIGKILL) == [worker]
        assert unrelated.pid not in tree.known  # forgotten, never signalled
        assert unrelated.poll() is None
        os.kill(reused, signal.SIGKILL)
    finally:
        for proc in (launcher, unrelated):
            proc.kill()
            proc.wait()
