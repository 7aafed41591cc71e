"""Checkpoints of the built-in trainer in replica mode (docs/replicas.md, "Checkpoints"): four
real worker ranks (`worker.run`, as an agent launches them, without one), two replicas of two
ranks each, the tiny model on gloo, a checkpoint dir on local disk.

At each checkpoint step only the lowest replica of the step's quorum saves (DCP inside its
own world), with the manifest of the whole-world mode. The run is then lost whole (every rank
SIGKILLed: a whole-world failure), and a whole-world round -- a new replica epoch, every
replica told to restore the newest committed checkpoint, as the daemon's round would name it
-- resumes both replicas from it; its losses are the uninterrupted run's. In that round
replica 0 is lost, so replica 1, the lowest left, takes the last save.

The test process plays members[0]'s agent: it hosts the store every replica's world and the
quorum live on, and it launches the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from lazarus.agent.ports import host_shard_stores
from lazarus.core import exitcodes
from lazarus.core.trainconfig import (CheckpointConfig, DataConfig, OptimizerConfig,
                                      ParallelConfig, TrainConfig)
from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint
from lazarus.trainer.data import ensure_corpus
from tests.forkedranks import _entry, _ranks_context
from tests.integration.test_replica_groups import _wait
from tests.integration.test_replica_trainer import _rows

JOB = "rckpt"
REPLICAS, PER = 2, 2
STEPS, EVERY = 12, 4
# The loss of a resumed run against the uninterrupted one's, step by step: the tolerance
# docs/replicas.md gives this mode ("drop" policy, 5%).
TOLERANCE = 0.05
OUT_ENV = "REPLICA_CKPT_OUT"
PORT_ENV = "REPLICA_CKPT_PORT"


def _rank_main(ident: int, rank: int, round_: int, port: int, out: str, train: dict,
               restore: str | None, restore_step: int) -> None:
    from lazarus.core.contract import WorkerAssignment
    from lazarus.trainer import worker
    from lazarus.trainer.hooks import HOOKS_ENV

    log = os.open(Path(out, f"log-{rank}-{round_}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                  0o600)
    os.dup2(log, 1)
    sys.stdout = open(1, "w", closefd=False)
    os.environ.update({HOOKS_ENV: f"{__name__}:_attach", OUT_ENV: out, PORT_ENV: str(port)})
    # Each round a whole-world start of the replicas: its own epoch, nobody joining.
    a = WorkerAssignment(rank=rank, world_size=REPLICAS * PER, local_rank=rank % PER,
                         round=round_, store_host="127.0.0.1", store_port=port, train=train,
                         job_id=JOB, replicas=REPLICAS, replica_epoch=round_,
                         restore=restore, restore_step=restore_step)
    code = worker.run(a)
    assert code == 0, code


def _attach(hooks) -> None:
    """Each rank's steps and saves, as it does them; and the test's hold on every rank at the
    step `hold/<round>` names, until `release/<round>`."""
    out, port = Path(os.environ[OUT_ENV]), int(os.environ[PORT_ENV])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    round_ = int(os.environ.get("LAZARUS_TEST_ROUND", "0"))

    def hook(phase, ctx) -> None:
        job_rank = ctx.loader.dp_rank  # dp x 1: the loader's share is the rank's place
        if phase == "checkpoint":
            with open(out / "saves.jsonl", "a") as f:
                f.write(json.dumps({"step": ctx.step, "rank": job_rank,
                                    "replica": job_rank // PER, "round": round_}) + "\n")
        if phase != "optimizer":
            return
        hold, release = f"hold/{round_}", f"release/{round_}"
        if store.check([hold]) and ctx.step == int(store.get(hold)):
            while not store.check([release]):
                time.sleep(0.05)

    hooks.add(hook)


def _steps(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _rows(path) if "step" in r and "kind" not in r}


def test_one_replica_saves_and_a_whole_world_restart_resumes_every_replica(tmp_path):
    ensure_corpus()  # built once here rather than raced by every rank
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = tmp_path / "ckpt"
    ctx = _ranks_context()

    def train(round_: int) -> dict:
        return TrainConfig(steps=STEPS, seed=3, metrics=str(tmp_path / f"metrics-{round_}.jsonl"),
                           parallelism=ParallelConfig(dp=PER),
                           optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
                           data=DataConfig(seq_len=32, global_batch=8),
                           checkpoint=CheckpointConfig(dir=str(root), every=EVERY)).to_dict()

    shard_stores = {}

    def launch(round_: int, restore: str | None = None, restore_step: int = 0) -> dict:
        env = {"OMP_NUM_THREADS": "1", "LAZARUS_TEST_ROUND": str(round_)}
        # as members[0]'s agent hosts them for the epoch (each round here is an epoch)
        shard_stores[round_] = host_shard_stores("127.0.0.1", store, job_id=JOB, epoch=round_,
                                                 shards=PER)
        procs = {}
        for rank in range(REPLICAS * PER):
            procs[rank] = ctx.Process(target=_entry, args=(
                env, f"{__name__}:_rank_main", 10 * round_ + rank, str(tmp_path),
                (rank, round_, store.port, str(tmp_path), train(round_), restore, restore_step)))
            procs[rank].start()
        return procs

    def committed() -> list[int]:
        return [m["step"] for _, m in committed_checkpoints(root)]

    def errors() -> str:
        return "".join(f.read_text()[-3000:] for f in tmp_path.glob("error-*.txt"))

    began = time.time()
    # Round 1: held in step 8 (before its save), once step 4's save is committed: then lost
    # whole, as when the first member's node goes.
    store.set("hold/1", "8")
    procs = launch(1)
    try:
        _wait("step 4's checkpoint", lambda: 4 in committed() or errors())
        _wait("round 1 to reach step 8", lambda: 7 in _steps(tmp_path / "metrics-1.jsonl")
              or errors())
        assert not errors(), errors()
        for p in procs.values():
            p.kill()
        for p in procs.values():
            p.join(60)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    lost = time.time()
    assert committed() == [4]
    newest = latest_checkpoint(root)

    # Round 2: the whole-world round, every replica restoring the newest save; held in step
    # 10 once step 8 is saved, when replica 0 loses a rank.
    store.set("hold/2", "10")
    procs = launch(2, restore=str(newest), restore_step=4)
    try:
        _wait("step 8's checkpoint", lambda: 8 in committed() or errors())
        _wait("round 2 to reach step 10", lambda: 9 in _steps(tmp_path / "metrics-2.jsonl")
              or errors())
        assert not errors(), errors()
        procs[1].kill()
        killed = time.time()
        store.set("release/2", "1")
        procs[0].join(120)
        assert procs[0].exitcode == exitcodes.PEER_LOST, (
            procs[0].exitcode, (tmp_path / "stderr-20.txt").read_text()[-3000:])
        for rank in (2, 3):
            procs[rank].join(240)
            assert procs[rank].exitcode == 0, f"rank {rank} exited {procs[rank].exitcode}: " + \
                errors()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    done = time.time()

    # Who saved: the lowest replica of each save step's quorum, all its ranks, nobody else.
    saves: dict[int, set[int]] = {}
    for s in _rows(tmp_path / "saves.jsonl"):
        saves.setdefault(s["step"], set()).add(s["rank"])
    assert saves == {4: {0, 1}, 8: {0, 1}, 12: {2, 3}}, saves
    # What was committed: one checkpoint a save step, named for the job and the step, of one
    # replica's world.
    manifests = committed_checkpoints(root)
    assert [m["step"] for _, m in manifests] == [4, 8, 12]
    for path, m in manifests:
        assert (m["job_id"], path.name, m["world_size"]) == (JOB, f"step-{m['step']:08d}", PER)
        assert m["extra"]["step"] == m["step"]

    # Round 2 resumed every replica from storage at step 4 ...
    for rank in (0, 2):  # each replica's rank 0
        log = (tmp_path / f"log-{rank}-2.txt").read_text()
        assert f"resumed from {newest} at step 4" in log, log[-2000:]
    start = next(r for r in _rows(tmp_path / "metrics-2.jsonl") if r.get("kind") == "start")
    assert (start["from"], start["step"]) == ("storage", 4)
    # ... and its loss goes on as the uninterrupted run's did (round 1's steps 5-7).
    before, after = _steps(tmp_path / "metrics-1.jsonl"), _steps(tmp_path / "metrics-2.jsonl")
    assert min(after) == 5
    overlap = [s for s in (5, 6, 7) if s in before]
    assert overlap == [5, 6, 7]
    diffs = [abs(after[s]["loss"] - before[s]["loss"]) / before[s]["loss"] for s in overlap]
    assert max(diffs) <= TOLERANCE, list(zip(overlap, diffs))
    # The tolerance tells a resumed run from a fresh one: the first steps differ by more.
    assert abs(before[5]["loss"] - before[1]["loss"]) / before[1]["loss"] > TOLERANCE
    print(f"replica checkpoints: saves {dict(sorted((k, sorted(v)) for k, v in saves.items()))};"
          f" resumed loss vs uninterrupted at steps {overlap}: "
          f"{', '.join(f'{d:.2e}' for d in diffs)} relative (bit-equal: "
          f"{all(after[s]['loss'] == before[s]['loss'] for s in overlap)}); round 1 "
          f"{lost - began:.1f} s, round 2 {done - lost:.1f} s (replica 0's rank killed "
          f"+{killed - lost:.1f} s)")
