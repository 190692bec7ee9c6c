"""``spotguard checkpoints`` through click's CliRunner, against a file store and the S3 emulator."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from spotguard.storage import Durable
from spotguard.storage.durable import manifest_key, object_key
from spotguard_daemon.commands.checkpoints import checkpoints


@pytest.fixture
def populated(new_bucket, make_ckpt, tmp_path):
    store = new_bucket("s3")
    durable = Durable(store)
    for step in (10, 20):
        durable.upload(make_ckpt(tmp_path / "local", step, {"w.bin": os.urandom(4096), "o.bin": b"o" * step}), "run")
    return store


def invoke(*args: str, endpoint: str | None = None):
    extra = ["--endpoint-url", endpoint] if endpoint else []
    return CliRunner().invoke(checkpoints, [*args, *extra], catch_exceptions=False,
                              env={"SPOTGUARD_STORAGE__URL": None})


def test_list_marks_latest_and_shows_sizes(populated, moto):
    result = invoke("list", "--store", populated.url, "--job", "run", endpoint=moto.url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "STEP" in lines[0] and len(lines) == 3
    assert lines[1].startswith("  ") and " 10 " in lines[1] and "4,106" in lines[1]
    assert lines[2].startswith("*") and " 20 " in lines[2] and "4,116" in lines[2]


def test_list_of_an_unknown_job_fails_naming_the_jobs_there_and_without_job_lists_them(populated, moto):
    result = invoke("list", "--store", populated.url, "--job", "nope", endpoint=moto.url)
    assert result.exit_code == 1, result.output
    assert result.output.strip().endswith("job 'nope' has no durable checkpoint; jobs there: run")
    jobs = invoke("list", "--store", populated.url, endpoint=moto.url)
    assert jobs.exit_code == 0 and jobs.output.splitlines() == ["run  latest step 20"], jobs.output


def test_verify_passes_then_names_a_corrupt_file(populated, moto):
    ok = invoke("verify", "--store", populated.url, "--job", "run", endpoint=moto.url)
    assert ok.exit_code == 0 and "run step 20: OK (2 files verified)" in ok.output
    import json

    sha = json.loads(populated.get_bytes(manifest_key("run", 20)))["files"]["w.bin"]["sha256"]
    populated.put_bytes(object_key(sha), b"rotten")
    bad = invoke("verify", "--store", populated.url, "--job", "run", "--step", "20", endpoint=moto.url)
    assert bad.exit_code == 1 and "w.bin" in bad.output and "not restorable" in bad.output
    populated.delete([object_key(sha)])
    quick = invoke("verify", "--store", populated.url, "--job", "run", "--quick", endpoint=moto.url)
    assert quick.exit_code == 1 and "missing" in quick.output


def test_restore_writes_a_committed_checkpoint(populated, moto, tmp_path):
    dest = tmp_path / "restored"
    result = invoke("restore", "--store", populated.url, "--job", "run", "--step", "10", "--dest", str(dest),
                    endpoint=moto.url)
    assert result.exit_code == 0, result.output
    assert f"into {dest}/step-0000000010" in result.output
    assert (dest / "latest").read_text() == "step-0000000010\n" and (dest / "step-0000000010/o.bin").read_bytes() == b"o" * 10


def test_restore_of_a_missing_step_fails_in_one_line(populated, moto, tmp_path):
    result = invoke("restore", "--store", populated.url, "--job", "run", "--step", "99",
                    "--dest", str(tmp_path / "d"), endpoint=moto.url)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1


def _objects(store) -> set[str]:
    return set(store.list("objects/"))


def test_delete_removes_a_job_and_keeps_what_another_job_shares(populated, moto, make_ckpt, tmp_path):
    durable = Durable(populated)
    shared = {"o.bin": b"o" * 10}  # the same bytes as run's step 10: one object, two jobs
    durable.upload(make_ckpt(tmp_path / "other", 5, {**shared, "x.bin": os.urandom(1000)}), "other")
    run_only = {object_key(meta["sha256"]) for step in (10, 20)
                for name, meta in durable.manifest("run", step)["files"].items() if name == "w.bin"}
    assert run_only <= _objects(populated)
    asked = CliRunner().invoke(checkpoints, ["delete", "--store", populated.url, "--job", "run",
                                             "--endpoint-url", moto.url], input="n\n",
                               env={"SPOTGUARD_STORAGE__URL": None})
    assert asked.exit_code == 1 and "nothing deleted (not confirmed" in asked.output
    assert "Delete 2 durable checkpoint(s) of job 'run' (steps 10-20)" in asked.output
    assert durable.list("run") == [10, 20]
    result = invoke("delete", "--store", populated.url, "--job", "run", "--yes", endpoint=moto.url)
    assert result.exit_code == 0, result.output
    assert "deleted 2 durable checkpoint(s) of job 'run'" in result.output and "3 object(s)" in result.output  # both w.bin, step 20's o.bin
    assert not list(populated.list("jobs/run/")) and not run_only & _objects(populated)
    assert durable.jobs() == ["other"] and durable.verify("other", 5) == []  # the shared object stayed
    again = invoke("delete", "--store", populated.url, "--job", "run", "--yes", endpoint=moto.url)
    assert again.exit_code == 1 and "job 'run' has no durable checkpoint; jobs there: other" in again.output


def test_delete_refuses_while_the_job_uploads(populated, moto):
    import time

    populated.put_bytes(f"jobs/run/pending/{int(time.time())}-0123abcd.json", b'{"hashes": []}')
    before = _objects(populated)
    result = invoke("delete", "--store", populated.url, "--job", "run", "--yes", endpoint=moto.url)
    assert result.exit_code == 1 and "nothing deleted" in result.output and "upload in flight" in result.output
    assert Durable(populated).list("run") == [10, 20] and _objects(populated) == before
    populated.delete([k for k in populated.list("jobs/run/pending/")])
    populated.put_bytes("jobs/run/pending/1000-0123abcd.json", b'{"hashes": []}')  # a crashed upload's, long stale
    result = invoke("delete", "--store", populated.url, "--job", "run", "--yes", endpoint=moto.url)
    assert result.exit_code == 0, result.output
    assert not list(populated.list("jobs/run/"))


def test_delete_removes_what_a_job_without_a_complete_checkpoint_left(populated, moto):
    left = ["jobs/partial/parts/step-0000000005/node-1.0123456789abcdef.json", "jobs/partial/pending/1000-0123abcd.json"]
    for key in left:
        populated.put_bytes(key, b'{"hashes": []}')
    result = invoke("delete", "--store", populated.url, "--job", "partial", "--yes", endpoint=moto.url)
    assert result.exit_code == 0, result.output
    assert "deleted what job 'partial' left (no complete checkpoint)" in result.output and "2 key(s)" in result.output
    assert not list(populated.list("jobs/partial/")) and Durable(populated).list("run") == [10, 20]


def test_a_bad_store_url_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(checkpoints, ["list", "--store", "ftp://x/y", "--job", "j"])
    assert result.exit_code == 2 and "unsupported store URL" in result.output


def test_default_store_comes_from_settings(tmp_path, make_ckpt):
    from spotguard.storage import open_store

    Durable(open_store(f"file://{tmp_path}/durable")).upload(make_ckpt(tmp_path / "l", 3, {"a": b"a"}), "j")
    result = CliRunner().invoke(checkpoints, ["list", "--job", "j"],
                                env={"SPOTGUARD_STORAGE__URL": f"file://{tmp_path}/durable"})
    assert result.exit_code == 0 and "*          3" in result.output
    empty = CliRunner().invoke(checkpoints, ["list", "--store", f"file://{tmp_path}/none"])
    assert empty.exit_code == 0 and "no job has a durable checkpoint" in empty.output
    absent = CliRunner().invoke(checkpoints, ["restore", "--store", f"file://{tmp_path}/none", "--job",
                                              "j", "--dest", str(tmp_path / "d")])
    assert absent.exit_code == 1 and "the store holds no job" in absent.output
