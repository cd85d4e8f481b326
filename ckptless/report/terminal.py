"""The report in a terminal, with ``rich``.

Why the console is widened instead of letting rich fit the terminal: a cut
header (``reformatio``) or an ellipsised number is worse than a long line.
Every table is measured first and the console is made at least that wide;
headers are set ``no_wrap``. Colours only when stdout is a terminal.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ckptless.goodput import CATEGORIES, GOOGLE, PHASES
from ckptless.report.model import LABELS, MEANING, Report

COLOURS = {"productive": "green", "startup": "grey62", "checkpoint_save": "cyan", "detection": "red",
           "reformation": "dark_orange", "replacement_wait": "orange3", "transfer": "blue", "disk_restore": "magenta", "rollback": "purple",
           "wasted_progress": "bright_red", "reprotection": "dark_green", "idle": "grey50",
           "first_step": "yellow"}


def _s(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _table(title: str, head: list[str], right: set[int] | None = None) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold", expand=False,
              pad_edge=False, show_edge=False)
    for n, h in enumerate(head):
        t.add_column(h, justify="right" if right and n in right else "left", no_wrap=True)
    return t


def _summary(r: Report) -> Text:
    a, tf = r.analysis, r.time
    t = Text()
    t.append("ckptless report ", style="bold")
    t.append(f"{r.source}  ({len(r.files)} ledger files, {a.world_size} ranks)\n")
    if a.clock == "wall":
        t.append(f"run {tf.day(a.start)} -> {tf.at(a.end)}")
    else:
        t.append("times: seconds since the job started (monotonic)")
    t.append(f"   wall {a.wall_s:.3f} s   steps {a.steps_done} done, {a.steps_lost} lost"
             f"   incidents {len(a.incidents)}\n")
    t.append("goodput ", style="bold")
    t.append(f"{a.goodput:.1%}", style="bold green")
    t.append(f"   productive {a.productive_s:.3f} s   badput {a.badput_s:.3f} s   median step "
             f"{_s(a.median_step_s)} s")
    for inc in a.incidents:
        k = inc.kill_to_first_step_s
        t.append(f"\nincident {inc.index}: ", style="bold")
        t.append(f"kill -> first step {_s(k)} s" if k is not None else
                 f"no injection time; detection -> first step {_s(inc.downtime_s)} s")
    for note in r.notes:
        t.append(f"\nnote: {note}", style="yellow")
    return t


def _categories(r: Report) -> Table:
    a = r.analysis
    t = _table("Goodput and badput", ["category", "seconds", "share", "ml-goodput-measurement", "meaning"], {1, 2})
    for c in CATEGORIES:
        sec = a.seconds[c]
        share = sec / a.wall_s if a.wall_s > 0 else 0.0
        t.add_row(Text(LABELS[c], style=COLOURS[c]), f"{sec:.3f}", f"{share:.1%}", GOOGLE[c], MEANING[c],
                  style=None if sec > 0 else "dim")
    t.add_row(Text("wall", style="bold"), f"{a.wall_s:.3f}", "100.0%", "", "")
    return t


def _incidents(r: Report) -> list[Table]:
    a, tf = r.analysis, r.time
    if not a.incidents:
        return []
    t = _table("Incidents", ["#", "gen", "lost ranks", "started", "started by", "decision", "resume step",
                             "steps lost", "downtime s", "kill -> first step s", "re-protection s (bg)",
                             "restored from", "note"],
               {0, 1, 6, 7, 8, 9, 10})
    for i in a.incidents:
        note = ", ".join(x for x, on in (("interrupted", i.interrupted), ("no first step", i.resumed_at is None
                                                                           and not i.interrupted)) if on)
        faults = "; ".join(f"{f.kind} -> {f.target}" for f in i.faults)
        t.add_row(str(i.index), str(i.generation), ",".join(map(str, i.lost_ranks)) or "-", tf.at(i.started_at),
                  i.start_source + (f" ({faults})" if faults else ""), i.decision or "-",
                  "-" if i.resume_step is None else str(i.resume_step), str(i.steps_lost), _s(i.downtime_s),
                  _s(i.kill_to_first_step_s), _s(i.reprotect_s), i.restored_from or "-", note or "-")
    p = _table("Recovery phases (seconds; each ends when the last rank reaches it)",
               ["#", *[LABELS[x] for x in PHASES], "sum = downtime"], set(range(len(PHASES) + 2)))
    for i in a.incidents:
        p.add_row(str(i.index), *[Text(_s(i.phases.get(x)), style=COLOURS[x] if x in i.phases else "dim")
                                  for x in PHASES], _s(i.downtime_s))
    return [t, p]


def _comparison(r: Report) -> list[RenderableType]:
    """The measured baseline with failures when one ran (``--baseline DIR``); else the restart-from-disk
    ESTIMATE (and a fault-free baseline beside it, if given)."""
    a, e = r.analysis, r.estimate
    out: list[RenderableType] = []
    if r.baseline is not None and r.baseline.has_failures:
        return _measured(r)
    t = _table("ckptless vs restart-from-disk", ["", "ckptless (measured)", "restart-from-disk (ESTIMATE)"],
               {1, 2})
    t.add_row("wall s", f"{a.wall_s:.3f}", f"{e.wall_s:.3f}")
    t.add_row("goodput", f"{a.goodput:.1%}", f"{e.goodput:.1%}")
    t.add_row("failure badput s", f"{e.ckptless_failure_s:.3f}", f"{e.failure_badput_s:.3f}")
    t.add_row("checkpoint save s", f"{a.seconds['checkpoint_save']:.3f}", f"{e.save_total_s:.3f} ({e.saves} saves)")
    for f in e.failures:
        inc = a.incidents[f.incident]
        t.add_row(f"incident {f.incident} s", _s(inc.downtime_s),
                  f"{f.seconds:.3f} ({f.lost_steps} steps since ckpt)")
    out.append(t)
    inp = e.inputs
    out.append(Text(
        f"estimate inputs: restart {inp.restart_s:.2f} s + DCP load {inp.load_s:.2f} s (if the checkpoint is past "
        f"step 0) + warm-up {e.warmup_s:.3f} s (this run's startup) + lost steps x {e.step_s:.4f} s (this run's "
        f"median step) per failure; checkpoint every {inp.interval_steps} steps ({inp.interval_source}), "
        f"{inp.save_s:.2f} s blocking per save. Source: {inp.source}. "
        f"Estimated saving: {e.saved_s:.3f} s.", style="italic"))
    return out + _measured(r)


def _measured(r: Report) -> list[RenderableType]:
    a, b = r.analysis, r.baseline
    out: list[RenderableType] = []
    if b is not None:
        bt = _table(f"Measured baseline: {r.baseline_source}", ["", "this run", "baseline"], {1, 2})
        bt.add_row("wall s", f"{a.wall_s:.3f}", f"{b.baseline.wall_s:.3f}")
        bt.add_row("goodput", f"{a.goodput:.1%}", f"{b.baseline.goodput:.1%}")
        bt.add_row("incidents", str(len(a.incidents)), str(len(b.baseline.incidents)))
        bt.add_row("failure badput s", f"{b.failure_badput(a):.3f}", f"{b.failure_badput(b.baseline):.3f}")
        bt.add_row("mean downtime s", _s(b.mean_downtime(a)), _s(b.mean_downtime(b.baseline)))
        bt.add_row("steps done / lost", f"{a.steps_done} / {a.steps_lost}",
                   f"{b.baseline.steps_done} / {b.baseline.steps_lost}")
        out.append(bt)
        out.append(Text(("baseline had failures: its figures are measured restart costs"
                         if b.has_failures else "baseline had no failures: this run took "
                         f"{-b.wall_delta_s:+.3f} s longer (its failures plus run-to-run variation)"), style="italic"))
    return out


def render(report: Report, file: IO[str] | None = None, colour: bool | None = None) -> None:
    """Print the report; the console is widened so that no table header is cut."""
    parts: list[RenderableType] = [_summary(report), _categories(report), *_incidents(report),
                                   *_comparison(report)]
    probe = Console(file=file, force_terminal=colour, no_color=colour is False)
    wide = probe.options.update_width(10_000)
    need = max((Measurement.get(probe, wide, p).maximum for p in parts if isinstance(p, Table)), default=0)
    console = Console(file=file, force_terminal=colour, no_color=colour is False,
                      width=max(probe.width, need), highlight=False, soft_wrap=False)
    first = True
    for p in parts:
        if not first:
            console.print()
        console.print(p, soft_wrap=isinstance(p, Text))
        first = False
