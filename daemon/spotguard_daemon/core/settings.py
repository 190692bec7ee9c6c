"""The daemon's settings: one model, built once at the entry point and passed down.

Precedence, lowest to highest: defaults < TOML file (``--config``, else ``/etc/spotguard/spotguard.toml``
when present) < environment (``SPOTGUARD_...``, nested sections with ``__``, e.g.
``SPOTGUARD_AWS__INTERVAL=2``) < command-line flags. Invalid values are rejected at start-up with one
line naming the setting (:func:`load_settings` raises :class:`SettingsError`).
"""

from __future__ import annotations

import difflib
import json
import os
import signal as _signal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from spotguard._paths import default_runtime_dir as _default_runtime_dir

from ._urls import NO_STORE, HttpEndpoint, StoreUrl, is_loopback
from .redact import redact_data, redact_text, register, register_environment, register_url
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as PydanticSettingsError

__all__ = ["Settings", "SettingsError", "load_settings", "DEFAULT_CONFIG_PATH", "redacted"]

DEFAULT_CONFIG_PATH = Path("/etc/spotguard/spotguard.toml")

Platform = Literal["auto", "aws", "gcp", "azure", "alibaba", "none"]

CLIENT_VARIABLES = frozenset({
    "SPOTGUARD_RECORD", "SPOTGUARD_RECORD_ELASTIC", "SPOTGUARD_VENV", "SPOTGUARD_JOB_ID", "SPOTGUARD_FRESH",
    "SPOTGUARD_SAVE_EVERY", "SPOTGUARD_FAST_EXIT", "SPOTGUARD_FUSE_RENAME_IS_ATOMIC",
    "SPOTGUARD_HANDLED_NOTICES", "SPOTGUARD_PROGRESS_SECONDS", "SPOTGUARD_HUGE_PAGES"})
"""``SPOTGUARD_*`` variables that are not daemon settings (read by the client or the scripts); any
other name that is no setting is a typo, refused at start."""


class SettingsError(ValueError):
    """A setting is invalid; the message is one line naming the setting and the problem."""


def _default_state_dir() -> Path:
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/spotguard")
    return Path.home() / ".local" / "state" / "spotguard"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class RunnerSettings(_Section):
    """How every watcher is polled when its endpoint misbehaves."""

    request_timeout: float = Field(2.0, gt=0, le=300)
    """Seconds before one metadata request is abandoned (long-polls add their own wait)."""
    backoff_initial: float = Field(0.5, gt=0, le=60)
    """First delay after a failed poll; doubles per consecutive failure, with full jitter."""
    backoff_max: float = Field(30.0, gt=0, le=600)
    """Ceiling of the backoff delay of advisory paths; a path that can raise a termination notice
    backs off at most its interval, so a healed endpoint's notice is seen within one interval plus
    ``request_timeout``."""

    @model_validator(mode="after")
    def _ordered(self) -> "RunnerSettings":
        if self.backoff_max < self.backoff_initial:
            raise ValueError("backoff_max must be >= backoff_initial")
        return self


class AwsSettings(_Section):
    endpoint: HttpEndpoint = "http://169.254.169.254"
    """IMDS base URL; point it at ``spotguard simulate aws`` to try the daemon without a cloud."""
    interval: float = Field(1.0, gt=0, le=3600)
    """Seconds between polls of each IMDS path (AWS recommends 5, the notice gives about 120)."""
    token_ttl: int = Field(21600, ge=1, le=21600)
    """IMDSv2 session-token lifetime in seconds."""
    imdsv1_fallback: bool = False
    """Fall back to token-less IMDSv1 requests when the token PUT fails. Off: IMDSv2 only."""
    advisory_interval: float = Field(5.0, gt=0, le=3600)
    """Seconds between polls of the rebalance and scheduled-event paths: their lead time is minutes
    to days, and AWS recommends 5 s, so polling them every second only costs CPU."""
    scheduled_events: bool = True
    """Watch ``events/maintenance/scheduled`` (reboots, retirements, stops)."""
    rebalance: bool = True
    """Watch rebalance recommendations (advisory: an early sign of elevated risk)."""


class GcpSettings(_Section):
    endpoint: HttpEndpoint = "http://metadata.google.internal/computeMetadata/v1"
    """Metadata server base URL (``http://169.254.169.254/computeMetadata/v1`` works too)."""
    long_poll: bool = True
    """Use ``wait_for_change`` long-polls; falls back to polling at ``interval`` when they fail."""
    long_poll_timeout: int = Field(60, ge=1, le=3600)
    """``timeout_sec`` sent to the metadata server; the client waits a little longer."""
    interval: float = Field(1.0, gt=0, le=3600)
    """Seconds between plain polls when long-polls are off or failing."""
    preemption_notice_duration: float = Field(0.0, ge=0, le=3600)
    """Seconds of metadata preemption notice before the ACPI soft-off that this Spot VM was created
    with (``scheduling.preemptionNoticeDuration``, Beta; GCP offers up to 120 s). A preemption's
    deadline is then this plus the 30 s soft-off window. The metadata server does not document the
    value, so it is not read from there: set it as the VM was created."""
    preemptible: Literal["auto", "yes", "no"] = "auto"
    """Legacy Preemptible VM (stopped after 24 h): ``auto`` reads ``instance/scheduling/preemptible``."""
    preemptible_max_runtime: float = Field(24 * 3600, gt=0)
    """The legacy Preemptible VM's maximum run time in seconds."""
    preemptible_lead: float = Field(600.0, ge=0)
    """Seconds before the 24 h cap at which the walltime notice is raised."""


class AzureSettings(_Section):
    endpoint: HttpEndpoint = "http://169.254.169.254"
    """IMDS base URL of Scheduled Events."""
    interval: float = Field(1.0, gt=0, le=3600)
    """Seconds between Scheduled Events polls (Microsoft recommends once per second)."""
    first_call_timeout: float = Field(150.0, gt=0)
    """The first Scheduled Events call after boot can take up to two minutes."""
    vm_name: str | None = None
    """This VM's name in ``Resources``; read from IMDS when unset."""
    freeze_threshold: float = Field(30.0, ge=0)
    """Freeze events shorter than this many seconds are ignored (``DurationInSeconds``)."""
    acknowledge: bool = True
    """POST ``StartRequests`` once every registered client reported safe (or at the deadline)."""


class AlibabaSettings(_Section):
    endpoint: HttpEndpoint = "http://100.100.100.200"
    """ECS metadata server base URL."""
    interval: float = Field(1.0, gt=0, le=3600)
    """Seconds between polls of ``instance/spot/termination-time``."""
    hardened: bool = True
    """Use the hardened-mode metadata token (PUT /latest/api/token)."""
    token_ttl: int = Field(21600, ge=1, le=21600)
    """Hardened-mode token lifetime in seconds."""


class SignalSettings(_Section):
    grace: float = Field(30.0, ge=0, le=3600)
    """Deadline of the notice raised when the daemon itself gets SIGTERM/SIGINT (Kubernetes default 30 s)."""
    means: Literal["auto", "node", "daemon"] = "auto"
    """What SIGTERM/SIGINT to the daemon means. ``node``: the node, container or pod is going (raise
    the notice; set this for a sidecar whose SIGTERM means the pod is deleted). ``daemon``: only the
    daemon stops (an upgrade): no notice, training goes on. ``auto``: under systemd (``INVOCATION_ID``
    set) ``node`` only while ``systemctl is-system-running`` says ``stopping`` (a shutdown or reboot),
    else ``daemon``; outside systemd (a container, a pod, a terminal) ``node``."""


class SlurmSettings(_Section):
    enabled: Literal["auto", "yes", "no"] = "auto"
    """``auto``: on when ``SLURM_JOB_ID`` is set."""
    lead: float = Field(300.0, ge=0)
    """Seconds before the job's end time at which the walltime notice is raised."""
    squeue: str = "squeue"
    """The ``squeue`` executable (``scontrol`` is looked up beside it as a fallback)."""
    interval: float = Field(60.0, gt=0)
    """Seconds between reads of the end time (it changes only with ``scontrol update``, or when a
    preemption's ``GraceTime`` starts)."""


class ZmqSettings(_Section):
    pub_endpoint: str | None = None
    """Notices are published here; default ``ipc://<runtime_dir>/events.sock``."""
    request_endpoint: str | None = None
    """Requests are served here; default ``ipc://<runtime_dir>/requests.sock``."""
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    """Seconds between heartbeats on the PUB socket; clients call the daemon gone after a few missed."""
    max_message_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Largest request accepted; larger ones get an error reply (or are cut off by ZeroMQ)."""
    allow_remote: bool = False
    """Allow ``tcp://`` endpoints on addresses other than loopback."""

    @field_validator("pub_endpoint", "request_endpoint")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("ipc://", "tcp://")):
            raise ValueError("must start with ipc:// or tcp://")
        return value


class DeliverySettings(_Section):
    signal: str = "SIGUSR1"
    """Signal sent to registered and listed processes on a terminating notice; ``none`` to disable."""
    pid_files: list[Path] = Field(default_factory=list)
    """Files holding one PID each (e.g. written by a launcher) that also get the signal."""
    cgroup: Path | None = None
    """A cgroup v2 directory whose ``cgroup.procs`` also get the signal."""
    hook: list[str] | None = None
    """Command run per notice (argv list); the notice JSON arrives on stdin."""
    webhook: AnyHttpUrl | None = None
    """URL that gets each notice as a JSON POST."""
    webhook_secret: SecretStr | None = None
    """Sent as a bearer token to the webhook; never logged."""
    attempts: int = Field(3, ge=1, le=20)
    """Tries per hook or webhook call, with exponential backoff."""
    timeout: float = Field(10.0, gt=0, le=600)
    """Seconds before one hook or webhook attempt is abandoned."""

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        if value.lower() == "none":
            return "none"
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        if not hasattr(_signal.Signals, name):
            raise ValueError(f"unknown signal {value!r}")
        return name


class MetricsSettings(_Section):
    enabled: bool = True
    """Serve Prometheus metrics on ``host:port`` at ``/metrics``."""
    host: str = "127.0.0.1"
    """Loopback by default; another address needs ``zmq.allow_remote``."""
    port: int = Field(9464, ge=0, le=65535)
    """0 picks a free port (logged at start-up and shown by ``spotguard status``)."""


class StorageSettings(_Section):
    url: StoreUrl = None
    """Durable store: ``file:///dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``az://container/prefix``, or ``none``: no store (commits are accepted, nothing is copied or
    made durable; for notices only, e.g. a Slurm job's daemon).
    Default ``file://<state_dir>/durable``."""
    keep: int = Field(3, ge=1)
    """Durable checkpoints kept per job; older ones and unreferenced objects are deleted."""
    concurrency: int = Field(8, ge=1, le=128)
    """Files (and multipart parts) transferred in parallel per checkpoint."""
    bandwidth_mbps: float | None = Field(None, gt=0)
    """Upload bandwidth cap in megabytes per second; unset for no cap."""
    finish_superseded: bool = False
    """Finish uploading an older checkpoint when a newer one is committed meanwhile."""
    durable_lag_seconds: float = Field(600.0, ge=0)
    """Bound on the lag behind the global step: once this node's oldest commit that no global step
    covers is older than this, the upload in flight is finished even if a newer checkpoint is
    committed (0: no bound)."""
    max_superseded: int = Field(3, ge=0)
    """After this many uploads of a job in a row were superseded, the next ones are finished until
    one is not overtaken by a newer commit (0: no bound): a node that uploads slower than the job
    saves still makes steps durable and global, one upload after another."""
    progress_seconds: float = Field(30.0, gt=0, le=3600)
    """Each job's goodput record is copied to the store at most this often (when it changed; every
    second while a terminating notice is pending), so a fresh node counts what a restart lost."""
    upload_nice: int = Field(19, ge=0, le=19)
    """CPU niceness of the upload threads (Linux, per thread; 0: normal priority): uploads are
    background work and yield to training on the same cores; lower it if uploads lag on busy CPUs."""
    endpoint_url: HttpEndpoint | None = None
    """S3-compatible (or emulator) endpoint; GCS and Azure emulators too."""
    azure_account: str | None = None
    """Storage account name for ``az://container/prefix`` URLs (credentials from ``DefaultAzureCredential``)."""
    azure_connection_string: SecretStr | None = None
    """Connection string instead of ``DefaultAzureCredential`` (Azurite, shared keys); never logged."""


class PeerSettings(_Section):
    """The peer tier (docs/multi-node.md, "Three tiers"): node-local parts copied to partner nodes."""

    listen: str | None = None
    """``host:port`` this daemon serves partners' parts on (the cluster address; port 0 picks one).
    Unset (the default): it holds no partner's parts."""
    partners: Annotated[list[HttpEndpoint], NoDecode] = Field(default_factory=list, max_length=16)
    """The peer servers this node's committed parts are copied to, and a fresh node in its place
    restores from (``http://10.0.0.2:9475``; a JSON list or commas in the environment). K = its
    length; a ring (node k to node k+1) survives the loss of any one node."""
    secret: SecretStr | None = None
    """Shared by every node of the job (at least 16 characters); each job's key is derived from it.
    Required with ``listen`` or ``partners``."""
    keep: int = Field(2, ge=1, le=100)
    """Steps kept per partner node (the newest)."""
    timeout: float = Field(60.0, gt=0, le=3600)
    """Seconds one peer request may stall before it fails (socket timeout, both sides)."""

    @field_validator("partners", mode="before")
    @classmethod
    def _commas(cls, value: Any) -> Any:
        if isinstance(value, str):  # the environment's: a JSON list, or URLs separated by commas
            if value.strip().startswith("["):
                return json.loads(value)
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f"{value!r} is not host:port")
        return value

    @model_validator(mode="after")
    def _secret_required(self) -> "PeerSettings":
        if (self.listen or self.partners) and (self.secret is None or len(self.secret.get_secret_value()) < 16):
            raise ValueError("peer.secret (16 characters or more, the same on every node) is required "
                             "with peer.listen or peer.partners")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.listen or self.partners)


class CadenceSettings(_Section):
    node_mtbf_hours: float | None = Field(None, gt=0, le=100 * 365 * 24)
    """Prior MTBF of one node, hours, from which each job's MTBF is learned (divided by the nodes
    the job spans). A published preemption rate of p per day is ``24 / p`` hours. Unset: 6 h on every
    platform, ``none`` included (the one default of ``spotguard.cadence.DEFAULT_NODE_MTBF_S``, which
    ``spotguard cadence`` and the drill assume too); on dedicated (non-spot) nodes set about 6000."""
    prior_weight: float = Field(1.0, gt=0, le=1000)
    """How many interruptions the prior counts as: more trusts it longer against what is observed."""
    min_mtbf_seconds: float = Field(300.0, gt=0)
    """The learned MTBF never goes below this (a job restarting in a crash loop is not preempted
    that often, and saving every few seconds would not help it)."""


class Settings(BaseSettings):
    """Everything the daemon can be told. See docs/reference/settings.md."""

    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    platform: Platform = "auto"
    """Cloud platform to watch; ``auto`` detects it from DMI and the environment, never by probing."""
    runtime_dir: Path = Field(default_factory=_default_runtime_dir)
    """Sockets live here (created mode 0700)."""
    state_dir: Path = Field(default_factory=_default_state_dir)
    """Pending notices, the upload journal and the goodput ledger live here."""
    checkpoint_root: Path | None = None
    """Committed checkpoints must lie under this directory, and the daemon uploads only those. Unset
    (the default): none, whatever directory the daemon starts in; it says so at start, nothing is
    uploaded, and every commit is refused with a warning naming this setting."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Daemon log level (the client library never configures logging)."""
    log_format: Literal["text", "json"] = "text"
    """``json`` writes one JSON object per line, for log shippers."""

    runner: RunnerSettings = RunnerSettings()
    aws: AwsSettings = AwsSettings()
    gcp: GcpSettings = GcpSettings()
    azure: AzureSettings = AzureSettings()
    alibaba: AlibabaSettings = AlibabaSettings()
    signal: SignalSettings = SignalSettings()
    slurm: SlurmSettings = SlurmSettings()
    zmq: ZmqSettings = ZmqSettings()
    delivery: DeliverySettings = DeliverySettings()
    metrics: MetricsSettings = MetricsSettings()
    storage: StorageSettings = StorageSettings()
    cadence: CadenceSettings = CadenceSettings()
    peer: PeerSettings = PeerSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @property
    def pub_endpoint(self) -> str:
        return self.zmq.pub_endpoint or f"ipc://{self.runtime_dir}/events.sock"

    @property
    def request_endpoint(self) -> str:
        return self.zmq.request_endpoint or f"ipc://{self.runtime_dir}/requests.sock"

    @property
    def storage_url(self) -> str | None:
        """The durable store's URL; None when ``storage.url`` is ``none`` (no durable store)."""
        if self.storage.url == NO_STORE:
            return None
        return self.storage.url or f"file://{self.state_dir / 'durable'}"

    @model_validator(mode="after")
    def _loopback_only(self) -> "Settings":
        """tcp:// endpoints and metrics listen on loopback only, unless ``zmq.allow_remote``."""
        if self.zmq.allow_remote:
            return self
        for field in ("pub_endpoint", "request_endpoint"):
            endpoint = getattr(self.zmq, field)
            if endpoint and endpoint.startswith("tcp://") and not is_loopback(
                    endpoint[len("tcp://"):].rsplit(":", 1)[0]):
                raise ValueError(f"zmq.{field}: {endpoint} is not loopback; set zmq.allow_remote=true to allow it")
        if self.metrics.enabled and not is_loopback(self.metrics.host):
            raise ValueError(f"metrics.host: {self.metrics.host} is not loopback; set zmq.allow_remote=true to allow it")
        return self

    def register_secrets(self) -> None:
        """Tell :mod:`~spotguard_daemon.core.redact` the secret values, so no output shows them."""
        secrets = (self.delivery.webhook_secret, self.storage.azure_connection_string, self.peer.secret)
        register(s.get_secret_value() for s in secrets if s is not None)
        register_environment()
        for url in (self.delivery.webhook and str(self.delivery.webhook), self.storage.url,
                    self.storage.endpoint_url, self.aws.endpoint, self.gcp.endpoint, self.azure.endpoint,
                    self.alibaba.endpoint):
            register_url(url)


def _one_line(exc: ValidationError) -> str:
    """``where: problem (got 'value')``, secrets masked; a model-level error names its setting itself."""
    err = exc.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    where = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None or "secret" in where \
        or "connection_string" in where else f" (got {str(value)[:80]!r})"
    more = f" [and {len(exc.errors()) - 1} more]" if len(exc.errors()) > 1 else ""
    return redact_text(f"{where + ': ' if where else ''}{msg}{shown}{more}")


def _unknown_variables(environ: dict[str, str]) -> str | None:
    """The first ``SPOTGUARD_*`` variable that names no setting (pydantic-settings ignores those
    at the top level, so a typo such as ``SPOTGUARD_PLATFROM`` would silently do nothing)."""
    known = {f"SPOTGUARD_{name.upper()}" for name in Settings.model_fields}
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith("SPOTGUARD_") and upper not in CLIENT_VARIABLES \
                and upper.split("__", 1)[0] not in known:
            close = difflib.get_close_matches(upper.split("__", 1)[0], sorted(known), n=1)
            return f"{name}: no such setting" + (f" (did you mean {close[0]}?)" if close else "")
    return None


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from every source. ``config=None`` uses the default file when it exists.

    Raises :class:`SettingsError` with one line naming the bad setting.
    """
    unknown = _unknown_variables(dict(os.environ))
    if unknown:
        raise SettingsError(unknown)
    if config is None and DEFAULT_CONFIG_PATH.is_file():
        config = DEFAULT_CONFIG_PATH
    if config is not None:
        if not config.is_file():
            raise SettingsError(f"--config: {config}: no such file")
        try:
            import tomllib

            tomllib.loads(config.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"--config: {config}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"--config: {config}: not valid TOML: {exc}") from None
    cls = type("Settings", (Settings,), {"model_config": {**Settings.model_config, "toml_file": config}})
    try:
        settings = cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(_one_line(exc)) from None
    except PydanticSettingsError as exc:  # a variable that is not the JSON its setting needs
        raise SettingsError(redact_text(f"{exc}: a list or table in a SPOTGUARD_ variable is written "
                                        "as JSON, e.g. '[\"a\", \"b\"]'")) from None
    settings.register_secrets()
    return settings


def redacted(settings: Settings) -> dict[str, Any]:
    """The effective settings as JSON-able data: ``SecretStr`` fields shown as ``**********``, and
    passwords, query values and credentials inside URLs and other strings masked (see redact.py)."""
    settings.register_secrets()
    return redact_data(settings.model_dump(mode="json"))
