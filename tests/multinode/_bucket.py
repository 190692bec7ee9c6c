"""The store of the node-local tests: the S3 emulator, reachable from both namespaces.

``moto_server`` listens on the host's 127.0.0.1, which no namespace reaches. Each node gets its own
relay (the storage tests' HTTP proxy, ``tests/storage/storage_proxy.py``) whose listening socket is
made inside node a's namespace, on node a's address: node a reaches it locally, node b over the
veth. The relay's threads connect to moto from the host's namespace (a socket stays in the
namespace it was made in). One relay per node lets a test hold one node's uploads
(:class:`HoldingRelay`). Every relay is closed and moto is stopped, by its pid, on the way out.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))

from storage_proxy import Proxy  # noqa: E402

from spotguard.storage import Durable, StoreOptions, open_store  # noqa: E402

CLONE_NEWNET = 0x40000000
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the block's socket creation in namespace ``name`` (``setns``: this thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET):
                raise OSError(ctypes.get_errno(), "setns back to the host's namespace")
    finally:
        os.close(own)
        os.close(target)


class Relay(Proxy):
    """The storage tests' proxy, counting the object bytes it hands out (:attr:`fetched`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fetched = 0

    def rewrite(self, method: str, path: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if method == "GET" and "/objects/sha256/" in path:
            with self.lock:
                self.fetched += int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
        return headers


class HoldingRelay(Relay):
    """A relay that, once armed with :meth:`hold_after`, holds the first object PUT of the job's
    upload that follows the node's part of ``step`` (its pending note was written, no object of it
    lands): :attr:`held` is set, and the request waits for :meth:`release`, then is reset unsent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after = self.pending = ""
        self.stage = 0
        self.held, self.released = threading.Event(), threading.Event()

    def hold_after(self, job: str, step: int) -> None:
        self.after, self.pending, self.stage = f"/jobs/{job}/parts/step-{step:010d}/", f"/jobs/{job}/pending/", 0

    def release(self) -> None:
        self.released.set()

    def pick_fault(self, method: str, path: str) -> str | None:
        path = unquote(path)
        if not self.after or method != "PUT":
            return None
        if self.after in path:
            self.stage = 1  # the part of the step before: the next upload is the one to catch
        elif self.stage == 1 and self.pending in path:
            self.stage = 2
        elif self.stage == 2 and "/objects/sha256/" in path:
            self.held.set()
            self.released.wait(600)
            return "reset"
        return None


class Bucket:
    """A fresh bucket on a moto_server of its own, and the relays of one cluster."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
        if not binary:
            raise RuntimeError("moto_server not installed (pip install 'moto[server]')")
        os.environ.update(AWS)
        self.log = workdir / "moto.log"
        with open(self.log, "wb") as out:  # port 0 is not allowed: moto picks none; take a free one
            self.proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(_free_port())], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
        self.url = f"http://127.0.0.1:{self._port()}"
        self.name = f"sg-{uuid.uuid4().hex[:12]}"
        self.store_url = f"s3://{self.name}/pre"
        self.store = open_store(self.store_url, StoreOptions(endpoint_url=self.url))
        self.store._client.create_bucket(Bucket=self.name)
        self.relays: list[Relay] = []

    def _port(self, timeout: float = 30.0) -> int:
        port = int(self.proc.args[-1])
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                return port
            except urllib.error.HTTPError:
                return port
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()[-500:]
                assert time.monotonic() < deadline, f"moto_server did not answer in {timeout:.0f} s"
                time.sleep(0.1)

    def durable(self) -> Durable:
        return Durable(self.store)

    def relay(self, netns: str, host: str, holding: bool = False) -> Relay:
        """A relay listening on ``host`` in namespace ``netns`` (started; closed by :meth:`close`)."""
        with in_netns(netns):
            relay = (HoldingRelay if holding else Relay)(self.url, host=host)
        self.relays.append(relay.__enter__())
        return relay

    def env(self, relay: Relay) -> dict[str, str]:
        """A node's store settings: the bucket through ``relay``."""
        return {**AWS, "SPOTGUARD_STORAGE__URL": self.store_url, "SPOTGUARD_STORAGE__ENDPOINT_URL": relay.url}

    def close(self) -> None:
        for relay in self.relays:
            if isinstance(relay, HoldingRelay):
                relay.release()
            relay.__exit__(None, None, None)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
