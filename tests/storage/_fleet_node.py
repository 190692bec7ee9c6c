"""One node of a fleet test in a process of its own, as each node's daemon is: its job's saves
(a node-local checkpoint, then the job's retention) and its daemon's upload queue, with no
interpreter lock shared with the other nodes (three queues in one test process slowed each
other's store requests by several times on a loaded machine, more than any real node sees).

``python _fleet_node.py BUCKET_URL PROXY_URL ROOT INDEX NODES KEEP``; stdin: one JSON line per
command, ``{"save": step}`` or ``{"close": true}``; stdout: ``{"saved": step}`` once committed and
queued, ``{"done": [steps], "idle": bool}`` at the close. The daemon's log: ``ROOT/node.log``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent)]

from spotguard.checkpoint.commit import apply_retention  # noqa: E402
from spotguard.storage.base import StoreOptions  # noqa: E402
from spotguard.storage.registry import open_store  # noqa: E402

from test_upload_long_run import node_ckpt  # noqa: E402
from test_upload_queue import _queue  # noqa: E402
from spotguard_daemon.core.upload_retention import Retention  # noqa: E402


def main() -> None:
    url, proxy, root, index, nodes, keep = sys.argv[1:7]
    root, index, nodes, keep = Path(root), int(index), int(nodes), int(keep)
    logging.basicConfig(filename=root / "node.log", level=logging.INFO,
                        format=f"%(created).3f node {index} %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    queue, done, _ = _queue(open_store(url, StoreOptions(endpoint_url=proxy, max_attempts=6)), root)
    queue.durable.concurrency = 1
    queue.retention = Retention(lambda job: None, 5.0)  # the bucket's: node 0's, not measured here
    queue.start()
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if "close" in command:
                break
            step = command["save"]
            files = {f"f{i}.bin": os.urandom(20_000) for i in range(6)}
            ckpt = node_ckpt(root / "ckpt", step, index, files, nodes=nodes)
            queue.submit("job", ckpt, step)
            apply_retention(root / "ckpt", keep, ckpt)  # the job's own, after its commit
            print(json.dumps({"saved": step}), flush=True)
        idle = queue.wait_idle(60)
    finally:
        queue.close()
    print(json.dumps({"done": [s for _, s in done], "idle": idle}), flush=True)


if __name__ == "__main__":
    main()
