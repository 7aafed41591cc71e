"""A model of one recovery of today's design at N ranks (8 a node): each part a law of N
with where its constants come from -- measured here (tests/bench/bench_round_scale.py,
tests/bench/bench_fleet.py, dated in docs/benchmarks.md) or published (cited). docs/scale.md
prints and reads its table; bench_round_scale.py prints it with the store's law measured in
the same run.

What today's design does on every recovery, survivors included: a new round of the whole
world, in which every rank connects to one new store hosted by one agent (its loop thread
serves every connect), and every rank rebuilds every process group (NCCL: one communicator
bootstrap per group) -- so the parts that grow are the store and the communicators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RANKS_PER_NODE = 8
LEASE_TTL_S = 5.0          # lazarus.core.settings.LEASE_TTL_S: a lost node is seen one TTL late

# Measured here (2026-11-29, tests/bench/bench_round_scale.py, 2 to 8 gloo ranks): the
# agent sees a rank's exit and its status reaches the daemon; flat in the world size.
DETECT_CRASH_S = 0.35
# Measured here: a survivor's handover (the agent hands it the next round's assignment over
# the worker channel) and its own restore from the objects it kept (docs/inplace.md).
HANDOVER_S = 0.05
RESTORE_IN_PLACE_S = 0.05
FIRST_STEP_S = 0.3         # the tiny model's step here; a real step is the job's own

# The daemon's decision, fault seen -> round committed, measured with the fleet simulator
# (docs/benchmarks.md, "The control plane at scale"): 0.14 / 0.20 / 0.45 s at 256 / 1,024 /
# 4,096 nodes; a line through the last two.
DECIDE = ((1024, 0.20), (4096, 0.45))

# Stock NCCL's communicator bootstrap and connection setup at 96K GPUs: ~265 s, growing
# super-linearly (NCCLX, Si et al., "Collective Communication for 100k+ GPUs", arXiv
# 2510.20171, 2025; the O(N^2) loops of ncclBuildRing and initTransportsRank: NVIDIA/nccl
# PR #1789, 26 s of CPU at 96K in ncclBuildRing alone). Modelled as c N^2 through that
# point, with a floor: a communicator's setup within a node and to its ring neighbours is
# not free at any size (ASSUMED 2 s: not measured here, no GPU; TrainMover, OSDI'26, reports
# a whole recovery in ~20 s at 1,024 GPUs, which bounds it from above). NCCLX cuts startup
# 11x with lazy, host-driven connection setup (same paper).
NCCL_AT = (98_304, 265.0)
NCCL_FLOOR_S = 2.0
# The 265 s is the job's NCCL initialization, its communicators together: counted once per
# round, though a round of the built-in trainer makes the world's, the mesh's dp and tp
# (trainer/parallelize.py build_mesh; split from the world's where NCCL can) and the
# checkpointer's gloo group (trainer/ckptsave.py; made on use since 2026-11-29: it connects
# the pairs its saves use, where made eagerly it was a full mesh on the host, N - 1 TCP
# connections a rank, which fd limits bind near 20,000 ranks). A rank of the built-in
# trainer connects to the store once a round, not twice (trainer/rankrun.py agent_store);
# the store's requests are still every rank's (the law below).
GROUPS = 1


@dataclass(frozen=True)
class Part:
    name: str
    seconds: float
    law: str
    source: str


@dataclass(frozen=True)
class Prediction:
    ranks: int
    kind: str
    parts: tuple[Part, ...]

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.parts)

    def dominant(self) -> Part:
        return max(self.parts, key=lambda p: p.seconds)


def fit_store(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """Least squares a + b N through (ranks, seconds) measured for the round's store."""
    n = len(points)
    if n == 1:
        (x, y), = points
        return lambda ranks: y * ranks / x
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = (sum((x - mx) * (y - my) for x, y in points)
         / max(1e-12, sum((x - mx) ** 2 for x, _ in points)))
    a = my - b * mx
    return lambda ranks: max(0.0, a + b * ranks)


def _decide(nodes: int) -> float:
    (n0, t0), (n1, t1) = DECIDE
    return t0 + (t1 - t0) * (nodes - n0) / (n1 - n0)


def _nccl(ranks: int) -> float:
    n, t = NCCL_AT
    return max(NCCL_FLOOR_S, t * (ranks / n) ** 2)


def predict(ranks: int, *, kind: str, store: Callable[[int], float]) -> Prediction:
    """A `kind` ("worker_crash" or "node_lost" with a warm spare) at `ranks`."""
    nodes = max(1, ranks // RANKS_PER_NODE)
    detect = (Part("detect", DETECT_CRASH_S, "flat", "measured here")
              if kind == "worker_crash" else
              Part("detect", LEASE_TTL_S + DETECT_CRASH_S, "lease TTL, flat",
                   "lazarus.core.settings.LEASE_TTL_S"))
    return Prediction(ranks, kind, (
        detect,
        Part("decide", _decide(nodes), "a + b nodes", "fleet simulator, 256-4,096 nodes"),
        Part("hand over", HANDOVER_S, "flat (one message a rank)", "measured here"),
        Part("rendezvous", store(ranks), "a + b ranks, one loop thread",
             "the round store's loop thread under N simulated ranks, measured here, no DNS"),
        Part("process groups", GROUPS * _nccl(ranks), "c ranks^2, 2 s floor",
             "NCCLX arXiv 2510.20171 (265 s at 96K); floor assumed"),
        Part("restore", RESTORE_IN_PLACE_S, "flat (kept objects)", "measured here"),
        Part("first step", FIRST_STEP_S, "the job's step", "measured here (tiny model)"),
    ))


def ettr(recovery_s: float, mtbf_s: float) -> float:
    """The share of time training when every failure costs `recovery_s` (work redone is
    none: in place from the kept step)."""
    return mtbf_s / (mtbf_s + recovery_s)


# Failures every ... at these sizes (Meta, "Revisiting Reliability in Large-Scale Machine
# Learning Research Clusters", HPCA'25: ~1.8 h at 16,384 GPUs, ~14 min at 131,072; the
# 1,024 figure scales the same rate).
MTBF_S = {1024: 16 * 1.8 * 3600, 16384: 1.8 * 3600, 131072: 14 * 60}


def table(store: Callable[[int], float]) -> str:
    rows = ["| part | 1,024 GPUs | 16,384 | 131,072 | law | source |", "|---|---|---|---|---|---|"]
    preds = {n: predict(n, kind="worker_crash", store=store) for n in MTBF_S}
    for i, part in enumerate(preds[1024].parts):
        cells = " | ".join(f"{preds[n].parts[i].seconds:.2f} s" for n in MTBF_S)
        rows.append(f"| {part.name} | {cells} | {part.law} | {part.source} |")
    rows.append("| **worker crash, total** | " + " | ".join(
        f"**{preds[n].total:.1f} s**" for n in MTBF_S) + " | | |")
    nodes = {n: predict(n, kind="node_lost", store=store) for n in MTBF_S}
    rows.append("| **node lost (warm spare), total** | " + " | ".join(
        f"**{nodes[n].total:.1f} s**" for n in MTBF_S) + " | | |")
    rows.append("| dominant part | " + " | ".join(preds[n].dominant().name for n in MTBF_S)
                + " | | |")
    rows.append("| ETTR at the published failure rate (crashes) | " + " | ".join(
        f"{100 * ettr(preds[n].total, MTBF_S[n]):.1f}%" for n in MTBF_S) + " | | |")
    return "\n".join(rows)
