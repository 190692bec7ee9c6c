"""The ``spotguard`` entry point, run as a real subprocess from the venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spotguard.protocol import Notice

SPOTGUARD = str(Path(sys.executable).parent / "spotguard")


def run(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    return subprocess.run([SPOTGUARD, *args], env={**full_env, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


BAD_TOML = "[aws\ninterval = 1"


@pytest.mark.parametrize("args, env, config, where", [
    (["--platform", "mars"], {}, None, "platform"),
    (["--metrics-port", "70000"], {}, None, "metrics.port"),
    (["--metrics-port", "abc"], {}, None, "metrics.port"),
    (["--log-level", "LOUD"], {}, None, "log_level"),
    (["--bogus"], {}, None, "--bogus"),
    ([], {"SPOTGUARD_AWS__INTERVAL": "0"}, None, "aws.interval"),
    ([], {"SPOTGUARD_DELIVERY__SIGNAL": "SIGBOGUS"}, None, "delivery.signal"),
    ([], {"SPOTGUARD_ZMQ__PUB_ENDPOINT": "tcp://10.0.0.1:5555"}, None, "zmq.pub_endpoint"),
    ([], {"SPOTGUARD_SIGNAL__GRACE": "-1"}, None, "signal.grace"),
    ([], {}, "missing", "--config"),
    ([], {}, BAD_TOML, "not valid TOML"),
    ([], {}, "[runner]\nbackoff_initial = 5\nbackoff_max = 1\n", "backoff_max"),
    ([], {}, "nope = 1\n", "nope"),
    ([], {}, '[delivery]\nwebhook = "not a url"\n', "delivery.webhook"),
])
def test_every_invalid_setting_exits_2_with_one_line(tmp_path, args, env, config, where):
    if config is not None:
        path = tmp_path / "spotguard.toml"
        if config != "missing":
            path.write_text(config)
        args = ["--config", str(path), *args]
    result = run("daemon", *args, "--runtime-dir", str(tmp_path / "run"), env=env)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists(), "nothing may start on invalid settings"


def test_print_config_shows_effective_settings_with_secrets_redacted(tmp_path):
    config = tmp_path / "spotguard.toml"
    config.write_text("[aws]\ninterval = 3.0\n")
    result = run("daemon", "--config", str(config), "--platform", "aws", "--metrics-port", "0",
                 "--print-config", env={"SPOTGUARD_DELIVERY__WEBHOOK_SECRET": "hunter2"})
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)
    assert settings["platform"] == "aws" and settings["aws"]["interval"] == 3.0
    assert settings["metrics"]["port"] == 0
    assert settings["delivery"]["webhook_secret"] == "**********" and "hunter2" not in result.stdout


def test_status_exits_1_when_no_daemon_answers_and_says_how_to_start_one(sock_dir):
    result = run("status", "--timeout", "300ms", env={"SPOTGUARD_RUNTIME_DIR": str(sock_dir)})
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "no daemon answered" in result.stderr
    assert "within 0.3 s; start one with `spotguard daemon`" in result.stderr, result.stderr


@pytest.mark.parametrize("args, said", [
    (["run", "--max-restart", "3", "--", "true"], "no such option: --max-restart (did you mean --max-restarts?)"),
    (["drill", "--preemption=3", "--", "true"], "no such option: --preemption (did you mean --preemptions?)"),
    (["status", "--jsn"], "Did you mean '--json'?"),
    (["notify", "--deadline", "2x"], "'2x' is not a duration: seconds, or a number with a unit (90s, 2m, 1h)"),
    (["notify", "--deadline", "8d"], "'8d' is 691200 s: give a duration between 0 s and 604800 s"),
])
def test_a_mistyped_option_or_duration_is_one_line_that_says_what_was_meant(args, said):
    result = run(*args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert said in result.stderr, result.stderr


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("2m", 120), ("2min", 120),
                                           ("1h", 3600), ("1.5h", 5400), ("1h30m", 5400),
                                           ("500ms", 0.5), ("1d", 86400), (" 1 h ", 3600)])
def test_durations_take_units(text, seconds):
    from spotguard_daemon.commands.common import seconds as parse

    assert parse(text) == seconds
    for bad in ("", "x", "1h30", "2x", "-1", "nan", "inf", "1e3", "1 2"):
        with pytest.raises(ValueError):
            parse(bad)



def test_the_cadence_takes_its_durations_with_units_too():
    result = run("cadence", "--checkpoint-seconds", "30s", "--mtbf-hours", "3", "--step-seconds", "500ms")
    assert result.returncode == 0, result.stderr
    assert "checkpoint cost  C = 30.0 s" in result.stdout and "floor(T / 0.5 s)" in result.stdout


def test_notify_and_status_against_a_running_daemon(daemon_factory):
    daemon = daemon_factory()
    env = {"SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    notified = run("notify", "--kind", "preempt", "--deadline", "2m", "--detail", "drill", env=env)
    assert notified.returncode == 0, notified.stderr
    notice_id = notified.stdout.strip()
    assert notice_id.startswith("manual:preempt:")
    human = run("status", env=env)
    assert human.returncode == 0 and notice_id in human.stdout and "preempt" in human.stdout
    data = json.loads(run("status", "--json", env=env).stdout)
    assert [n["id"] for n in data["notices"]] == [notice_id]
    assert 100 < Notice.model_validate(data["notices"][0]).seconds_left() <= 120  # 2m
    assert data["platform"] == "none" and data["metrics"].startswith("http://127.0.0.1:")


def test_version_and_help():
    assert run("version").stdout.startswith("spotguard ")
    assert "daemon" in run("--help").stdout


def test_the_group_imports_without_the_daemons_heavy_parts():
    code = ("import sys, spotguard_daemon.commands.cli; "
            "print(sorted(m for m in ('httpx', 'prometheus_client', 'tenacity', 'spotguard_daemon.core.app')"
            " if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "[]", result


def test_a_port_in_use_fails_start_up_with_one_line_and_status_1(sock_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("daemon", "--platform", "none", "--runtime-dir", str(sock_dir / "run"),
                     "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port),
                     "--log-level", "ERROR")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"spotguard: cannot start: cannot serve metrics on 127.0.0.1:{port}: Address already in use"]
