"""``spotguard drill``'s checks from the progress marks (drill_marks) and its causes, on run records
written by the library's own Recorder: what stays exact for a job that is not reproducible run to
run (every RNG stream restored and going on, step, epoch and LR continuing), a DDP the job kept
from Run named as the arithmetic, and the final loss beside the parameters in the spread."""

from __future__ import annotations

from test_drill_checks import failed, recorded

from spotguard_daemon.commands.drill_checks import judge, verdict

RNG = {"python": "p1", "torch": "t1"}


def marks(step, at="save", rng=None, lr=(0.01,), epoch=0, **extra):
    return ("marks", {"step": step, "at": at, "rng": dict(rng or RNG), "lr": list(lr), "epoch": epoch,
                      **extra})


def drill(tmp_path, *, load=None, after=None, reference=None, first=None, extra=()):
    """Launch 1 saves at 10 and 20, is killed; launch 2 loads 20 (its marks ``load``), saves at 30
    (``after``) and finishes; the reference saves at 10, 20 and 30 (``reference``)."""
    first = first or (marks(10), marks(20))
    tmp_path.mkdir(exist_ok=True)
    one = recorded(tmp_path, 1, steps=(20, 22), commits=((10, "periodic"), (20, "periodic")),
                   kind="sigkill", extra=first)
    two = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="abc",
                   extra=(load or marks(20, "load"), after or marks(30), *extra))
    ref = recorded(tmp_path, 0, steps=(100,), finish="abc",
                   extra=reference or (marks(10), marks(20), marks(30)))
    return failed(judge([one, two], ref, 1)), judge([one, two], ref, 1)


def test_exact_marks_pass_and_each_check_is_named(tmp_path):
    problems, checks = drill(tmp_path)
    assert problems == {} and verdict(checks) == "PASSED"
    assert {"rng streams", "step", "epoch", "lr"} <= {check.name for check in checks}


def test_an_rng_stream_not_restored_at_load_is_named(tmp_path):
    problems, _ = drill(tmp_path, load=marks(20, "load", rng={"python": "p1", "torch": "OTHER"}))
    assert set(problems) == {"rng streams"}
    assert ("launch 2's torch RNG stream right after loading step 20 is not the one saved at step 20"
            in problems["rng streams"])


def test_an_rng_stream_drawn_from_after_the_resume_is_found_against_the_reference(tmp_path):
    problems, _ = drill(tmp_path, after=marks(30, rng={"python": "p1", "torch": "drawn"}))
    assert ("the torch RNG stream at step 30 is not the uninterrupted run's (equal at step 20, after "
            "launch 2 resumed from step 20)" in problems["rng streams"])
    assert "spotguard.DataLoader" in problems["rng streams"]


def test_an_unseeded_stream_is_compared_only_with_itself(tmp_path):
    """Python's random, never seeded, starts from OS entropy in each process: it differs from the
    reference from the start, which is no fault; across a load it must still be restored."""
    own = {"python": "mine", "torch": "t1"}
    problems, _ = drill(tmp_path, first=(marks(10, rng=own), marks(20, rng=own)),
                        load=marks(20, "load", rng=own), after=marks(30, rng={"python": "x", "torch": "t1"}))
    assert problems == {}


def test_the_lr_and_epoch_must_continue(tmp_path):
    problems, _ = drill(tmp_path, load=marks(20, "load", lr=(0.0005,)))
    assert ("launch 2's lr right after loading step 20 is [0.0005], saved [0.01]: the learning-rate "
            "schedule is not restored" in problems["lr"])
    problems, _ = drill(tmp_path / "b", after=marks(30, lr=(0.002,)))
    assert "the lr at step 30 is [0.002], the uninterrupted run's [0.01] (equal at step 20" in problems["lr"]
    problems, _ = drill(tmp_path / "c", load=marks(20, "load", epoch=0), first=(marks(10), marks(20, epoch=3)),
                        reference=(marks(10), marks(20, epoch=3), marks(30, epoch=3)), after=marks(30, epoch=3))
    assert "launch 2's epoch right after loading step 20 is 0, saved 3: the data position" in problems["epoch"]


def test_a_relaunch_counting_from_below_its_load_fails_the_step_check(tmp_path):
    problems, _ = drill(tmp_path, extra=(("progress", {"step": 3}),))
    assert "launch 2 loaded step 20 but counted from step 3" in problems["step"]


def test_a_ddp_kept_from_run_is_named_as_the_arithmetic(tmp_path):
    one = recorded(tmp_path, 1, steps=(20, 22), commits=((20, "periodic"),), kind="sigkill",
                   extra=(("ddp", {"entry": "model", "world_size": 3}),))
    two = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="other")
    ref = recorded(tmp_path, 0, steps=(100,), commits=((20, "periodic"),), finish="full")
    detail = failed(judge([one, two], ref, 1))["identical"]
    assert "its model trains through a DistributedDataParallel that Run was not given" in detail
    assert "with 3 ranks, sums each gradient in another order" in detail
    assert "(DDP bucket layout, reduction order), not the state: pass the DDP itself" in detail


def test_the_spread_compares_the_final_loss_too_with_its_threshold(tmp_path):
    one = recorded(tmp_path, 1, steps=(20, 22), commits=((20, "periodic"),), kind="sigkill")
    one.events = [{**e, "digest": "x"} if e["event"] == "commit" else e for e in one.events]
    two = recorded(tmp_path, 2, resumed=20, steps=(100,), finish="other")
    ref = recorded(tmp_path, 0, steps=(100,), commits=((20, "periodic"),), finish="full")
    spread = {"reference": 1e-7, "drill": 5e-7, "threshold": 1e-6,
              "loss": {"reference": 1e-6, "drill": 3e-4, "threshold": 1e-5}}
    detail = failed(judge([one, two], ref, 1, spread))["identical"]
    assert "the final loss lies 0.0003 (relative) from the reference's, the second reference's 1e-06: threshold 1e-05" in detail
    spread["loss"]["drill"] = 2e-6
    assert failed(judge([one, two], ref, 1, spread)) == {}
