"""``storage.url = "none"``: a daemon for notices only, with no durable store.

A real daemon subprocess over real ZeroMQ: a commit is accepted (and ordered) as with a store, but
nothing is copied anywhere, no ``durable`` event is published, ``status`` says uploads are disabled,
the upload metrics exist at their idle values, and a SIGTERM drain waits for no upload. ``none`` is
read from the environment and from TOML; a misspelling is refused at start. The client side reads
``none`` as no store: nothing restored, and the HF callback commits no copies for upload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq
from spotguard.protocol import CommitRequest, StatusRequest
from spotguard.storage.fresh_node import restore_newer, store_from_env

from _group import run_group
from test_durable_e2e import commit_dir
from test_settings_refused import spotguard

NONE = {"SPOTGUARD_STORAGE__URL": "none"}
QUIET_SECONDS = 1.5
"""How long no durable event must come: a local store announces a small commit well within it."""


def commit(daemon, step: int):
    ckpt = commit_dir(daemon.checkpoint_root, step, {"w.bin": b"w" * 4096})
    return daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=step))


def uploads_status(daemon) -> dict:
    return daemon.request(StatusRequest()).data["uploads"]


def topics_within(sub, seconds: float) -> list[bytes]:
    """Every topic published within ``seconds`` (bounded in time)."""
    topics, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000) + 1):
            topics.append(sub.recv_multipart()[0])
    return topics


def metric_lines(url: str) -> dict[str, str]:
    text = httpx.get(url, timeout=5).text
    return dict(line.split(" ", 1) for line in text.splitlines()
                if line and not line.startswith("#"))


def test_a_commit_is_accepted_copied_nowhere_and_never_announced_durable(daemon_factory):
    daemon = daemon_factory(env={**NONE, "SPOTGUARD_SIGNAL__GRACE": "120"})
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(daemon.pub_endpoint)
        time.sleep(0.3)  # slow joiner: let the subscription reach the daemon
        for step in (10, 20):
            reply = commit(daemon, step)
            assert reply.ok, reply.error
        reply = commit(daemon, 5)
        assert not reply.ok and "older than step 20" in reply.error  # commits still ordered
        assert b"durable" not in topics_within(sub, QUIET_SECONDS)
    status = daemon.request(StatusRequest()).data
    uploads = status["uploads"]
    assert uploads["store"] is None and uploads["disabled"] is True
    shown = (uploads["pending"], uploads["uploading"], uploads["durable"], uploads["bytes_pending"])
    assert shown == ([], None, {}, 0)
    metrics = metric_lines(status["metrics"])
    assert metrics["spotguard_upload_queue_depth"] == "0.0"
    assert metrics["spotguard_upload_bytes_total"] == "0.0"
    assert metrics["spotguard_upload_last_durable_age_seconds"] == "NaN"
    env = {**os.environ, "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    human = subprocess.run([sys.executable, "-m", "spotguard_daemon", "status"],
                           capture_output=True, text=True, env=env)
    assert human.returncode == 0, human.stderr
    assert "durable store: none (uploads disabled" in human.stdout
    assert not (daemon.state_dir / "durable").exists()
    assert not (daemon.state_dir / "uploads.json").exists()
    steps = sorted(p.name for p in daemon.checkpoint_root.iterdir())
    assert steps == ["step-0000000005", "step-0000000010", "step-0000000020"]  # nothing beside them
    assert daemon.stop(timeout=20) == 0  # no upload to wait for, not the grace
    assert "no client is registered, so no notice is raised" in daemon.output()  # nobody to drain
    assert "durable storage" not in daemon.output()  # no store check at start-up


def test_none_from_the_toml_file(daemon_factory, tmp_path):
    config = tmp_path / "spotguard.toml"
    config.write_text('[storage]\nurl = "none"\n')
    daemon = daemon_factory("--config", str(config))
    assert commit(daemon, 1).ok
    assert uploads_status(daemon)["disabled"] is True
    assert not (daemon.state_dir / "durable").exists()


def test_the_default_store_is_unchanged(daemon_factory):
    uploads = uploads_status(daemon_factory())
    assert uploads["disabled"] is False and uploads["store"].endswith("/state/durable")


MEANT_NONE = " (did you mean none?): "


@pytest.mark.parametrize("value, hint", [("nnone", MEANT_NONE), ("Non", MEANT_NONE), ("off", ": ")])
def test_a_misspelt_none_is_refused_at_start(tmp_path, value, hint):
    result = spotguard("daemon", "--platform", "none", "--runtime-dir", str(tmp_path / "run"),
                       "--state-dir", str(tmp_path / "state"),
                       env={"SPOTGUARD_STORAGE__URL": value})
    assert result.returncode == 2, result
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"spotguard: storage.url: unsupported store URL{hint}use file://"), line
    assert line.endswith(f" or none (no store) (got {value!r})"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("value", ["none", "NONE", " None "])
def test_the_settings_read_none_as_no_store(value):
    from spotguard_daemon.core.settings import load_settings

    settings = load_settings(None, storage={"url": value})
    assert settings.storage.url == "none" and settings.storage_url is None


def test_the_checkpoints_command_needs_a_store_when_there_is_none():
    result = spotguard("checkpoints", "list", "--job", "job", env=NONE)
    assert result.returncode == 2 and "storage.url is none" in result.stderr, result


def test_the_client_reads_none_as_no_store(tmp_path):
    assert store_from_env(NONE)[0] is None
    assert store_from_env({"SPOTGUARD_STORAGE__URL": "None"})[0] is None
    assert store_from_env({"SPOTGUARD_STORAGE__URL": "s3://b/p"})[0] == "s3://b/p"
    assert restore_newer(tmp_path / "ckpt", "job", "none") is None  # no store named "none" opened
    assert not (tmp_path / "ckpt").exists()


def test_the_hf_callback_commits_no_copies_without_a_store(daemon_factory, monkeypatch, tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (extra: hf)")
    from spotguard import Guard
    from spotguard.integrations.huggingface import SpotguardTrainerCallback
    from transformers import TrainerControl, TrainerState, TrainingArguments

    daemon = daemon_factory(env=NONE)
    guard = Guard(job_id="job", pub_endpoint=daemon.pub_endpoint,
                  request_endpoint=daemon.request_endpoint)
    try:
        deadline = time.monotonic() + 10
        while guard.daemon_status() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.daemon_status()["uploads"]["store"] is None
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
        for url in ("none", None):  # the variable says none, or only the daemon's status does
            if url is None:
                monkeypatch.delenv("SPOTGUARD_STORAGE__URL", raising=False)
            else:
                monkeypatch.setenv("SPOTGUARD_STORAGE__URL", url)
            callback = SpotguardTrainerCallback(guard=guard)
            callback.on_train_begin(args, TrainerState(), TrainerControl())
            assert callback.durable is False
    finally:
        guard.close()


TRAIN = """import json, subprocess, sys
status = subprocess.run(["spotguard", "status", "--json"], capture_output=True, text=True,
                        check=True)
open("uploads.json", "w").write(json.dumps(json.loads(status.stdout)["uploads"]))
"""


@pytest.mark.parametrize("url", [None, "file://{tmp}/bucket"])
def test_the_slurm_scripts_daemon_has_no_store_unless_one_is_set(tmp_path, sock_dir, url):
    """deploy/slurm/train.sbatch run as Slurm would (its daemon part needs no Slurm): the daemon it
    starts has uploads disabled, or the store named by SPOTGUARD_STORAGE__URL."""
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", TMPDIR=str(sock_dir),
               SLURM_JOB_ID="7", SPOTGUARD_RUNTIME_DIR=str(sock_dir / "no-daemon"),
               SPOTGUARD_SLURM__ENABLED="no", SPOTGUARD_PLATFORM="none")
    if url:
        env["SPOTGUARD_STORAGE__URL"] = url.format(tmp=tmp_path)
    script = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "train.sbatch"
    code, output = run_group(["bash", str(script)], cwd=tmp_path, env=env, timeout=60)
    assert code == 0, output
    uploads = json.loads((tmp_path / "uploads.json").read_text())
    assert uploads["disabled"] is (url is None)
    assert uploads["store"] == (url and url.format(tmp=tmp_path))
    assert not list(sock_dir.glob("spotguard-7.*"))  # the script stopped its daemon and cleaned up
