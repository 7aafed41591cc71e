"""Replica groups on real gloo processes (docs/replicas.md): two replicas of the tiny model,
each sharded with FSDP2 over its own two ranks, average their gradients across replicas.
Replica B's ranks are SIGSTOPped -- a node that stops answering: no connection resets, no
heartbeat, nobody says it left -- and replica A trains on alone from the step it was at, a
few seconds later, not after the cross-replica collective's timeout (ten minutes here). B's
ranks are then killed and restarted, as its agent would; they fetch the current state from
A's matching ranks and rejoin at a step boundary, and the two replicas end with the same
parameters.

The test process plays the supervisor: it hosts the store (the quorum's and each replica's
world's) and restarts the broken replica, as an agent would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.models import get_model_config
from lazarus.trainer.optim import build_optimizer
from tests.forkedranks import _entry, _ranks_context

SEED, LR, SEQ, GLOBAL_BATCH = 3, 3e-3, 32, 8
REPLICAS, RANKS = 2, 2
WAIT_S = 3.0  # a replica's leader silent this long is gone
JOB = "replicas"  # the quorum's namespace: the job's and its replicas' epoch's
MAX_STEPS = 400  # a bound for a run the test lost control of; the test sets the real end
# Longer than the test waits: a live replica that waited out its collective with a silent
# one would fail the test, not pass it late.
COLLECTIVE_TIMEOUT_S = 600.0


def _rank_main(ident: int, replica: int, local_rank: int, incarnation: int, port: int,
               out: str) -> None:
    from torch.distributed.tensor import DTensor

    from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model
    from lazarus.trainer.replicagroup import ReplicaGroup, quorum_store
    from lazarus.trainer.replicastep import replica_step

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    # this replica's own world: its FSDP collectives never involve another replica
    world = dist.PrefixStore(f"world/{replica}/{incarnation}/", store)
    dist.init_process_group("gloo", store=world, rank=local_rank, world_size=RANKS)
    mesh = build_mesh("cpu", dp=RANKS, tp=1)
    model = build_model(get_model_config("tiny"), mesh, ParallelConfig(dp=RANKS, tp=1), seed=SEED)
    optimizer = build_optimizer(model, lr=LR)
    # Replica r reads share r of every global batch ("drop": a missing replica's share is
    # left out of the step).
    loader = SequenceLoader(TokenDataset(ensure_corpus(), SEQ), seed=SEED,
                            global_batch=GLOBAL_BATCH, dp_rank=replica * RANKS + local_rank,
                            dp_size=REPLICAS * RANKS, micro_batch=1)
    read = [0]  # steps the loader has moved past

    def batches(step: int):
        loader.skip(step - read[0])
        read[0] = step + 1
        return loader.next_step()

    rg = ReplicaGroup(lambda: quorum_store("127.0.0.1", port, JOB, 1), replica=replica,
                      replicas=REPLICAS, wait_s=WAIT_S, timeout_s=COLLECTIVE_TIMEOUT_S)
    log = open(Path(out, f"steps-{replica}-{local_rank}.jsonl"), "a")
    log.write(json.dumps({"started": time.time(), "incarnation": incarnation}) + "\n")
    step = 0
    while step < MAX_STEPS:
        if store.check(["stop_at"]) and step >= int(store.get("stop_at")):
            break
        t = time.time()
        r = replica_step(rg, model, optimizer, step, batches, grad_clip=1.0)
        log.write(json.dumps({"step": r.step, "members": list(r.members), "attempt": r.attempt,
                              "loss": r.loss, "healed": r.healed, "t": time.time(),
                              "took": time.time() - t}) + "\n")
        log.flush()
        step = r.step + 1
    torch.save([(p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                for p in model.parameters()], Path(out, f"final-{replica}-{local_rank}.pt"))
    dist.destroy_process_group()


def _steps(out: Path, replica: int, local_rank: int) -> list[dict]:
    path = out / f"steps-{replica}-{local_rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, cond, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_replica_trains_on_while_the_other_heals_from_it(tmp_path):
    ensure_corpus()  # built once here rather than raced by every rank
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _ranks_context()
    env = {"OMP_NUM_THREADS": "1"}

    def start(replica: int, local_rank: int, incarnation: int):
        ident = 100 * incarnation + 10 * replica + local_rank
        p = ctx.Process(target=_entry, args=(env, f"{__name__}:_rank_main", ident, str(tmp_path),
                                             (replica, local_rank, incarnation, store.port,
                                              str(tmp_path))))
        p.start()
        return p

    began = time.time()
    procs = {(r, s): start(r, s, 0) for r in range(REPLICAS) for s in range(RANKS)}
    try:
        a_steps = lambda: [x for x in _steps(tmp_path, 0, 0) if "step" in x]  # noqa: E731
        _wait("both replicas to train together", lambda: sum(
            x["members"] == [0, 1] for x in a_steps()) >= 3)
        for s in range(RANKS):
            os.kill(procs[(1, s)].pid, signal.SIGSTOP)
        killed, killed_at = time.time(), len(a_steps())
        # A goes on alone once B's leader has been silent WAIT_S: its steps continue with
        # replica B out of the quorum.
        _wait("replica A to step alone", lambda: sum(x["members"] == [0] for x in a_steps()) >= 2,
              timeout_s=COLLECTIVE_TIMEOUT_S / 3)
        # The broken replica is stopped for good, as its agent would stop it.
        for s in range(RANKS):
            procs[(1, s)].kill()
            procs[(1, s)].join()
        restarted = time.time()
        for s in range(RANKS):
            procs[(1, s)] = start(1, s, 1)
        _wait("replica B to rejoin", lambda: any(
            x.get("members") == [0, 1] for x in a_steps()[killed_at:]))
        # Finish a few steps after the rejoin, at a step no rank has reached yet (they move in
        # lockstep, so a margin of a few steps is plenty).
        store.set("stop_at", str(len(a_steps()) + 3))
        for key, p in procs.items():
            p.join(240)
            assert p.exitcode == 0, f"rank {key} exited {p.exitcode}: " + "".join(
                f.read_text()[-2000:] for f in tmp_path.glob("error-1*.txt"))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()

    for s in range(RANKS):
        a = [x for x in _steps(tmp_path, 0, s) if "step" in x]
        # A lost no step: every step once, in order, on both of its ranks.
        assert [x["step"] for x in a] == list(range(len(a)))
        alone = [x["step"] for x in a if x["members"] == [0]]
        assert len(alone) >= 2, alone
        b = _steps(tmp_path, 1, s)
        [healed] = [x["step"] for x in b if x.get("healed")]
        # B came back at the step boundary right after A's last step alone
        assert healed == max(alone) + 1 and min(alone) > killed_at - 2
        assert a[healed]["members"] == [0, 1]
        b_after = [x["step"] for x in b if "step" in x and x["step"] >= healed]
        assert b_after == list(range(healed, a[-1]["step"] + 1))
        final_a = torch.load(tmp_path / f"final-0-{s}.pt", weights_only=True)
        final_b = torch.load(tmp_path / f"final-1-{s}.pt", weights_only=True)
        assert all(torch.equal(x, y) for x, y in zip(final_a, final_b, strict=True))
    losses = [x["loss"] for x in _steps(tmp_path, 0, 0) if "step" in x]
    assert losses[-1] < losses[0], losses
    print(_figures(tmp_path, began=began, killed=killed, restarted=restarted))


def _figures(out: Path, *, began: float, killed: float, restarted: float) -> str:
    """What the run measured, for docs/replicas.md (`pytest -s` shows it)."""
    a = [x for x in _steps(out, 0, 0) if "step" in x]
    gaps = [y["t"] - x["t"] for x, y in zip(a, a[1:])]
    together = sorted(g for x, g in zip(a[1:], gaps) if x["members"] == [0, 1])
    alone = [g for x, g in zip(a[1:], gaps) if x["members"] == [0]]
    b = _steps(out, 1, 0)
    restart = [x["started"] for x in b if x.get("incarnation") == 1][0]
    healed = [x for x in b if x.get("healed")][0]
    return (f"replica groups: A step median {together[len(together) // 2]:.2f} s, first step "
            f"alone {alone[0]:.2f} s, then {sorted(alone)[len(alone) // 2]:.2f} s; "
            f"{len(alone)} steps alone; timeline: first step +{a[0]['t'] - began:.1f} s, "
            f"stop -> A's first step alone {_alone_first(a, killed):.1f} s, B restart -> its "
            f"model built {restart - restarted:.1f} s -> first step done (healed) "
            f"{healed['t'] - restart:.2f} s")


def _alone_first(a: list[dict], killed: float) -> float:
    return next(x["t"] for x in a if x["members"] == [0]) - killed


def _heal_main(ident: int, replica: int, port: int, out: str) -> None:
    from lazarus.trainer.replicagroup import ReplicaGroup, quorum_store

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{replica}/", store), rank=0,
                            world_size=1)
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, lr=LR)
    rg = ReplicaGroup(lambda: quorum_store("127.0.0.1", port, "heal", 1), replica=replica,
                      replicas=2, wait_s=1.0, start_wait_s=1.0, timeout_s=COLLECTIVE_TIMEOUT_S,
                      joining=replica == 1)
    if replica == 1:
        q = rg.next_quorum(1)  # let in, healing...
        os.kill(os.getpid(), signal.SIGSTOP)  # ... and stopped before it reads a byte
        return
    assert rg.next_quorum(0).members == (0,)  # replica 1 not started yet: gone, A alone
    store.set("a_alone", "1")
    _wait("replica 1 to ask in", lambda: rg.store.check(["join/1"]))
    q = rg.next_quorum(1)
    assert q.members == (0, 1) and q.healing == (1,)
    began = time.monotonic()
    # far more than the sockets buffer: the send waits on the stopped reader
    rg.heal(model, optimizer, {"step": 0, "blob": torch.zeros(16 << 20)})
    Path(out, "source.json").write_text(json.dumps({"broken": rg._broken,
                                                    "heal_s": time.monotonic() - began}))


def test_a_source_does_not_wait_out_a_joiner_stopped_mid_heal(tmp_path):
    """A restarted replica is let in and stops (SIGSTOP) before it reads its state: the source's
    send, 64 MB, fills the socket and waits (loopback buffers up to ~37 MB here). It gives up
    once the joiner's leader is silent (wait_s, 1 s here), not at the group's timeout (ten
    minutes: the test would time out), and marks its group broken, so its step is tried again
    without the joiner."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _ranks_context()
    procs = []
    for replica in (0, 1):
        if replica == 1:
            _wait("replica 0 alone", lambda: store.check(["a_alone"]), timeout_s=120)
        procs.append(ctx.Process(target=_entry, args=(
            {"OMP_NUM_THREADS": "1"}, f"{__name__}:_heal_main", replica, str(tmp_path),
            (replica, store.port, str(tmp_path)))))
        procs[-1].start()
    try:
        procs[0].join(180)
        assert procs[0].exitcode == 0, (tmp_path / "error-0.txt").read_text()[-3000:] if (
            tmp_path / "error-0.txt").exists() else procs[0].exitcode
        said = json.loads((tmp_path / "source.json").read_text())
        assert said["broken"], said
        print(f"\nheal to a stopped joiner: the source gave up after {said['heal_s']:.1f} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
