"""A full disk under the state directory while the daemon persists its notice store.

A real daemon subprocess with its state directory on a 512 KiB tmpfs that the test fills to the last
byte: the daemon keeps serving, a notice sent meanwhile still reaches a subscriber, the previous
``notices.json`` stays whole (no torn or empty file, no temporary left behind), and once space is
freed the next change is persisted.
"""

from __future__ import annotations

import json

import pytest
import zmq
from spotguard.protocol import NotifyRequest, StatusRequest
from test_adversarial_requests import next_event, subscribe
from test_adversarial_uploads import fill, small_tmpfs, wait_until  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # starts a daemon


def notify(daemon) -> str:
    reply = daemon.request(NotifyRequest(kind="rebalance", deadline_seconds=600))
    assert reply.ok, reply.error
    return reply.data["notice"]["id"]


def stored_ids(state) -> set[str]:
    doc = json.loads((state / "notices.json").read_text())
    return {entry["notice"]["id"] for entry in doc["notices"]}


def test_a_full_state_directory_keeps_notices_flowing_and_the_previous_store_whole(small_tmpfs,
                                                                                 daemon_factory):
    daemon = daemon_factory(env={"SPOTGUARD_DELIVERY__SIGNAL": "none"})
    assert daemon.state_dir == small_tmpfs
    first = notify(daemon)
    wait_until(lambda: first in stored_ids(small_tmpfs), "the first notice persisted", daemon)
    before = (small_tmpfs / "notices.json").read_bytes()

    filler = fill(small_tmpfs)
    with zmq.Context() as ctx, subscribe(ctx, daemon.pub_endpoint) as sub:
        second = notify(daemon)
        while next_event(sub, "notice").notice.id != second:
            pass
    status = daemon.request(StatusRequest())
    assert status.ok and second in {n["id"] for n in status.data["notices"]}
    assert (small_tmpfs / "notices.json").read_bytes() == before  # the previous store, whole
    assert stored_ids(small_tmpfs) == {first}
    assert sorted(p.name for p in small_tmpfs.iterdir() if "notices" in p.name) == ["notices.json"]
    assert daemon.proc.poll() is None

    filler.unlink()
    third = notify(daemon)
    wait_until(lambda: stored_ids(small_tmpfs) == {first, second, third}, "the store written again", daemon)
    assert daemon.proc.poll() is None
