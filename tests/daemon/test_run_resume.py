"""``spotguard run`` with a job that imports spotguard (``examples/train_plain.py``) and a real daemon:
a manual notice stops the job, the supervisor relaunches the identical command, and the final
training state equals that of an uninterrupted run (the ``finish`` digests of the run record). A
neighbour on the node that never reports safe keeps the notice pending, so the relaunch trains only
because it ignores the notice its first launch obeyed (``$SPOTGUARD_HANDLED_NOTICES``).
The summary's figures are checked against the record, and, on a hand-made record, exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotguard._record import read
from spotguard.protocol import NotifyRequest, RegisterRequest, StatusRequest

from spotguard_daemon.commands.run_summary import Launch, human, summary
from test_run_supervisor import finished

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, str(ROOT / "examples" / "train_plain.py"), "--steps", "80", "--save-every",
         "10", "--step-sleep", "0.03", "--ckpt-dir", "ckpt"]

NEIGHBOUR = "import signal, time; signal.signal(signal.SIGUSR1, lambda *a: None); print('ready', flush=True); time.sleep(120)"
"""Another job on the node: it hears the daemon's signal, and never reports safe."""


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}, **extra}


def wait_progress(record: Path, step: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "progress" and e["step"] >= step for e in read(record)):
        assert proc.poll() is None and time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_manual_notice_is_relaunched_and_ends_as_an_uninterrupted_run(tmp_path, daemon_factory):
    (tmp_path / "ref").mkdir()
    reference = tmp_path / "reference.jsonl"
    subprocess.run(TRAIN, cwd=tmp_path / "ref", env=clean_env(SPOTGUARD_RECORD=str(reference)),
                   check=True, capture_output=True, timeout=120)
    [expected] = [e for e in read(reference) if e["event"] == "finish"]

    daemon = daemon_factory()
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE)
    record = tmp_path / "run.jsonl"
    env = clean_env(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), SPOTGUARD_RECORD=str(record))
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spotguard_daemon", "run", "--json", "--", *TRAIN],
                                cwd=tmp_path, env=env, stdout=out, stderr=err)
    try:
        assert neighbour.stdout.readline() == b"ready\n"
        assert daemon.request(RegisterRequest(pid=neighbour.pid)).ok
        wait_progress(record, 25, proc)
        notice = daemon.request(NotifyRequest(deadline_seconds=60)).data["notice"]
    finally:
        status, figures = finished(proc, tmp_path / "run.out", 120)
        neighbour.kill()
        neighbour.wait(10)
    assert status == 0, (tmp_path / "run.err").read_text()
    assert [n["id"] for n in daemon.request(StatusRequest()).data["notices"]] == [notice["id"]]
    assert figures["launches"] == 2 and figures["preemptions"] == 1
    assert figures["finish"] == {"step": expected["step"], "digest": expected["digest"]}
    stop = next(e for e in read(record) if e["event"] == "stop")
    starts = [e for e in read(record) if e["event"] == "start"]
    assert starts[1]["resumed_from"] == stop["step"]  # the emergency save: nothing redone
    assert figures["steps_lost"] == 0 and figures["seconds_lost"] > 0
    assert figures["runs"][0]["reached"] == stop["step"]
    assert "2 run(s), 1 preemption(s), 0 failure(s); 0 step(s)" in (tmp_path / "run.err").read_text()


def test_the_summary_counts_steps_and_time_lost_from_the_record():
    def progress(t: float, step: int) -> dict:
        return {"event": "progress", "t": t, "step": step}

    first = Launch(1, pid=10, t_start=0.0, t_end=10.0, status=76, events=[
        {"event": "start", "t": 1.0, "resumed_from": None}, progress(2.0, 5), progress(4.0, 20),
        {"event": "commit", "t": 4.5, "step": 20}, progress(8.0, 33)])
    second = Launch(2, pid=11, t_start=11.0, t_end=20.0, status=0, events=[
        {"event": "start", "t": 12.0, "resumed_from": 20}, progress(14.0, 21), progress(19.0, 50),
        {"event": "finish", "t": 19.5, "step": 50, "digest": "d"}])
    figures = summary([first, second], 0, 21.0, "the command succeeded")
    assert figures["steps_lost"] == 13  # 33 reached, resumed from 20
    assert figures["seconds_lost"] == 10.0  # first at step 20 at t=4, past it again at t=14
    assert figures["preemptions"] == 1 and figures["failures"] == 0
    assert figures["finish"] == {"step": 50, "digest": "d"}
    assert "13 step(s) and 10.0 s lost" in human(figures) and "tier" not in human(figures)

    # a node-local job whose fresh node restored its part from a partner (the peer tier)
    second.events[0:1] = [{"event": "start", "t": 12.0, "resumed_from": 20, "rank": r, "tier": tier}
                          for r, tier in enumerate(["local", "local", "peer", "peer"])]
    figures = summary([first, second], 0, 21.0, "the command succeeded")
    assert [run["tiers"] for run in figures["runs"]] == [[], ["local", "peer"]]
    assert "finished at step 50; resumed from the peer tier" in human(figures)

    plain = summary([Launch(1, t_start=0.0, t_end=1.0, status=75), Launch(2, t_start=1.0, t_end=2.0, status=0)],
                    0, 2.0, "the command succeeded")
    assert plain["steps_lost"] is None and "? step(s) and ? s lost" in human(plain)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_whose_workers_stopped_cleanly_is_relaunched(tmp_path, daemon_factory):
    """torchrun exits 1 when its workers exit 75: the record's ``stop`` events make it a preemption."""
    daemon = daemon_factory()
    record = tmp_path / "run.jsonl"
    env = clean_env(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), SPOTGUARD_RECORD=str(record))
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", *TRAIN[1:]]
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "spotguard_daemon", "run", "--json", "--", *torchrun],
                                cwd=tmp_path, env=env, stdout=out, stderr=err)
    try:
        wait_progress(record, 20, proc, timeout=120)
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
    finally:
        status, figures = finished(proc, tmp_path / "run.out", 180)
    assert status == 0, (tmp_path / "run.err").read_text()[-3000:]
    assert figures["launches"] == 2 and figures["preemptions"] == 1 and figures["failures"] == 0
    assert figures["runs"][0]["status"] == 1 and figures["finish"]["step"] == 80
    stops = [e for e in read(record) if e["event"] == "stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1]
    assert [e for e in read(record) if e["event"] == "start"][-1]["resumed_from"] == stops[0]["step"]
