"""The agent's parked workers forked from a zygote (lazarus.trainer.zygote, lazarus.agent.zygote):
they train what they are given as a cold worker would, their exits are read whatever happens
to the zygote, and a zygote killed or stopped leaves the agent with cold workers, not none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
import torch.distributed as dist

from lazarus.agent import workers as W
from lazarus.agent import zygote as Z
from lazarus.agent.adopt import VANISHED
from lazarus.agent.workers import Workers
from lazarus.core import exitcodes
from lazarus.core.contract import WorkerAssignment, round_port_key
from lazarus.core.trainconfig import DataConfig, TrainConfig


def _workers(tmp_path, nproc: int = 1) -> Workers:
    return Workers(nproc=nproc, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   log_dir=tmp_path / "logs", notes_dir=tmp_path / "notes", park=True)


def _until(cond, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _parked(w: Workers, n: int) -> list:
    def full():
        w.refill()
        return len(w.parked) >= n
    _until(full, f"{n} parked worker(s)")
    return list(w.parked)


def _stores(round_: int):
    """The agent's long-lived store and the round's own, its port published in the first."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    round_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(round_port_key(round_), str(round_store.port))
    return store, round_store


def test_a_forked_worker_trains_like_a_cold_one_and_outlives_the_agent(tmp_path):
    w = _workers(tmp_path, nproc=2)
    store, _round_store = _stores(7)
    try:
        first, second = _parked(w, 2)
        zygote = w.zygote.proc.pid
        for worker in (first, second):
            assert isinstance(worker, Z.ForkedWorker)
            assert psutil.Process(worker.pid).ppid() == zygote  # a fork of the zygote
            # in a session of its own, as a cold worker is (the fork says so itself, a moment
            # after the zygote has reported it)
            _until(lambda: os.getsid(worker.pid) == worker.pid, "the fork's own session")
        metrics = tmp_path / "m.jsonl"
        train = TrainConfig(steps=2, data=DataConfig(seq_len=32, global_batch=2),
                            metrics=str(metrics)).to_dict()
        trains = WorkerAssignment(rank=0, world_size=1, local_rank=0, round=7,
                                  store_host="127.0.0.1", store_port=store.port, train=train)
        group = w.launch(7, {0: trains})
        _until(lambda: w.poll() and not group.alive, "the round to end")
        assert group.exit_codes == {0: 0} and group.succeeded
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows if "kind" not in r] == [1, 2]

        # A rank that runs a program of its own replaces the forked process (exec), and it
        # goes on when the agent goes: the zygote ends, the rank does not.
        sleeps = WorkerAssignment(rank=0, world_size=1, local_rank=0, round=7,
                                  store_host="127.0.0.1", store_port=store.port,
                                  train={}, command=["sleep", "60"])
        (rank,) = w.launch(7, {0: sleeps}).procs.values()
        _until(lambda: psutil.Process(rank.pid).name() == "sleep", "the rank to exec")
        w.shutdown(leave_ranks=True)
        assert not psutil.pid_exists(zygote) or \
            psutil.Process(zygote).status() == psutil.STATUS_ZOMBIE
        assert psutil.Process(rank.pid).status() != psutil.STATUS_ZOMBIE
        os.kill(rank.pid, signal.SIGKILL)
    finally:
        w.shutdown()


def test_exits_are_read_with_the_zygote_killed_and_cold_workers_fill_in(tmp_path, monkeypatch):
    w = _workers(tmp_path, nproc=2)
    try:
        first, second = _parked(w, 2)
        os.kill(first.pid, signal.SIGKILL)
        assert _until(first.poll, "the killed worker's exit") == -signal.SIGKILL  # the zygote's word

        zygote = w.zygote.proc
        zygote.kill()
        zygote.wait()
        w.refill()  # notices, and fills the pool with cold workers meanwhile
        assert w.zygote is None
        cold = [p for p in w.parked if isinstance(p, subprocess.Popen)]
        assert len(cold) == 1 and second in w.parked
        # the orphan's end, with nobody left to report it: from /proc and its (absent) note
        os.kill(second.pid, signal.SIGKILL)
        assert _until(lambda: second.poll() is not None, "the orphan's exit") and \
            second.poll() == VANISHED

        monkeypatch.setattr(W, "ZYGOTE_RETRY_S", 0.0)  # the retry comes at once
        w._zygote_failed_at = -1.0
        _until(lambda: (w.refill(), w.zygote is not None and w.zygote.ready)[1],
               "a new zygote")
        assert w.zygote.proc.pid != zygote.pid
    finally:
        w.shutdown()


def test_a_stopped_zygote_is_replaced(tmp_path, monkeypatch):
    w = _workers(tmp_path)
    try:
        (first,) = _parked(w, 1)
        stopped = w.zygote.proc
        monkeypatch.setattr(Z, "ZYGOTE_ANSWER_S", 1.0)
        monkeypatch.setattr(W, "ZYGOTE_RETRY_S", 0.0)
        os.kill(stopped.pid, signal.SIGSTOP)
        first.kill()  # its exit is read without the zygote; the spawn that replaces it is
        _until(lambda: first.poll() is not None, "the worker's exit")  # never answered
        w.refill()
        assert w.zygote.in_flight == 1
        (fresh,) = _parked(w, 1)
        assert stopped.poll() == -signal.SIGKILL  # killed while stopped
        assert w.zygote.proc.pid != stopped.pid and fresh.poll() is None
    finally:
        w.shutdown()


def test_a_node_whose_imports_initialise_cuda_starts_its_workers_cold_for_good(
        tmp_path, monkeypatch, caplog):
    # What the GPU run found: on such a node a fork could not use the GPU. The CUDA state is
    # the hardware edge, faked here the only way a CPU machine can: torch says it initialised.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import lazarus.trainer.zygote as z\nz.driver_initialised = lambda: True\n")
    monkeypatch.setattr(W, "ZYGOTE_RETRY_S", 0.0)  # a retry would come at once, were there one
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    w = Workers(nproc=1, env=env, log_dir=tmp_path / "logs", notes_dir=tmp_path / "notes",
                park=True)
    try:
        w.refill()
        unfit = w.zygote.proc
        assert unfit.wait(timeout=120) == exitcodes.ZYGOTE_UNFIT
        (cold,) = _parked(w, 1)
        assert isinstance(cold, subprocess.Popen) and cold.pid != unfit.pid
        for _ in range(3):
            w.refill()
        assert w.zygote is None, "a zygote that cannot help was started again"
        assert "every worker starts cold" in caplog.text
        assert '"zygote_unfit"' in (tmp_path / "logs" / "zygote.log").read_text()
    finally:
        w.shutdown()


@pytest.fixture(autouse=True)
def _no_strays():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert not left, f"left running: {[' '.join(p.cmdline()) for p in left]}"


def test_preflight_tests_run_in_forks_of_the_zygote(tmp_path, monkeypatch):
    """The agent's preflight checkpoint round trip and collective run in children of the
    zygote: no cold interpreter, and no torch in the agent."""
    from lazarus.agent import collective_check as coll
    from lazarus.agent import preflight as pre

    w = _workers(tmp_path)
    try:
        zygote = w.ready_zygote(120)
        assert zygote is not None

        def no_cold_child(*a, **k):
            raise AssertionError("a cold child was started")
        monkeypatch.setattr(coll.subprocess, "Popen", no_cold_child)
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        done = pre.run_checks(pre.PreflightConfig(workdir=tmp_path, checkpoint_dir=ckpt,
                                                  skip=frozenset({"gpu", "clock"}),
                                                  zygote=zygote), etcd=None,
                              gpu_verdicts=lambda: ([], "none"))
        by = {c.name: c for c in done}
        assert by["checkpoint"].ok and not by["checkpoint"].skipped, by["checkpoint"]
        assert by["collective"].ok and "GB/s" in by["collective"].reason, by["collective"]
        assert not list(ckpt.iterdir())  # the round trip cleaned up after itself
    finally:
        w.shutdown()


def test_workers_forked_after_a_rehearsal_start_warm_and_train_as_cold_ones(tmp_path):
    """The first launch of a job has the zygote rehearse its step (lazarus.trainer.rehearsal);
    the next round's ranks, forked after it, start with DTensor's caches filled -- rank 0's
    meshes in them, made their own -- and train bit for bit as the cold round did."""
    from lazarus.core.trainconfig import ParallelConfig

    w = _workers(tmp_path, nproc=2)
    try:
        _parked(w, 2)
        losses, starts = {}, {}
        for round_ in (7, 8):
            store, _round_store = _stores(round_)
            metrics = tmp_path / f"m{round_}.jsonl"
            train = TrainConfig(steps=2, data=DataConfig(seq_len=32, global_batch=4),
                                parallelism=ParallelConfig(dp=2), metrics=str(metrics)).to_dict()
            group = w.launch(round_, {r: WorkerAssignment(
                rank=r, world_size=2, local_rank=r, round=round_, store_host="127.0.0.1",
                store_port=store.port, train=train) for r in (0, 1)})
            _until(lambda: w.poll() and not group.alive, f"round {round_} to end")
            assert group.exit_codes == {0: 0, 1: 0}, [
                p.read_text()[-2000:] for p in (tmp_path / "logs").glob("**/*.log")]
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            losses[round_] = [r["loss"] for r in rows if "kind" not in r]
            (starts[round_],) = [r for r in rows if r.get("kind") == "start"]
            _parked(w, 2)  # forked after the rehearsal the launch asked for
        assert losses[8] == losses[7] and len(losses[7]) == 2
        assert starts[7]["warm"] == [] and starts[8]["warm"] == ["rehearsal"]
        said = [json.loads(line) for line in (tmp_path / "logs" / "zygote.log").read_text()
                .splitlines() if line.startswith('{"event": "rehearsal"')]
        assert [s["result"] for s in said] == ["rehearsed"], said  # asked once for one shape
    finally:
        w.shutdown()


def test_a_node_that_sees_the_round_renews_its_pool_with_forks_made_after_the_rehearsal(
        tmp_path):
    """Every agent has its zygote rehearse the current round's job (a spare too: its worker
    is a node loss's new rank). The parked workers from before are let go once forks made
    after the rehearsal are parked, never before: the pool is never empty."""
    from lazarus.core.jobcommand import BUILTIN
    from lazarus.core.trainconfig import ParallelConfig

    w = _workers(tmp_path, nproc=1)
    try:
        (old,) = _parked(w, 1)
        assert old.generation == 0
        train = TrainConfig(steps=2, data=DataConfig(seq_len=32, global_batch=4),
                            parallelism=ParallelConfig(dp=2)).to_dict()
        w.rehearse(5, ["python", "my_train.py"], train, 2)  # a script of the user's: no
        assert w.zygote.generation == 0
        w.rehearse(3, list(BUILTIN), train, 2)
        w.rehearse(4, list(BUILTIN), train, 2)  # the same job's shape: asked once

        def renewed():
            w.refill()
            assert w.parked, "the pool was emptied before its renewal"
            return w.parked if all(p.generation == 1 for p in w.parked) else None
        (new,) = _until(renewed, "a fork made after the rehearsal")
        assert new.pid != old.pid and w.zygote.generation == 1
        _until(lambda: old.poll() is not None, "the old parked worker to end")
        said = [json.loads(line)["result"] for line in (tmp_path / "logs" / "zygote.log")
                .read_text().splitlines() if line.startswith('{"event": "rehearsal"')]
        assert said == ["rehearsed"]
    finally:
        w.shutdown()
