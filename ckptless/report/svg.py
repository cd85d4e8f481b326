"""Hand-written SVG charts for the HTML report (no plotting library, no script, no network).

Why by hand: the page must be one self-contained file that renders the same
offline, in any browser, years later; a few hundred lines of SVG do that
without a JavaScript bundle. Tooltips are SVG ``<title>`` elements.
"""

from __future__ import annotations

from html import escape

from ckptless.goodput import CATEGORIES, PHASES, IncidentView
from ckptless.report.model import LABELS, Report, nice_ticks

COLOURS = {
    "productive": "#3b8f5a", "startup": "#a3a3a3", "checkpoint_save": "#00838f", "detection": "#d62728",
    "reformation": "#f28e2b", "replacement_wait": "#ffbe7d", "transfer": "#4e79a7", "disk_restore": "#8c564b", "rollback": "#9467bd",
    "wasted_progress": "#e377c2", "reprotection": "#17becf", "idle": "#d4d4d4", "first_step": "#e0b000",
}
RANKS = ["#1f3b73", "#4e79a7", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2", "#edc948", "#ff9da7", "#bab0ac",
         "#e15759"]
FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


def _ticks(lo: float, hi: float, target: int) -> list[float]:
    return nice_ticks(lo, hi, target)[0]


class _Scale:
    def __init__(self, lo: float, hi: float, a: float, b: float) -> None:
        self.lo, self.hi, self.a, self.b = lo, (hi if hi > lo else lo + 1.0), a, b

    def __call__(self, v: float) -> float:
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def _phase_spans(inc: IncidentView) -> list[tuple[str, float, float]]:
    out, prev = [], inc.started_at
    for name in PHASES[:-1]:
        if name in inc.ends:
            out.append((name, prev, inc.ends[name]))
            prev = inc.ends[name]
    if inc.resumed_at is not None:
        out.append(("first_step", prev, inc.resumed_at))
        if inc.reprotected_at is not None and inc.reprotected_at > inc.resumed_at:
            out.append(("reprotection", inc.resumed_at, inc.reprotected_at))
    return out


def timeline(r: Report, width: int = 1120) -> str:
    """Steps over time per rank; incident phases as coloured bands; one lane per rank below."""
    a, tf = r.analysis, r.time
    ranks = a.ranks
    left, right, top, plot_h, lane_h = 64, 16, 34, 300, 18
    lanes_top = top + plot_h + 70
    height = lanes_top + lane_h * max(len(ranks), 1) + 28
    t0, t1 = a.start, max(a.end, a.start + 1e-3)
    x = _Scale(t0, t1, left, width - right)
    max_step = max([s for tr in ranks for _, s, _ in tr.steps] + [1])
    y = _Scale(0, max_step * 1.05, top + plot_h, top)
    out = [f'<svg id="timeline" class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="timeline of steps per rank" {FONT}>']
    out.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" fill="#fbfbfb" '
               'stroke="#ddd"/>')
    # incident bands, behind everything
    for inc in a.incidents:
        for name, s, e in _phase_spans(inc):
            x0, x1 = x(s), x(e)
            w = max(x1 - x0, 1.5)
            out.append(f'<rect class="phase phase-{name}" x="{x0:.2f}" y="{top}" width="{w:.2f}" height="{plot_h}" '
                       f'fill="{COLOURS[name]}" fill-opacity="{0.16 if name == "reprotection" else 0.28}">'
                       f'{_title(f"incident {inc.index}: {LABELS[name]} {e - s:.3f} s ({tf.at(s)} - {tf.at(e)})")}'
                       '</rect>')
        label_x = x(inc.started_at)
        out.append(f'<text x="{label_x + 3:.1f}" y="{top + 13}" font-size="11" fill="#444">incident {inc.index}'
                   f'{"" if inc.downtime_s is None else f" · {inc.downtime_s:.2f} s"}</text>')
        for f in inc.faults:
            fx = x(f.t)
            out.append(f'<line x1="{fx:.2f}" x2="{fx:.2f}" y1="{top - 6}" y2="{lanes_top + lane_h * len(ranks)}" '
                       f'stroke="#b00020" stroke-width="1.5" stroke-dasharray="4 3">'
                       f'{_title(f"{f.kind} -> {f.target} at {tf.at(f.t)}")}</line>')
            out.append(f'<text x="{fx:.2f}" y="{top - 9}" font-size="11" fill="#b00020" text-anchor="middle">'
                       f'✕ {escape(f.kind)} {escape(f.target)}</text>')
    # axes
    xt, xs = tf.ticks(t0, t1, 8)
    for v in xt:
        px = x(v)
        out.append(f'<line x1="{px:.2f}" x2="{px:.2f}" y1="{top + plot_h}" y2="{top + plot_h + 5}" stroke="#888"/>')
        out.append(f'<text x="{px:.2f}" y="{top + plot_h + 18}" font-size="11" fill="#555" text-anchor="middle">'
                   f'{escape(tf.tick(v, xs))}</text>')
    for v in _ticks(0, max_step * 1.05, 6):
        py = y(v)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{py:.2f}" y2="{py:.2f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py + 4:.2f}" font-size="11" fill="#555" text-anchor="end">'
                   f'{v:g}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2}" font-size="12" fill="#333" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">step</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{top + plot_h + 34}" font-size="12" fill="#333" '
               f'text-anchor="middle">{"wall-clock time" if a.clock == "wall" else "seconds since start"}</text>')
    # step lines: one polyline per (rank, generation), so a rollback does not draw a slope
    for n, tr in enumerate(ranks):
        colour = RANKS[n % len(RANKS)]
        runs: dict[int, list[tuple[float, int]]] = {}
        for t, s, g in tr.steps:
            runs.setdefault(g, []).append((t, s))
        for g, pts in runs.items():
            if len(pts) > 1:
                path = " ".join(f"{x(t):.2f},{y(s):.2f}" for t, s in pts)
                out.append(f'<polyline class="steps" points="{path}" fill="none" stroke="{colour}" '
                           f'stroke-width="1.6" stroke-opacity="0.9">{_title(f"rank {tr.rank}, generation {g}")}'
                           '</polyline>')
            for t, s in pts[:: max(1, len(pts) // 200)]:
                out.append(f'<circle cx="{x(t):.2f}" cy="{y(s):.2f}" r="2.2" fill="{colour}">'
                           f'{_title(f"rank {tr.rank} step {s} at {tf.at(t)} (gen {g})")}</circle>')
    # lanes: each rank's lives (member / replacement)
    out.append(f'<text x="{left}" y="{lanes_top - 8}" font-size="12" fill="#333">process lives per rank '
               '(dark: original member, light: replacement)</text>')
    for n, tr in enumerate(ranks):
        ly = lanes_top + n * lane_h
        out.append(f'<text x="{left - 6}" y="{ly + 12}" font-size="11" fill="#555" text-anchor="end">'
                   f'rank {tr.rank}</text>')
        for s, e, role in tr.lives:
            fill = RANKS[n % len(RANKS)]
            op = 0.85 if role == "member" else 0.45
            out.append(f'<rect x="{x(s):.2f}" y="{ly + 2}" width="{max(x(e) - x(s), 1.5):.2f}" height="{lane_h - 5}" '
                       f'rx="3" fill="{fill}" fill-opacity="{op}">'
                       f'{_title(f"rank {tr.rank} {role}: {tf.at(s)} - {tf.at(e)}")}</rect>')
    out.append("</svg>")
    return "\n".join(out)


def incident_bar(r: Report, inc: IncidentView, width: int = 1120) -> str:
    """One incident, zoomed: the merged phases as one stacked bar, then each rank's own view below it."""
    tf = r.time
    spans = _phase_spans(inc)
    start = min([inc.started_at, *[f.t for f in inc.faults]])
    end = max([inc.started_at + 1e-3, *[e for _, _, e in spans], *[t for _, _, t in inc.marks]])
    left, right, top, row_h = 150, 24, 30, 20
    who = sorted({rk for rk, _, _ in inc.marks}, key=lambda v: -1 if v is None else v)
    height = top + 40 + row_h * len(who) + 30
    x = _Scale(start, end + (end - start) * 0.02, left, width - right)
    out = [f'<svg class="chart incident" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="incident {inc.index} phases" {FONT}>']
    out.append(f'<text x="{left - 8}" y="{top + 15}" font-size="12" font-weight="600" fill="#333" '
               'text-anchor="end">merged (last rank)</text>')
    for name, s, e in spans:
        x0, x1 = x(s), x(e)
        w = max(x1 - x0, 1.0)
        out.append(f'<rect class="phase phase-{name}" x="{x0:.2f}" y="{top}" width="{w:.2f}" height="22" '
                   f'fill="{COLOURS[name]}" fill-opacity="{0.55 if name == "reprotection" else 0.9}">'
                   f'{_title(f"{LABELS[name]}: {e - s:.3f} s ({tf.at(s)} - {tf.at(e)})")}</rect>')
        text = f"{LABELS[name]} {e - s:.2f}s"
        if w > 7 * len(text):
            out.append(f'<text x="{x0 + w / 2:.2f}" y="{top + 15}" font-size="11" fill="#fff" text-anchor="middle">'
                       f'{escape(text)}</text>')
    for f in inc.faults:
        fx = x(f.t)
        out.append(f'<line x1="{fx:.2f}" x2="{fx:.2f}" y1="{top - 8}" y2="{height - 24}" stroke="#b00020" '
                   f'stroke-dasharray="4 3"/><text x="{fx + 3:.2f}" y="{top - 10}" font-size="11" fill="#b00020">'
                   f'{escape(f.kind)} → {escape(f.target)} at {escape(tf.at(f.t))}</text>')
    for n, rk in enumerate(who):
        ry = top + 44 + n * row_h
        label = "leader / job" if rk is None else f"rank {rk}"
        out.append(f'<text x="{left - 8}" y="{ry + 4}" font-size="11" fill="#555" text-anchor="end">{label}</text>')
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{ry}" y2="{ry}" stroke="#eee"/>')
        for _, name, t in [m for m in inc.marks if m[0] == rk]:
            colour = COLOURS.get(name, "#333")
            tip = _title(f"{label}: {LABELS.get(name, name)} at {tf.at(t)}")
            if name in ("joined", "incident opened", "plan published"):
                out.append(f'<path d="M{x(t):.2f},{ry - 5} l5,5 l-5,5 l-5,-5 z" fill="{colour}">{tip}</path>')
            else:
                out.append(f'<circle cx="{x(t):.2f}" cy="{ry}" r="4" fill="{colour}" stroke="#fff">{tip}</circle>')
    xt, xs = tf.ticks(start, end, 8)
    for v in xt:
        out.append(f'<text x="{x(v):.2f}" y="{height - 8}" font-size="10" fill="#666" text-anchor="middle">'
                   f'{escape(tf.tick(v, xs))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def breakdown(r: Report, width: int = 1120) -> str:
    """Badput by category (bars), and the wall time of ckptless vs restart-from-disk (stacked bars)."""
    a, e = r.analysis, r.estimate
    cats = [c for c in CATEGORIES if c != "productive"]
    left, top, bar_h, gap = 210, 12, 18, 6
    peak = max([a.seconds[c] for c in cats] + [1e-9])
    h1 = top + len(cats) * (bar_h + gap)
    stack_top = h1 + 46
    height = stack_top + 2 * (bar_h + 14) + 40
    x = _Scale(0, peak, left, width * 0.62)
    out = [f'<svg id="breakdown" class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="badput breakdown" {FONT}>']
    for n, c in enumerate(cats):
        yy = top + n * (bar_h + gap)
        sec = a.seconds[c]
        share = sec / a.wall_s if a.wall_s > 0 else 0.0
        out.append(f'<text x="{left - 8}" y="{yy + 13}" font-size="12" fill="#333" text-anchor="end">'
                   f'{escape(LABELS[c])}</text>')
        out.append(f'<rect x="{left}" y="{yy}" width="{max(x(sec) - left, 0.5):.2f}" height="{bar_h}" rx="2" '
                   f'fill="{COLOURS[c]}">{_title(f"{LABELS[c]}: {sec:.3f} s ({share:.1%} of wall)")}</rect>')
        out.append(f'<text x="{max(x(sec), left) + 6:.2f}" y="{yy + 13}" font-size="11" fill="#444">'
                   f'{sec:.3f} s · {share:.1%}</text>')
    # stacked wall-time comparison
    total = max(a.wall_s, e.wall_s, 1e-9)
    sx = _Scale(0, total, left, width - 80)
    failure = e.ckptless_failure_s
    other = max(0.0, a.wall_s - a.productive_s - a.seconds["startup"] - a.seconds["checkpoint_save"] - failure)
    rows = [("ckptless (measured)", [("productive", a.productive_s), ("startup", a.seconds["startup"]),
                                     ("checkpoint_save", a.seconds["checkpoint_save"]),
                                     ("detection", failure), ("idle", other)]),
            ("restart-from-disk (estimate)", [("productive", a.productive_s), ("startup", a.seconds["startup"]),
                                              ("checkpoint_save", e.save_total_s),
                                              ("detection", e.failure_badput_s), ("idle", other)])]
    out.append(f'<text x="{left}" y="{stack_top - 12}" font-size="12" fill="#333">wall time: productive, '
               'startup, checkpoint saves, <tspan fill="#d62728">failures</tspan>, other</text>')
    for n, (label, parts) in enumerate(rows):
        yy = stack_top + n * (bar_h + 14)
        out.append(f'<text x="{left - 8}" y="{yy + 13}" font-size="12" fill="#333" text-anchor="end">'
                   f'{escape(label)}</text>')
        cur = 0.0
        for name, sec in parts:
            if sec <= 0:
                continue
            what = "failures" if name == "detection" else ("other" if name == "idle" else LABELS[name])
            out.append(f'<rect x="{sx(cur):.2f}" y="{yy}" width="{max(sx(cur + sec) - sx(cur), 0.5):.2f}" '
                       f'height="{bar_h}" fill="{COLOURS[name]}">{_title(f"{what}: {sec:.3f} s")}</rect>')
            cur += sec
        out.append(f'<text x="{sx(cur) + 6:.2f}" y="{yy + 13}" font-size="11" fill="#333">{cur:.2f} s</text>')
    out.append("</svg>")
    return "\n".join(out)
