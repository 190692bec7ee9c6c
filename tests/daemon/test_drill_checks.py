"""``spotguard drill``'s judgement, on run records written by the library's own Recorder.

Each case builds the records a job of a given shape leaves (a correct one, one that restarts from
zero, one that saves only the weights, one that loses steps to SIGTERM, one whose load failed),
then checks the verdict and that the diagnosis names the problem in the user's terms. The report
files (JSON, SVG) and the live timeline are checked on the same records.
"""

from __future__ import annotations

import json
import math
import xml.dom.minidom

import pytest
import torch

import spotguard
from spotguard._record import Recorder, read, read_new
from spotguard.cadence import DEFAULT_NODE_MTBF_S
from spotguard.checkpoint import CheckpointCorruptError
from spotguard_daemon.commands.drill_checks import KINDS, Launch, judge, losses, save_figures, verdict
from spotguard_daemon.commands.drill_report import CHAR_W, Live, write_report


def recorded(tmp_path, index, *, resumed=None, steps=(), commits=(), stop=None, finish=None,
             kind=None, load_error=None, skipped=(), extra=(), loaded=None, cadence=None, daemon=None,
             entries=("model", "rng")):
    """A Launch whose events went through a real Recorder file and back; ``extra``: (event,
    fields) emitted after the start."""
    path = tmp_path / f"{index}.jsonl"
    rec = Recorder(path)
    if load_error:
        rec.emit("load_failed", error=load_error)
    rec.start(root=tmp_path / "ckpt", world_size=1, resumed_from=resumed, skipped=list(skipped),
              total=100, entries=list(entries), loaded_digest=loaded, cadence=cadence, daemon=daemon)
    for event, fields in extra:
        rec.emit(event, **fields)
    for step in steps:
        rec.emit("progress", step=step)
    for step, how in commits:
        rec.emit("commit", step=step, kind=how, digest="d", blocking_s=0.01, persist_s=0.02)
    if stop is not None:
        rec.emit("stop", step=stop, saved=True, seconds_left=30.0, notice=None)
    if finish is not None:
        rec.emit("finish", step=100, digest=finish)
    killed = kind == "sigkill"
    launch = Launch(index, kind, log=tmp_path / f"{index}.log", events=list(read(path)),
                    status=0 if finish else -9 if killed else 75, killed=killed)
    launch.t_launch, launch.t_end = launch.events[0]["t"] - 1, launch.events[-1]["t"] + 0.1
    if kind:  # delivered at the last progress the record showed
        launch.preempted_at, launch.preempted_step = launch.events[-1]["t"] - 0.01, launch.reached
    return launch


def failed(checks):
    return {check.name: check.detail for check in checks if not check.ok}


def test_a_job_that_resumes_exactly_passes(tmp_path):
    first = recorded(tmp_path, 1, steps=(10, 20, 25), commits=((10, "periodic"), (20, "periodic")),
                     kind="sigkill")
    second = recorded(tmp_path, 2, resumed=20, steps=(30, 40), commits=((30, "periodic"),),
                      stop=40, kind="notice")
    last = recorded(tmp_path, 3, resumed=40, steps=(60, 100), finish="abc")
    reference = recorded(tmp_path, 0, steps=(50, 100), finish="abc")
    launches = [first, second, last]
    assert failed(judge(launches, reference)) == {}
    rows = losses(launches, save_figures(launches))
    assert [(r["kind"], r["steps_lost"], r["resumed_from"]) for r in rows] == [
        ("sigkill", 5, 20), ("notice", 0, 40)]
    assert save_figures(launches)["save_cost_s"] == 0.03
    assert (save_figures(launches)["mtbf_s"], save_figures(launches)["mtbf_source"]) == (DEFAULT_NODE_MTBF_S, "default")


def test_the_save_figures_use_the_mtbf_the_job_planned_with(tmp_path):
    """The record's commits carry the cadence's MTBF (given, or learned by the daemon): Young's
    optimum in the drill's figures is taken at the last one, not at a default."""
    path = tmp_path / "1.jsonl"
    rec = Recorder(path)
    rec.start(root=tmp_path / "ckpt", world_size=1, resumed_from=None, skipped=[], total=100,
              entries=["model"], loaded_digest=None)
    for step, mtbf in ((10, 7200.0), (20, 1800.0)):
        rec.emit("progress", step=step)
        rec.emit("commit", step=step, kind="periodic", digest="d", blocking_s=0.5, persist_s=0.5,
                 mtbf_s=mtbf, mtbf_source="learned")
    launch = Launch(1, None, log=tmp_path / "1.log", events=list(read(path)), status=0)
    figures = save_figures([launch])
    assert (figures["mtbf_s"], figures["mtbf_source"]) == (1800.0, "learned")
    assert figures["young_interval_s"] == pytest.approx(spotguard.young_interval(1800.0, 1.0))


def test_restarting_from_zero_fails_the_resume_check(tmp_path):
    first = recorded(tmp_path, 1, steps=(30,), commits=((10, "periodic"), (20, "periodic")),
                     kind="sigkill")
    again = recorded(tmp_path, 2, resumed=None, steps=(100,), finish="abc")
    checks = judge([first, again], None)
    problems = failed(checks)
    assert verdict(checks) == "FAILED" and set(problems) == {"resume", "preemptions"}
    assert "launch 2 started from scratch although step 20 was committed" in problems["resume"]
    assert "0 of 1 preemption(s) took effect" in problems["preemptions"]
    assert "the next launch resumed from step 0" in problems["preemptions"]


def test_a_different_final_state_is_named(tmp_path):
    first = recorded(tmp_path, 1, steps=(30,), commits=((20, "periodic"), (30, "emergency")),
                     stop=30, kind="notice")
    last = recorded(tmp_path, 2, resumed=30, steps=(100,), commits=((40, "periodic"),),
                    finish="weights-only")
    for event in last.of("commit"):
        event["digest"] = "other"
    reference = recorded(tmp_path, 0, steps=(100,), commits=((20, "periodic"), (40, "periodic")),
                         finish="full")
    problems = failed(judge([first, last], reference))
    assert set(problems) == {"identical"}
    assert "final training state differs from the uninterrupted run" in problems["identical"]
    assert "Its checkpoint holds: model, rng." in problems["identical"]
    assert ("identical at step 20 and differ at step 40, after launch 2 resumed from step 30"
            in problems["identical"])


def test_warned_preemption_that_loses_steps_and_failed_loads(tmp_path):
    first = recorded(tmp_path, 1, steps=(35,), commits=((20, "periodic"),), kind="sigterm")
    second = recorded(tmp_path, 2, resumed=20, load_error="CheckpointCorruptError: bad",
                      skipped=({"path": "p", "reason": "torn"},))
    problems = failed(judge([first, second], None))
    assert "lost 15 step(s) to SIGTERM" in problems["saves on warning"]
    assert "CheckpointCorruptError: bad" in problems["loads"]
    assert "exited with status 75 without finishing" in problems["finished"]


def test_a_job_that_outruns_the_drills_sigterm_finished_though_its_launcher_exits_1(tmp_path):
    """A SIGTERM with a deadline far enough to train the last steps: the job records its finish
    and torchrun's agent exits 1 of the signal. That launch finished (the preemption did not land);
    a non-zero exit after a notice, which the drill sends the launcher no signal for, did not."""
    first = recorded(tmp_path, 1, steps=(10, 20), commits=((10, "periodic"), (20, "periodic")), kind="sigkill")
    last = recorded(tmp_path, 2, resumed=20, steps=(88, 100), finish="abc", kind="sigterm")
    last.status = 1
    reference = recorded(tmp_path, 0, steps=(50, 100), finish="abc")
    problems = failed(judge([first, last], reference))
    assert "finished" not in problems and "identical" not in problems, problems
    assert [c.detail for c in judge([first, last], reference) if c.name == "finished"] == [
        "the job finished at step 100 (after the drill's SIGTERM; the launch exited with status 1)"]
    last.kind = "notice"
    assert "exited with status 1 without finishing" in failed(judge([first, last], reference))["finished"]


def test_a_job_that_never_records_and_one_that_is_not_fresh(tmp_path):
    silent = Launch(1, log=tmp_path / "1.log", status=1)
    assert "without starting a spotguard run" in failed(judge([silent], None))["recorded"]
    stale = recorded(tmp_path, 1, resumed=40, steps=(100,), finish="x")
    assert "already held checkpoints" in failed(judge([stale], None))["fresh start"]


def test_report_files_and_timeline(tmp_path, capsys):
    first = recorded(tmp_path, 1, steps=(10, 25), commits=((10, "periodic"), (20, "periodic")),
                     kind="sigkill")
    first.killed = True
    last = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="abc")
    reference = recorded(tmp_path, 0, steps=(100,), finish="abc")
    live = Live(tty=False)
    for event in last.events:
        live.event(last, event)
    live.bar(last)  # not a terminal: no bar
    status = write_report(tmp_path, ["python", "job.py"], [first, last], reference,
                          judge([first, last], reference), live)
    out = capsys.readouterr().out
    assert status == 0
    assert "launch 2: resumed from step 20 of 100 steps" in out and "\r" not in out
    assert "spotguard drill: PASSED" in out and "sigkill" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["preemptions"][0]["steps_lost"] == 5
    svg = xml.dom.minidom.parse(str(tmp_path / "timeline.svg"))
    assert len(svg.getElementsByTagName("polyline")) == 3  # reference and two launches
    assert len(svg.getElementsByTagName("circle")) == 2  # the saves


def test_read_new_leaves_a_partial_line_for_later(tmp_path):
    path = tmp_path / "r.jsonl"
    Recorder(path).emit("progress", step=1)
    with open(path, "a") as file:
        file.write('{"v": 1, "event": "progr')
    events, offset = read_new(path, 0)
    assert [e["step"] for e in events] == [1]
    with open(path, "a") as file:
        file.write('ess", "step": 2, "t": 1.5, "pid": 7, "rank": 0}\n')
    events, _ = read_new(path, offset)
    assert [e["step"] for e in events] == [2]
    assert read_new(tmp_path / "missing", 0) == ([], 0)


def test_the_library_records_a_failed_load_and_the_state_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_RECORD", str(tmp_path / "r.jsonl"))
    model = torch.nn.Linear(2, 2)
    with spotguard.Run(tmp_path / "ckpt", model=model, daemon=False, save_every=1) as run:
        for _ in run.steps(2):
            pass
    for path in (tmp_path / "ckpt").rglob("*"):
        if path.is_file():
            path.write_bytes(b"torn")
    with pytest.raises(CheckpointCorruptError):
        with spotguard.Run(tmp_path / "ckpt", model=model, daemon=False) as run:
            for _ in run.steps(2):
                pass
    events = list(read(tmp_path / "r.jsonl"))
    assert events[0]["event"] == "start" and events[0]["entries"] == ["model", "rng"]
    (failure,) = [e for e in events if e["event"] == "load_failed"]
    assert "CheckpointCorruptError" in failure["error"]


def _round(values):
    """Ticks from 0, evenly spaced by 1, 2, 2.5 or 5 times a power of ten."""
    gaps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    if values[0] != 0 or len(gaps) != 1:
        return False
    gap = gaps.pop()
    mantissa = gap / 10 ** math.floor(math.log10(gap))
    return any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5))


def test_picture_table_log_and_report_agree_legend_inside_round_ticks(tmp_path, capsys):
    """Each preemption's step is the one the record showed at delivery, everywhere; the legend
    fits in the canvas; both axes carry round ticks reaching past the data."""
    first = recorded(tmp_path, 1, steps=(10, 20, 37), commits=((10, "periodic"), (30, "periodic")),
                     kind="sigkill")
    first.killed, first.deadline = True, 0.0
    first.events.append({**first.events[-1], "event": "progress", "step": 39})  # after delivery
    second = recorded(tmp_path, 2, resumed=30, steps=(41, 55), stop=56, kind="notice")
    second.deadline = 3.5
    last = recorded(tmp_path, 3, resumed=56, steps=(97,), finish="abc")
    reference = recorded(tmp_path, 0, steps=(97,), finish="abc")
    last.t_end = first.t_launch + 39.3  # a span that is no round number
    live = Live(tty=False)
    for launch in (first, second):
        live.preempt(launch)
    launches = [first, second, last]
    assert write_report(tmp_path, ["job"], launches, reference, judge(launches, reference, 2),
                        live) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    picture = (tmp_path / "timeline.svg").read_text()
    for row, launch in zip(report["preemptions"], (first, second)):
        step = launch.preempted_step
        assert row["at_step"] == step and row["effective"]
        assert f"PREEMPTED at step {step}" in out and f"at step {step}</title>" in picture
    assert report["preemptions"][0]["stopped_at"] == 39
    assert "deadline 3.5 s" in out
    svg = xml.dom.minidom.parseString(picture)
    width = float(svg.documentElement.getAttribute("width"))
    texts = svg.getElementsByTagName("text")
    legend = [t for t in texts if t.getAttribute("class") == "legend"]
    assert [t.firstChild.data for t in legend] == [  # only what occurred: no emergency save,
        "reference run", "drilled launches, saves", "daemon notice with room to save",  # no
        "SIGKILL, no warning", "x  process killed"]  # short notice, no SIGTERM
    colours = [r.getAttribute("fill") for r in svg.getElementsByTagName("rect")[1:]]
    assert len(colours) == 5 and len(set(colours)) == 5, colours  # one colour per kind and mark
    for text in legend:
        assert float(text.getAttribute("x")) + CHAR_W * len(text.firstChild.data) <= width
    for axis, top in (("tick-x", 39.3), ("tick-y", 100)):
        ticks = [float(t.firstChild.data) for t in texts if t.getAttribute("class") == axis]
        assert _round(ticks) and ticks[-1] >= top, ticks


def test_the_cause_is_named_from_what_the_record_shows(tmp_path):
    """Before blaming missing state: state the job left out of Run (recorded by the library),
    DDP's layout the checkpoint says cannot be restored, samples that differ, a load of another
    state than the one committed; with state and data exact, the arithmetic."""
    def case(*, extra=(), loaded=None, layout=None, data_after=(("data", {"step": 25, "ids": "a"}),)):
        here = tmp_path / str(len(list(tmp_path.iterdir())))
        here.mkdir()
        ref_data = tuple(("data", {"step": s, "ids": "a"}) for s in (5, 25))
        first = recorded(here, 1, steps=(20, 22), commits=((20, "periodic"),), kind="sigkill",
                         extra=extra)
        last = recorded(here, 2, resumed=20, steps=(100,), finish="other", extra=data_after,
                        loaded=loaded)
        reference = recorded(here, 0, steps=(100,), commits=((20, "periodic"),), finish="full",
                             extra=ref_data)
        return failed(judge([first, last], reference, 1, layout=layout))

    unsaved = case(extra=(("unsaved", {"what": "optimizer (AdamW)"}), ("unsaved", {"what": "LR scheduler"})))
    assert ("The job uses state that is not in its checkpoint: LR scheduler; optimizer (AdamW)"
            in unsaved["identical"])
    ddp = case(layout={"restorable": False, "why": "model: a comm hook is registered"})
    assert "DDP's gradient bucket layout cannot be restored (model: a comm hook" in ddp["identical"]
    exact = case()
    assert set(exact) == {"identical"} and "the arithmetic of the resumed steps differs" in exact["identical"]
    data = case(data_after=(("data", {"step": 25, "ids": "b"}),))
    assert "launch 2 consumed other samples at step 25 after it resumed from step 20" in data["data"]
    swapped = case(loaded="e" * 64)
    assert "launch 2 loaded a state of step 20 other than the one committed" in swapped["loads"]


def test_a_newer_durable_checkpoint_not_restored_fails_the_resume_check(tmp_path):
    first = recorded(tmp_path, 1, steps=(20, 25), commits=((20, "periodic"),), kind="sigkill")
    second = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="abc", extra=(
        ("restore_failed", {"store": "s3://b/p", "store_step": 30, "local_step": 20,
                            "error": "ResponseStreamingError"}),))
    problems = failed(judge([first, second], None, 1))
    assert set(problems) == {"resume"}
    assert ("launch 2 did not restore the newer checkpoint the durable store held (step 30) and "
            "went on from local step 20: ResponseStreamingError") in problems["resume"]


def test_pass_rests_on_every_kind_landing_once_not_on_every_one_planned(tmp_path):
    """Seven of eight planned preemptions took effect, every kind at least once: PASSED, the one
    that did not land named; with a kind that never landed it stays INCONCLUSIVE."""
    kinds = ["sigkill", "notice", "sigterm", "short-notice", "sigkill", "notice", "sigterm"]
    launches = []
    for i, kind in enumerate(kinds):
        at = 10 * (i + 1)
        launches.append(recorded(tmp_path, i + 1, resumed=at - 10 or None, steps=(at,),
                                 commits=((at, "periodic"),), kind=kind,
                                 stop=at if kind in ("notice", "sigterm") else None))
        if kind == "short-notice":  # the drill's kill at the deadline ended it
            launches[-1].killed, launches[-1].status = True, -9
    last = recorded(tmp_path, 8, resumed=70, steps=(100,), finish="abc")
    last.skipped = "no room left for a short-notice after step 95"
    checks = judge([*launches, last], None, 8)
    assert verdict(checks) == "PASSED", failed(checks)
    took = next(c for c in checks if c.name == "preemptions")
    assert "7 of 8 preemption(s) took effect" in took.detail and "every kind at least once" in took.detail
    assert "not landed: launch 8: no room left" in took.detail
    no_short = [launch for launch in launches if launch.kind != "short-notice"]
    checks = judge([*no_short, last], None, 8)
    assert verdict(checks) == "INCONCLUSIVE" and "(none of kind short-notice)" in failed(checks)["preemptions"]


@pytest.mark.parametrize("cadence, advice", [
    ("save_every", "the job sets its own cadence (Run(save_every=...) or cadence=), which wins over "
                   "the drill's $SPOTGUARD_SAVE_EVERY: for the drill pass save_every=12"),
    ("save_steps", "TrainingArguments(save_steps=...): for the drill pass save_steps=12"),
    ("default", "save sooner: Run(save_every=12)"),
])
def test_checks_that_rest_on_nothing_are_not_judged_and_the_advice_names_the_argument(
        tmp_path, capsys, cadence, advice):
    """The job committed nothing before its end, so the preemption could not take effect: the
    checks about resuming found nothing wrong but are shown as not judged, never passed."""
    only = recorded(tmp_path, 1, steps=(50, 100), finish="abc", cadence=cadence)
    only.preempted_at, only.preempted_step, only.kind = only.events[-1]["t"], 50, "sigterm"
    reference = recorded(tmp_path, 0, steps=(100,), finish="abc")
    checks = judge([only], reference, 4, save_every=12)
    assert verdict(checks) == "INCONCLUSIVE" and advice in failed(checks)["preemptions"]
    unjudged = {c.name for c in checks if not c.judged}
    assert {"resume", "loads", "saves on warning", "identical"} <= unjudged
    assert all(c.ok for c in checks if not c.judged)
    write_report(tmp_path, ["job"], [only], reference, checks, Live(tty=False))
    out = capsys.readouterr().out
    assert "- resume: not judged: no relaunch resumed from a checkpoint" in out
    assert "- saves on warning: not judged: no warned preemption" in out
    assert "\u2714 resume" not in out and "ok resume" not in out


def test_a_notice_to_a_job_that_does_not_listen_to_the_daemon_is_named_not_the_loop(tmp_path):
    deaf = recorded(tmp_path, 1, steps=(20, 35), commits=((20, "periodic"),), kind="notice",
                    daemon=False)
    deaf.killed, deaf.status = True, -9
    after = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="abc", daemon=False)
    problem = failed(judge([deaf, after], None))["saves on warning"]
    assert "lost 15 step(s) to a daemon notice" in problem
    assert "does not listen to the daemon (its record says Run(daemon=False))" in problem
    assert "reached promptly" not in problem


TORCHRUN_FAILED = """\
W1130 05:15:27.759000 6104 torch/distributed/run.py:874] *****************************************
spotguard: the checkpoint root /x/ckpt is in use by pid 6109 on host vm (job t-b2ba94e7b0, since \
2026-11-30 05:15:30 UTC): two launches on one root would interleave their checkpoints
spotguard: job t-b2ba94e7b0: fresh start at step 0 (no checkpoint to resume from); saves every 10 steps
W1130 05:15:31.663000 6104 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 6109 \
closing signal SIGTERM
stopping at step 18: emergency save (about 0.01 s, 30.0 s left)
E1130 05:15:31.880000 6104 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 6110)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
"""The end of a real torchrun launch whose rank 1 was refused its checkpoint root."""


def test_the_drill_plans_only_the_preemptions_that_fit_and_stops_on_a_failed_reference(tmp_path):
    from spotguard_daemon.commands.drill import Drill, DrillError

    run = Drill(["job"], tmp_path, 8, 3, 60.0, Live(tty=False))
    try:
        first = Launch(1, run.kinds[0])
        run._fit(first, 60)  # room for 30: the 8 stand
        assert len(run.kinds) == 8 and len(run.slots) == 8
        run.fitted, run.kinds = False, ["sigkill"] * 8
        run._fit(Launch(1, "sigkill"), 11)  # room for 5: every kind once, the running one first
        assert run.kinds[0] == "sigkill" and sorted(run.kinds[:4]) == sorted(KINDS)
        assert len(run.kinds) == 5 and len(run.slots) == 5 and run.slots == sorted(run.slots)

        failing = Launch(0, label="reference", status=2, log=tmp_path / "reference.log")
        failing.log.write_text("python: can't open file '/x/train.py': [Errno 2] No such file\n")
        with pytest.raises(DrillError, match=r"the reference run \(the command, uninterrupted\) "
                           r"exited with status 2 before it started a spotguard run \(no start "
                           r"event\): \"python: can't open file '/x/train.py'.*nothing was drilled"):
            run._reference_ran(failing)
        # torchrun's report of the failed worker ends the log; the cause is the worker's own line
        failing.status = 1
        failing.log.write_text(TORCHRUN_FAILED)
        with pytest.raises(DrillError, match=r"exited with status 1 before it started a spotguard run "
                           r"\(no start event\): 'spotguard: the checkpoint root /x/ckpt is in use by "
                           r"pid 6109 on host vm.*'; see .*nothing was drilled"):
            run._reference_ran(failing)
        failing.log.write_text(TORCHRUN_FAILED.replace("spotguard: the checkpoint", "the checkpoint")
                               .replace("stopping at step 18", "ValueError: bad batch\nstopping at step 18"))
        with pytest.raises(DrillError, match=r"\(no start event\): 'ValueError: bad batch'; see"):
            run._reference_ran(failing)
        measured = recorded(tmp_path, 0, steps=(10, 100), commits=((100, "periodic"),), finish="x")
        for event, t in zip(measured.of("progress"), (100.0, 109.0)):
            event["t"] = t  # 0.1 s a step; a save costs 0.03 s
        run.kinds = ["notice"] * 8
        run._reference_ran(measured)
        assert run.save_every == 100 // (2 * 9)  # about two saves per preemption
        measured.of("commit")[0]["blocking_s"] = 3.0  # 30 steps a save: one save per preemption
        run._reference_ran(measured)
        assert run.save_every == 100 // 9
    finally:
        run.close()


def _final(root, weight, checkpoint_name):
    """A committed checkpoint holding a Lightning-like dict: weights and a ModelCheckpoint state."""
    from spotguard.checkpoint import Checkpointer

    path = f"/jobs/checkpoints/{checkpoint_name}"
    state = {"lightning": {"state_dict": {"w": torch.full((4,), weight)}, "callbacks": {
        "ModelCheckpoint{'monitor': 'val'}": {"best_model_path": path, "dirpath": "/jobs/checkpoints",
                                              "best_k_models": {path: torch.tensor(0.5)}}}}}
    with Checkpointer(root, job_id="j") as ck:
        ck.save(100, state, blocking=True)
    return ck.latest().path


def test_a_differing_final_state_is_shown_entry_by_entry_and_lightnings_file_versions_are_not_a_difference(
        tmp_path):
    """The drill reads both final checkpoints: a weight that differs is named with what each run
    holds; ModelCheckpoint's '-v1' (a file of the name it wanted existed) is not a difference."""
    from spotguard_daemon.commands.drill_diff import differences

    base = _final(tmp_path / "reference", 1.0, "epoch=5-step=96.ckpt")
    renamed = _final(tmp_path / "renamed", 1.0, "epoch=5-step=96-v1.ckpt")
    other = _final(tmp_path / "other", 2.0, "epoch=5-step=96-v2.ckpt")
    assert differences(renamed, base) == ([], True)
    found, _ = differences(other, base)
    assert found == [("/rank-0/lightning/state_dict/w", "tensor(4,) float32", "tensor(4,) float32")]

    first = recorded(tmp_path, 1, steps=(30,), commits=((20, "periodic"),), stop=30, kind="notice")
    last = recorded(tmp_path, 2, resumed=30, steps=(100,), commits=((40, "periodic"),), finish="mine")
    reference = recorded(tmp_path, 0, steps=(100,), commits=((20, "periodic"), (40, "periodic")),
                         finish="theirs")
    checks = {c.name: c for c in judge([first, last], reference, differing=differences(renamed, base))}
    assert checks["identical"].ok and "'…-v1.ckpt'" in checks["identical"].detail
    problems = failed(judge([first, last], reference, differing=differences(other, base)))
    assert ("It differs in: rank-0/lightning/state_dict/w: tensor(4,) float32 (drilled) vs "
            "tensor(4,) float32 (reference).") in problems["identical"]
    assert "spotguard.DataLoader" in problems["identical"]  # a Run job: its loader is the suspect

    lightning = recorded(tmp_path, 3, resumed=30, steps=(100,), commits=((40, "periodic"),),
                         finish="mine", entries=("data", "lightning", "rng"))
    problems = failed(judge([first, lightning], reference, differing=differences(other, base)))
    assert "The Lightning callback restores Lightning's checkpoint dict" in problems["identical"]
    assert "spotguard.DataLoader" not in problems["identical"]  # the callback owns the loader
