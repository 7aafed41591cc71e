"""The expected effective training time ratio (ETTR) of a run: the standard first-order model.

ETTR is the share of wall time that makes progress that is kept. Symbols (seconds):

    s      step time (compute only: a step's step_time_s excludes checkpoints)
    t      compute between two checkpoints of a tier: every x s
    c      what one checkpoint holds the loop (its blocked_s)
    d      how long a checkpoint stays not durable once the loop has moved on:
           max(0, durable_s - blocked_s)
    R      restart cost per failure: detection + new round + restore (not the steps redone)
    M      mean time between failures of the job: 1 / (failure rate per GPU x GPUs)

Without failures a tier's checkpoints take the share c / (t + c) of wall time; with several
tiers the useful share is u = 1 / (1 + sum of c_i / t_i). A failure costs R, plus the work since
the newest durable checkpoint of the tier it restores from: half a checkpoint period on average,
t / (2u), plus d (a failure in the d seconds after a checkpoint finds it not durable yet and goes
back one more period: probability d / period, cost one period). As shares of wall time:

    restarts        R / M
    recomputation   (t / (2u) + d) / M
    stalls          (1 - restarts - recomputation) x (1 - u)
    ETTR            (1 - restarts - recomputation) x u            (0 when failures eat it all)

The checkpoint interval that maximises it is Young's: t_opt = sqrt(2 c M) (J. W. Young, "A
first order approximation to the optimum checkpoint interval", CACM 17(9), 1974; J. T. Daly,
"A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3),
2006, refines it for M not much larger than c).

The default failure rate is Llama 3's: 419 unexpected interruptions in 54 days of pre-training
on 16,384 GPUs (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4), assumed to scale
linearly with the GPU count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
DAY_S = 86400.0


def _check(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, not {value:g}")


def job_mtbf_s(gpus: int, *, interruptions: float = LLAMA3_INTERRUPTIONS,
               days: float = LLAMA3_DAYS, on_gpus: int = LLAMA3_GPUS) -> float:
    """The job's mean time between failures, from `interruptions` seen in `days` on `on_gpus`
    GPUs, scaled to `gpus`."""
    _check("GPUs", gpus, positive=True)
    _check("interruptions", interruptions, positive=True)
    _check("days", days, positive=True)
    _check("GPUs of the failure rate", on_gpus, positive=True)
    return days * DAY_S * on_gpus / (interruptions * gpus)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tier:
    """A checkpoint tier as measured: `every` steps, `blocked_s` and `durable_s` per
    checkpoint (both from the start of the save, lazarus.core.stall)."""
    every: int
    blocked_s: float
    durable_s: float

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"checkpoint interval must be a whole number of steps >= 1, "
                             f"not {self.every!r}")
        _check("blocked time per checkpoint", self.blocked_s)
        _check("durable time per checkpoint", self.durable_s)

    def exposed_s(self) -> float:
        """d: how long the checkpoint is not yet durable after the loop moved on."""
        return max(0.0, self.durable_s - self.blocked_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Ettr:
    ettr: float
    stalls: float         # the shares of wall time lost to each; they sum to 1 - ettr
    recomputation: float
    restarts: float
    mtbf_s: float
    optimal_every_s: float   # Young's interval for the tier restored from (compute seconds)
    optimal_every: int       # the same in steps (at least 1)


def young_interval_s(blocked_s: float, mtbf_s: float) -> float:
    """sqrt(2 c M): the compute time between checkpoints that loses least."""
    _check("blocked time per checkpoint", blocked_s)
    _check("MTBF", mtbf_s, positive=True)
    return math.sqrt(2 * blocked_s * mtbf_s)


def expected_ettr(*, step_s: float, tiers: list[Tier], restore_from: Tier, restart_s: float,
                  mtbf_s: float) -> Ettr:
    """ETTR of a run whose checkpoints are `tiers` and whose failures all restore from
    `restore_from` (one of them), each costing `restart_s` plus the work redone."""
    _check("step time", step_s, positive=True)
    _check("restart time per failure", restart_s)
    _check("MTBF", mtbf_s, positive=True)
    if restore_from not in tiers:
        raise ValueError("the tier restored from must be one of the run's tiers")
    useful = 1.0 / (1.0 + sum(t.blocked_s / (t.every * step_s) for t in tiers))
    period_compute_s = restore_from.every * step_s
    restarts = restart_s / mtbf_s
    recomputation = (period_compute_s / (2 * useful) + restore_from.exposed_s()) / mtbf_s
    left = 1.0 - restarts - recomputation
    if left <= 0:
        # A failure comes before a checkpoint period is done: nothing is ever kept.
        restarts, recomputation = (restarts / (restarts + recomputation),
                                   recomputation / (restarts + recomputation))
        left = 0.0
    optimal_s = young_interval_s(restore_from.blocked_s, mtbf_s)
    return Ettr(ettr=left * useful, stalls=left * (1.0 - useful), recomputation=recomputation,
                restarts=restarts, mtbf_s=mtbf_s, optimal_every_s=optimal_s,
                optimal_every=max(1, round(optimal_s / step_s)))
