"""``ckptless report --html FILE``: one self-contained page (inline CSS and SVG, no script, no fetch).

Why no external anything: the page is attached to tickets and opened on
machines without network access; a CDN link would render a blank chart
there (and makes the headless-browser test flaky on a closed network). The
favicon is an inline ``data:`` URL so the browser does not request one.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from ckptless.goodput import CATEGORIES, GOOGLE, PHASES
from ckptless.goodput import BADPUT_CATEGORIES
from ckptless.report import svg
from ckptless.report.model import LABELS, MEANING, Report

CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; background: #f4f5f7;
       color: #1d2330; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 30px 0 10px; }
h3 { font-size: 15px; margin: 16px 0 8px; }
.sub { color: #5b6475; font-size: 13px; margin-bottom: 16px; word-break: break-all; }
.note { background: #fff6d6; border: 1px solid #f0d77a; padding: 8px 12px; border-radius: 6px; font-size: 13px;
        margin: 8px 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0 4px; }
.card { background: #fff; border-radius: 8px; padding: 12px 16px; min-width: 150px;
        box-shadow: 0 1px 2px rgba(0,0,0,.08); }
.card .v { font-size: 24px; font-weight: 650; } .card .k { font-size: 12px; color: #5b6475; }
.card.good .v { color: #2f7d4a; } .card.bad .v { color: #b00020; }
.panel { background: #fff; border-radius: 8px; padding: 14px 16px; box-shadow: 0 1px 2px rgba(0,0,0,.08);
         overflow-x: auto; }
svg.chart { display: block; max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { padding: 5px 10px; border-bottom: 1px solid #e6e8ec; text-align: left; white-space: nowrap; }
th { background: #f0f2f5; font-weight: 600; } td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.sw { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px;
      vertical-align: -1px; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; font-size: 12px; margin: 8px 0 2px; color: #333; }
.est { border-left: 4px solid #f28e2b; padding-left: 10px; font-size: 13px; color: #333; }
footer { font-size: 12px; color: #5b6475; margin-top: 28px; }
"""


def _n(x: float | None, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _table(head: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    h = "".join(f'<th class="{"n" if i in numeric else ""}">{escape(c)}</th>' for i, c in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"n" if i in numeric else ""}">{c}</td>'
                                     for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _sw(name: str) -> str:
    return f'<span class="sw" style="background:{svg.COLOURS[name]}"></span>'


def _cards(r: Report) -> str:
    a, e = r.analysis, r.estimate
    cards = [("good", f"{a.goodput:.1%}", "goodput"), ("", f"{a.wall_s:.2f} s", "wall time"),
             ("", f"{a.steps_done} / {a.steps_lost}", "steps done / lost"),
             ("bad" if a.incidents else "", str(len(a.incidents)), "incidents")]
    for inc in a.incidents:
        k = inc.kill_to_first_step_s
        cards.append(("bad", _n(k if k is not None else inc.downtime_s, 2) + " s",
                      f"incident {inc.index}: " + ("kill → first step" if k is not None else
                                                  "detection → first step (no kill time)")))
    if r.baseline is not None and r.baseline.has_failures:  # measured: no estimate beside it
        cards.append(("", f"{r.baseline.baseline.goodput:.1%}", "baseline goodput (measured)"))
    else:
        cards.append(("", f"{e.goodput:.1%}", "restart-from-disk goodput (estimate)"))
    return '<div class="cards">' + "".join(
        f'<div class="card {c}"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
        for c, v, k in cards) + "</div>"


def _incident_rows(r: Report) -> list[list[str]]:
    tf = r.time
    rows = []
    for i in r.analysis.incidents:
        faults = "; ".join(f"{f.kind} → {f.target} at {tf.at(f.t)}" for f in i.faults) or "–"
        rows.append([str(i.index), str(i.generation), escape(",".join(map(str, i.lost_ranks)) or "–"),
                     escape(faults), escape(tf.at(i.started_at)), escape(i.start_source), escape(i.decision or "–"),
                     *[_n(i.phases.get(p)) for p in PHASES], _n(i.downtime_s), _n(i.kill_to_first_step_s),
                     _n(i.reprotect_s), "–" if i.resume_step is None else str(i.resume_step), str(i.steps_lost),
                     "interrupted" if i.interrupted else ("–" if i.resumed_at is not None else "no first step")])
    return rows


def _comparison(r: Report) -> str:
    """The measured baseline with failures when one ran (``--baseline DIR``, e.g. torchrun + DCP with the same
    faults); else the restart-from-disk ESTIMATE (and a fault-free baseline beside it, if given)."""
    if r.baseline is not None and r.baseline.has_failures:
        return _measured(r)
    a, e = r.analysis, r.estimate
    inp = e.inputs
    rows = [["wall time s", _n(a.wall_s), _n(e.wall_s)], ["goodput", f"{a.goodput:.1%}", f"{e.goodput:.1%}"],
            ["badput from failures s", _n(e.ckptless_failure_s), _n(e.failure_badput_s)],
            ["checkpoint saves s", _n(a.seconds["checkpoint_save"]), f"{_n(e.save_total_s)} ({e.saves} saves)"]]
    for f in e.failures:
        rows.append([f"incident {f.incident} (fault after step {f.fault_step})",
                     _n(a.incidents[f.incident].downtime_s) + " downtime",
                     f"{_n(f.seconds)} ({f.lost_steps} steps since the checkpoint)"])
    html = _table(["", "ckptless (measured)", "restart-from-disk (ESTIMATE)"], rows, {1, 2})
    html += (f'<p class="est"><b>Estimate</b>, not a measurement. Per failure: process restart {inp.restart_s:.2f} s'
             f' + DCP load {inp.load_s:.2f} s (when the checkpoint is past step 0) + warm-up {e.warmup_s:.3f} s '
             f"(this run's own startup) + steps since the last checkpoint × {e.step_s:.4f} s (this run's median "
             f"step). Checkpoint every {inp.interval_steps} steps ({escape(inp.interval_source)}), "
             f"{inp.save_s:.2f} s blocking per save. Source of the restart and load costs: {escape(inp.source)}. "
             f"Estimated saving by ckptless: <b>{e.saved_s:.2f} s</b>. Override with <code>--ckpt-every</code>, "
             "<code>--restart-s</code>, <code>--load-s</code>, <code>--save-s</code>, or measure with "
             "<code>--baseline DIR</code>.</p>")
    return html + (_measured(r) if r.baseline is not None else "")


def _measured(r: Report) -> str:
    """This run beside a measured baseline (torchrun + DCP with the same faults, or a fault-free run)."""
    a, b = r.analysis, r.baseline
    assert b is not None
    ba = b.baseline
    rows = [["wall time s", _n(a.wall_s), _n(ba.wall_s)], ["goodput", f"{a.goodput:.1%}", f"{ba.goodput:.1%}"],
            ["incidents", str(len(a.incidents)), str(len(ba.incidents))],
            ["badput from failures s", _n(b.failure_badput(a)), _n(b.failure_badput(ba))],
            ["mean downtime per incident s", _n(b.mean_downtime(a)), _n(b.mean_downtime(ba))]]
    rows += [["steps done / lost", f"{a.steps_done} / {a.steps_lost}", f"{ba.steps_done} / {ba.steps_lost}"],
             ["median step s", _n(a.median_step_s, 4), _n(ba.median_step_s, 4)]]
    rows += [[f"badput {c} s", _n(a.seconds[c]), _n(ba.seconds[c])] for c in BADPUT_CATEGORIES
             if a.seconds[c] > 0.0005 or ba.seconds[c] > 0.0005]
    html = f"<h3>Measured baseline: <code>{escape(str(r.baseline_source))}</code></h3>"
    html += _table(["", "this run", "baseline"], rows, {1, 2})
    html += ("<p class='est'>The baseline had failures: its figures are measured restart costs.</p>"
             if b.has_failures else
             f"<p class='est'>The baseline had no failures: this run took {-b.wall_delta_s:+.3f} s longer "
             "(its failures plus run-to-run variation).</p>")
    return html


def render_html(r: Report) -> str:
    a, tf = r.analysis, r.time
    when = tf.day(a.start) + (f" → {tf.at(a.end)}" if a.clock == "wall" else "")
    notes = "".join(f'<div class="note">{escape(n)}</div>' for n in r.notes)
    if a.unmatched_faults:
        notes += '<div class="note">faults without an incident: ' + escape("; ".join(
            f"{f.kind} → {f.target} at {tf.at(f.t)}" for f in a.unmatched_faults)) + "</div>"
    legend = '<div class="legend">' + "".join(
        f"<span>{_sw(p)}{escape(LABELS[p])}</span>" for p in (*PHASES, "reprotection")) + \
        '<span><span class="sw" style="background:#b00020"></span>injected fault</span></div>'
    legend += '<div class="legend">' + "".join(
        f'<span><span class="sw" style="background:{svg.RANKS[n % len(svg.RANKS)]};height:3px;vertical-align:3px">'
        f"</span>rank {tr.rank}</span>" for n, tr in enumerate(a.ranks[:32])) + \
        ("<span>…</span>" if len(a.ranks) > 32 else "") + \
        "<span>(lines overlap where ranks step together)</span></div>"
    cats = _table(["category", "seconds", "share", "ml-goodput-measurement", "meaning"],
                  [[_sw(c) + escape(LABELS[c]), _n(a.seconds[c]), f"{(a.seconds[c] / a.wall_s if a.wall_s else 0):.1%}",
                    GOOGLE[c], escape(MEANING[c])] for c in CATEGORIES] + [["<b>wall</b>", _n(a.wall_s), "100.0%", "", ""]],
                  {1, 2})
    head = ["#", "gen", "lost ranks", "fault", "started", "started by", "decision", "resume step", "steps lost",
            "note", "restored from"]
    phead = ["#", *[LABELS[p] + " s" for p in PHASES], "downtime s", "kill → first step s",
             "re-protection s (background)"]
    rows = _incident_rows(r)
    restored = [escape(i.restored_from or "–") for i in a.incidents]
    inc_html = (_table(head, [x[:7] + x[-3:] + [s] for x, s in zip(rows, restored)], {0, 1, 7, 8})
                + "<h3>Phases (seconds)</h3>"
                + _table(phead, [[x[0], *x[7:-3]] for x in rows], set(range(len(phead))))
                if a.incidents else "<p>No incidents: the generation never changed.</p>")
    zooms = "".join(f"<h3>Incident {i.index} (generation {i.generation - 1} → {i.generation})</h3>"
                    + svg.incident_bar(r, i) for i in a.incidents)
    zooms += ('<p class="sub">Top bar: the merged phases. Below: when each rank (and the leader) reached each '
              "phase, in the colours above; ◆ marks a replacement joining and the leader's incident and plan."
              "</p>") if zooms else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>ckptless report – {escape(r.source.name)}</title>
<style>{CSS}</style></head>
<body><main>
<h1>ckptless report</h1>
<div class="sub">{escape(str(r.source))} · {len(r.files)} ledger files · {a.world_size} ranks · {escape(when)}</div>
{notes}
{_cards(r)}
<h2>Timeline</h2>
<div class="panel">{legend}{svg.timeline(r)}</div>
{('<h2>Incidents, zoomed</h2><div class="panel">' + zooms + '</div>') if zooms else ''}
<h2>Incidents</h2>
<div class="panel">{inc_html}<p class="sub">Each phase ends when the last rank reaches it; the phases are
consecutive and sum to the downtime. Re-protection runs in the background after the first step and is badput
only where it slowed steps.</p></div>
<h2>Goodput and badput</h2>
<div class="panel">{svg.breakdown(r)}{cats}</div>
<h2>ckptless vs restart-from-disk</h2>
<div class="panel">{_comparison(r)}</div>
<footer>Badput categories follow Google's ml-goodput-measurement where they apply. Accounting rules:
docs/report.md. Generated by <code>ckptless report</code>; this page loads nothing from the network.</footer>
</main></body></html>
"""


def write_html(r: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(r), encoding="utf-8")
