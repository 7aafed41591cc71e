"""A model of one recovery of today's design at N ranks (8 a node): each part a law of N
with where its constants come from -- measured here (tests/bench/bench_round_scale.py,
tests/bench/bench_fleet.py, dated in docs/benchmarks.md) or published (cited). docs/scale.md
prints and reads its table; bench_round_scale.py prints it with the store's law measured in
the same run.

What today's design does on every recovery, survivors included: a new round of the whole
world, in which every rank connects to one new store hosted by one agent (its loop thread
serves every connect), and every rank rebuilds every process group (NCCL: one communicator
bootstrap per group) -- so the parts that grow are the store and the communicators.

`predict_replica` is the same for a job of replica groups (docs/replicas.md), where a failure
restarts only its replica and the others go on: what the live replicas wait, when the failed
one is back, and the GPU time lost between (docs/scale.md, "In replica mode").
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


# torch's ProcessGroupNCCL makes a communicator of more than TORCH_NCCL_RANKS_PER_ROOT (128)
# ranks with ncclCommInitRankScalable (NCCL 2.23+): every 128th rank puts a 128-byte unique id
# on the group's store, and every rank reads all ceil(N / 128) of them in one multi-get
# (torch 2.13: ProcessGroupNCCL.hpp TORCH_NCCL_RANKS_PER_ROOT, allgatherUniqueNCCLIDs) -- N
# ceil(N / 128) x 128 bytes out of the round store's one loop thread, a communicator: 17 GB at
# 131,072 ranks. Its loop thread under N simulated ranks doing just that, measured here
# (2026-11-30, tests/bench/storeload.py `ids`, no DNS in the path): (ranks, bytes it sent,
# busy seconds, the connects' included). The bench fits its own.
RANKS_PER_ROOT = 128
NCCL_ID_BYTES = 128
IDS_MEASURED = ((1024, 1 << 20, 0.06), (4096, 1 << 24, 0.33), (16384, 1 << 28, 1.92))


def id_bytes(ranks: int) -> int:
    """What the store sends for one communicator of `ranks` made by torch's scalable init."""
    return ranks * -(-ranks // RANKS_PER_ROOT) * NCCL_ID_BYTES if ranks > RANKS_PER_ROOT else 0


def fit_ids(points: list[tuple[int, int, float]]) -> Callable[[int], float]:
    """Least squares busy = a N + b bytes through (ranks, bytes, busy) measured; returns the
    bytes' part at N ranks (a rank's connect is the rendezvous's, counted there)."""
    nn = sum(n * n for n, _, _ in points)
    nb = sum(n * b for n, b, _ in points)
    bb = sum(b * b for _, b, _ in points)
    ny = sum(n * y for n, _, y in points)
    by = sum(b * y for _, b, y in points)
    det = nn * bb - nb * nb
    per_byte = (nn * by - nb * ny) / det if det else by / max(1, bb)
    return lambda ranks: max(0.0, per_byte) * id_bytes(ranks)


IDS = fit_ids(list(IDS_MEASURED))


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


def predict(ranks: int, *, kind: str, store: Callable[[int], float],
            ids: Callable[[int], float] = IDS) -> Prediction:
    """A `kind` ("worker_crash" or "node_lost" with a warm spare) at `ranks`; `ids`: the
    store's seconds for one communicator's unique ids at N ranks (`fit_ids`)."""
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
        Part("communicator ids", GROUPS * ids(ranks), "N ceil(N/128) x 128 B, one loop thread",
             "torch's scalable NCCL init (TORCH_NCCL_RANKS_PER_ROOT); the store's bytes "
             "measured here"),
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


def table(store: Callable[[int], float], ids: Callable[[int], float] = IDS) -> str:
    rows = ["| part | 1,024 GPUs | 16,384 | 131,072 | law | source |", "|---|---|---|---|---|---|"]
    preds = {n: predict(n, kind="worker_crash", store=store, ids=ids) for n in MTBF_S}
    for i, part in enumerate(preds[1024].parts):
        cells = " | ".join(f"{preds[n].parts[i].seconds:.2f} s" for n in MTBF_S)
        rows.append(f"| {part.name} | {cells} | {part.law} | {part.source} |")
    rows.append("| **worker crash, total** | " + " | ".join(
        f"**{preds[n].total:.1f} s**" for n in MTBF_S) + " | | |")
    nodes = {n: predict(n, kind="node_lost", store=store, ids=ids) for n in MTBF_S}
    rows.append("| **node lost (warm spare), total** | " + " | ".join(
        f"**{nodes[n].total:.1f} s**" for n in MTBF_S) + " | | |")
    rows.append("| dominant part | " + " | ".join(preds[n].dominant().name for n in MTBF_S)
                + " | | |")
    rows.append("| ETTR at the published failure rate (crashes) | " + " | ".join(
        f"{100 * ettr(preds[n].total, MTBF_S[n]):.1f}%" for n in MTBF_S) + " | | |")
    return "\n".join(rows)


# The round store's loop thread under N simulated ranks, measured here (2026-11-29,
# docs/scale.md; tests/bench/storeload.py, no DNS in the path): (ranks, busy seconds). The
# tables of docs/scale.md are printed with `fit_store(STORE_MEASURED)`; the bench fits its own.
STORE_MEASURED = ((1024, 0.16), (4096, 0.51), (16384, 3.34))
# What one simulated rank does there (tests/bench/storeload.py): connect, publish its address,
# count itself in, wait for the world, read its ring neighbours' addresses.
STORE_OPS = 5


# -- replica mode (docs/replicas.md; docs/scale.md, "In replica mode") ----------------------
#
# A failure restarts only its replica (replica_gpus ranks); the R - 1 others go on. Where the
# requests go, by the code: the built-in trainer's ranks make every group on the store of
# the first member's agent (daemon/rounds.py: store_host is members[0]'s; trainer/worker.py:
# the replica's world under lazarus/round/<round>/replica/<r>), and the quorum is on that
# same store (trainer/replicagroup.py: quorum_store). So one loop thread serves the
# restarted replica's rendezvous (its ranks only) and the per-step quorum of the R leaders.
# The rebuild of the cross-replica groups, whose publications are every live rank's, goes to
# the epoch's shard stores (SHARD_STORES below; until 2026-11-30 it was on that one store).

# Copied from the code, which imports torch (tests/unit/test_scalemodel.py checks they agree):
RETRY_GRACE_S = 0.5        # trainer/quorum.py: a retry waits this for the failed try's
QUORUM_WAIT_S = 5.0        # trainer/replicaloop.py: a replica leader silent this long is gone
SILENCE_CHECK_S = 0.5      # trainer/replicagroup.py: how often a rank in a long cross-replica
                           # collective looks for a member gone silent (it then leaves it)
# A silent member's collective fails once its leader's silence is seen: at most the wait
# plus one look, never the cross-replica group's own timeout (a minute).
REPLICA_SILENT_S = QUORUM_WAIT_S + SILENCE_CHECK_S
# The restarted replica's ranks are new processes (a replica's rank never survives in
# place): measured here, the restarted rank's start at 2 ranks (docs/scale.md, the first
# table: 0.47 s; 0.9-2.2 s at 4-8 ranks on 2 loaded cores). A real model's build and CUDA
# init are the job's own, as the first step is.
REPLICA_START_S = 0.47
# The quorum's decision (trainer/quorum.py): every leader says it arrived and counts itself
# in; the one whose count completes the members checks all their arrivals at once and
# decides; the first names itself the watcher; the others wait on the answer (the store wakes
# them) and read it, and the decider reads the floor of the keys let go: 4R + 3 requests on
# the one loop thread, each at the store's cost per request (STORE_OPS a rank in the
# measured law). The watcher looks at the missing members only after LOOK_S (in a step every
# member reaches, never) or a retry's grace. The R + 4 deletes of the step two back come
# after the answer, in the step's compute: off this path.
LOOK_S = 1.0               # trainer/quorum.py
# A cross-replica group rebuilt (ProcessGroupGloo made on use under a fresh prefix): a rank
# publishes its address and reads its ring neighbours' at the first collective, 3 requests,
# no connect -- ASSUMED 3 of the measured law's 5 operations a rank.
REBUILD_OPS = 3
# Where a rebuild's requests go (built 2026-11-30): not to the quorum's store but to the
# epoch's shard stores, which members[0]'s agent hosts (agent/ports.py host_shard_stores):
# one per shard, at most SHARD_STORES (lazarus.core.contract), shard s's groups on the
# (s mod K)-th, each store with a loop thread of its own (torch's TCPStore server). So K
# loop threads share the live ranks' rebuild, and the restarted replica's rendezvous, the
# quorum and the heartbeats no longer queue behind it. ASSUMED: the host runs the K threads
# in parallel (a GPU node has dozens of cores; its ranks wait meanwhile).
SHARD_STORES = 16
# The heal: rank s of a live replica sends its shard of the model and optimizer to rank s of
# the restarted one, all shards in parallel (ReplicaGroup.heal). ASSUMED at torchft's
# figure, issue 41's text: "12 GB of state fetched from a peer in 3 s", 4 GB/s a pair; not
# measured here at any size (the built path is torch.save to host memory and one gloo send).
HEAL_BYTES_PER_S = 12e9 / 3
# The state healed: ASSUMED a 405B-parameter model (Llama 3 405B, trained on 16,384 GPUs)
# at 16 bytes a parameter (bf16 weights, fp32 master weights and Adam's two fp32 moments),
# sharded over the replica's ranks.
STATE_BYTES = 405e9 * 16


@dataclass(frozen=True)
class ReplicaPrediction:
    """One failure of `kind` in a job of replica groups of `replica_gpus` ranks each.
    `stall`: what the live replicas wait from the fault to their next average (every GPU
    idle); `back`: the failed replica from the fault to its first step healed; `rejoin`:
    what the live replicas wait, beyond their step, in the step that takes it back in;
    `quorum_s`: the quorum's decision, every step of every replica (not a recovery's)."""
    ranks: int
    replica_gpus: int
    kind: str
    stall: Prediction
    back: Prediction
    rejoin: Prediction
    quorum_s: float

    @property
    def replicas(self) -> int:
        return self.ranks // self.replica_gpus

    @property
    def lost_s(self) -> float:
        """GPU time lost, in seconds of the whole job: every GPU for the stalls, the failed
        replica's share (1/R, "drop": its samples are left out) while it is away between."""
        away = max(0.0, self.back.total - self.stall.total)
        return self.stall.total + self.rejoin.total + away / self.replicas


def _per_request(store: Callable[[int], float]) -> float:
    n = STORE_MEASURED[-1][0]
    return store(n) / (n * STORE_OPS)


def quorum_requests(replicas: int) -> int:
    """The requests of one quorum's decision in a step every member reaches (above)."""
    return 4 * replicas + 3


def predict_replica(ranks: int, *, kind: str, store: Callable[[int], float],
                    replica_gpus: int, state_bytes: float = STATE_BYTES,
                    silent_seen_s: float = REPLICA_SILENT_S,
                    ids: Callable[[int], float] = IDS) -> ReplicaPrediction:
    """A `kind` ("worker_crash", or "node_lost": the node stops answering, its replica
    restarts on a warm spare) at `ranks`, in replicas of `replica_gpus`. `silent_seen_s`: when
    the live replicas' collective with a silent node fails -- by the code, once its leader's
    heartbeat has been silent QUORUM_WAIT_S (a process that dies, or a host whose kernel
    answers, resets the connection at once)."""
    if replica_gpus <= 0 or ranks % replica_gpus or ranks // replica_gpus < 2:
        raise ValueError(f"{ranks} ranks do not split into 2 or more replicas of "
                         f"{replica_gpus}")
    if kind not in ("worker_crash", "node_lost"):
        raise ValueError(f"kind {kind!r}: worker_crash or node_lost")
    r = ranks // replica_gpus
    nodes = max(1, ranks // RANKS_PER_NODE)
    per_req = _per_request(store)
    quorum_s = quorum_requests(r) * per_req

    shard_stores = min(SHARD_STORES, replica_gpus)

    def rebuild_store(n: int) -> float:
        # the busiest of the shard stores: ceil(shards / K) shards' groups of n / shards ranks,
        # each group's communicator ids too where it has more than 128 members
        groups = -(-replica_gpus // shard_stores)
        return (store(groups * (n // replica_gpus)) * REBUILD_OPS / STORE_OPS
                + groups * ids(n // replica_gpus))

    # The live replicas: the average of the step fails, every rank of each agrees on it, and
    # the step's next try asks the quorum, waiting the grace for the failed try's members.
    seen = (Part("the failed average", 0.0, "flat: a reset connection fails it at once",
                 "measured here: the step in which a replica died 0.21 s, median 0.33 s "
                 "(docs/replicas.md)")
            if kind == "worker_crash" else
            Part("the failed average", silent_seen_s, "the leader's silence, then a look",
                 "trainer/replicagroup.py _finished (a silent host resets nothing): 3.7 s "
                 "with a 3 s wait, measured here (tests/integration/test_replica_groups.py)"))
    retry = Part("the retry's quorum", RETRY_GRACE_S + quorum_s,
                 "grace + 4R + 3 requests, one loop thread",
                 "trainer/quorum.py RETRY_GRACE_S; the store's cost a request, measured")
    left = ranks - replica_gpus
    stall = Prediction(ranks, kind, (
        seen, retry,
        Part("cross-replica groups, rendezvous", rebuild_store(left),
             f"a + b live ranks / K, K = {shard_stores} shard stores",
             f"the store's law, {REBUILD_OPS} of {STORE_OPS} operations a rank (assumed); "
             f"their loop threads in parallel (assumed)"),
        Part("cross-replica groups, communicators", _nccl(r), "c R^2, 2 s floor",
             "NCCLX arXiv 2510.20171; floor assumed; gloo today"),
    ))
    # The quorum's store, first come first served: the retry's quorum, then the restarted
    # replica's rendezvous (the live ranks' rebuild is on the shard stores).
    store_free = seen.seconds + RETRY_GRACE_S + quorum_s

    detect = (Part("detect", DETECT_CRASH_S, "flat", "measured here")
              if kind == "worker_crash" else
              Part("detect", LEASE_TTL_S + DETECT_CRASH_S, "lease TTL, flat",
                   "lazarus.core.settings.LEASE_TTL_S"))
    decide = Part("decide", _decide(nodes), "a + b nodes (the job's)",
                  "fleet simulator, 256-4,096 nodes")
    start = Part("start", REPLICA_START_S, "flat (the replica's ranks start anew)",
                 "measured here (a restarted rank, tiny model)")
    arrive = detect.seconds + decide.seconds + start.seconds
    rdv = max(arrive, store_free) + store(replica_gpus) + ids(replica_gpus) - arrive
    own = _nccl(replica_gpus)
    ready = arrive + rdv + own
    # Let in at the live replicas' next quorum: they are back at their steps at stall.total,
    # one quorum and one step apart.
    period = FIRST_STEP_S + quorum_s
    live = stall.total
    let_in = live if ready <= live else live + period * -(-(ready - live) // period)
    heal_rdv = rebuild_store(ranks)
    heal_groups = _nccl(r)
    transfer = state_bytes / replica_gpus / HEAL_BYTES_PER_S
    back = Prediction(replica_gpus, kind, (
        detect, decide, start,
        Part("rendezvous", rdv, "a + b replica ranks, after the retry's quorum",
             "the round store's law, measured here; one loop thread with the quorum's"),
        Part("process groups", own, "c (N/R)^2, 2 s floor",
             "NCCLX arXiv 2510.20171 (265 s at 96K); floor assumed"),
        Part("wait to be let in", let_in - ready + quorum_s,
             "the live replicas' next quorum", "trainer/quorum.py join"),
        Part("cross-replica groups, again", heal_rdv + heal_groups,
             "a + b ranks (all N) / K + c R^2", "as above"),
        Part("heal", transfer, "state / replica ranks / bandwidth",
             "torchft's 12 GB in 3 s (issue 41), 405B x 16 B assumed"),
        Part("first step", FIRST_STEP_S, "the job's step", "measured here (tiny model)"),
    ))
    rejoin = Prediction(ranks, kind, (
        Part("cross-replica groups, again", heal_rdv + heal_groups,
             "a + b ranks (all N) / K + c R^2", "as above"),
        Part("heal", transfer, "the source sends before its step; the others wait in the "
             "average", "as above"),
    ))
    return ReplicaPrediction(ranks, replica_gpus, kind, stall, back, rejoin, quorum_s)


def replica_ettr(p: ReplicaPrediction, mtbf_s: float) -> float:
    """The share of GPU time training when every failure is `p`."""
    return ettr(p.lost_s, mtbf_s)


def _cells(preds: dict, cell: Callable[[ReplicaPrediction], str]) -> str:
    return " | ".join("-" if preds[n] is None else cell(preds[n]) for n in MTBF_S)


def replica_table(store: Callable[[int], float], replica_gpus: int,
                  ids: Callable[[int], float] = IDS) -> str:
    """The table of docs/scale.md, "In replica mode", at 1,024 / 16,384 / 131,072 GPUs."""
    def at(kind: str) -> dict:
        return {n: (predict_replica(n, kind=kind, store=store, replica_gpus=replica_gpus,
                                    ids=ids)
                    if n // replica_gpus >= 2 and n % replica_gpus == 0 else None)
                for n in MTBF_S}

    crash, node = at("worker_crash"), at("node_lost")
    whole = {n: predict(n, kind="worker_crash", store=store, ids=ids) for n in MTBF_S}
    some = next(p for p in crash.values() if p is not None)
    rows = [f"| part ({replica_gpus} GPUs a replica) | 1,024 GPUs | 16,384 | 131,072 | law | "
            "source |", "|---|---|---|---|---|---|",
            "| replicas | " + _cells(crash, lambda p: f"{p.replicas}") + " | | |"]

    def section(title: str, which: str, total: str) -> None:
        rows.append(f"| *{title}* | | | | | |")
        for i, part in enumerate(getattr(some, which).parts):
            rows.append(f"| {part.name} | "
                        + _cells(crash, lambda p: f"{getattr(p, which).parts[i].seconds:.2f} s")
                        + f" | {part.law} | {part.source} |")
        rows.append(f"| **{total}, worker crash** | "
                    + _cells(crash, lambda p: f"**{getattr(p, which).total:.1f} s**") + " | | |")
        rows.append(f"| **{total}, node lost (silent; warm spare)** | "
                    + _cells(node, lambda p: f"**{getattr(p, which).total:.1f} s**")
                    + " | | |")
        rows.append("| dominant part (crash) | "
                    + _cells(crash, lambda p: getattr(p, which).dominant().name) + " | | |")

    section("the live replicas, from the fault: every GPU waits", "stall",
            "the live replicas train again")
    section("the failed replica, from the fault", "back", "the failed replica back")
    section("the live replicas, in the step that lets it back in", "rejoin",
            "their wait in that step")
    rows.append("| the quorum's decision, every step (not in the totals above it) | "
                + _cells(crash, lambda p: f"{p.quorum_s:.3f} s")
                + " | 4R + 3 requests, one loop thread | trainer/quorum.py ask |")
    rows.append("| GPU time lost a failure, crash / node | "
                + " | ".join("-" if crash[n] is None else
                             f"{crash[n].lost_s:.1f} / {node[n].lost_s:.1f} s" for n in MTBF_S)
                + " | stalls + the failed replica's 1/R while away | |")
    rows.append("| ETTR at the published failure rate (crashes) | "
                + " | ".join("-" if crash[n] is None else
                             f"{100 * replica_ettr(crash[n], MTBF_S[n]):.1f}%" for n in MTBF_S)
                + " | | whole world: " + ", ".join(
                    f"{100 * ettr(whole[n].total, m):.1f}%" for n, m in MTBF_S.items()) + " |")
    return "\n".join(rows)


def replica_sizes_table(store: Callable[[int], float], ranks: int = 131072,
                        sizes: tuple[int, ...] = (128, 512, 2048, 8192),
                        ids: Callable[[int], float] = IDS) -> str:
    """What the replica's size trades at `ranks` GPUs (a worker crash): fewer, bigger
    replicas cost a quorum of fewer leaders and a smaller heal a rank, but a bigger world of
    communicators to rebuild for the failed one."""
    rows = [f"| GPUs a replica, at {ranks:,} | replicas | the quorum, every step | live "
            "replicas train again | failed replica back | of it, heal | GPU time lost | ETTR |",
            "|---|---|---|---|---|---|---|---|"]
    for g in sizes:
        p = predict_replica(ranks, kind="worker_crash", store=store, replica_gpus=g, ids=ids)
        heal = next(x for x in p.back.parts if x.name == "heal")
        rows.append(f"| {g:,} | {p.replicas:,} | {p.quorum_s:.2f} s | {p.stall.total:.1f} s | "
                    f"{p.back.total:.1f} s | {heal.seconds:.1f} s | {p.lost_s:.1f} s | "
                    f"{100 * replica_ettr(p, MTBF_S[ranks]):.1f}% |")
    return "\n".join(rows)
