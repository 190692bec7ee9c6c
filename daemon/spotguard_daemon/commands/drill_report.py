"""What ``spotguard drill`` shows: a live timeline, a one-screen summary, ``report.json`` and
``timeline.svg`` (step against wall time, with saves, preemptions and kills marked).

The live timeline prints one line per event that matters (launch, resume, emergency save, stop,
preemption, exit) and, on a terminal only, redraws a progress bar on the line below; piped output
gets the lines alone. The picture is a small SVG written here, with no plotting dependency: its
axes carry round ticks (1, 2 or 5 times a power of ten), each kind of preemption and each mark has
a colour of its own, and its legend lists only what the picture shows, sized to its longest entry,
inside the canvas. A check that rests on nothing is marked as not judged (``-``), never passed. Every step shown (log, table, checks, report, picture) is the one the
record showed: a preemption's step is the launch's at delivery. Files are written through a private
temporary file renamed into place (:func:`~spotguard_daemon.commands.drill_tree.write_private`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from html import escape
from pathlib import Path
from typing import Any

import click

from spotguard_daemon.commands.drill_checks import Check, Launch, losses, save_figures, verdict
from spotguard_daemon.commands.drill_tree import write_private

__all__ = ["DESCRIBE", "EXIT", "Live", "write_report", "svg", "round_ticks"]

DESCRIBE = {"notice": "daemon notice with room to save",
            "short-notice": "daemon notice, no room to save",
            "sigterm": "SIGTERM, no daemon", "sigkill": "SIGKILL, no warning"}
EXIT = {"PASSED": 0, "FAILED": 1, "INCONCLUSIVE": 3}
CHAR_W = 7.0
"""Width allowed per character of the 11 px sans-serif text (wider than any such font's average)."""
COLOURS = {"notice": "#1f77b4", "short-notice": "#9467bd", "sigterm": "#ff7f0e", "sigkill": "#d62728"}
"""One colour per kind of preemption, none shared with a mark below."""
REFERENCE, SAVES, EMERGENCY, KILLED = "#aaaaaa", "#2ca02c", "#e377c2", "#000000"
BAR = 30


class Live:
    """The timeline as it happens, in seconds since the drill started."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.t0, self._bar, self._next = tty, time.monotonic(), False, 0.0

    def line(self, text: str) -> None:
        if self._bar:
            click.echo("\r\033[K", nl=False)
            self._bar = False
        click.echo(f"{time.monotonic() - self.t0:6.1f}s  {text}")

    def phase(self, text: str) -> None:
        self.line(f"== {text}")

    def launch(self, launch: Launch, pid: int) -> None:
        self.line(f"{_name(launch)}: started (pid {pid})" + (f" on {launch.ranks} ranks" if launch.ranks else ""))

    @staticmethod
    def name(launch: Launch) -> str:
        return _name(launch)

    def event(self, launch: Launch, event: dict[str, Any]) -> None:
        name, kind = _name(launch), event["event"]
        if event.get("rank", 0) != 0:
            return
        if kind == "start":
            where = event.get("resumed_from")
            tier = f" ({event['tier']} tier)" if where is not None and event.get("tier") not in (None, "local") else ""
            self.line(f"{name}: {'fresh start' if where is None else f'resumed from step {where}'}{tier}"
                      f" of {event.get('total')} steps")
        elif kind == "commit" and event.get("kind") in ("emergency", "requested"):
            self.line(f"{name}: saved step {event['step']} ({event['kind']}, "
                      f"{event.get('blocking_s', 0) + event.get('persist_s', 0):.2f} s)")
        elif kind == "stop":
            self.line(f"{name}: stopped at step {event['step']}"
                      f"{' after an emergency save' if event.get('saved') else ', no save'}")
        elif kind == "load_failed":
            self.line(f"{name}: LOAD FAILED: {event.get('error')}")
        elif kind == "finish":
            self.line(f"{name}: finished at step {event['step']} (digest {event['digest'][:16]})")

    def preempt(self, launch: Launch) -> None:
        self.line(f"{_name(launch)}: PREEMPTED at step {launch.preempted_step}: {_describe(launch)}")

    def ended(self, launch: Launch) -> None:
        how = "killed" if launch.killed else f"exited with status {launch.status}"
        self.line(f"{_name(launch)}: {how} after {launch.t_end - launch.t_launch:.1f} s")

    def bar(self, launch: Launch) -> None:
        """Redraw the progress bar (terminals only, at most 10 times a second)."""
        start = launch.first("start")
        if not self.tty or start is None or not start.get("total") or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + 0.1
        total, step = start["total"], launch.reached
        filled = int(BAR * min(step, total) / total)
        click.echo(f"\r\033[K  [{'#' * filled}{'.' * (BAR - filled)}] step {step}/{total}  "
                   f"{_name(launch)}", nl=False)
        self._bar = True


def _name(launch: Launch) -> str:
    return launch.label or ("reference" if launch.index == 0 else f"launch {launch.index}")


def _describe(launch: Launch) -> str:
    deadline = f", deadline {launch.deadline:g} s" if launch.deadline else ""
    return DESCRIBE[launch.kind] + deadline


def write_report(report: Path, command: list[str], launches: list[Launch], reference: Launch | None,
                 checks: list[Check], live: Live, *, spread: dict[str, Any] | None = None,
                 problems: list[str] = (), as_json: bool = False, resize: str | None = None) -> int:
    """Write report.json and timeline.svg, print the summary (and with ``as_json`` the report on
    stdout's last line); return the exit status (:data:`EXIT`)."""
    figures = save_figures(launches)
    rows = losses(launches, figures)
    outcome = verdict(checks)
    data = {"command": command, "verdict": outcome, "passed": outcome == "PASSED",
            "checks": [vars(c) for c in checks],
            "reference": reference.point() if reference else None,
            "launches": [launch.point() for launch in launches], "preemptions": rows,
            "effective_preemptions": sum(row["effective"] for row in rows), "save": figures,
            "spread": spread, "resize": resize, "malformed_record_lines": list(problems)}
    write_private(report / "report.json", json.dumps(data, indent=2) + "\n")
    write_private(report / "timeline.svg", svg(launches, reference))
    live.line("done")
    click.echo("\n".join(summary(data, report)))
    for check in checks:
        if not check.ok:
            click.echo(f"spotguard drill: {'INCONCLUSIVE' if check.inconclusive else 'FAILED'} "
                       f"({check.name}): {check.detail}", err=True)
    if as_json:
        click.echo(json.dumps(data))
    return EXIT[outcome]


def summary(data: dict[str, Any], report: Path) -> list[str]:
    """The one-screen summary."""
    ok, bad = _marks()
    lines = ["", f"spotguard drill: {data['verdict']}"]
    if data["reference"]:
        ref = data["reference"]
        lines.append(f"  reference: {ref['reached']} steps in {ref['seconds']:.1f} s, uninterrupted")
    lines.append(f"  drill:     {len(data['launches'])} launches, {len(data['preemptions'])} "
                 f"preemptions delivered, {data['effective_preemptions']} took effect")
    if data.get("resize"):
        lines.append(f"  resize:    {data['resize']}")
    lines.append(f"  {'preemption':<14}{'at step':>8}{'stopped':>8}{'resumed':>8}{'lost':>6}"
                 f"{'lost s':>8}{'predicted s':>12}{'restart s':>10}  effect")
    for row in data["preemptions"]:
        lines.append(f"  {row['kind']:<14}{_cell(row['at_step']):>8}{_cell(row['stopped_at']):>8}"
                     f"{_cell(row['resumed_from']):>8}{_cell(row['steps_lost']):>6}"
                     f"{_num(row['seconds_lost']):>8}{_num(row['predicted_s']):>12}"
                     f"{_num(row['restart_s']):>10}  {'yes' if row['effective'] else 'NO'}")
    save = data["save"]
    if save["save_cost_s"] is not None:
        lines.append(f"  save cost {save['save_cost_s']:.3f} s; saves every "
                     f"{_num(save['save_interval_s'])} s; Young's optimum at a "
                     f"{save['mtbf_s'] / 3600:.3g} h MTBF ({save.get('mtbf_source') or 'default'}): "
                     f"every {save['young_interval_s']:.0f} s")
    lines += [f"  {(ok if c.get('judged', True) else '-') if c['ok'] else bad} {c['name']}: "
              f"{c['detail']}" for c in data["checks"]]
    lines.append(f"  report: {report / 'report.json'}  picture: {report / 'timeline.svg'}")
    return lines


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _marks() -> tuple[str, str]:
    try:
        "\u2714\u2718".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "ok", "FAIL"
    return "\u2714", "\u2718"


def round_ticks(top: float, count: int = 5) -> list[float]:
    """Ticks from 0 at a round spacing (1, 2, 2.5 or 5 times a power of ten), about ``count`` of
    them, the last at or above ``top``: the axis ends on a tick."""
    top = max(top, 1e-9)
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    spacing = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [round(i * spacing, 10) for i in range(math.ceil(top / spacing - 1e-9) + 1)]


def _tick(value: float) -> str:
    return f"{value:g}"


def _legend_items(launches: list[Launch], reference: Launch | None) -> list[tuple[str, str]]:
    """The legend's entries: only what the picture shows (the kinds that occurred, in order)."""
    kinds = {launch.kind for launch in launches if launch.preempted}
    emergency = any(c.get("kind") == "emergency" for launch in launches for c in launch.of("commit"))
    return ([(REFERENCE, "reference run")] * (reference is not None)
            + [(SAVES, "drilled launches, saves")] + [(EMERGENCY, "emergency save")] * emergency
            + [(COLOURS[k], DESCRIBE[k]) for k in COLOURS if k in kinds]
            + [(KILLED, "x  process killed")] * any(launch.killed for launch in launches))


def svg(launches: list[Launch], reference: Launch | None, width: int = 860, height: int = 380) -> str:
    """Step against wall time: the reference in grey, each launch a line, saves as dots,
    preemptions as dashed lines in their kind's colour, kills as red crosses; the legend right of
    the plot, inside the canvas."""
    t0 = launches[0].t_launch
    span = max([launch.t_end for launch in launches] + [t0 + (reference.t_end - reference.t_launch)
                                                        if reference else t0]) - t0 or 1.0
    total = max([(launch.first("start") or {}).get("total") or launch.reached
                 for launch in launches + ([reference] if reference else [])] + [1])
    t_ticks, s_ticks = round_ticks(span), round_ticks(total)
    t1, s1 = t_ticks[-1], s_ticks[-1]
    legend = _legend_items(launches, reference)
    legend_w = 14 + CHAR_W * max(len(text) for _, text in legend)
    left, top, right, bottom = 60, 20, width - 20 - legend_w, height - 40

    def x(t: float) -> float:
        return left + (right - left) * (t - t0) / t1

    def y(step: float) -> float:
        return bottom - (bottom - top) * step / s1

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{left}" y1="{bottom}" x2="{right:.1f}" y2="{bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>',
             f'<text x="{(left + right) / 2:.1f}" y="{height - 8}" text-anchor="middle">wall time (s)</text>',
             f'<text x="14" y="{(top + bottom) / 2}" transform="rotate(-90 14 {(top + bottom) / 2})" '
             'text-anchor="middle">step</text>']
    parts += [f'<text class="tick-x" x="{x(t0 + t):.1f}" y="{bottom + 14}" text-anchor="middle">'
              f'{_tick(t)}</text>' for t in t_ticks]
    parts += [f'<text class="tick-y" x="{left - 4}" y="{y(s) + 4:.1f}" text-anchor="end">{_tick(s)}</text>'
              for s in s_ticks]
    if reference is not None:
        shift = reference.t_launch - t0
        parts.append(_path(reference, lambda t: x(t - shift), y, REFERENCE))
    for launch in launches:
        parts.append(_path(launch, x, y, SAVES))
        parts += [f'<circle cx="{x(c["t"]):.1f}" cy="{y(c["step"]):.1f}" r="3" fill="'
                  f'{EMERGENCY if c.get("kind") == "emergency" else SAVES}"/>' for c in launch.of("commit")]
        if launch.preempted:
            colour, px = COLOURS[launch.kind], x(launch.preempted_at)
            parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{bottom}" stroke="{colour}" '
                         f'stroke-dasharray="4 3"><title>{escape(_describe(launch))} at step '
                         f'{launch.preempted_step}</title></line>')
        if launch.killed:
            cx, cy = x(launch.t_end), y(launch.reached)
            parts.append(f'<path d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}M{cx - 5:.1f},'
                         f'{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}" stroke="{KILLED}" stroke-width="2"/>')
    parts += _legend(legend, right + 12, top)
    return "\n".join(parts + ["</svg>"]) + "\n"


def _path(launch: Launch, x: Any, y: Any, colour: str) -> str:
    marks = [e for e in launch.events if e["event"] in ("start", "progress", "stop", "finish")
             and e.get("rank", 0) == 0]
    points = [(e["t"], e.get("step", e.get("resumed_from") or 0)) for e in marks]
    if not points:
        return ""
    d = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in points)
    return f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="1.5"/>'


def _legend(items: list[tuple[str, str]], lx: float, ly: int) -> list[str]:
    return [f'<rect x="{lx:.1f}" y="{ly + 16 * i}" width="10" height="10" fill="{colour}"/>'
            f'<text class="legend" x="{lx + 14:.1f}" y="{ly + 16 * i + 9}">{escape(text)}</text>'
            for i, (colour, text) in enumerate(items)]
