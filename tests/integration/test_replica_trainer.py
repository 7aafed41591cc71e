"""The built-in trainer in replica mode (docs/replicas.md): four real worker ranks
(`worker.run`, as an agent launches them, without one: no report socket), two replicas of
two ranks each, the tiny model on gloo. A rank of replica 1 is SIGKILLed: its partner marks
the replica left and exits as a lost peer's, replica 0 trains on alone at once; replica 1's
ranks are launched again in a later round of the same replica epoch, as the daemon's replica
round launches them, heal from replica 0 at a step boundary, and both replicas end with the
same parameters, bit for bit.

The test process plays members[0]'s agent: it hosts the store each replica's world and the
quorum live on, and it launches the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lazarus.agent.ports import host_shard_stores
from lazarus.core import exitcodes
from lazarus.core.trainconfig import DataConfig, OptimizerConfig, ParallelConfig, TrainConfig
from lazarus.trainer.data import ensure_corpus
from lazarus.trainer.replicagroup import quorum_prefix
from tests.forkedranks import _entry, _ranks_context
from tests.integration.test_replica_groups import _wait

JOB, EPOCH = "rjob", 1
REPLICAS, PER = 2, 2
STEPS = 40
OUT_ENV = "REPLICA_TEST_OUT"
PORT_ENV = "REPLICA_TEST_PORT"


def _rank_main(ident: int, rank: int, round_: int, port: int, out: str, train: dict) -> None:
    from lazarus.core.contract import WorkerAssignment
    from lazarus.trainer import replicaloop, worker
    from lazarus.trainer.hooks import HOOKS_ENV

    # the rank's log, as an agent keeps one per rank and round
    log = os.open(Path(out, f"log-{rank}-{round_}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                  0o600)
    os.dup2(log, 1)
    sys.stdout = open(1, "w", closefd=False)
    os.environ.update({HOOKS_ENV: f"{__name__}:_attach", OUT_ENV: out, PORT_ENV: str(port)})
    run = replicaloop.ReplicaRound.run

    def run_then_keep(rnd, snapshot_dir):
        # The model as the run left it, read once it is over.
        run(rnd, snapshot_dir)
        torch.save([p.to_local().detach().clone() for p in rnd.model.parameters()],
                   Path(out, f"final-{rank}.pt"))

    replicaloop.ReplicaRound.run = run_then_keep
    a = WorkerAssignment(rank=rank, world_size=REPLICAS * PER, local_rank=rank % PER,
                         round=round_, store_host="127.0.0.1", store_port=port, train=train,
                         job_id=JOB, replicas=REPLICAS, replica_epoch=EPOCH)
    assert worker.run(a) == 0


def _attach(hooks) -> None:
    """Each rank's steps, as it computes them; and the test's hold on the healthy replica
    while the other restarts (the run's length is fixed: on a busy machine the restart may
    take longer than the rest of the run)."""
    out, port = Path(os.environ[OUT_ENV]), int(os.environ[PORT_ENV])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)

    def hook(phase, ctx) -> None:
        if phase != "optimizer":
            return
        job_rank = ctx.loader.dp_rank  # dp x 1: the loader's share is the rank's place
        with open(out / f"steps-{job_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": ctx.step, "t": time.time(), "pid": os.getpid()}) + "\n")
        while store.check(["hold"]) and not store.check(["release"]):
            time.sleep(0.05)

    hooks.add(hook)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_replica_of_the_builtin_trainer_heals_from_the_other(tmp_path):
    ensure_corpus()  # built once here rather than raced by every rank
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    quorum = dist.PrefixStore(quorum_prefix(JOB, EPOCH), store)
    # as members[0]'s agent hosts them: a store per shard for the cross-replica groups
    shard_stores = host_shard_stores("127.0.0.1", store, job_id=JOB, epoch=EPOCH, shards=PER)
    metrics = tmp_path / "metrics.jsonl"
    train = TrainConfig(steps=STEPS, seed=3, metrics=str(metrics),
                        parallelism=ParallelConfig(dp=PER),
                        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
                        data=DataConfig(seq_len=32, global_batch=8)).to_dict()
    ctx = _ranks_context()
    env = {"OMP_NUM_THREADS": "1"}

    def launch(rank: int, round_: int):
        p = ctx.Process(target=_entry, args=(env, f"{__name__}:_rank_main", 10 * round_ + rank,
                                             str(tmp_path), (rank, round_, store.port,
                                                             str(tmp_path), train)))
        p.start()
        return p

    began = time.time()
    procs = {r: launch(r, EPOCH) for r in range(REPLICAS * PER)}
    steps = lambda: [r for r in _rows(metrics) if "step" in r and "kind" not in r]  # noqa: E731
    try:
        _wait("both replicas to train together",
              lambda: sum(r["replicas_in_step"] == 2 for r in steps()) >= 3)
        procs[3].kill()  # replica 1's second rank
        killed = time.time()
        # Its partner exits by itself, as a lost peer's, having told the quorum.
        procs[2].join(120)
        assert procs[2].exitcode == exitcodes.PEER_LOST, (
            procs[2].exitcode, (tmp_path / "stderr-12.txt").read_text()[-3000:])
        _wait("replica 0 to step alone",
              lambda: sum(r["replicas_in_step"] == 1 for r in steps()) >= 2)
        store.set("hold", "1")
        restarted = time.time()
        # The daemon's replica round: round 2 of the same epoch, replica 1's ranks only.
        procs[2], procs[3] = launch(2, 2), launch(3, 2)
        _wait("replica 1 to ask back in", lambda: quorum.check(["join/1"]))
        asked = time.time()
        store.set("release", "1")
        for rank, p in procs.items():
            p.join(240)
            assert p.exitcode == 0, f"rank {rank} exited {p.exitcode}: " + "".join(
                f.read_text()[-3000:] for f in tmp_path.glob("error-*.txt"))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()

    rows = steps()
    # Replica 0 lost no step: every step once, in order; with both, then alone, then both.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    counts = [r["replicas_in_step"] for r in rows]
    first_alone, last_alone = counts.index(1), len(counts) - 1 - counts[::-1].index(1)
    assert set(counts[:first_alone]) == {2} and set(counts[first_alone:last_alone + 1]) == {1}
    assert set(counts[last_alone + 1:]) == {2} and last_alone + 1 < STEPS
    assert {r["replica_policy"] for r in rows} == {"drop"}
    # when each step's members were known, inside the step (the bench dates a rejoin by it)
    assert all(0 <= r["quorum_s"] <= r["step_time_s"] for r in rows), rows
    healed_at = last_alone + 2  # the step number of the first step after the last alone
    for rank in range(REPLICAS * PER):
        done = _rows(tmp_path / f"steps-{rank}.jsonl")
        if rank >= PER:  # replica 1: its restart computed from the healed step on, each once
            pid = done[-1]["pid"]
            assert [d["step"] for d in done if d["pid"] == pid] == list(range(healed_at,
                                                                              STEPS + 1))
        else:
            assert [d["step"] for d in done] == list(range(1, STEPS + 1))
    for local in range(PER):
        a = torch.load(tmp_path / f"final-{local}.pt", weights_only=True)
        b = torch.load(tmp_path / f"final-{PER + local}.pt", weights_only=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    log0 = (tmp_path / f"log-0-{EPOCH}.txt").read_text()
    assert " | replicas 1/2" in log0
    assert f"replica 1: healed from replica 0 at step {healed_at - 1}" in (
        tmp_path / "log-2-2.txt").read_text()
    assert rows[-1]["loss"] < rows[0]["loss"]
    # Each shard's cross-replica groups rendezvoused on a store of their own (which holds
    # nothing else), built there at the start, the loss and the return.
    assert len(shard_stores) == PER
    assert all(s.num_keys() >= 3 for s in shard_stores), [s.num_keys() for s in shard_stores]
    print(_figures(rows, tmp_path, began=began, killed=killed, restarted=restarted,
                   asked=asked, healed_at=healed_at))


def _figures(rows: list[dict], out: Path, *, began: float, killed: float, restarted: float,
             asked: float, healed_at: int) -> str:
    """What the run measured (`pytest -s` shows it): step times are the metrics rows'."""
    both = sorted(r["step_time_s"] for r in rows[1:] if r["replicas_in_step"] == 2)
    alone = [r["step_time_s"] for r in rows if r["replicas_in_step"] == 1]
    # the last step alone is the one the test held until replica 1 asked back in
    rest = sorted(alone[1:-1]) or [float("nan")]
    a = _rows(out / "steps-0.jsonl")
    first_alone = next(x["t"] for x, r in zip(a, rows) if r["replicas_in_step"] == 1)
    healed = next(x["t"] for x in _rows(out / "steps-2.jsonl") if x["step"] == healed_at)
    return (f"replica trainer: step median {both[len(both) // 2]:.2f} s with both, first step "
            f"alone {alone[0]:.2f} s, then {rest[len(rest) // 2]:.2f} s; {len(alone)} steps "
            f"alone (the last held while replica 1 restarted); timeline: first step "
            f"+{a[0]['t'] - began:.1f} s, kill -> replica 0's first step alone done "
            f"{first_alone - killed:.1f} s, replica 1 launched -> asked back in "
            f"{asked - restarted:.1f} s -> released -> its first step (healed) done "
            f"{healed - asked:.2f} s")
