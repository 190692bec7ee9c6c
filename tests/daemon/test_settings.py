"""Settings: precedence of the sources, validators, redaction, systemd directory variables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spotguard_daemon.core.settings import SettingsError, load_settings, redacted


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("SPOTGUARD_RUNTIME_DIR", "RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)


def test_precedence_defaults_file_env_flags(tmp_path, monkeypatch):
    config = tmp_path / "spotguard.toml"
    config.write_text('platform = "gcp"\n[aws]\ninterval = 3.0\n[gcp]\ninterval = 7.0\n')
    assert load_settings(config).aws.interval == 3.0
    monkeypatch.setenv("SPOTGUARD_AWS__INTERVAL", "4")
    settings = load_settings(config, platform="azure")
    assert settings.aws.interval == 4.0  # env over file
    assert settings.gcp.interval == 7.0  # file over default
    assert settings.platform == "azure"  # flag over file
    assert settings.runner.backoff_max == 30.0  # default


def test_nested_flag_overrides_merge_with_the_other_sources(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_METRICS__HOST", "localhost")
    settings = load_settings(None, metrics={"port": 9999})
    assert (settings.metrics.host, settings.metrics.port) == ("localhost", 9999)


@pytest.mark.parametrize("overrides, where", [
    ({"zmq": {"pub_endpoint": "tcp://10.1.2.3:5555"}}, "zmq.pub_endpoint"),
    ({"zmq": {"request_endpoint": "udp://127.0.0.1:1"}}, "zmq.request_endpoint"),
    ({"metrics": {"host": "0.0.0.0"}}, "metrics.host"),
    ({"delivery": {"signal": "SIGNOPE"}}, "delivery.signal"),
    ({"runner": {"backoff_initial": 5, "backoff_max": 1}}, "backoff_max"),
])
def test_invalid_values_name_the_setting(overrides, where):
    with pytest.raises(SettingsError, match=where.replace(".", r"\.")) as info:
        load_settings(None, **overrides)
    assert "\n" not in str(info.value)


def test_remote_endpoints_need_allow_remote():
    settings = load_settings(None, zmq={"pub_endpoint": "tcp://0.0.0.0:5555", "allow_remote": True})
    assert settings.pub_endpoint == "tcp://0.0.0.0:5555"


def test_signal_names_are_normalised():
    assert load_settings(None, delivery={"signal": "usr2"}).delivery.signal == "SIGUSR2"
    assert load_settings(None, delivery={"signal": "None"}).delivery.signal == "none"


def test_secrets_are_redacted(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_DELIVERY__WEBHOOK_SECRET", "hunter2")
    text = json.dumps(redacted(load_settings(None)))
    assert "hunter2" not in text and "**********" in text


def test_systemd_directories_and_default_endpoints(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run"))
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'state'}:/elsewhere")
    settings = load_settings(None)
    assert settings.runtime_dir == tmp_path / "run" and settings.state_dir == tmp_path / "state"
    assert settings.request_endpoint == f"ipc://{tmp_path / 'run'}/requests.sock"
    assert settings.storage_url == f"file://{Path(tmp_path / 'state' / 'durable')}"
