"""Prometheus and Grafana files against real tools: ``promtool`` checks and unit-tests the alert rules and
lints a live daemon's ``/metrics``; a real Prometheus server scrapes a daemon and answers a query (and
fires an alert) after a drill notice; every dashboard and alert query names a metric the daemon exports.

``scripts/test`` installs Debian's ``prometheus`` package (server and promtool) when it runs as root.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from spotguard.protocol import Kind, NotifyRequest, StatusRequest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "spotguard.json"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(Debian package prometheus; scripts/test installs it as root)")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60)


def metrics_url(daemon) -> str:
    url = daemon.request(StatusRequest()).data["metrics"]
    assert url, "the daemon serves no metrics"
    return url


def exported_names(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can hold, even for families with no sample yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
                "unknown": ("",), "info": ("_info",), "summary": ("", "_count", "_sum")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def queried_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(spotguard_[a-z_]+)", expr))


@needs_promtool
def test_alert_rules_are_valid_and_pass_their_unit_tests():
    assert promtool("check", "rules", str(RULES)).returncode == 0
    result = promtool("test", "rules", str(RULES.with_name("alerts.test.yml")))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@needs_promtool
def test_live_metrics_pass_promtool_lint(daemon_factory):
    daemon = daemon_factory()
    daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=60))
    text = httpx.get(metrics_url(daemon), timeout=5).text
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'spotguard_notices_pending{kind="drill",terminating="true"} 1.0' in text


def test_every_dashboard_and_alert_query_names_an_exported_metric(daemon_factory):
    daemon = daemon_factory()
    exported = exported_names(httpx.get(metrics_url(daemon), timeout=5).text)
    dashboard = yaml.safe_load(DASHBOARD.read_text())  # JSON is YAML
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [r["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    assert len(exprs) > 15
    for expr in exprs:
        assert queried_names(expr) <= exported, (expr, queried_names(expr) - exported)
    named = set().union(*map(queried_names, exprs))
    for must in ("spotguard_notices_pending", "spotguard_notice_deadline_seconds",
                 "spotguard_poll_requests_total", "spotguard_upload_queue_depth",
                 "spotguard_upload_last_durable_age_seconds", "spotguard_clients_safe",
                 "spotguard_steps_lost_total", "spotguard_time_lost_seconds_total",
                 "spotguard_downtime_seconds_total", "spotguard_training_seconds_total"):
        assert must in named


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def prometheus(tmp_path):
    """``prometheus(target)``: a real server on 127.0.0.1 scraping ``target`` every second, with the
    alert rules loaded; stopped by its pid at teardown."""
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/test installs it)")
    procs: list[subprocess.Popen] = []

    def start(target: str) -> str:
        shutil.copy(RULES, tmp_path / "alerts.yml")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [{"job_name": "spotguard", "static_configs": [{"targets": [target]}]}]}))
        address = f"127.0.0.1:{free_port()}"
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--web.listen-address={address}",
             f"--storage.tsdb.path={tmp_path / 'data'}"], stdout=log, stderr=subprocess.STDOUT))
        base = f"http://{address}"
        for _ in range(150):
            assert procs[-1].poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    return base
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(15)


def query_until(base: str, query: str, seconds: float = 30) -> list:
    """Poll an instant query (at most ``seconds``, twice a second) until it returns a series."""
    for _ in range(int(seconds * 2)):
        result = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5).json()
        if result["data"]["result"]:
            return result["data"]["result"]
        time.sleep(0.5)
    raise AssertionError(f"no result for {query} within {seconds}s")


@pytest.mark.slow
def test_prometheus_scrapes_a_daemon_and_fires_on_a_notice(daemon_factory, prometheus):
    daemon = daemon_factory()
    base = prometheus(httpx.URL(metrics_url(daemon)).netloc.decode())
    assert query_until(base, 'up{job="spotguard"} == 1')
    daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=120, detail="prometheus test"))
    pending = query_until(base, 'spotguard_notices_pending{terminating="true"}')
    assert pending[0]["metric"]["kind"] == "drill" and pending[0]["value"][1] == "1"
    deadline = query_until(base, "spotguard_notice_deadline_seconds > 0")
    assert 0 < float(deadline[0]["value"][1]) <= 120
    firing = query_until(base, 'ALERTS{alertname="SpotguardTerminationNoticePending",alertstate="firing"}')
    assert firing[0]["metric"]["severity"] == "warning"
