"""The wire protocol that the daemon and its clients speak, and the one model of a notice.

Everything that crosses a socket is UTF-8 JSON validated by the pydantic models below; nothing is
ever unpickled. A message is one JSON object with a protocol version ``v`` and a ``type`` that picks
the model (a discriminated union), so both sides reject unknown or malformed input with one clear
error instead of guessing.

Sockets (ZeroMQ):

* **PUB** (daemon) -> SUB (clients): two frames, ``[topic, json]``. Topics are the ``type`` of the
  event: ``notice``, ``cancel``, ``heartbeat``, ``durable``.
* **ROUTER** (daemon) <- REQ (clients): one JSON request frame, one JSON reply frame
  (:class:`Reply`). Request types: ``register``, ``unregister``, ``status``, ``safe``, ``commit``,
  ``notify``, ``progress``, ``ack``, ``cadence``.

Exceptions::

    ProtocolError            a message that is not valid JSON, too large, or not a known message

Every number and time on the wire is bounded here, at the protocol, so that nothing a client sends
can overflow what the daemon later derives from it (a ledger, a metric, an object in the store):
steps, sizes and counts are exact JSON integers (``MAX_COUNT``), pids are Linux pids, ranks fit any
real world size, durations are at most a week and times lie between 2000 and 2200.
"""

from __future__ import annotations

import enum
import json
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_COUNT",
    "MAX_PID",
    "MAX_RANK",
    "Kind",
    "Notice",
    "NoticeEvent",
    "CancelEvent",
    "HeartbeatEvent",
    "DurableEvent",
    "Event",
    "RegisterRequest",
    "UnregisterRequest",
    "StatusRequest",
    "SafeRequest",
    "CommitRequest",
    "NotifyRequest",
    "WithdrawRequest",
    "ProgressRequest",
    "AckRequest",
    "CadenceRequest",
    "JobRate",
    "SAVE_OUTCOMES",
    "RESUME_TIERS",
    "MAX_HISTORY",
    "Request",
    "Reply",
    "ProtocolError",
    "TERMINATING_KINDS",
    "encode",
    "decode_event",
    "decode_request",
    "decode_reply",
    "utcnow",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest request the daemon accepts; larger ones get an error reply without being parsed."""


MAX_COUNT = 2**53 - 1
"""The largest step, size or count on the wire: every JSON reader holds it exactly (a double's
integers), and sums of a few of them stay far inside every 64-bit field the daemon keeps."""
MAX_PID = 2**22
"""Linux's ``PID_MAX_LIMIT``: no process, in any PID namespace, has a larger pid."""
MAX_RANK = 2**20 - 1
"""The largest rank: past every real world size, far below any overflow."""
WEEK = 7 * 24 * 3600.0
_EARLIEST = datetime(2000, 1, 1, tzinfo=timezone.utc)
_LATEST = datetime(2200, 1, 1, tzinfo=timezone.utc)


class ProtocolError(ValueError):
    """A message that is not valid JSON, is too large, or is not a known message of this version."""


def _plausible(when: datetime) -> datetime:
    if not _EARLIEST <= when < _LATEST:
        raise ValueError(f"time {when.isoformat()} is not between {_EARLIEST.year} and {_LATEST.year}")
    return when


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A step, a size in bytes or a number of things."""
Pid = Annotated[int, Field(gt=0, le=MAX_PID)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]
Seconds = Annotated[float, Field(ge=0, le=WEEK)]
Stamp = Annotated[AwareDatetime, AfterValidator(_plausible)]
"""A time a client reports (timezone-aware, between 2000 and 2200)."""


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Kind(str, enum.Enum):
    """What is about to happen. Terminating kinds end the machine or the job; the rest are advisory."""

    PREEMPT = "preempt"  # spot/preemptible capacity reclaimed (GCP, Azure Preempt, Alibaba)
    TERMINATE = "terminate"  # the instance goes away (AWS spot terminate, Azure Terminate)
    STOP = "stop"  # AWS spot stop: disk survives, processes do not
    HIBERNATE = "hibernate"  # AWS spot hibernate
    REBALANCE = "rebalance"  # AWS rebalance recommendation: elevated risk, advisory
    MAINTENANCE = "maintenance"  # host maintenance that the VM survives (live migration)
    REBOOT = "reboot"  # Azure Reboot, AWS instance/system-reboot
    REDEPLOY = "redeploy"  # Azure Redeploy: moved to another host, local disk lost
    FREEZE = "freeze"  # Azure Freeze: paused for seconds
    SIGNAL = "signal"  # SIGTERM/SIGINT to the daemon (Kubernetes, RunPod, docker stop)
    WALLTIME = "walltime"  # the scheduler's time limit is near (Slurm)
    DRILL = "drill"  # manual notice from `spotguard notify`


TERMINATING_KINDS = frozenset(
    {Kind.PREEMPT, Kind.TERMINATE, Kind.STOP, Kind.HIBERNATE, Kind.REBOOT, Kind.REDEPLOY,
     Kind.SIGNAL, Kind.WALLTIME, Kind.DRILL}
)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Notice(_Model):
    """One normalised interruption notice, whatever platform announced it.

    ``id`` is stable across polls: the platform's event id where there is one, else
    ``platform:kind:target-time``; never a hash of a payload that changes per request.
    """

    id: str = Field(min_length=1, max_length=256)
    platform: str = Field(min_length=1, max_length=32)
    kind: Kind
    deadline: AwareDatetime | None = None
    """When the interruption happens (UTC); ``None`` when the platform gives no time."""
    received_at: AwareDatetime = Field(default_factory=utcnow)
    terminating: bool = True
    """True when the machine or job ends at the deadline; False for advisory notices."""
    source: str = Field(default="", max_length=64)
    """The watcher that produced it, e.g. ``aws.spot``; cancellation is tracked per source."""
    detail: str = Field(default="", max_length=1024)
    raw: Any = None
    """The platform's payload, for debugging only."""

    def seconds_left(self, now: datetime | None = None) -> float | None:
        """Seconds until the deadline (negative once passed), or None without a deadline."""
        if self.deadline is None:
            return None
        return (self.deadline - (now or utcnow())).total_seconds()


# ---------------------------------------------------------------- events (PUB -> SUB)


class _Message(_Model):
    v: Literal[1] = PROTOCOL_VERSION

    LATER: ClassVar[frozenset[str]] = frozenset()
    """Optional fields added after a daemon release: :func:`encode` leaves them out while they are
    None, so that an older daemon (which refuses fields it does not know) still takes the message."""


class NoticeEvent(_Message):
    type: Literal["notice"] = "notice"
    notice: Notice


class CancelEvent(_Message):
    type: Literal["cancel"] = "cancel"
    id: str
    reason: str = ""


class HeartbeatEvent(_Message):
    """Sent every heartbeat interval; ``pending`` lets a subscriber notice an event it missed."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: Count
    daemon_id: str = Field(max_length=256)
    pending: list[str] = Field(default_factory=list)
    interval: float = Field(default=1.0, gt=0, le=3600)


class DurableEvent(_Message):
    """A committed checkpoint became durable in the configured store."""

    type: Literal["durable"] = "durable"
    job_id: str = Field(default="", max_length=256)
    step: Count
    location: str


Event = Annotated[
    Union[NoticeEvent, CancelEvent, HeartbeatEvent, DurableEvent], Field(discriminator="type")
]

# ---------------------------------------------------------------- requests (REQ -> ROUTER)


RESUME_TIERS = ("local", "peer", "bucket")
"""Where a resumed checkpoint came from: the node's own disk (``local``), a partner node's daemon
(``peer``) or the durable store (``bucket``)."""


class RegisterRequest(_Message):
    """Register a client process. A process that resumed from a checkpoint registers again with
    ``resumed_from_step`` (optional; older clients leave it out), which the daemon counts as a restart,
    and ``resumed_tier``, where that checkpoint came from (one of :data:`RESUME_TIERS`; optional:
    older clients, and integrations that cannot tell, leave it out, and the daemon counts the
    restart's loss under the tier ``unknown``).
    ``signal``: the process handles the daemon's delivery signal (SIGUSR1); False where it installed no
    handler (a Guard made outside the main thread), whose default action would kill it: the daemon
    then never signals it, and it learns of notices over ZeroMQ only."""

    type: Literal["register"] = "register"
    pid: Pid
    rank: Rank = 0
    job_id: str = Field(default="", max_length=256)
    resumed_from_step: Count | None = None
    resumed_tier: Literal["local", "peer", "bucket"] | None = None

    LATER = frozenset({"resumed_tier"})
    signal: bool = True


class UnregisterRequest(_Message):
    type: Literal["unregister"] = "unregister"
    pid: Pid


MAX_HISTORY = 64
"""The most notice timelines a daemon keeps, and a ``status`` request may ask for."""


class StatusRequest(_Message):
    """``history``: also send the last that many notice timelines (newest first)."""

    type: Literal["status"] = "status"
    history: int = Field(default=0, ge=0, le=MAX_HISTORY)


SAVE_OUTCOMES = ("committed", "already", "no_room", "failed")
"""What a stopping client did about its emergency save: ``committed`` it, the step was ``already``
committed, there was ``no_room`` before the deadline (``estimate_s`` said so), or the save ``failed``."""


class SafeRequest(_Message):
    """The client reached a safe state for these notices (checkpoint committed, or nothing to save).

    The optional fields tell the daemon's notice timeline the client's side of the stop (older
    clients and plain jobs leave them out): when the flag was set, the step it stopped at and when,
    what became of the emergency save (``save``, one of :data:`SAVE_OUTCOMES`) with the estimate
    that decided it and the seconds left then, and when the save was committed."""

    type: Literal["safe"] = "safe"
    pid: Pid
    notice_ids: list[str] = Field(default_factory=list, max_length=64)
    flagged_at: Stamp | None = None
    step: Count | None = None
    stopped_at: Stamp | None = None
    save: Literal["committed", "already", "no_room", "failed"] | None = None
    estimate_s: Seconds | None = None
    seconds_left: Annotated[float, Field(ge=-WEEK, le=WEEK)] | None = None
    committed_at: Stamp | None = None


class CommitRequest(_Message):
    """A checkpoint was committed locally; the daemon may make it durable.

    ``path`` must resolve inside the daemon's checkpoint root, or the request is refused.
    """

    type: Literal["commit"] = "commit"
    pid: Pid
    job_id: str = Field(default="", max_length=256)
    path: str = Field(min_length=1, max_length=4096)
    step: Count
    size_bytes: Count = 0
    files: Count = 0
    save_seconds: Seconds | None = None
    """How long the training loop was blocked by this save (optional; for the goodput metrics)."""
    reached_at: Stamp | None = None
    """When the training loop reached ``step`` (optional; for the goodput metrics). A commit is
    reported after its write, by then later steps may have been reported: without this stamp the
    daemon can only bound the time from above, by the commit's arrival."""


class NotifyRequest(_Message):
    """Inject a manual notice (drills, ``scancel --signal`` style stops)."""

    type: Literal["notify"] = "notify"
    kind: Kind = Kind.DRILL
    deadline_seconds: Seconds | None = None
    detail: str = Field(default="", max_length=1024)


class WithdrawRequest(_Message):
    """Cancel pending notices by id, or all with ``all`` (``spotguard notices cancel``); the daemon
    allows it to its own user and root only, proven by the kernel (``ipc://``)."""

    type: Literal["withdraw"] = "withdraw"
    ids: list[Annotated[str, Field(max_length=512)]] = Field(default_factory=list, max_length=64)
    all: bool = False


class ProgressRequest(_Message):
    """Rank 0 of a job reached ``step`` (steps completed) at ``at``; sent at most every few seconds.

    The daemon keeps the newest report per job, so that a restart resuming from an older step can
    count the steps (and training time) lost after the last commit (see the daemon's goodput docs).
    """

    type: Literal["progress"] = "progress"
    pid: Pid
    job_id: str = Field(default="", max_length=256)
    step: Count
    at: Stamp
    nodes: Annotated[int, Field(ge=1, le=MAX_RANK + 1)] = 1
    """Nodes the job spans (the distributed multiplier of its prior MTBF; older clients leave it out).
    The reply's ``data["rate"]`` is the job's :class:`JobRate` (newer daemons)."""


MAX_MTBF = 100 * 365 * 24 * 3600.0
"""The largest MTBF on the wire: a century, past any prior anyone configures."""
Mtbf = Annotated[float, Field(gt=0, le=MAX_MTBF)]


class JobRate(_Model):
    """A daemon's estimate of how often a job is interrupted (:func:`spotguard.cadence.learned_mtbf`):
    ``interruptions`` seen in ``running_s`` of its running time, on any node, over a prior of
    ``prior_weight`` interruptions at ``prior_mtbf_s`` (the node prior divided by ``nodes``); the job
    plans with ``mtbf_s``, never below ``floor_s``."""

    job_id: str = Field(max_length=256)
    mtbf_s: Mtbf
    prior_mtbf_s: Mtbf
    prior_weight: float = Field(gt=0, le=1e6)
    floor_s: Mtbf
    interruptions: Count
    running_s: float = Field(ge=0, le=MAX_MTBF)
    nodes: Annotated[int, Field(ge=1, le=MAX_RANK + 1)] = 1


class CadenceRequest(_Message):
    """Ask for a job's :class:`JobRate` (``spotguard cadence --job``); the reply's ``data["rate"]``
    is it, or None when the daemon knows nothing of the job."""

    type: Literal["cadence"] = "cadence"
    job_id: str = Field(default="", max_length=256)


class AckRequest(_Message):
    """The client set its stop flag for these notices at ``at`` (the daemon's notice timeline)."""

    type: Literal["ack"] = "ack"
    pid: Pid
    notice_ids: list[str] = Field(min_length=1, max_length=64)
    at: Stamp


Request = Annotated[
    Union[RegisterRequest, UnregisterRequest, StatusRequest, SafeRequest, CommitRequest, NotifyRequest,
          ProgressRequest, AckRequest, CadenceRequest, WithdrawRequest],
    Field(discriminator="type"),
]


class Reply(_Message):
    type: Literal["reply"] = "reply"
    ok: bool
    error: str = ""
    data: dict[str, Any] = Field(default_factory=dict)


_EVENT = TypeAdapter(Event)
_REQUEST = TypeAdapter(Request)
_REPLY = TypeAdapter(Reply)


def encode(message: BaseModel) -> bytes:
    """Serialise a message for the wire (compact UTF-8 JSON); a :attr:`_Message.LATER` field is left
    out while it is None."""
    later = getattr(message, "LATER", ())
    unset = {name for name in later if getattr(message, name) is None}
    return message.model_dump_json(exclude=unset or None).encode()


def _decode(adapter: TypeAdapter, data: bytes, limit: int) -> Any:
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {limit}")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    if isinstance(obj, dict) and obj.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {obj.get('v')!r}; this side speaks {PROTOCOL_VERSION}")
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ProtocolError(f"invalid message: {where}: {first['msg']}") from None


def decode_event(data: bytes, limit: int = 1024 * 1024) -> NoticeEvent | CancelEvent | HeartbeatEvent | DurableEvent:
    return _decode(_EVENT, data, limit)


def decode_request(
    data: bytes, limit: int = MAX_MESSAGE_BYTES
) -> (RegisterRequest | UnregisterRequest | StatusRequest | SafeRequest | CommitRequest | NotifyRequest
      | ProgressRequest | AckRequest | CadenceRequest):
    return _decode(_REQUEST, data, limit)


def decode_reply(data: bytes, limit: int = 1024 * 1024) -> Reply:
    return _decode(_REPLY, data, limit)
