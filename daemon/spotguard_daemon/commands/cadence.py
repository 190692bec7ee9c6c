"""``spotguard cadence``: how often should this job checkpoint? Young/Daly, shown step by step.

A planning aid: the formulas and the one default MTBF live in :mod:`spotguard.cadence`;
this module only parses, checks and prints. With ``--job ID`` it asks the local daemon (its settings'
request socket) for the MTBF it learned for that job (:mod:`spotguard_daemon.core.job_rates`) and
shows how it was learned; otherwise it touches no network. Invalid numbers exit with status 2 and
one line on stderr (click's usage-error status); a daemon that does not answer, or knows nothing of
the job, exits 1.
"""

from __future__ import annotations

import math

import click

from spotguard import cadence as _cadence

__all__ = ["cadence"]


def _number(name: str, raw: str | None, *, integer: bool = False,
            duration: bool = False) -> float | int | None:
    """Parse ``raw`` as a finite number > 0 (an integer >= 1 if ``integer``; with ``duration``
    also seconds with a unit, ``90s``, ``2m``, ``1h``), else exit 2."""
    from spotguard_daemon.commands.common import seconds

    if raw is None:
        return None
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None and duration:
        try:
            value = seconds(raw)
        except ValueError:
            value = None
    if value is None or not math.isfinite(value) or value <= 0:
        kind = "an integer >= 1" if integer else "a finite number > 0"
        _fail(f"--{name} must be {kind}, got {raw!r}")
    return value


class _InvalidInput(click.ClickException):
    """One line on stderr, exit status 2, both standalone and under the ``spotguard`` group."""

    exit_code = 2


def _fail(message: str) -> None:
    raise _InvalidInput(message)


def _duration(seconds: float) -> str:
    """``805 s (13.4 min)``: seconds, plus the unit a human reads most easily."""
    if seconds >= 2 * 3600:
        return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"
    if seconds >= 120:
        return f"{seconds:.0f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.1f} s"


def _node_mtbf(mtbf_hours: float | None, platform: str | None) -> tuple[float, str]:
    """The node MTBF in seconds and where it came from."""
    if mtbf_hours is not None and platform is not None:
        _fail("give --mtbf-hours or --platform, not both")
    if mtbf_hours is not None:
        return mtbf_hours * 3600, "--mtbf-hours"
    if platform is not None:
        if platform not in _cadence.NODE_MTBF_S:
            _fail(f"--platform must be one of {', '.join(sorted(_cadence.NODE_MTBF_S))}, "
                  f"got {platform!r}")
        return _cadence.node_mtbf(platform), f"--platform {platform}: {_cadence.DEFAULT_MTBF_SOURCE}"
    return _cadence.DEFAULT_NODE_MTBF_S, (f"{_cadence.DEFAULT_MTBF_SOURCE}, as the daemon and the drill "
                                          "assume; --mtbf-hours H sets yours")


@click.command("cadence")
@click.option("--checkpoint-seconds", "checkpoint", required=True, metavar="C",
              help="Seconds one checkpoint costs (blocking + persist); or 90s, 2m.")
@click.option("--mtbf-hours", "mtbf_hours", metavar="H", help="Measured MTBF of one node, hours.")
@click.option("--platform", metavar="|".join(sorted(_cadence.NODE_MTBF_S)),
              help="Use this platform's default node MTBF (6 h on every platform) instead of --mtbf-hours.")
@click.option("--nodes", default="1", show_default=True, metavar="N",
              help="Nodes whose failure ends the job.")
@click.option("--step-seconds", "step", metavar="S", help="Seconds per training step.")
@click.option("--job", metavar="ID", help="Use the MTBF the local daemon learned for this job (its "
              "interruptions over a prior) instead of --mtbf-hours, --platform and --nodes.")
@click.option("--config", type=click.Path(dir_okay=False), help="The daemon's TOML settings (with --job).")
def cadence(checkpoint: str, mtbf_hours: str | None, platform: str | None, nodes: str,
            step: str | None, job: str | None, config: str | None) -> None:
    """Compute the optimum checkpoint interval (Young 1974, Daly 2006), step by step."""
    c = _number("checkpoint-seconds", checkpoint, duration=True)
    step_s = _number("step-seconds", step, duration=True)
    if job is not None:
        if mtbf_hours is not None or platform is not None or nodes != "1":
            _fail("give --job or --mtbf-hours/--platform/--nodes, not both")
        m, mtbf_lines = _learned(job, config)
    else:
        node_s, source = _node_mtbf(_number("mtbf-hours", mtbf_hours), platform)
        n = _number("nodes", nodes, integer=True)
        m = _cadence.job_mtbf(node_s, n)
        mtbf_lines = [f"node MTBF          = {_duration(node_s)}  [{source}]",
                      f"job MTBF         M = node MTBF / nodes = {node_s:.6g} / {n} = {_duration(m)}"]
    young, daly = _cadence.young_interval(m, c), _cadence.daly_interval(m, c)
    for line in _explain(c, mtbf_lines, m, young, daly, step_s):
        click.echo(line)


def _learned(job: str, config: str | None) -> tuple[float, list[str]]:
    """The job MTBF the daemon learned, and the lines that show how; exit 1 without one."""
    from spotguard._paths import untrusted
    from spotguard.protocol import CadenceRequest, JobRate

    from spotguard_daemon.commands.common import fail, no_daemon, request, settings_or_exit

    endpoint = settings_or_exit(config).request_endpoint
    distrust = untrusted(endpoint)
    reply = None if distrust else request(endpoint, CadenceRequest(job_id=job), 2.0)
    if reply is None:
        fail(1, distrust or no_daemon(endpoint, 2.0))
    if not reply.ok or reply.data.get("rate") is None:
        fail(1, reply.error or f"the daemon knows nothing of job {job!r} (it learns a job from the "
                               "progress its rank 0 reports)")
    r = JobRate.model_validate(reply.data["rate"])
    w, m0, n, t = r.prior_weight, r.prior_mtbf_s, r.interruptions, r.running_s
    floor = f", at least the floor {_duration(r.floor_s)}" if r.mtbf_s == r.floor_s else ""
    return r.mtbf_s, [
        f"job {r.job_id!r}: {n} interruptions in {_duration(t)} of running, on {r.nodes} node(s) "
        "[learned by the daemon]",
        f"prior            M0 = node prior / nodes = {_duration(m0)}, worth w = {w:g} interruptions",
        f"job MTBF         M = (w*M0 + t) / (w + n) = ({w:g} * {m0:.6g} + {t:.6g}) / ({w:g} + {n})"
        f" = {_duration(r.mtbf_s)}{floor}"]


def _explain(c: float, mtbf_lines: list[str], m: float, young: float, daly: float,
             step_s: float | None) -> list[str]:
    x = c / (2 * m)
    lines = [
        f"checkpoint cost  C = {_duration(c)}",
        *mtbf_lines,
        f"Young (1974)     T = sqrt(2*M*C) = sqrt(2 * {m:.6g} * {c:.6g}) = {_duration(young)}",
        f"Daly (2006)      x = C/(2M) = {x:.6f}",
    ]
    if x < 1:
        lines.append("                 T = sqrt(2*M*C) * (1 + sqrt(x)/3 + x/9) - C = "
                     + _duration(daly))
    else:
        lines.append(f"                 C >= 2M, so T = M = {_duration(daly)}")
        lines.append("warning: a checkpoint costs more than twice the MTBF; the job will rarely "
                     "get past one: make saves cheaper or use fewer nodes")
    waste = _cadence.expected_waste(daly, m, c)
    if waste < 1:
        lines.append(f"expected waste     ~ C/T + T/(2M) = {100 * waste:.1f} % of run time "
                     "(Daly's T, first order)")
    if step_s is not None:
        steps_d = _cadence.steps_between(daly, step_s)
        steps_y = _cadence.steps_between(young, step_s)
        lines.append(f"steps between saves = floor(T / {step_s:g} s): "
                     f"Daly {steps_d}, Young {steps_y}")
    return lines
