"""The run record ($SPOTGUARD_RECORD): what tools outside the job (drill, run) judge it by.

The example job runs as a real subprocess; the record alone must tell where each launch started,
what it committed, where it stopped, and whether two runs ended in the same state.
"""

from __future__ import annotations

import signal

import pytest

from _example import Proc, isolated_env, run_to_end
from spotguard import _record

pytestmark = pytest.mark.slow

STEPS = 60


def events(path, kind):
    return [e for e in _record.read(path) if e["event"] == kind]


def test_uninterrupted_and_resumed_runs_record_the_same_final_digest(tmp_path):
    ref_record, record = tmp_path / "ref.jsonl", tmp_path / "run.jsonl"
    run_to_end(tmp_path / "ref", STEPS, "--save-every", "10",
               env=isolated_env(tmp_path / "rt1", SPOTGUARD_RECORD=str(ref_record)))
    (start,) = events(ref_record, "start")
    assert start["resumed_from"] is None and start["skipped"] == [] and start["total"] == STEPS
    assert start["root"] == str(tmp_path / "ref") and start["world_size"] == 1
    (finish,) = events(ref_record, "finish")
    assert finish["step"] == STEPS and len(finish["digest"]) == 64
    commits = events(ref_record, "commit")
    assert [c["step"] for c in commits] == list(range(10, STEPS + 1, 10))
    assert commits[-1]["digest"] == finish["digest"]  # the last periodic save is the final state
    assert events(ref_record, "progress")[-1]["step"] <= STEPS

    env = isolated_env(tmp_path / "rt2", SPOTGUARD_RECORD=str(record))
    first = Proc.example(tmp_path / "ckpt", STEPS, "--save-every", "10", "--step-sleep", "0.02", env=env)
    first.wait_line(r"checkpoint step=20", 60)
    first.popen.send_signal(signal.SIGTERM)
    assert first.finish(30) == 75, first.output
    (stop,) = events(record, "stop")
    assert stop["notice"]["kind"] == "signal"
    emergency = [c["step"] for c in events(record, "commit") if c["kind"] == "emergency"]
    periodic = [c["step"] for c in events(record, "commit") if c["kind"] != "emergency"]
    if stop["step"] in periodic:  # on a loaded machine the signal can land at the step just saved
        assert stop["saved"] is False and emergency == [], stop
    else:
        assert stop["saved"] is True and emergency == [stop["step"]], stop

    run_to_end(tmp_path / "ckpt", STEPS, "--save-every", "10", env=env)
    starts = events(record, "start")
    assert [s["resumed_from"] for s in starts] == [None, stop["step"]]
    assert events(record, "finish")[0]["digest"] == finish["digest"]


def test_without_the_variable_nothing_is_written(tmp_path):
    recorder = _record.Recorder(None)
    recorder.emit("start")
    assert not recorder.enabled and list(tmp_path.iterdir()) == []


def test_unwritable_record_never_raises_and_torn_lines_are_skipped(tmp_path):
    _record.Recorder(tmp_path / "missing-dir" / "r.jsonl").emit("progress", step=1)
    path = tmp_path / "r.jsonl"
    recorder = _record.Recorder(path, rank=0, job="j")
    recorder.emit("commit", step=3)
    with open(path, "a") as out:
        out.write('{"v": 1, "event": "comm')  # a line cut short
    assert [(e["event"], e["step"], e["job"]) for e in _record.read(path)] == [("commit", 3, "j")]


def test_state_digest_ignores_rng_but_not_any_trained_byte(tmp_path):
    import random

    import torch
    from spotguard import Checkpointer
    from spotguard.run import _RngState

    def digest(root, *, seed, big_delta=0.0, small_delta=0.0, step_value=7, shape=(2, 3), blocking=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 2))  # 1.4 MB + small
        with torch.no_grad():
            model[0].weight[0, 0] += big_delta
            model[1].bias[0] += small_delta
        random.seed(seed)  # an RNG the job never drew from: differs between processes
        state = {"model": model, "extra": {"n": step_value, "v": torch.arange(6.0).reshape(shape)}, "rng": _RngState()}
        with Checkpointer(root) as ckpt:
            ckpt.save(1, state, blocking=blocking)  # blocking: laid out at write time; else staged packed
            return ckpt.wait().digest

    base = digest(tmp_path / "a", seed=1)
    assert digest(tmp_path / "b", seed=2) == base
    assert digest(tmp_path / "b2", seed=2, blocking=False) == base
    assert digest(tmp_path / "c", seed=1, big_delta=1e-6) != base
    assert digest(tmp_path / "d", seed=1, small_delta=1e-6) != base
    assert digest(tmp_path / "d2", seed=1, small_delta=1e-6, blocking=False) != base
    assert digest(tmp_path / "e", seed=1, step_value=8) != base
    assert digest(tmp_path / "f", seed=1, shape=(3, 2)) != base  # the same bytes, another shape


def test_one_schema_reports_each_malformed_line_and_keeps_the_rest(tmp_path):
    """What crashed both tools: a progress event with ``"t": "x"`` (spotguard run's TypeError), a
    stop without ``step`` (the drill's KeyError); also out-of-bound and wrongly typed fields."""
    path = tmp_path / "r.jsonl"
    _record.Recorder(path).emit("progress", step=4)
    common = '"v": 1, "pid": 5, "rank": 0'
    with open(path, "a") as out:
        out.write('{%s, "event": "progress", "t": "x", "step": 5}\n' % common)
        out.write('{%s, "event": "stop", "t": 1.0, "saved": true}\n' % common)
        out.write('{%s, "event": "commit", "t": 1.0, "step": %d}\n' % (common, 2**63))
        out.write('{%s, "event": "finish", "t": 1.0, "step": true, "digest": "d"}\n' % common)
        out.write('[1, 2]\nnot json\n')
    problems: list[str] = []
    assert [(e["event"], e["step"]) for e in _record.read(path, problems)] == [("progress", 4)]
    assert [p.split(":")[0] for p in problems] == [
        "progress event with t='x' (not a time)", "stop event without 'step'",
        f"commit event with step='{2**63}' (not a count)", "finish event with step='True' (not a count)",
        "not a JSON object", "not JSON"]
