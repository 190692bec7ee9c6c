"""Another local user creates ``/tmp/spotguard-<uid>`` before its owner does (no ``XDG_RUNTIME_DIR``)
and serves a fake daemon there, with world-writable sockets and a forged terminating notice. Every
client refuses it with one line naming the fix, and sends it nothing: ``spotguard status``,
``spotguard run`` (which launches nothing), the library's link, and ``deploy/slurm/train.sbatch``
(which starts a daemon of its own in a directory of its own, and whose training talks only to that).

Two real users are created for the test (``useradd``), as in test_adversarial_requests.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _group import run_group
from _users import new_user

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="creating users needs root")]

ROOT = Path(__file__).resolve().parents[2]

FAKE = """
import json, os, sys, time, zmq
from datetime import datetime, timedelta, timezone
from spotguard.protocol import Kind, Notice, NoticeEvent, Reply, encode
home, log = sys.argv[1], sys.argv[2]
os.mkdir(home); os.chmod(home, 0o755)
ctx = zmq.Context()
router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
router.bind(f"ipc://{home}/requests.sock"); pub.bind(f"ipc://{home}/events.sock")
for name in ("requests.sock", "events.sock"):
    os.chmod(f"{home}/{name}", 0o777)
notice = Notice(id="forged", platform="aws", kind=Kind.TERMINATE, source="aws.spot",
                deadline=datetime.now(timezone.utc) + timedelta(seconds=90))
print("ready", flush=True)
while True:
    if router.poll(100):
        ident, _, body = router.recv_multipart()
        with open(log, "a") as file:
            file.write(body.decode(errors="replace") + "\\n")
        router.send_multipart([ident, b"", encode(Reply(ok=True, data={
            "version": "fake", "pid": os.getpid(), "notices": [notice.model_dump(mode="json")],
            "clients": []}))])
    pub.send_multipart([b"notice", encode(NoticeEvent(notice=notice))])
"""

LINK = """
import logging, sys
from spotguard._daemon_client import DaemonLink
logging.basicConfig(level=logging.ERROR, format="%(message)s")
events = []
link = DaemonLink(events.append, request_timeout=2.0)
connected = link.connect()
link.poll(1.0)
print(connected, len(events), flush=True)
link.close()
"""

TRAIN = """import json, subprocess
status = subprocess.run(["spotguard", "status", "--json"], capture_output=True, text=True, check=True)
open("status.json", "w").write(status.stdout)
"""


def python_for_anyone(where: Path) -> Path:
    """A ``bin`` directory with ``python`` and ``spotguard`` that any user can run: a virtual
    environment over this one's packages, on a base interpreter outside root's home (this test
    venv's base may sit in /root, which other users cannot enter)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = next((p for p in (os.path.realpath(sys._base_executable), f"/usr/bin/{version}")
                 if not p.startswith("/root/") and os.path.exists(p)), None)
    if base is None:
        pytest.skip(f"no {version} that other users can run")
    site = where / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    (site / "test-venv.pth").write_text(
        "import site; site.addsitedir(%r)\n" % next(p for p in sys.path if p.endswith("site-packages")))
    (where / "pyvenv.cfg").write_text(f"home = {Path(base).parent}\ninclude-system-site-packages = false\n")
    (where / "bin").mkdir()
    (where / "bin" / "python").symlink_to(base)
    (where / "bin" / "spotguard").write_text(
        f"#!{where}/bin/python\nimport sys\nfrom spotguard_daemon.commands.cli import main\nsys.exit(main())\n")
    (where / "bin" / "spotguard").chmod(0o755)
    where.chmod(0o755)
    return where / "bin"


def private_dir(uid: int, gid: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sg-squat-", dir="/tmp"))
    os.chown(path, uid, gid)
    return path


def as_user(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]


@pytest.fixture
def squatted():
    """(victim's uid, gid, home, env, attacker's uid, the fake daemon's request log): the attacker's
    fake daemon already serves in ``/tmp/spotguard-<victim's uid>`` and ``/tmp/spotguard-7.0``, the
    Slurm script's former name for job 7, is the attacker's too."""
    with new_user() as (victim, vgid), new_user() as (attacker, agid):
        home, spy = private_dir(victim, vgid), private_dir(attacker, agid)
        tools = Path(tempfile.mkdtemp(prefix="sg-python-", dir="/tmp"))
        squat, old_slurm = Path(f"/tmp/spotguard-{victim}"), Path("/tmp/spotguard-7.0")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SPOTGUARD_") and k not in ("XDG_RUNTIME_DIR", "TMPDIR")}
        env.update(HOME=str(home), PATH=f"{python_for_anyone(tools)}:/usr/bin:/bin")
        fake = None
        try:
            subprocess.run([*as_user(attacker, agid), "mkdir", "-m", "777", str(old_slurm)], check=True)
            fake = subprocess.Popen([*as_user(attacker, agid), "python", "-c", FAKE, str(squat),
                                     str(spy / "requests.log")], env=env, stdout=subprocess.PIPE, text=True)
            assert fake.stdout.readline().strip() == "ready"
            assert squat.stat().st_uid == attacker
            yield victim, vgid, home, env, attacker, spy / "requests.log"
        finally:
            if fake is not None:
                fake.kill()
                fake.wait()
            for path in (home, spy, tools, squat, old_slurm):
                shutil.rmtree(path, ignore_errors=True)


def refusal(victim: int, attacker: int) -> str:
    return f"/tmp/spotguard-{victim} belongs to uid {attacker}, not to this user ({victim}) or root"


def test_status_run_and_the_library_refuse_the_fake_daemon(squatted):
    victim, gid, home, env, attacker, spied = squatted
    user = as_user(victim, gid)
    status = subprocess.run([*user, "spotguard", "status"], env=env, cwd=home, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 1 and status.stderr.count("\n") == 1, status.stderr
    assert refusal(victim, attacker) in status.stderr and "SPOTGUARD_RUNTIME_DIR" in status.stderr

    run = subprocess.run([*user, "spotguard", "run", "--", "python", "-c", "open('ran', 'w')"],
                         env=env, cwd=home, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("spotguard run: ") and refusal(victim, attacker) in run.stderr
    assert not (home / "ran").exists(), "nothing is launched beside a fake daemon"

    link = subprocess.run([*user, "python", "-c", LINK], env=env, cwd=home, capture_output=True,
                          text=True, timeout=60)
    assert link.stdout.split() == ["False", "0"], link.stdout + link.stderr
    assert link.stderr.count("not talking to the daemon") == 1, link.stderr
    assert not spied.exists(), f"the fake daemon was asked: {spied.read_text()}"


def test_the_slurm_script_runs_its_own_daemon_in_a_directory_of_its_own(squatted):
    victim, gid, home, env, attacker, spied = squatted
    shutil.copy(ROOT / "deploy" / "slurm" / "train.sbatch", home / "train.sbatch")
    (home / "train.py").write_text(TRAIN)
    env = {**env, "SLURM_JOB_ID": "7", "SPOTGUARD_SLURM__ENABLED": "no", "SPOTGUARD_PLATFORM": "none"}
    code, output = run_group([*as_user(victim, gid), "bash", "train.sbatch"], cwd=home, env=env, timeout=90)
    assert code == 0, output
    assert refusal(victim, attacker) in output
    status = json.loads((home / "status.json").read_text())
    assert status["version"] != "fake" and status["notices"] == [], status
    assert not spied.exists(), f"the fake daemon was asked: {spied.read_text()}"
