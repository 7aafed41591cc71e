"""`lazarus report`: one self-contained HTML page (optionally a PNG of it) telling a run's story.

    lazarus report WORKDIR_OR_METRICS [--events FILE | --etcd HOST:PORT [--history DIR]]
                   [--out report.html] [--png report.png]

The loss curve by step, with faults, recoveries, skipped batches and checkpoints marked, a
table of incidents and one of what checkpoints cost (stall per tier). Inputs: the trainer's
metrics (JSON lines: step, loss, ..., `skipped` on a batch the guard rejected; and one line per
checkpoint, lazarus.core.stall), the run's events (JSON lines of EventRecord, as `lazarus up` leaves
in events.jsonl, or read from etcd) and its checkpoint records (checkpoints.jsonl beside the
events file, or etcd). What the daemon's retention moved out of etcd is in its history files
(lazarus.daemon.history): --history DIR (the daemon's --data-dir) adds them to etcd's.

Metrics carry steps, events carry wall times; they meet at the restores: a recovery's round
restores step r (round_started's restore_step), so its first trained step is r + 1, and the
fault is drawn at the last step trained before that. Redone steps show as a second curve over
the same steps. The page is inline SVG: no script, no network.
"""

from __future__ import annotations

import argparse
import html
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core import settings
from lazarus.core.consoletext import printable
from lazarus.core.errors import UserError
from lazarus.core.records import (DEFAULT_ROOT, CheckpointRecord, EventRecord, Keys, RecordError,
                                  load_json, number)
from lazarus.core.stall import KIND as STALL_KIND
from lazarus.core.stall import CheckpointStall, StallError, by_tier, is_step

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@dataclass(slots=True)
class Incident:
    kind: str
    culprit: str
    fault_at: float
    detected_at: float
    restore_step: int | None = None
    recovered_at: float | None = None
    outcome: str = "open"          # recovered | failed | cancelled | superseded | open
    fault_step: int | None = None  # last step trained before it (from the metrics)
    resume_step: int | None = None
    restore_tier: int | None = None  # 0: from memory, 1: from storage (None: not said)

    @property
    def detected_after_s(self) -> float:
        return self.detected_at - self.fault_at

    @property
    def recovered_after_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.fault_at


@dataclass(slots=True)
class Story:
    rows: list[dict]
    events: list[EventRecord]
    checkpoints: list[CheckpointRecord]
    incidents: list[Incident] = field(default_factory=list)
    title: str = "Lazarus run"
    stalls: list[CheckpointStall] = field(default_factory=list)


# -- inputs ----------------------------------------------------------------------------------

def read_metrics(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = load_json(line, f"{path}:{n}")
        except RecordError as e:
            raise UserError(str(e)) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path}:{n}: a metrics line needs an integer 'step'")
        rows.append(row)
    return rows


def _records(path: Path, cls) -> list:
    """The records of a JSON-lines file; a line that holds none is named and skipped (one
    bad line costs that line, not the report)."""
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                out.append(cls.from_json(line, f"{path}:{n}"))
            except RecordError as e:
                _skipped(str(e))
    return out


def read_events(path: Path) -> list[EventRecord]:
    """The event records of a JSON-lines file (events.jsonl); bad lines are named, skipped."""
    return _records(path, EventRecord)


def _skipped(why: str) -> None:
    # `why` may quote a key or a line that an agent wrote
    print(printable(f"lazarus report: skipped {why}"), file=sys.stderr)


def read_etcd(endpoint: str, keys: Keys, history: Path | None = None, auth=None
              ) -> tuple[list[EventRecord], list[CheckpointRecord]]:
    """Events and checkpoint records in etcd, and in the daemon's history under `history`
    (its data dir) when given."""
    # gRPC and the etcd client load only when etcd is read: a report from files needs neither
    from lazarus.core import etcd as E
    from lazarus.daemon.history import CHECKPOINTS, History, merged_events
    archive = None
    if history is not None:
        if not history.is_dir():
            raise UserError(f"--history {history}: no such directory (the daemon's --data-dir)")
        archive = History.at(history, keys)
    client = E.Etcd(endpoint, auth=auth)
    try:
        snap = client.snapshot([keys.events, keys.checkpoints])
    except E.EtcdUnavailable as e:
        raise UserError(f"--etcd {endpoint}: {e}") from None
    finally:
        client.close()
    ckpts = []
    stored = {**(archive.read(CHECKPOINTS) if archive is not None else {}),
              **snap.prefix(keys.checkpoints)}
    for key, kv in sorted(stored.items()):
        try:
            ckpts.append(CheckpointRecord.from_json(kv.value, key))
        except RecordError as e:
            _skipped(str(e))
    events = merged_events(archive, snap, keys)
    readable = {kv.key for kv, _ in events}
    for key in sorted(set(snap.prefix(keys.events)) - readable):
        _skipped(f"{key}: not an event record")
    return [ev for _, ev in events], ckpts


def last_run(events: list[EventRecord], ckpts: list[CheckpointRecord]):
    """Only the latest job's events and checkpoints (an etcd may hold several runs)."""
    starts = [i for i, ev in enumerate(events) if ev.kind == "job_accepted"]
    if not starts:
        return events, ckpts
    first = events[starts[-1]]
    job_id = first.fields.get("id")
    return events[starts[-1]:], [c for c in ckpts if not c.job_id or c.job_id == job_id]


# -- the story -------------------------------------------------------------------------------

def incidents(events: list[EventRecord]) -> list[Incident]:
    out: list[Incident] = []
    open_: Incident | None = None
    for ev in events:
        f = ev.fields
        if ev.kind == "fault_detected":
            if open_ is not None:
                open_.outcome = "superseded"
            open_ = Incident(kind=str(f.get("kind", "?")), culprit=str(f.get("culprit", "")),
                             fault_at=_num(f.get("fault_at"), ev.time),
                             detected_at=_num(f.get("detected_at"), ev.time))
            out.append(open_)
        elif open_ is None:
            continue
        elif ev.kind == "round_started":
            step, tier = f.get("restore_step"), f.get("restore_tier")
            open_.restore_step = step if isinstance(step, int) else 0
            open_.restore_tier = tier if tier in (0, 1) and not isinstance(tier, bool) else None
        elif ev.kind == "recovered":
            open_.recovered_at = _num(f.get("recovered_at"), ev.time)
            open_.outcome, open_ = "recovered", None
        elif ev.kind in ("failed", "cancelled"):
            open_.outcome, open_ = ev.kind, None
    return out


def _num(value, default: float) -> float:
    n = number(value)
    return default if n is None else n


def place(incs: list[Incident], rows: list[dict]) -> None:
    """Find each restore in the metrics: the row r + 1 after the previous incident's, preferring
    one where the steps jump back (work was redone) over plain progress."""
    trained = [r["step"] for r in rows if not r.get("skipped")]
    at = 0
    for inc in incs:
        if inc.restore_step is None:
            continue
        want = inc.restore_step + 1
        hits = [i for i in range(max(at, 1), len(trained)) if trained[i] == want]
        jumps = [i for i in hits if trained[i - 1] >= want]
        if not (jumps or hits):
            continue
        i = (jumps or hits)[0]
        inc.fault_step, inc.resume_step, at = trained[i - 1], want, i + 1


def stall_records(rows: list[dict]) -> list[CheckpointStall]:
    """The checkpoint stall lines among a metrics file's rows; a bad one is named and
    skipped."""
    out = []
    for row in rows:
        if row.get("kind") == STALL_KIND:
            try:
                out.append(CheckpointStall.from_row(row))
            except StallError as e:
                _skipped(f"checkpoint line of step {row['step']}: {e}")
    return out


def build(rows: list[dict], events: list[EventRecord], ckpts: list[CheckpointRecord],
          title: str) -> Story:
    events, ckpts = last_run(events, ckpts)
    story = Story(rows=[r for r in rows if is_step(r)], events=events, checkpoints=ckpts,
                  incidents=incidents(events), title=title, stalls=stall_records(rows))
    place(story.incidents, story.rows)
    return story


# -- rendering -------------------------------------------------------------------------------

W, H = 1100, 420
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 40, 50

COLORS = {"loss": "#1f5fa8", "fault": "#c62828", "recovery": "#2e7d32", "skip": "#ef6c00",
          "checkpoint": "#6a1b9a"}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    span = hi - lo or 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def chart(story: Story) -> str:
    rows = story.rows
    trained = [r for r in rows if not r.get("skipped") and _finite(r.get("loss"))]
    steps = [r["step"] for r in rows] + [c.step for c in story.checkpoints]
    x_lo, x_hi = 0, max(steps, default=1) or 1
    losses = [r["loss"] for r in trained]
    y_lo, y_hi = (min(losses), max(losses)) if losses else (0.0, 1.0)
    pad = (y_hi - y_lo) * 0.08 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def x(step: float) -> float:
        return LEFT + (step - x_lo) / (x_hi - x_lo) * (W - LEFT - RIGHT)

    def y(loss: float) -> float:
        return TOP + (y_hi - loss) / (y_hi - y_lo) * (H - TOP - BOTTOM)

    out = [f'<svg id="loss-chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="loss by step">',
           f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" '
           'fill="#fafafa" stroke="#ccc"/>']
    for t in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(t):.1f}" y2="{y(t):.1f}" '
                   f'stroke="#e6e6e6"/><text x="{LEFT - 6}" y="{y(t) + 4:.1f}" '
                   f'text-anchor="end" class="tick">{t:g}</text>')
    for t in _ticks(x_lo, x_hi, 10):
        out.append(f'<text x="{x(t):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle" '
                   f'class="tick">{t:g}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle" '
               'class="axis">step</text>'
               f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" class="axis" '
               f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">loss</text>')
    # One polyline per stretch of training; a restore starts a new one over redone steps.
    segments: list[list[dict]] = [[]]
    for r in trained:
        if segments[-1] and r["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(r)
    for i, seg in enumerate(s for s in segments if s):
        pts = " ".join(f"{x(r['step']):.1f},{y(r['loss']):.1f}" for r in seg)
        out.append(f'<polyline class="loss" data-segment="{i}" points="{pts}" fill="none" '
                   f'stroke="{COLORS["loss"]}" stroke-width="1.6" '
                   f'stroke-opacity="{1.0 if i == 0 else 0.75}"/>')
    base = H - BOTTOM
    for c in story.checkpoints:
        cx = x(c.step)
        fill = COLORS["checkpoint"] if c.good else "#fff"
        out.append(f'<g class="marker" data-marker="checkpoint" data-step="{c.step}" '
                   f'data-good="{str(c.good).lower()}"><title>checkpoint step {c.step}'
                   f'{"" if c.good else " (not good: rolled back past)"}</title>'
                   f'<path d="M{cx:.1f},{base - 7} l6,7 l-6,7 l-6,-7 z" fill="{fill}" '
                   f'stroke="{COLORS["checkpoint"]}" stroke-width="1.5"/></g>')
    for r in rows:
        if not r.get("skipped"):
            continue
        sx = x(r["step"])
        spike = r.get("spike") if isinstance(r.get("spike"), dict) else {}
        why = html.escape(str(spike.get("reason", "loss spike")))
        out.append(f'<g class="marker" data-marker="skip" data-step="{r["step"]}">'
                   f'<title>step {r["step"]} skipped: {why}</title>'
                   f'<line x1="{sx:.1f}" x2="{sx:.1f}" y1="{TOP}" y2="{base}" '
                   f'stroke="{COLORS["skip"]}" stroke-dasharray="2,3"/>'
                   f'<path d="M{sx - 6:.1f},{TOP + 2} h12 l-6,10 z" fill="{COLORS["skip"]}"/></g>')
    for n, inc in enumerate(story.incidents, 1):
        if inc.fault_step is None:
            continue
        fx, rx = x(inc.fault_step), x(inc.resume_step)
        label = html.escape(f"#{n} {inc.kind}")
        out.append(f'<g class="marker" data-marker="fault" data-step="{inc.fault_step}" '
                   f'data-kind="{html.escape(inc.kind)}"><title>fault #{n}: {label} '
                   f'({html.escape(inc.culprit)}) after step {inc.fault_step}</title>'
                   f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{TOP}" y2="{base}" '
                   f'stroke="{COLORS["fault"]}" stroke-width="2"/>'
                   f'<text x="{fx + 4:.1f}" y="{TOP + 14 + 14 * ((n - 1) % 3)}" '
                   f'class="label" fill="{COLORS["fault"]}">✕ {label}</text></g>')
        if inc.outcome == "recovered":
            took = inc.recovered_after_s
            out.append(f'<g class="marker" data-marker="recovery" data-step="{inc.resume_step}" '
                       f'data-incident="{n}"><title>recovered from #{n}: resumed at step '
                       f'{inc.resume_step}, {took:.1f} s after the fault</title>'
                       f'<line x1="{rx:.1f}" x2="{rx:.1f}" y1="{TOP}" y2="{base}" '
                       f'stroke="{COLORS["recovery"]}" stroke-width="2" '
                       'stroke-dasharray="6,3"/>'
                       f'<path d="M{fx:.1f},{base - 22} Q{(fx + rx) / 2:.1f},{base - 44} '
                       f'{rx:.1f},{base - 22}" fill="none" stroke="{COLORS["recovery"]}" '
                       'stroke-width="1.5" marker-end="url(#arrow)"/>'
                       f'<text x="{rx + 4:.1f}" y="{base - 50}" class="label" '
                       f'fill="{COLORS["recovery"]}">↺ {took:.1f} s</text></g>')
    out.insert(1, '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
                  'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                  f'<path d="M0,0 L10,5 L0,10 z" fill="{COLORS["recovery"]}"/></marker></defs>')
    out.append("</svg>")
    return "\n".join(out)


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def summary(story: Story) -> list[tuple[str, str]]:
    # lazily: lazarus.daemon.health loads gRPC and the etcd client, which a report from files
    # does not need
    from lazarus.daemon.health import goodput
    rows = story.rows
    trained = [r for r in rows if not r.get("skipped")]
    final = next((ev for ev in reversed(story.events)
                  if ev.kind in ("succeeded", "failed", "cancelled")), None)
    out = [("outcome", final.kind if final else "no end recorded"),
           ("steps trained", f"{max((r['step'] for r in trained), default=0)}"
                             f" ({len(trained)} step runs, incl. redone)")]
    if trained and _finite(trained[-1].get("loss")):
        out.append(("final loss", f"{trained[-1]['loss']:.4f}"))
    times = sorted(r["step_time_s"] for r in trained if _finite(r.get("step_time_s")))
    if times:
        median = times[len(times) // 2]
        tokens = next((r["tokens"] for r in trained if r.get("tokens")), 0)
        out.append(("median step time", f"{median * 1000:.0f} ms"
                    + (f" ({tokens / median:,.0f} tokens/s)" if tokens and median > 0 else "")))
    # On GPUs each step line carries its MFU and peak memory (lazarus.trainer.devstats).
    mfus = sorted(r["mfu"] for r in trained if _finite(r.get("mfu")))
    if mfus:
        out.append(("median MFU", f"{mfus[len(mfus) // 2]:.1%}"))
    peaks = [r["peak_mem_gib"] for r in trained if _finite(r.get("peak_mem_gib"))]
    if peaks:
        out.append(("peak memory", f"{max(peaks):.1f} GiB per GPU (rank 0)"))
    accepted = next((ev for ev in story.events if ev.kind == "job_accepted"), None)
    if accepted is not None and final is not None:
        g, wall, productive = goodput(story.events, str(accepted.fields.get("id")), final.time)
        out.append(("goodput", f"{g:.1%} ({productive:.1f} s productive of {wall:.1f} s)"))
    recovered = [i for i in story.incidents if i.outcome == "recovered"]
    out.append(("incidents", f"{len(story.incidents)} ({len(recovered)} recovered)"))
    out.append(("skipped batches", str(sum(1 for r in rows if r.get("skipped")))))
    out.append(("checkpoints", str(len(story.checkpoints))))
    return out


# Events where a monitor spoke up and the run went on (or was swapped at a checkpoint), and
# a replica job's replicas leaving and healing while the others trained on (its incident is
# in the incidents table): part of the story.
ALERT_KINDS = ("straggler", "gpu_degraded", "host_failed", "host_alert", "host_alert_cleared",
               "checkpoint_failed", "drained", "unkillable_rank",
               "replica_left", "replica_healing", "replica_joined")


def alerts_table(story: Story) -> str:
    start = next((ev.time for ev in story.events if ev.kind == "job_accepted"),
                 story.events[0].time if story.events else 0.0)
    rows = [ev for ev in story.events if ev.kind in ALERT_KINDS]
    out = ['<table id="alerts"><thead><tr><th>at</th><th>kind</th><th>node</th><th>what</th>'
           '</tr></thead><tbody>']
    for ev in rows:
        nodes = ev.fields.get("nodes")
        node = (ev.fields.get("culprit") or ev.fields.get("node") or ev.fields.get("reported_by")
                or (", ".join(map(str, nodes)) if isinstance(nodes, list) else "") or "–")
        cells = [f"+{ev.time - start:.1f} s", ev.kind, str(node), ev.message]
        out.append(f'<tr class="alert" data-kind="{html.escape(ev.kind)}">'
                   + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        out.append('<tr><td colspan="4">no alerts</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f} ms"


def stall_table(story: Story) -> str:
    """Per tier: how long saves held the training loop (blocked) and how long until they were
    committed (durable), and the blocked total as a share of the run's step time."""
    step_total = sum(r["step_time_s"] for r in story.rows
                     if not r.get("skipped") and _finite(r.get("step_time_s")))
    out = ['<table id="checkpoint-stall"><thead><tr><th>tier</th><th>checkpoints</th>'
           '<th>blocked median</th><th>blocked max</th><th>durable median</th>'
           '<th>durable max</th><th>stall, % of step time</th></tr></thead><tbody>']
    tiers = by_tier(story.stalls)
    for t in tiers.values():
        count = str(t.count) + ("" if t.committed == t.count
                                else f" ({t.count - t.committed} never durable)")
        share = f"{t.blocked_total_s / step_total:.1%}" if step_total > 0 else "–"
        cells = [f"{t.tier} (tier {0 if t.tier == 'memory' else 1})", count,
                 _ms(t.blocked_median_s), _ms(t.blocked_max_s), _ms(t.durable_median_s),
                 _ms(t.durable_max_s), share]
        out.append(f'<tr class="stall" data-tier="{html.escape(t.tier)}">'
                   + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not tiers:
        out.append('<tr><td colspan="7">no checkpoint stall lines in the metrics</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def render(story: Story) -> str:
    table = ["<table id=\"incidents\"><thead><tr><th>#</th><th>kind</th><th>culprit</th>"
             "<th>after step</th><th>restored step</th><th>from</th><th>detected after</th>"
             "<th>recovered after</th><th>outcome</th></tr></thead><tbody>"]
    for n, inc in enumerate(story.incidents, 1):
        cells = [str(n), inc.kind, inc.culprit or "–",
                 "–" if inc.fault_step is None else str(inc.fault_step),
                 "–" if inc.restore_step is None else str(inc.restore_step),
                 {0: "memory", 1: "storage"}.get(inc.restore_tier, "–"),
                 _s(inc.detected_after_s), _s(inc.recovered_after_s), inc.outcome]
        table.append(f'<tr class="incident" data-outcome="{html.escape(inc.outcome)}">'
                     + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not story.incidents:
        table.append('<tr><td colspan="9">no incidents</td></tr>')
    table.append("</tbody></table>")
    facts = "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd></div>"
                    for k, v in summary(story))
    legend = "".join(f'<span><i style="background:{COLORS[k]}"></i>{label}</span>'
                     for k, label in (("loss", "loss"), ("fault", "fault"),
                                      ("recovery", "resumed from checkpoint"),
                                      ("skip", "skipped batch"), ("checkpoint", "checkpoint")))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(story.title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px 32px; color: #222; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 12px; }}
dl {{ display: flex; flex-wrap: wrap; gap: 8px 28px; margin: 0 0 16px; }}
dl div {{ min-width: 120px; }} dt {{ color: #666; font-size: 12px; }} dd {{ margin: 0; font-weight: 600; }}
.legend span {{ margin-right: 18px; font-size: 13px; }}
.legend i {{ display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -1px; }}
svg text.tick {{ font-size: 11px; fill: #555; }} svg text.axis {{ font-size: 12px; fill: #333; }}
svg text.label {{ font-size: 12px; font-weight: 600; }}
table {{ border-collapse: collapse; margin-top: 16px; font-size: 13px; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 4px 12px; text-align: left; }}
th {{ background: #f3f3f3; }}
</style></head>
<body>
<h1>{html.escape(story.title)}</h1>
<dl id="summary">{facts}</dl>
<div class="legend">{legend}</div>
{chart(story)}
<h2 style="font-size:16px;margin:18px 0 0">Incidents</h2>
{"".join(table)}
<h2 style="font-size:16px;margin:18px 0 0">Checkpoint stall (blocked: the training loop waited;
durable: until committed)</h2>
{stall_table(story)}
<h2 style="font-size:16px;margin:18px 0 0">Alerts (stragglers, degraded GPUs, disks, planned swaps, replicas)</h2>
{alerts_table(story)}
</body></html>
"""


def screenshot(html_path: Path, png_path: Path, *, size=(1200, 800)) -> bool:
    """Render with headless Debian chromium; False (and nothing written) without it."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        return False
    with tempfile.TemporaryDirectory(prefix="lazarus-chromium-") as profile:
        subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        f"--screenshot={png_path.resolve()}",
                        f"--window-size={size[0]},{size[1]}", html_path.resolve().as_uri()],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                       check=False)
    return png_path.exists()


# -- command ---------------------------------------------------------------------------------

def write(source: Path, *, events: Path | None = None, etcd: str | None = None,
          root: str = DEFAULT_ROOT, out: Path | None = None,
          history: Path | None = None, etcd_auth=None) -> Path:
    """Build the report of the run in `source` (a workdir or a metrics file); returns its path.
    `etcd_auth`: TLS and user for `etcd` (lazarus.core.etcd_auth.EtcdAuth)."""
    metrics = source / "metrics.jsonl" if source.is_dir() else source
    if not metrics.is_file():
        raise UserError(f"{metrics}: no metrics file (give a workdir with metrics.jsonl, or "
                        "the metrics file)")
    folder = metrics.parent
    ckpts: list[CheckpointRecord] = []
    if history is not None and etcd is None:
        raise UserError("--history goes with --etcd (it adds to what etcd holds)")
    if etcd is not None:
        evs, ckpts = read_etcd(etcd, Keys(root), history, etcd_auth)
    else:
        events = events or folder / "events.jsonl"
        if not events.is_file():
            raise UserError(f"{events}: no events file (give --events FILE or --etcd HOST:PORT)")
        evs = _records(events, EventRecord)
        if (events.parent / "checkpoints.jsonl").is_file():
            ckpts = _records(events.parent / "checkpoints.jsonl", CheckpointRecord)
    story = build(read_metrics(metrics), evs, ckpts, title=f"Lazarus run — {folder.name}")
    out = out or folder / "report.html"
    out.write_text(render(story), encoding="utf-8")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus report", description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="a `lazarus up` workdir, or a metrics JSON-lines "
                   "file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--events", type=Path, help="events as JSON lines (default: events.jsonl "
                     "next to the metrics)")
    src.add_argument("--etcd", help="read events and checkpoints from etcd at HOST:PORT")
    p.add_argument("--history", type=Path, help="with --etcd: also the events and checkpoint "
                   "records the daemon moved out of etcd, from its data dir (--data-dir)")
    p.add_argument("--root", default=DEFAULT_ROOT, help="key prefix in etcd (default %(default)s)")
    settings.add_etcd_security_args(p)
    p.add_argument("--out", type=Path, help="the HTML page (default: report.html next to the "
                   "metrics)")
    p.add_argument("--png", type=Path, help="also a screenshot of the page (needs chromium)")
    args = p.parse_args(argv)
    out = write(args.source, events=args.events, etcd=args.etcd, root=args.root, out=args.out,
                history=args.history,
                etcd_auth=settings.etcd_auth(args) if args.etcd is not None else None)
    print(out)
    if args.png is not None:
        if screenshot(out, args.png):
            print(args.png)
        else:
            print("no PNG: chromium is not installed (apt-get install -y chromium)",
                  file=sys.stderr)
    return 0
