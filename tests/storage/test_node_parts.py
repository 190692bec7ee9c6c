"""Node-local checkpoints in the store (issue 24, item 1): node parts, then one global manifest.

Each node's daemon uploads its node's part (the objects, then ``parts/step-N/node-<k>.<token>.json``);
the global manifest, which names the parts, and ``latest`` appear only once every node's part is in
the store, written the same by whichever node completes the set; a part that lies about what it holds
is refused and nothing global is written; a reader fetches only the parts it needs. The store is the
S3 emulator (moto).
"""

from __future__ import annotations

import json
import os

import pytest

from spotguard.checkpoint.layout import combine_digests
from spotguard.storage import Durable, ManifestError
from spotguard.storage.durable import manifest_key

DIGESTS = ["a" * 64, "b" * 64, "c" * 64]


def node_part(make_ckpt, root, step: int, index: int, ranks: list[int], nodes: int = 2, **over):
    """A committed node-local checkpoint of ``ranks`` the way a node's leader commits one (the
    layout: one rank a node unless given)."""
    files = {f"rank-{r}/{name}": os.urandom(2048) for r in ranks for name in ("tree.json", "small.bin")}
    node = {"index": index, "nodes": nodes, "leader": ranks[0], "ranks": ranks,
            "digests": DIGESTS[:nodes], **over}
    node.setdefault("layout", [[k, 1] for k in range(len(node["digests"]))])
    world = len(node["digests"])  # the state digest hashes every rank's, as a save writes it
    return make_ckpt(root, step, files, node=node, world_size=world, digest=combine_digests(node["digests"]),
                     job_id="job")


@pytest.fixture
def durable(new_bucket):
    durable = Durable(new_bucket("s3"))
    durable.replicated_wait = 0.5  # tests that upload node 1 before node 0 wait this for node 0's part
    return durable


def test_the_global_manifest_appears_once_every_nodes_part_is_durable(durable, make_ckpt, tmp_path):
    a = node_part(make_ckpt, tmp_path / "a", 10, 0, [0])
    b = node_part(make_ckpt, tmp_path / "b", 10, 1, [1])
    durable.upload(a, "job")
    assert durable.list("job") == [] and durable.latest("job") is None  # node a alone: not global
    durable.upload(b, "job")
    assert durable.list("job") == [10] and durable.latest("job") == 10
    manifest = durable.manifest("job", 10)
    assert "node" not in manifest and manifest["durable"]["nodes"] == 2
    assert sorted({rel.split("/")[0] for rel in manifest["files"]}) == ["rank-0", "rank-1"]
    body = durable.store.get_bytes(manifest_key("job", 10))
    assert durable._complete("job", 10) and durable.store.get_bytes(manifest_key("job", 10)) == body  # same bytes

    restored = durable.restore("job", tmp_path / "c")  # a fresh node gets a loadable whole
    assert sorted(p.name for p in restored.iterdir()) == ["manifest.json", "rank-0", "rank-1"]


class Reads:
    """The keys a store was asked for (``get_bytes``), around the real store."""

    def __init__(self, store):
        self.store, self.keys = store, []

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get_bytes(self, key, **kwargs):
        self.keys.append(key)
        return self.store.get_bytes(key, **kwargs)


def test_the_global_manifest_names_the_parts_and_a_node_reads_only_the_parts_it_needs(durable, make_ckpt, tmp_path):
    """Issue 28 item 9: parts list no per-rank digests (the state digest hashes them) and only
    node 0's carries the layout; the completing node reads node 0's part and no other; the global
    manifest copies no part; a fresh node of rank 2 reads node 0's and node 2's parts, not node 1's."""
    three = DIGESTS[:3]
    locals_ = [node_part(make_ckpt, tmp_path / f"n{k}", 10, k, [k], nodes=3, digests=three) for k in range(3)]
    for ckpt in locals_[:2]:
        durable.upload(ckpt, "job")
    reads = durable.store = Reads(durable.store)
    durable.upload(locals_[2], "job")
    keys = sorted(durable.store.list("jobs/job/parts/"))
    assert [k.rsplit("/", 1)[1].split(".")[0] for k in keys] == ["node-0", "node-1", "node-2"]
    assert [k for k in reads.keys if "/parts/" in k] == [keys[0]]  # node 0's part only, for the layout
    parts = [json.loads(durable.store.get_bytes(k)) for k in keys]
    assert all("digests" not in p["node"] for p in parts)
    assert [("layout" in p["node"]) for p in parts] == [True, False, False]
    raw = json.loads(durable.store.get_bytes(manifest_key("job", 10)))
    assert raw["files"] == {} and raw["parts"]["nodes"] == 3 and raw["parts"]["layout"] == [[0, 1], [1, 1], [2, 1]]
    assert sorted(durable.manifest("job", 10)["files"]) == sorted(
        f"rank-{r}/{n}" for r in range(3) for n in ("small.bin", "tree.json"))
    reads.keys.clear()
    restored = durable.restore("job", tmp_path / "fresh", ranks=[2])
    assert sorted(p.name for p in restored.iterdir()) == ["manifest.json", "rank-0", "rank-2"]
    assert sorted(k for k in reads.keys if "/parts/" in k) == [keys[0], keys[2]]


def test_a_missing_node_part_leaves_the_previous_step_global(durable, make_ckpt, tmp_path):
    for k in (0, 1):
        durable.upload(node_part(make_ckpt, tmp_path / f"n{k}", 10, k, [k]), "job")
    durable.upload(node_part(make_ckpt, tmp_path / "n0", 20, 0, [0]), "job")  # node b died mid-upload
    assert durable.list("job") == [10] and durable.latest("job") == 10


@pytest.mark.parametrize("lie", ["foreign files", "digests", "ranks twice"])
def test_a_crafted_node_part_is_refused_and_nothing_global_is_written(durable, make_ckpt, tmp_path, lie):
    durable.upload(node_part(make_ckpt, tmp_path / "a", 10, 0, [0]), "job")
    over = {"digests": DIGESTS[1:3]} if lie == "digests" else {}
    if lie == "ranks twice":  # its own layout agrees with it; node 0's does not
        over = {"layout": [[1, 1], [0, 1]]}
    bad = node_part(make_ckpt, tmp_path / "b", 10, 1, [0] if lie == "ranks twice" else [1], **over)
    if lie == "foreign files":  # the part says it holds rank 1 but lists rank 0's files
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["files"] = {k.replace("rank-1", "rank-0"): v for k, v in manifest["files"].items()}
        os.rename(bad / "rank-1", bad / "rank-0")
        (bad / "manifest.json").write_text(json.dumps(manifest))
    if lie == "digests":  # another save's digests: another incarnation, never mixed with node 0's
        durable.upload(bad, "job")
    else:
        with pytest.raises(ManifestError):
            durable.upload(bad, "job")
    assert durable.list("job") == [] and durable.latest("job") is None


def test_a_fresh_node_fetches_only_its_ranks_parts_and_rank_0s(durable, make_ckpt, tmp_path):
    """Three ranks, node 0 = rank 0, node 1 = ranks 1-2; a fresh node for ranks 2 skips rank 1's part."""
    layout = [[0, 1], [1, 2]]
    durable.upload(node_part(make_ckpt, tmp_path / "a", 10, 0, [0], nodes=2, digests=DIGESTS, layout=layout), "job")
    durable.upload(node_part(make_ckpt, tmp_path / "b", 10, 1, [1, 2], nodes=2, digests=DIGESTS, layout=layout), "job")
    restored = durable.restore("job", tmp_path / "c", ranks=[2])
    assert sorted(p.name for p in restored.iterdir()) == ["manifest.json", "rank-0", "rank-2"]
    manifest = json.loads((restored / "manifest.json").read_text())
    assert manifest["node"] == {"leader": 0, "ranks": [0, 2], "restored": True}
    info = durable.upload(restored, "job")  # its daemon finds it durable already: nothing is sent
    assert info.objects_uploaded == 0 and durable.list("job") == [10]


def test_a_fresh_node_downloads_the_replicated_state_once_for_all_its_ranks(make_ckpt, tmp_path, moto):
    """DDP's replicated state is the same bytes in every rank's part (one object in the store): a
    fresh node holding ranks 0 and 1 downloads it once and copies it, every file verified."""
    from spotguard.storage import StoreOptions, open_store
    from storage_proxy import Proxy

    with Proxy(moto.url) as proxy:
        store = open_store("s3://sg-replicated/pre", StoreOptions(endpoint_url=proxy.url, part_size=1 << 20))
        store._client.create_bucket(Bucket="sg-replicated")
        durable = Durable(store)
        replicated = os.urandom(300_000)
        files = {f"rank-{r}/{name}": data for r in (0, 1)
                 for name, data in (("tree.json", os.urandom(512)), ("model.bin", replicated))}
        node = {"index": 0, "nodes": 1, "leader": 0, "ranks": [0, 1], "digests": DIGESTS[:2]}
        durable.upload(make_ckpt(tmp_path / "a", 10, files, node=node, world_size=2, digest="d" * 64,
                                 job_id="job"), "job")
        proxy.reset()
        restored = durable.restore("job", tmp_path / "fresh", ranks=[0, 1])
        gets = [path for method, path, _ in proxy.requests if method == "GET" and "/objects/" in path]
    assert (restored / "rank-0" / "model.bin").read_bytes() == (restored / "rank-1" / "model.bin").read_bytes() \
        == replicated
    assert len(gets) == len(set(gets)) == 3, gets  # two tree.json objects and the one replicated object
    assert (restored / "rank-1" / "model.bin").stat().st_nlink == 1
    assert (restored / "rank-1" / "model.bin").stat().st_mode & 0o777 == 0o600


def test_only_the_canonical_part_key_counts(durable, make_ckpt, tmp_path):
    """``node-00.<token>.json`` is not node 0: a part under it is ignored, never read."""
    durable.upload(node_part(make_ckpt, tmp_path / "a", 10, 0, [0]), "job")
    store = durable.store
    token = next(iter(store.list("jobs/job/parts/"))).split(".")[-2]
    store.put_bytes(f"jobs/job/parts/step-0000000010/node-00.{token}.json", b"{}")
    store.put_bytes(f"jobs/job/parts/step-0000000010/node-01.{token}.json", b"not json")
    durable.upload(node_part(make_ckpt, tmp_path / "b", 10, 1, [1]), "job")
    assert durable.list("job") == [10] and durable.latest("job") == 10


def test_a_relaunch_supersedes_the_parts_of_an_earlier_incarnation(durable, make_ckpt, tmp_path):
    """A leftover part of the same step from a launch with another node count neither mixes in nor
    makes the relaunch's uploads fail; the relaunch's own set completes and becomes ``latest``."""
    for k in range(3):  # the first launch: 3 nodes; its node 2's part is left behind
        if k != 1:
            durable.upload(node_part(make_ckpt, tmp_path / f"old{k}", 10, k, [k], nodes=3), "job")
    assert durable.latest("job") is None
    relaunch = {"digests": DIGESTS[:2] + ["e" * 64], "layout": [[0, 1], [1, 2]]}
    durable.upload(node_part(make_ckpt, tmp_path / "new1", 10, 1, [1, 2], nodes=2, **relaunch), "job")  # 2 nodes
    assert durable.latest("job") is None  # node 0 of the relaunch not yet: old node-0 is not mixed in
    durable.upload(node_part(make_ckpt, tmp_path / "new0", 10, 0, [0], nodes=2, **relaunch), "job")
    assert durable.latest("job") == 10
    manifest = durable.manifest("job", 10)
    assert manifest["durable"]["nodes"] == 2 and manifest["world_size"] == 3


def test_the_replicated_state_crosses_the_network_once_a_step_not_once_a_node(make_ckpt, tmp_path, moto):
    """Issue 28 item 9: both nodes' leaders hold the replicated state (the same bytes); their
    daemons upload at the same time. Node 1 sends its own ranks' files, waits for node 0's part,
    finds the replicated object proven in the store and does not send it: one PUT of it in all;
    a node 0 that never comes makes node 1 send it itself after ``replicated_wait``."""
    import hashlib
    import threading

    from spotguard.storage import StoreOptions, open_store
    from storage_proxy import Proxy

    replicated = os.urandom(300_000)
    layout = [[0, 2], [1, 2]]

    def node(root, index, step=10):
        files = {f"rank-{r}/{name}": data for r in (2 * index, 2 * index + 1)
                 for name, data in (("tree.json", os.urandom(512)),
                                    ("model.bin", replicated if r == 2 * index else os.urandom(1000)))}
        return make_ckpt(root, step, files, world_size=4, digest="d" * 64, job_id="job",
                         node={"index": index, "nodes": 2, "leader": 2 * index, "ranks": [2 * index, 2 * index + 1],
                               "digests": DIGESTS[:2] * 2, "layout": layout})

    replicated_key = "objects/sha256/" + hashlib.sha256(replicated).hexdigest()
    with Proxy(moto.url) as proxy:
        def durable():
            store = open_store("s3://sg-once/pre", StoreOptions(endpoint_url=proxy.url, part_size=1 << 20))
            return Durable(store)

        durable().store._client.create_bucket(Bucket="sg-once")
        a, b = node(tmp_path / "a", 0), node(tmp_path / "b", 1)
        threads = [threading.Thread(target=durable().upload, args=(ckpt, "job")) for ckpt in (b, a)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        puts = [path for method, path, _ in proxy.requests if method == "PUT" and path.endswith(replicated_key)]
        assert len(puts) == 1, puts
        assert durable().latest("job") == 10 and durable().verify("job", 10) == []

        proxy.reset()  # step 20: node 0 never uploads; node 1 waits its bound, then sends it itself
        lonely = durable()
        lonely.replicated_wait = 1.0
        replicated = os.urandom(300_000)  # a new model: not in the store yet
        info = lonely.upload(node(tmp_path / "c", 1, step=20), "job")
        assert info.objects_uploaded == 4 and not info.complete
