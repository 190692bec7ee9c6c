"""The ``spotguard`` command: run the daemon, ask it for status, inject a notice, run a simulator.

Exit statuses: 0 success; 1 the daemon is unreachable or failed at start-up (one line on stderr);
2 invalid settings or usage (one line on stderr naming the setting or option, no traceback).

The group imports little (click and the settings model), so ``spotguard --help`` and the commands
that other parts add stay quick; each command imports what it needs when it runs. Other parts add
their commands at the bottom (``main.add_command(...)``).

Exceptions: none escape; see the exit statuses.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from spotguard import __version__
from spotguard._paths import untrusted
from spotguard.protocol import Kind
from spotguard_daemon.commands.common import (Duration, fail, no_daemon, printable, request,
                                              settings_or_exit)
from spotguard_daemon.core.settings import Settings, redacted

__all__ = ["main"]

PLATFORMS = ("aws", "gcp", "azure", "alibaba")


class _Group(click.Group):
    """A group whose usage errors are one line on stderr with exit status 2."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> None:
        try:
            super().main(args=args, prog_name=prog_name or "spotguard", standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = f"{exc.ctx.command_path}: " if exc.ctx else ""
            fail(2, f"{where}{exc.format_message()}")
        except click.ClickException as exc:
            fail(exc.exit_code, exc.format_message())
        except click.Abort:
            fail(1, "aborted")
        sys.exit(0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", message="spotguard %(version)s")
def main() -> None:
    """spotguard: ride spot and preemptible machines without losing training work."""


config_option = click.option("--config", metavar="PATH", help="TOML settings file "
                             "(default /etc/spotguard/spotguard.toml when present).")


@main.command()
@config_option
@click.option("--platform", metavar="NAME", help="auto, aws, gcp, azure, alibaba or none.")
@click.option("--runtime-dir", metavar="DIR", help="Directory of the sockets (made 0700).")
@click.option("--state-dir", metavar="DIR", help="Directory of pending notices and upload state.")
@click.option("--checkpoint-root", metavar="DIR", help="Commits must lie under this directory.")
@click.option("--metrics-port", metavar="PORT", help="Port of /metrics (0: any free port).")
@click.option("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--print-config", is_flag=True, help="Print the effective settings as JSON and exit.")
@click.option("--parent-pid", type=click.IntRange(1), metavar="PID",
              help="Stop (raising no notice) once process PID is no longer this daemon's parent: "
                   "for the private daemon of a supervisor that passes its own pid.")
def daemon(config: str | None, metrics_port: str | None, print_config: bool, parent_pid: int | None,
           **flags: Any) -> None:
    """Run the node daemon in the foreground (systemd, a container, a terminal)."""
    overrides = {k: v for k, v in flags.items() if v is not None}
    if metrics_port is not None:
        overrides["metrics"] = {"port": metrics_port}
    settings = settings_or_exit(config, **overrides)
    if print_config:
        click.echo(json.dumps(redacted(settings), indent=2))
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        fail(1, f"not started: its parent is not pid {parent_pid} (--parent-pid), which is gone "
                "or never started it")
    _run_daemon(settings, parent_pid)


def _run_daemon(settings: Settings, parent_pid: int | None = None) -> None:
    import asyncio

    from spotguard_daemon.core import logs
    from spotguard_daemon.core.abandon import exit_abandoning
    from spotguard_daemon.core.app import Daemon
    from spotguard_daemon.core.server import ServerError

    logs.configure(settings.log_level, settings.log_format)
    try:
        status = asyncio.run(Daemon(settings, on_ready=lambda: _announce_root(settings),
                                    parent_pid=parent_pid).run())
    except (ServerError, OSError) as exc:
        fail(1, f"cannot start: {exc}")
    exit_abandoning(status)  # a store call still in flight must not hold the exit (abandon.py)


def _announce_root(settings: Settings) -> None:
    """Say in one line which checkpoints it watches and uploads, or loudly that it watches none."""
    import logging

    log = logging.getLogger("spotguard_daemon")
    if settings.checkpoint_root is None:
        log.warning("watching no checkpoints: no checkpoint_root is configured, so nothing is uploaded "
                    "and every commit will be refused; set --checkpoint-root DIR or "
                    "SPOTGUARD_CHECKPOINT_ROOT=DIR")
    else:
        log.info("watching checkpoints below %s (only commits there are accepted), uploading to %s",
                 settings.checkpoint_root, settings.storage_url or "no store (storage.url = none)")


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status reply as JSON.")
@click.option("--timeout", default=2.0, show_default=True, type=Duration(0.001),
              help="How long to wait for the daemon (seconds, or 500ms, 1m).")
def status(config: str | None, as_json: bool, timeout: float) -> None:
    """Show the daemon's pending notices and clients; exit 1 when it does not answer or its socket
    directory could have been made by another user (with
    ``--json``, a JSON object ``{"ok": false, "error": ...}`` on stdout as well)."""
    from spotguard.protocol import StatusRequest

    from spotguard_daemon.core.redact import redact_data

    endpoint = settings_or_exit(config).request_endpoint
    distrust = untrusted(endpoint)  # another user's directory: a fake daemon
    reply = None if distrust else request(endpoint, StatusRequest(), timeout)
    if reply is None:
        error = distrust or no_daemon(endpoint, timeout)
        if as_json:
            click.echo(json.dumps({"ok": False, "error": error, "endpoint": endpoint}))
        fail(1, error)
    if as_json:
        click.echo(json.dumps(redact_data(reply.data), indent=2))
    else:
        click.echo(printable(_human_status(reply.data)))


def _human_uploads(uploads: dict[str, Any]) -> list[str]:
    """The upload queue: store, what waits, bytes pending, each job's last durable step and last
    refused checkpoint, and whether the worker and its journal are well."""
    import time

    if uploads.get("disabled"):
        return ["durable store: none (uploads disabled: committed checkpoints are not copied)"]
    queued = [u for u in (uploads.get("pending") or [])]
    if uploads.get("uploading"):
        queued.insert(0, uploads["uploading"])
    lines = [f"durable store: {uploads.get('store') or '-'}; queued: "
             + (", ".join(f"{u['job_id']} step {u['step']}" for u in queued) or "none")
             + f"; bytes pending: {uploads.get('bytes_pending', 0)}"]
    for job, durable in sorted((uploads.get("durable") or {}).items()):
        age = time.time() - durable.get("at", time.time())
        lines.append(f"  job {job}: step {durable.get('step')} durable, {age:.0f} s ago")
    for job, refused in sorted((uploads.get("refused") or {}).items()):
        lines.append(f"  job {job}: step {refused.get('step')} REFUSED ({refused.get('path')}): "
                     f"{refused.get('error')}")
    for job, retry in sorted((uploads.get("retention_retry") or {}).items()):
        lines.append(f"  job {job}: retention failed {retry.get('failures')} times; retrying "
                     "(old checkpoints stay in the bucket until it succeeds)")
    if worker := uploads.get("worker"):
        lines.append(f"  upload worker: {'alive' if worker.get('alive') else 'DOWN'}, "
                     f"restarts: {worker.get('restarts', 0)}; journal: "
                     + ("ok" if uploads.get("journal_ok", True) else "NOT WRITABLE"))
    return lines


def _human_status(data: dict[str, Any]) -> str:
    from spotguard.protocol import Notice

    lines = [f"spotguard daemon {data.get('version')} pid {data.get('pid')} platform "
             f"{data.get('platform')}, up since {data.get('started_at')}"
             + (" (stopping)" if data.get("draining") else "")]
    notices = [Notice.model_validate(n) for n in data.get("notices", [])]
    overdue = [Notice.model_validate(n) for n in data.get("overdue", [])]
    lines.append(f"pending notices: {len(notices) + len(overdue) or 'none'}")
    for notice in sorted(notices + overdue, key=lambda n: n.received_at):
        left = notice.seconds_left()
        due = "no deadline" if left is None else f"deadline in {left:.0f} s" if notice not in overdue else \
            f"OVERDUE: deadline passed {-left:.0f} s ago and the node is still alive; jobs started since are " \
            "not stopped by it"
        safe = data.get("safe", {}).get(notice.id, [])
        lines.append(f"  {notice.id}  {notice.kind.value}  {due}  safe pids: {safe or '-'}")
    clients = data.get("clients", [])
    lines.append(f"clients: {len(clients) or 'none'}")
    lines += [f"  pid {c['pid']} rank {c['rank']} job {c['job_id'] or '-'}" for c in clients]
    if data.get("timeline"):
        from spotguard_daemon.commands.notices import human_timeline

        lines += ["latest terminating notice:", *("  " + line for line in human_timeline(data["timeline"]))]
    lines += _human_uploads(data.get("uploads") or {})
    if mtbf := data.get("mtbf"):
        lines.append(f"checkpoint cadence assumes a node MTBF of {mtbf['node_prior_s'] / 3600:g} h "
                     f"({mtbf['source']}) until it learns a job's")
    lines.append(f"metrics: {data.get('metrics') or 'off'}")
    return "\n".join(lines)


@main.command()
@config_option
@click.option("--kind", default="drill", show_default=True,
              type=click.Choice([kind.value for kind in Kind]), help="Kind of the notice.")
@click.option("--deadline", type=Duration(0, 7 * 24 * 3600), metavar="DURATION",
              help="Time from now until the interruption: seconds, or 90s, 2m, 1h (none: no "
                   "deadline).")
@click.option("--detail", default="", help="Free text shown to the clients.")
@click.option("--timeout", default=2.0, show_default=True, type=Duration(0.001),
              help="How long to wait for the daemon (seconds, or 500ms, 1m).")
def notify(config: str | None, kind: str, deadline: float | None, detail: str, timeout: float) -> None:
    """Inject a manual notice (a drill, or a scripted stop) into the daemon."""
    from spotguard.protocol import NotifyRequest

    endpoint = settings_or_exit(config).request_endpoint
    if distrust := untrusted(endpoint):
        fail(1, distrust)
    reply = request(endpoint, NotifyRequest(kind=Kind(kind), deadline_seconds=deadline,
                                            detail=detail), timeout)
    if reply is None:
        fail(1, no_daemon(endpoint, timeout))
    if not reply.ok:
        fail(1, f"the daemon refused: {reply.error}")
    click.echo(reply.data["notice"]["id"])


@main.command()
@click.argument("platform", type=click.Choice(PLATFORMS))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=1338, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port; the URL is printed on the first line.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Platform option, e.g. vm_name=vm-3 (azure), imdsv1=true (aws).")
def simulate(platform: str, host: str, port: int, options: tuple[str, ...]) -> None:
    """Serve a local metadata endpoint that imitates PLATFORM, with a control API under /_sim/."""
    from spotguard_daemon.simulator import parse_option, serve

    try:
        parsed = dict(parse_option(text) for text in options)
    except ValueError as exc:
        fail(2, f"simulate: {exc}")
    try:
        serve(platform, host, port, **parsed)
    except (TypeError, ValueError) as exc:
        fail(2, f"simulate: {exc}")
    except OSError as exc:
        fail(1, f"simulate: cannot listen on {host}:{port}: {exc}")


@main.command()
def version() -> None:
    """Print the version (also ``spotguard --version``)."""
    click.echo(f"spotguard {__version__}")


# ---------------------------------------------------------------- commands of other parts
# Each part adds its command here, one line each.
from spotguard_daemon.commands.cadence import cadence  # noqa: E402
from spotguard_daemon.commands.checkpoints import checkpoints  # noqa: E402
from spotguard_daemon.commands.demo import demo  # noqa: E402
from spotguard_daemon.commands.drill import drill  # noqa: E402
from spotguard_daemon.commands.notices import notices  # noqa: E402
from spotguard_daemon.commands.run import run  # noqa: E402

main.add_command(cadence)
main.add_command(checkpoints)
main.add_command(demo)
main.add_command(drill)
main.add_command(notices)
main.add_command(run)
