"""`lazarus goodput`: the expected ETTR of a run, from its measured figures and a failure rate.

    lazarus goodput --metrics WORKDIR/metrics.jsonl [--events FILE] [--gpus N] [figures ...]

Figures come from the run where it measured them, and from flags otherwise (a flag wins):
the median step time (metrics), the checkpoint interval, blocked and durable time per
checkpoint of each tier (the metrics' checkpoint lines, lazarus.core.stall), the restart cost
per failure of each tier (the events' recovered incidents: fault to the first step after the
restore, less that step, by the tier their `round_started` event says they restored from; a
recovery whose event does not say counts as tier 1's in a run without tier 0 only) and the GPU
count (the checkpoint lines' ranks). The model and its sources are in lazarus.core.ettr;
docs/operations.md ("Goodput") explains the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from pathlib import Path

from lazarus.core import ettr as model
from lazarus.core.errors import UserError
from lazarus.core.records import number
from lazarus.core.stall import by_tier, is_step
from lazarus.ops import report

NOT_MEASURED = "not measured"


@dataclasses.dataclass(slots=True)
class Figure:
    """A number and where it came from ("given", or how it was measured); None: unknown."""
    value: float | None
    source: str = ""

    def text(self, fmt) -> str:
        if self.value is None:
            return NOT_MEASURED
        return f"{fmt(self.value)} ({self.source})" if self.source else fmt(self.value)


@dataclasses.dataclass(slots=True)
class TierFigures:
    every: Figure
    blocked_s: Figure
    durable_s: Figure
    restart_s: Figure

    def missing(self) -> list[str]:
        """The flags (without their tier's prefix) of the figures not known."""
        return [name.replace("_", "-") for name in ("every", "blocked_s", "durable_s",
                                                    "restart_s")
                if getattr(self, name).value is None]

    def tier(self) -> model.Tier:
        return model.Tier(every=int(self.every.value), blocked_s=self.blocked_s.value,
                          durable_s=self.durable_s.value)


@dataclasses.dataclass(slots=True)
class Inputs:
    step_s: Figure
    gpus: Figure
    storage: TierFigures
    memory: TierFigures


def _given(value, measured: Figure) -> Figure:
    return measured if value is None else Figure(value, "given")


def measure(metrics: Path | None, events: Path | None
            ) -> tuple[Figure, Figure, dict, dict[str, Figure]]:
    """(step time, GPUs, {tier: (every, blocked, durable)}, {tier: restart}) as the run
    recorded them; unknown figures are Figure(None)."""
    step_s, gpus = Figure(None), Figure(None)
    restart = {"storage": Figure(None), "memory": Figure(None)}
    tiers: dict[str, tuple[Figure, Figure, Figure]] = {}
    if metrics is None:
        return step_s, gpus, tiers, restart
    if not metrics.is_file():
        raise UserError(f"--metrics {metrics}: no such file")
    rows = report.read_metrics(metrics)
    times = [t for r in rows if is_step(r) and not r.get("skipped")
             and (t := number(r.get("step_time_s"))) is not None and t > 0]
    if times:
        step_s = Figure(statistics.median(times), f"median of {len(times)} steps")
    stalls = report.stall_records(rows)
    ranks = [s.ranks for s in stalls if s.ranks is not None]
    if ranks:
        gpus = Figure(ranks[-1], "the ranks of the last checkpoint")
    for name, t in by_tier(stalls).items():
        n = f"median of {t.count}"
        tiers[name] = (
            Figure(t.every, "measured") if t.every is not None else Figure(None),
            Figure(t.blocked_median_s, n),
            Figure(t.durable_median_s, f"median of {t.committed} committed")
            if t.durable_median_s is not None else Figure(None))
    if events is not None and events.is_file() and step_s.value is not None:
        # Events written before round_started said its tier: from storage, unless the run
        # also took snapshots (then either).
        unsaid = None if "memory" in tiers else "storage"
        for name, tier in (("storage", 1), ("memory", 0)):
            recovered = [i.recovered_after_s
                         for i in report.incidents(report.read_events(events))
                         if i.outcome == "recovered" and i.recovered_after_s is not None
                         and (i.restore_tier == tier
                              or (i.restore_tier is None and unsaid == name))]
            if recovered:
                # recovered_at is the end of the first step after the restore: a step redone,
                # which the model counts as recomputation.
                restart[name] = Figure(max(0.0, statistics.median(recovered) - step_s.value),
                                       f"median of {len(recovered)} recoveries"
                                       if len(recovered) > 1 else "1 recovery")
    return step_s, gpus, tiers, restart


def _tier(tiers: dict, name: str, restart: Figure, args: argparse.Namespace,
          prefix: str) -> TierFigures:
    every, blocked, durable = tiers.get(name, (Figure(None), Figure(None), Figure(None)))
    return TierFigures(every=_given(getattr(args, f"{prefix}every"), every),
                       blocked_s=_given(getattr(args, f"{prefix}blocked_s"), blocked),
                       durable_s=_given(getattr(args, f"{prefix}durable_s"), durable),
                       restart_s=_given(getattr(args, f"{prefix}restart_s"), restart))


# -- rendering -------------------------------------------------------------------------------

def _pct(x: float) -> str:
    # The far ends matter here: 99.996% is not 100%, nor 0.004% nothing.
    if 0 < x < 0.0001:
        return "<0.01%"
    return ">99.99%" if 0.9999 < x < 1 else f"{x:.2%}"


def _secs(x: float) -> str:
    if x < 1:
        return f"{x * 1000:.3g} ms"
    if x >= 86400 * 2:
        return f"{x / 86400:,.1f} days"
    if x >= 7200:
        return f"{x / 3600:,.1f} h"
    return f"{x:,.3g} s" if x < 100 else f"{x:,.0f} s"


def _steps(x: float) -> str:
    return f"{int(x):,} step{'' if x == 1 else 's'}"


def table(inputs: Inputs, mtbf_s: float) -> list[tuple[str, str, str]]:
    """Rows (figure, tier 1 only, with tier 0) of the report. The optimal interval is that of
    the tier restored from (tier 0 in the second column), the others kept as measured."""
    step = inputs.step_s
    s1, s0 = inputs.storage, inputs.memory
    rows = [("step time", step.text(_secs), ""),
            ("checkpoint every", s1.every.text(_steps), s0.every.text(_steps)),
            ("blocked per checkpoint", s1.blocked_s.text(_secs), s0.blocked_s.text(_secs)),
            ("durable after", s1.durable_s.text(_secs), s0.durable_s.text(_secs)),
            ("restart per failure", s1.restart_s.text(_secs), s0.restart_s.text(_secs))]
    results = []
    for column, tiers_of in ((s1, lambda: [s1.tier()]), (s0, lambda: [s1.tier(), s0.tier()])):
        missing = column.missing() + (["step-time-s"] if step.value is None else [])
        if column is s0 and not missing and s1.missing():
            missing = [f"tier 1 {m}" for m in s1.missing()]
        if missing:
            results.append(None)
            continue
        tiers = tiers_of()
        now = model.expected_ettr(step_s=step.value, tiers=tiers, restore_from=tiers[-1],
                                  restart_s=column.restart_s.value, mtbf_s=mtbf_s)
        tiers[-1] = dataclasses.replace(tiers[-1], every=now.optimal_every)
        best = model.expected_ettr(step_s=step.value, tiers=tiers, restore_from=tiers[-1],
                                   restart_s=column.restart_s.value, mtbf_s=mtbf_s)
        results.append((now, best))

    def cells(fn) -> tuple[str, str]:
        return tuple(NOT_MEASURED if r is None else fn(r) for r in results)

    rows += [("lost to checkpoint stalls", *cells(lambda r: _pct(r[0].stalls))),
             ("lost to recomputation", *cells(lambda r: _pct(r[0].recomputation))),
             ("lost to restarts", *cells(lambda r: _pct(r[0].restarts))),
             ("ETTR", *cells(lambda r: _pct(r[0].ettr))),
             ("optimal interval (Young)", *cells(
                 lambda r: f"{_steps(r[0].optimal_every)} ({_secs(r[0].optimal_every_s)})")),
             ("ETTR at the optimal interval", *cells(lambda r: _pct(r[1].ettr)))]
    return rows


def render(inputs: Inputs, mtbf_s: float, rate: str) -> str:
    rows = table(inputs, mtbf_s)
    gpus = inputs.gpus.text(lambda g: f"{int(g):,} GPU" + ("" if g == 1 else "s"))
    lines = [f"failures: {rate}, scaled to {gpus}: one every {_secs(mtbf_s)}", ""]
    widths = [max(len(r[i]) for r in rows + [("", "tier 1 only", "with tier 0")])
              for i in range(3)]
    for r in [("", "tier 1 only", "with tier 0")] + rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    missing = [f"--{prefix}{m}" for prefix, t in (("", inputs.storage), ("t0-", inputs.memory))
               for m in t.missing()]
    if missing:
        lines += ["", "not measured in the run, give them to fill the table: "
                  + " ".join(missing)]
    return "\n".join(lines)


# -- command ---------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lazarus goodput", description=__doc__.splitlines()[0])
    p.add_argument("--metrics", type=Path, help="the run's metrics (JSON lines, [train] "
                   "metrics); its steps and checkpoint lines give the figures")
    p.add_argument("--events", type=Path, help="the run's events (default: events.jsonl next "
                   "to the metrics), for the restart cost of its recoveries")
    p.add_argument("--gpus", type=int, help="GPUs of the run: nodes x ranks per node (default: "
                   "the ranks that saved its checkpoints)")
    p.add_argument("--step-time-s", type=float, help="seconds per training step")
    for prefix, tier in (("", "tier 1 (storage)"), ("t0-", "tier 0 (memory)")):
        p.add_argument(f"--{prefix}every", type=int, metavar="STEPS",
                       help=f"{tier} checkpoint interval")
        p.add_argument(f"--{prefix}blocked-s", type=float, metavar="S",
                       help=f"{tier}: seconds a checkpoint holds the training loop")
        p.add_argument(f"--{prefix}durable-s", type=float, metavar="S",
                       help=f"{tier}: seconds from a checkpoint's start until it is durable")
        p.add_argument(f"--{prefix}restart-s", type=float, metavar="S",
                       help=f"restoring from {tier}: seconds per failure from the fault to "
                            "training again (detection, new round, restore)")
    p.add_argument("--interruptions", type=float, default=model.LLAMA3_INTERRUPTIONS,
                   help="failure rate: interruptions seen ... (default %(default)s)")
    p.add_argument("--days", type=float, default=model.LLAMA3_DAYS,
                   help="... in this many days ... (default %(default)s)")
    p.add_argument("--on-gpus", type=int, default=model.LLAMA3_GPUS,
                   help="... on this many GPUs (default %(default)s: Llama 3's pre-training)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    positive = {"gpus", "step_time_s", "every", "t0_every"}
    for name in ("gpus", "step_time_s", "every", "blocked_s", "durable_s", "restart_s",
                 "t0_every", "t0_blocked_s", "t0_durable_s", "t0_restart_s"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value < 0
                                  or (value == 0 and name in positive)):
            raise UserError(f"--{name.replace('_', '-')} must be "
                            f"{'> 0' if name in positive else '>= 0'}, not {value:g}")
    events = args.events
    if events is None and args.metrics is not None:
        events = args.metrics.parent / "events.jsonl"
    elif events is not None and not events.is_file():
        raise UserError(f"--events {events}: no such file")
    step_s, gpus, tiers, restart = measure(args.metrics, events)
    inputs = Inputs(step_s=_given(args.step_time_s, step_s), gpus=_given(args.gpus, gpus),
                    storage=_tier(tiers, "storage", restart["storage"], args, ""),
                    memory=_tier(tiers, "memory", restart["memory"], args, "t0_"))
    if inputs.gpus.value is None:
        raise UserError("the run's GPU count is unknown (its metrics have no checkpoint "
                        "lines with ranks): give --gpus N (nodes x ranks per node)")
    try:
        mtbf_s = model.job_mtbf_s(int(inputs.gpus.value), interruptions=args.interruptions,
                                  days=args.days, on_gpus=args.on_gpus)
    except ValueError as e:
        raise UserError(str(e)) from None
    default_rate = (args.interruptions, args.days, args.on_gpus) == (
        model.LLAMA3_INTERRUPTIONS, model.LLAMA3_DAYS, model.LLAMA3_GPUS)
    rate = (f"{args.interruptions:g} interruptions in {args.days:g} days on "
            f"{args.on_gpus:,} GPUs" + (" (Llama 3)" if default_rate else ""))
    try:
        print(render(inputs, mtbf_s, rate))
    except ValueError as e:
        raise UserError(str(e)) from None
    return 0
