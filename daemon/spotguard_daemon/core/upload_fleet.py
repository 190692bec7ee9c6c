"""Node-local roots: the step the fleet completes next, so that slow nodes converge on one step.

A step is global only once every node's part of it is in the store. When every node uploads slower
than the job saves, each node finishes *some* upload (:mod:`.upload_global` bounds the lag per
node), but each decides alone, so two slow nodes may finish different steps and none becomes
global. So the nodes agree by design, through one small object::

    jobs/<job>/parts/next.json      {"step": N, "proposed": <unix time>}

``N`` names each node's first commit at or after step ``N`` (:meth:`Fleet.resolve`): the same
commit on every node, since the ranks of a job commit the same steps; a committed ``N`` names
itself.

* **Node 0 proposes.** While its uploads are behind the saves (:meth:`.GlobalWatch.finish`), node
  0's daemon names the step it starts uploading in ``next.json`` and finishes that upload
  although superseded, as the others will; early, because the others hold it only for their
  job's ``keep`` saves, far shorter than one upload when uploads are slower than the saves. When
  the proposal would go out later than a quarter of a save interval after that step's commit
  (:data:`ON_TIME`: a loaded node, or saves seconds apart), the others may have deleted the step
  before they read it. Node 0 then proposes a step *ahead* of the commits instead
  (:meth:`Fleet.threshold`: three times its delay, in saves, 2 to :data:`MAX_AHEAD`), and every
  node, node 0 included, holds that commit open from the moment it is reported
  (:mod:`.upload_pins`), uploads it next and finishes it. On a 2-core machine running two other
  busy processes, three nodes made every proposed step global this way; before, they missed
  nearly every one. Node 0 also
  names a step whose part it uploaded that is not global yet, if it still holds it locally. Its
  other uploads are superseded as usual: only proposed steps are finished although superseded, on
  every node. An open proposal
  (not global yet, younger than ``storage.durable_lag_seconds``) stays, so the others are never sent
  chasing a moving target, while it is ahead of node 0's commits, while node 0 still holds it in
  its local root (the others, keeping alike, can still take it) or while the others may still be
  sending parts of it (:data:`SLOWER` times node 0's own upload of it); after that none can, and
  the next start proposes anew.
* **The other nodes follow.** Before each upload a follower reads ``next.json`` (one GET); a
  daemon learns which node it is from the first checkpoint of the job it stages, and, a follower,
  chooses that first upload again before sending anything (a restarted daemon included). When it
  names a step ahead of its commits, the follower holds that commit from its report (see above).
  When it names a step it holds (pinned, or still committed), newer than the last global one and
  not uploaded by it already, it uploads that step first (its newer commit waits in the queue) and finishes it even
  if superseded. A follower whose upload is superseded reads ``next.json`` once more: when it names
  the step in flight, the upload goes on from the files it holds open, which the job's retention
  may have deleted meanwhile. (A follower's upload waits for node 0's part of its step before it
  sends the replicated state, :meth:`Durable._await_node_0 <spotguard.storage.durable.Durable>`;
  a newer commit ends that wait within 50 ms, so the follower reads a fresh proposal in time.) Its
  own newest commit is uploaded as usual otherwise, and a follower never finishes a superseded
  upload of a step node 0 did not propose (that is how nodes diverged).

Node 0's daemon is also the only one to run the bucket's retention of the job (the others leave
it to node 0: one prune per step, not N). Cost: one GET per upload (and per superseded upload)
on the followers; on node 0, per part whose step is not global, a GET, the
global pointer's GET and HEAD, and at most one PUT: O(1) per node per step, whatever N. A job
without a ``node`` section (one node) never reads or writes ``next.json``. Any store error only
skips the coordination for that upload (logged at INFO); a ``next.json`` that is not what node 0
writes is ignored with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from spotguard.storage._local import MANIFEST, read_manifest, step_name
from spotguard.storage.base import IntegrityError, NotFound, StoreError

__all__ = ["Fleet", "LEADER", "next_key", "read_next"]

log = logging.getLogger(__name__)

LEADER = 0
"""The node whose parts propose the step: it exists in every incarnation."""
MAX_NEXT_BYTES = 256
SLOWER = 4
"""A proposal no longer held in node 0's local root stays open while the others may be finishing
their parts of it: until they would have at this many times node 0's own upload time of it."""
SLOWER_SLACK = 2.0
"""Seconds added to that wait (reading the proposal, a retry)."""
DONE_KEPT = 8
"""Uploads of a job whose end node 0 remembers (a proposal is one of its last few)."""
COMMITS_KEPT = 32
"""Commits of a job each daemon remembers (step, when): what a proposal names here, the save interval."""
ON_TIME = 0.25
"""Node 0 proposes the step it starts uploading when it starts within this fraction of a save
interval of that step's commit; later, a commit ahead (:meth:`Fleet.threshold`)."""
MAX_AHEAD = 16
"""Commits ahead at most of a proposal (bounds the lag it adds)."""


def next_key(job: str) -> str:
    return f"jobs/{job}/parts/next.json"


def read_next(store: Any, job: str) -> tuple[int, float] | None:
    """The proposed step and when it was proposed; None when there is none or it is unreadable."""
    try:
        body = store.get_bytes(next_key(job), max_size=MAX_NEXT_BYTES)
    except NotFound:
        return None
    except IntegrityError as exc:  # larger than node 0 ever writes
        log.warning("ignoring %s: not what node 0 writes (%s)", next_key(job), exc)
        return None
    try:
        data = json.loads(body)
        step, proposed = data["step"], data["proposed"]
        if type(step) is not int or step < 0 or type(proposed) not in (int, float) or not math.isfinite(proposed):
            raise ValueError("not a step and a time")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
        log.warning("ignoring %s: not what node 0 writes (%s)", next_key(job), exc)
        return None
    return step, float(proposed)


class Fleet:
    """Per job: this node's index (learned from each upload's manifest) and the step it follows."""

    def __init__(self, lag_bound: float) -> None:
        self.lag_bound = lag_bound
        self._lock = threading.Lock()
        self._node: dict[str, int] = {}
        self._following: dict[str, int] = {}
        """job -> the proposed step being uploaded now (finished although superseded)."""
        self._done: dict[str, dict[int, tuple[float, float]]] = {}
        """job -> step -> (when this node's part was in the store, seconds it took), its last uploads."""
        self._followed: dict[str, int] = {}
        """job -> the last proposed step this node uploaded (not sent again)."""
        self._commits: dict[str, deque[tuple[int, float]]] = {}
        """job -> its last commits here: (step, when reported)."""
        self._expected: dict[str, int] = {}
        """job -> a proposal ahead of this node's commits: its first commit at or after it is pinned."""

    def submitted(self, job: str, step: int) -> bool:
        """A commit of ``step`` reached this daemon: whether it is the proposed one this node awaited
        (pin it: :mod:`.upload_pins`)."""
        with self._lock:
            commits = self._commits.setdefault(job, deque(maxlen=COMMITS_KEPT))
            if commits and step <= commits[-1][0]:
                return False  # another rank's report of it, or a late one
            commits.append((step, time.time()))
            if self._expected.get(job, step + 1) <= step:
                del self._expected[job]
                return True
        return False

    def resolve(self, job: str, threshold: int) -> int | None:
        """The step a proposal names on this node: its first commit at or after ``threshold`` (a
        committed step names itself); None while this node has not committed one yet."""
        with self._lock:
            commits = [step for step, _ in self._commits.get(job, ())]
        if not commits or commits[0] > threshold:  # not seen here (a restarted daemon): that step
            return threshold
        return next((step for step in commits if step >= threshold), None)

    def expect(self, job: str, threshold: int) -> int | None:
        """A proposal read: the step it names here (:meth:`resolve`). While that is ahead of this
        node's commits (None), its commit is pinned when it comes (:meth:`submitted`)."""
        step = self.resolve(job, threshold)
        if step is None:
            with self._lock:
                if self._expected.get(job) != threshold:
                    self._expected[job] = threshold
                    log.info("%s: the commit at or after step %d is the proposed one; holding it from its "
                             "commit", job, threshold)
        return step

    def threshold(self, job: str, step: int) -> int:
        """Node 0, about to propose ``step`` (the upload it starts): what to propose. ``step`` itself
        when the proposal goes out within :data:`ON_TIME` of a save interval of its commit (the
        others still hold it); else a commit ahead, far enough that the others read the proposal
        before they commit it: three times this node's delay (a follower reads it at its next
        upload's start, as late or later), in saves, at least two."""
        with self._lock:
            commits = list(self._commits.get(job, ()))
        when = next((at for s, at in commits if s == step), None)
        gaps = [b[1] - a[1] for a, b in zip(commits, commits[1:])][-8:]
        interval = statistics.median(gaps) if gaps else 0.0
        late = time.time() - when if when is not None else 0.0
        if when is None or interval <= 0 or late < ON_TIME * interval:
            return step
        saves = min(MAX_AHEAD, max(2, 1 + math.ceil(3 * late / interval)))
        newest, spacing = commits[-1][0], max(1, commits[-1][0] - commits[-2][0])
        return newest + 1 + (saves - 1) * spacing

    def learn(self, job: str, ckpt: Path) -> None:
        """Note this node's index from the staged checkpoint's manifest (no ``node``: one node)."""
        node = read_manifest(ckpt).get("node")
        with self._lock:
            if isinstance(node, dict) and type(node.get("index")) is int:
                self._node[job] = node["index"]
            else:
                self._node.pop(job, None)

    def follows(self, job: str) -> bool:
        """Whether this node follows node 0's proposals for ``job`` (it is another node of it)."""
        with self._lock:
            return self._node.get(job, LEADER) != LEADER

    def finishes(self, job: str, step: int) -> bool:
        """Whether the upload of ``step`` is the proposed one: finished although superseded."""
        with self._lock:
            return self._following.get(job) == step

    def target(self, store: Any, job: str, step: int, path: str, global_step: int) -> int | None:
        """A follower about to upload ``step`` (at ``path``): the proposed step to upload instead,
        or None (upload ``step``; marked as followed when it is the proposed one)."""
        with self._lock:
            self._following.pop(job, None)
            if self._node.get(job, LEADER) == LEADER:
                return None
            followed = self._followed.get(job)
        try:
            found = read_next(store, job)
        except StoreError as exc:
            log.info("could not read %s (%s); uploading step %d", next_key(job), exc, step)
            return None
        if found is None:
            return None
        proposed = self.expect(job, found[0])
        if proposed is None:  # ahead of this node's commits: held from its commit, uploaded then
            return None
        if proposed <= global_step or proposed == followed or proposed > step:
            return None
        if proposed != step and not _held(path, proposed):
            return None  # this node's retention deleted it: node 0 proposes another (see propose)
        with self._lock:
            self._following[job] = proposed
        if proposed != step:
            log.info("uploading %s step %d before step %d: node 0's part of it is in the store", job, proposed, step)
        return None if proposed == step else proposed

    def leads(self, job: str) -> bool:
        """Whether this node is node 0 of a job with node-local roots (it proposes)."""
        with self._lock:
            return self._node.get(job) == LEADER

    def adopt(self, store: Any, job: str, step: int, global_step: int) -> bool:
        """A follower's upload of ``step`` was superseded: whether node 0 proposed ``step`` meanwhile
        (one GET); then the upload goes on and is finished, from the files it still holds open."""
        with self._lock:
            if self._node.get(job, LEADER) == LEADER or self._following.get(job) == step \
                    or self._followed.get(job) == step or step <= global_step:
                return False
        try:
            found = read_next(store, job)
        except StoreError as exc:
            log.info("could not read %s (%s); step %d is superseded", next_key(job), exc, step)
            return False
        if found is None:
            return False
        if self.expect(job, found[0]) != step:
            return False
        with self._lock:
            self._following[job] = step
        log.info("finishing the upload of %s step %d although a newer checkpoint is committed: node 0 "
                 "proposed it", job, step)
        return True

    def uploaded(self, durable: Any, job: str, step: int, path: str, complete: bool, seconds: float) -> None:
        """This node's part of ``step`` is in the store (in ``seconds``): a follower notes it; node 0
        proposes the step when it is not global, nothing open is proposed, and node 0 still holds
        it locally (the others, keeping alike, then too; a proposal none can take would only stand
        in the way of the next one)."""
        with self._lock:
            if self._following.get(job) == step:
                self._followed[job] = step
            done = self._done.setdefault(job, {})
            done[step] = (time.time(), seconds)
            for old in sorted(done)[:-DONE_KEPT]:
                del done[old]
        if self.leads(job) and not complete and _held(path, step):
            self.propose(durable, job, step, path, "node 0's part is in the store")

    def propose(self, durable: Any, job: str, step: int, path: str, why: str, ahead: bool = False) -> int | None:
        """Node 0: name ``step`` (committed at ``path``) in ``next.json``, unless an open proposal
        stays (see the module docstring); the step proposed now, None when none is. ``ahead``: the
        upload of ``step`` starts; propose :meth:`threshold` of it, reckoned right before the write."""
        try:
            found = read_next(durable.store, job)
            if found is not None and found[0] == step:
                return step
            if found is not None and self._open(durable, job, found, path):
                return None  # the others are still completing that one
            if ahead:
                step = self.threshold(job, step)
            body = json.dumps({"step": step, "proposed": time.time()}).encode()
            durable.store.put_bytes(next_key(job), body)
            if self.resolve(job, step) is None:
                log.info("%s: proposed the commit at or after step %d (%s); every node holds it from its "
                         "commit and uploads it next", job, step, why)
            else:
                log.info("%s step %d: %s; the other nodes upload it next", job, step, why)
            return step
        except StoreError as exc:
            log.info("could not propose %s step %d to the other nodes: %s", job, step, exc)
            return None

    def _open(self, durable: Any, job: str, found: tuple[int, float], path: str) -> bool:
        """Whether the proposal ``found`` stays: younger than the bound, not global yet, and not
        committed here yet (ahead), or still held here, or the others may still be sending it."""
        if time.time() - found[1] >= self.lag_bound:
            return False
        step = self.expect(job, found[0])  # ahead: node 0 holds it too (a restarted daemon did not propose it)
        if step is not None and not (_held(path, step) or self._may_still_come(job, step)):
            return False
        newest = durable.latest(job)
        return newest is None or newest < (found[0] if step is None else step)

    def _may_still_come(self, job: str, step: int) -> bool:
        """Whether the others may still be sending their parts of ``step``, proposed: taken before
        the job's retention deleted it, at most :data:`SLOWER` times slower than node 0 was."""
        with self._lock:
            done = self._done.get(job, {}).get(step)
        if done is None:
            return True  # not sent by this daemon (restarted since?): the bound decides
        return time.time() - done[0] < (SLOWER - 1) * done[1] + SLOWER_SLACK

    def finish(self, job: str, step: int) -> None:
        """Node 0: the upload of ``step`` (proposed) is finished although superseded, as the others'."""
        with self._lock:
            self._following[job] = step

    def coordinated(self, job: str) -> bool:
        """Whether ``job`` has node-local roots on several nodes: which superseded uploads are
        finished is the proposals' (this module's) decision, on node 0 too."""
        with self._lock:
            return job in self._node


def _held(path: str, step: int) -> bool:
    """Whether ``step`` is still committed in the local root of the checkpoint at ``path``."""
    return (Path(path).parent / step_name(step) / MANIFEST).is_file()
