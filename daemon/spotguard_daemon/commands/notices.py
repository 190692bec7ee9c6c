"""``spotguard notices``: the last terminating notices and what the emergency path did for each.

Each notice is shown as its timeline (:mod:`spotguard_daemon.core.timeline`): every stage with its
seconds after the daemon saw the notice, the clients' stages by pid, and the notice's outcome.
``spotguard status`` shows the current one the same way (:func:`human_timeline`).
``spotguard notices cancel ID... | --all`` withdraws pending notices (the daemon's own user and root
only); their timelines say ``cancelled by operator``.

Exit statuses: 0; 1 when no daemon answers or its socket directory could have been made by another
user, or it refused, or (cancel) an id named no pending notice; 2 for a usage error.
"""

from __future__ import annotations

import json
from typing import Any

import click
from spotguard._paths import untrusted
from spotguard.protocol import MAX_HISTORY, StatusRequest, WithdrawRequest

from spotguard_daemon.commands.common import (Duration, fail, no_daemon, printable, request,
                                              settings_or_exit)

__all__ = ["notices", "human_timeline"]

MAX_IDS = 64
"""Ids one ``withdraw`` request carries (the protocol's bound)."""
_OUTCOMES = {None: "undecided", "saved": "saved in time", "no_room": "no room to save",
             "missed_deadline": "MISSED THE DEADLINE", "no_client": "NO CLIENT", "cancelled": "cancelled"}
_DETAILS = (("pid", "pid {}"), ("pids", "pids {}"), ("step", "step {}"), ("job", "job {}"),
            ("estimate_s", "estimate {:.2f} s"), ("seconds_left", "{:.1f} s left"), ("detail", "{}"))


def human_timeline(line: dict[str, Any]) -> list[str]:
    """A timeline as lines: a heading with the outcome, then one line per stage."""
    deadline = line.get("deadline") or "no deadline"
    took_part = len({s["pid"] for s in line.get("stages", []) if "pid" in s})
    head = (f"notice {line['id']} ({line['kind']} on {line['platform']}, seen {line['seen']}, deadline "
            f"{deadline}; clients: {line.get('clients_at_seen', 0)} registered when seen, {took_part} took "
            f"part): {_OUTCOMES.get(line.get('outcome'), line.get('outcome'))}")
    if line.get("cancelled"):
        head += f" ({line['cancelled']})"
    if line.get("platform_at"):
        head += f"; the platform flipped it at {line['platform_at']}"
    lines = [head]
    for stage in line.get("stages", []):
        details = [fmt.format(", ".join(map(str, stage[key])) if isinstance(stage[key], list) else stage[key])
                   for key, fmt in _DETAILS if stage.get(key) is not None]
        lines.append(f"  +{stage['after_s']:9.3f} s  {stage['stage']:<15} {'  '.join(details)}".rstrip())
    if line.get("waiting_for_durable"):
        lines.append(f"  waiting for a durable checkpoint of: {', '.join(line['waiting_for_durable'])}")
    return lines


_config = click.option("--config", metavar="PATH", help="TOML settings file "
                       "(default /etc/spotguard/spotguard.toml when present).")
_timeout = click.option("--timeout", default=2.0, show_default=True, type=Duration(0.001),
                        help="How long to wait for the daemon (seconds, or 500ms, 1m).")


def _ask(config: str | None, message: Any, timeout: float) -> Any:
    """The daemon's reply to ``message``; exit 1 when none answers (or its directory is untrusted)."""
    endpoint = settings_or_exit(config).request_endpoint
    distrust = untrusted(endpoint)
    reply = None if distrust else request(endpoint, message, timeout)
    if reply is None:
        fail(1, distrust or no_daemon(endpoint, timeout))
    return reply


@click.group(invoke_without_command=True)
@_config
@click.option("-n", "--count", default=10, show_default=True, type=click.IntRange(1, MAX_HISTORY),
              help="How many of the latest notices.")
@click.option("--json", "as_json", is_flag=True, help="Print them as a JSON list, newest first.")
@_timeout
@click.pass_context
def notices(ctx: click.Context, config: str | None, count: int, as_json: bool, timeout: float) -> None:
    """List the latest terminating notices of this node, newest first, each with the stages the
    emergency path went through (seen, published, each client's flag, stop, save, safe, durable,
    node gone) and its outcome. Kept by the daemon in its state directory.
    ``spotguard notices cancel`` withdraws pending ones."""
    if ctx.invoked_subcommand is not None:
        return
    history = _ask(config, StatusRequest(history=count), timeout).data.get("history") or []
    if as_json:
        click.echo(json.dumps(history, indent=2))
        return
    if not history:
        click.echo("no terminating notice recorded")
    for line in history:
        click.echo(printable("\n".join(human_timeline(line))))


@notices.command()
@click.argument("ids", nargs=-1, metavar="ID...")
@click.option("--all", "every", is_flag=True, help="Cancel every pending notice.")
@_config
@_timeout
def cancel(ids: tuple[str, ...], every: bool, config: str | None, timeout: float) -> None:
    """Withdraw pending notices (ids as `spotguard status` shows them), or all with --all: clients
    stop waiting for them, and their timelines say `cancelled by operator`. Allowed to the daemon's
    own user and root."""
    if bool(ids) == every:
        raise click.UsageError("give notice ids or --all (one of them)")
    if len(ids) > MAX_IDS:
        raise click.UsageError(f"at most {MAX_IDS} ids at once (or --all)")
    reply = _ask(config, WithdrawRequest(ids=list(ids), all=every), timeout)
    if not reply.ok:
        fail(1, printable(reply.error))
    for notice_id in reply.data.get("cancelled", []):
        click.echo(printable(f"cancelled {notice_id}"))
    if every and not reply.data.get("cancelled"):
        click.echo("no notice was pending")
    if reply.data.get("unknown"):
        fail(1, printable(f"no pending notice {', '.join(reply.data['unknown'])} (see spotguard status)"))
