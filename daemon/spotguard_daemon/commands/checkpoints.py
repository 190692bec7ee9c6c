"""``spotguard checkpoints``: list, verify, restore and delete durable checkpoints from the command line.

The store is ``--store URL`` or, when absent, the configured ``storage.url`` (settings file and
``SPOTGUARD_STORAGE__*`` environment, as for the daemon). ``list`` without ``--job`` lists the jobs
in the store; a job with no durable checkpoint is named in one line with the jobs that exist.
``delete`` asks first (``--yes`` does not), refuses while the job has an upload in flight, and keeps
every object another job's checkpoint shares. Exit statuses: 0 success; 1 the store
failed, the checkpoint is unsound or absent (one line on stderr); 2 invalid settings or usage.
Credentials come from each cloud SDK's standard chain and are never printed.
"""

from __future__ import annotations

import datetime as dt
import functools
from pathlib import Path
from typing import Any, Callable

import click

__all__ = ["checkpoints"]


def _durable(store_url: str | None, endpoint_url: str | None, config: str | None) -> Any:
    from spotguard.storage import Durable, StoreOptions, open_store
    from spotguard_daemon.core.settings import SettingsError, load_settings

    try:
        settings = load_settings(Path(config) if config else None)
    except SettingsError as exc:
        raise click.BadParameter(str(exc), param_hint="settings") from None
    options = StoreOptions.of(settings.storage)
    if endpoint_url:
        options = StoreOptions(**{**options.__dict__, "endpoint_url": endpoint_url})
    if not (store_url or settings.storage_url):
        raise click.BadParameter("storage.url is none (no durable store); name one",
                                 param_hint="'--store'")
    try:
        store = open_store(store_url or settings.storage_url, options)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--store'") from None
    return Durable(store, concurrency=options.concurrency)


def _store_command(func: Callable[..., None], job_required: bool = True) -> Callable[..., None]:
    """Common options, and every storage error turned into one line with exit status 1."""

    @click.option("--store", "store_url", metavar="URL", help="file://, s3://, gs:// or az:// URL "
                  "(default: the configured storage.url).")
    @click.option("--endpoint-url", metavar="URL", help="S3-compatible endpoint or emulator.")
    @click.option("--config", metavar="PATH", help="TOML settings file.")
    @click.option("--job", required=job_required, help="Job id the checkpoints were uploaded under"
                  + ("." if job_required else " (default: list the jobs in the store)."))
    @functools.wraps(func)
    def wrapper(store_url: str | None, endpoint_url: str | None, config: str | None, **kwargs: Any) -> None:
        from spotguard.storage import StoreError

        try:
            func(_durable(store_url, endpoint_url, config), **kwargs)
        except (StoreError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group("checkpoints")
def checkpoints() -> None:
    """List, verify, restore and delete durable checkpoints."""


@checkpoints.command("list")
@functools.partial(_store_command, job_required=False)
def list_(durable: Any, job: str | None) -> None:
    """Every durable checkpoint of JOB, oldest first; '*' marks the one 'latest' names. Without
    --job, the jobs in the store, each with its latest step."""
    if job is None:
        jobs = durable.jobs()
        if not jobs:
            click.echo(f"{durable.store.url}: no job has a durable checkpoint")
        for name in jobs:
            click.echo(f"{name}  latest step {durable.latest(name)}")
        return
    steps, latest = durable.list(job), durable.latest(job)
    if not steps:
        raise _absent(durable, job)
    click.echo(f"{'':1} {'STEP':>10}  {'FILES':>5}  {'BYTES':>14}  CREATED")
    for step in steps:
        click.echo(_row(durable, job, step, step == latest))


def _row(durable: Any, job: str, step: int, latest: bool) -> str:
    from spotguard.storage import StoreError

    mark = "*" if latest else " "
    try:
        manifest = durable.manifest(job, step)
    except StoreError as exc:
        return f"{mark} {step:>10}  unreadable manifest: {exc}"
    size = sum(meta["size"] for meta in manifest["files"].values())
    created = manifest.get("created")
    when = dt.datetime.fromtimestamp(created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") \
        if isinstance(created, (int, float)) else "-"
    return f"{mark} {step:>10}  {len(manifest['files']):>5}  {size:>14,}  {when}"


@checkpoints.command("verify")
@_store_command
@click.option("--step", type=int, help="Step to verify (default: the latest).")
@click.option("--quick", is_flag=True, help="Only check that every object exists; no download.")
def verify(durable: Any, job: str, step: int | None, quick: bool) -> None:
    """Download every object of a checkpoint and check its sha256 against the manifest."""
    step = _step_or_latest(durable, job, step)
    problems = durable.verify(job, step, deep=not quick)
    for problem in problems:
        click.echo(f"  {problem}", err=True)
    if problems:
        raise click.ClickException(f"{job} step {step}: {len(problems)} problem(s); not restorable")
    files = len(durable.manifest(job, step)["files"])
    click.echo(f"{job} step {step}: OK ({files} files {'present' if quick else 'verified'})")


def _step_or_latest(durable: Any, job: str, step: int | None) -> int:
    step = durable.latest(job) if step is None else step
    if step is None:
        raise _absent(durable, job)
    return step


def _absent(durable: Any, job: str) -> click.ClickException:
    """Job ``job`` has no durable checkpoint: one line that names the jobs that do."""
    jobs = durable.jobs()
    there = (f"jobs there: {', '.join(jobs)}" if jobs else "the store holds no job")
    return click.ClickException(f"{durable.store.url}: job {job!r} has no durable checkpoint; "
                                f"{there}")


@checkpoints.command("restore")
@_store_command
@click.option("--step", type=int, help="Step to restore (default: the newest sound one).")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Checkpoint root to restore into; 'latest' there is updated.")
def restore(durable: Any, job: str, step: int | None, dest: Path) -> None:
    """Download a checkpoint, verify every file, and commit it under DEST like a local save."""
    if not durable.list(job):
        raise _absent(durable, job)
    path = durable.restore(job, dest, step)
    click.echo(f"restored {job} into {path}")


@checkpoints.command("delete")
@_store_command
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def delete(durable: Any, job: str, yes: bool) -> None:
    """Delete every durable checkpoint of JOB, and the objects no other job uses."""
    steps = durable.list(job)
    if steps:
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        what = f"{len(steps)} durable checkpoint(s) of job {job!r} ({span})"
    elif durable.keys_of(job):  # node parts of steps never made global, notes: an interrupted run's
        what = f"what job {job!r} left (no complete checkpoint)"
    else:
        raise _absent(durable, job)
    what += f" in {durable.store.url}"
    try:
        confirmed = yes or click.confirm(f"Delete {what}?", err=True)
    except click.Abort:  # no answer (stdin closed, Ctrl-C): end the question's line
        click.echo("", err=True)
        confirmed = False
    if not confirmed:
        raise click.ClickException("nothing deleted (not confirmed; --yes skips the question)")
    done = durable.delete_job(job)  # refused (UploadInFlight, a StoreError): one line, exit 1
    click.echo(f"deleted {what}: {done.keys_deleted} key(s) of the job and {done.objects_deleted} "
               "object(s) no other checkpoint uses")
