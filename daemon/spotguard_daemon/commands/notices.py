"""``spotguard notices``: the last terminating notices and what the emergency path did for each.

Each notice is shown as its timeline (:mod:`spotguard_daemon.core.timeline`): every stage with its
seconds after the daemon saw the notice, the clients' stages by pid, and the notice's outcome.
``spotguard status`` shows the current one the same way (:func:`human_timeline`).

Exit statuses: 0; 1 when no daemon answers or its socket directory could have been made by another
user; 2 for a usage error.
"""

from __future__ import annotations

import json
from typing import Any

import click
from spotguard._paths import untrusted
from spotguard.protocol import MAX_HISTORY, StatusRequest

from spotguard_daemon.commands.common import (Duration, fail, no_daemon, printable, request,
                                              settings_or_exit)

__all__ = ["notices", "human_timeline"]

_OUTCOMES = {None: "undecided", "saved": "saved in time", "no_room": "no room to save",
             "missed_deadline": "MISSED THE DEADLINE", "no_client": "NO CLIENT", "cancelled": "cancelled"}
_DETAILS = (("pid", "pid {}"), ("pids", "pids {}"), ("step", "step {}"), ("job", "job {}"),
            ("estimate_s", "estimate {:.2f} s"), ("seconds_left", "{:.1f} s left"), ("detail", "{}"))


def human_timeline(line: dict[str, Any]) -> list[str]:
    """A timeline as lines: a heading with the outcome, then one line per stage."""
    deadline = line.get("deadline") or "no deadline"
    head = (f"notice {line['id']} ({line['kind']} on {line['platform']}, seen {line['seen']}, deadline "
            f"{deadline}, {line.get('clients_at_seen', 0)} client(s) registered): "
            f"{_OUTCOMES.get(line.get('outcome'), line.get('outcome'))}")
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


@click.command()
@click.option("--config", metavar="PATH", help="TOML settings file "
              "(default /etc/spotguard/spotguard.toml when present).")
@click.option("-n", "--count", default=10, show_default=True, type=click.IntRange(1, MAX_HISTORY),
              help="How many of the latest notices.")
@click.option("--json", "as_json", is_flag=True, help="Print them as a JSON list, newest first.")
@click.option("--timeout", default=2.0, show_default=True, type=Duration(0.001),
              help="How long to wait for the daemon (seconds, or 500ms, 1m).")
def notices(config: str | None, count: int, as_json: bool, timeout: float) -> None:
    """List the latest terminating notices of this node, newest first, each with the stages the
    emergency path went through (seen, published, each client's flag, stop, save, safe, durable,
    node gone) and its outcome. Kept by the daemon in its state directory."""
    endpoint = settings_or_exit(config).request_endpoint
    distrust = untrusted(endpoint)
    reply = None if distrust else request(endpoint, StatusRequest(history=count), timeout)
    if reply is None:
        fail(1, distrust or no_daemon(endpoint, timeout))
    history = reply.data.get("history") or []
    if as_json:
        click.echo(json.dumps(history, indent=2))
        return
    if not history:
        click.echo("no terminating notice recorded")
    for line in history:
        click.echo(printable("\n".join(human_timeline(line))))
