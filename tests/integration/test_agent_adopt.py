"""An agent that takes over the ranks its predecessor left running (lazarus.agent.adopt):
a real etcd, real agents, and real processes standing in for ranks (they leave exit notes
as a trainer rank does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lazarus.agent.adopt import Left, LeftRank, NodeLock, record_path, start_time
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.service import Agent
from lazarus.core import etcd as E
from lazarus.core.contract import STACKS_ENV, exit_note_path, worker_files
from lazarus.core.errors import UserError
from lazarus.core.records import (RUNNING, W_FAILED, W_RUNNING, W_SUCCEEDED, NodeRecord,
                                  NodeStatus, RoundRecord, RunStatus)

# A rank: it runs until told its exit code, leaves its note, and exits with it.
STANDIN = """
import sys
from lazarus.trainer import exitnote
print("up", flush=True)
code = int(sys.stdin.readline())
exitnote.record(code)
sys.exit(code)
"""
ROUND = 5


def _standin(workdir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STANDIN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, STACKS_ENV: str(workdir / "stacks" / "n0")})
    assert proc.stdout.readline() == "up\n"
    return proc


def _end(proc: subprocess.Popen, code: int) -> None:
    proc.stdin.write(f"{code}\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == code


def _run_status(etcd, keys) -> None:
    """Round ROUND of job J runs on n0, as the daemon would have it."""
    etcd.put(keys.status, RunStatus(job_id="J", state=RUNNING, round=ROUND,
                                    members=["n0"]).to_json())
    etcd.put(keys.round, str(ROUND).encode())
    etcd.put(keys.round_key(ROUND), RoundRecord(
        round=ROUND, job_id="J", members=["n0"], nproc_per_node=2, world_size=2, dp=2, tp=1,
        store_host="127.0.0.1", store_port=1).to_json())


def _agent_died(etcd, keys, workdir, ranks: dict[int, tuple[int, float]]) -> int:
    """What an agent killed mid-round leaves: its lease, unexpired, with its node record and
    status under it (step 42), and its record of the ranks (local rank -> (pid, started))."""
    session = E.Session(etcd, ttl_s=10)
    etcd.put(keys.node_key("n0"), NodeRecord(node="n0", host="127.0.0.1", nproc=2,
                                             store_port=1, pid=1).to_json(), lease=session.lease)
    etcd.put(keys.nodestatus_key("n0"), NodeStatus(
        node="n0", round=ROUND, workers=W_RUNNING, step=42, loss=2.5,
        pids=[pid for pid, _ in ranks.values()]).to_json(), lease=session.lease)
    Left(node="n0", round=ROUND, job_id="J", world_size=2, lease=session.lease,
         channel=str(workdir / "n0.sock"), checkpoint_dir=None, agent_pid=1,
         ranks=[LeftRank(local_rank=lr, rank=lr, pid=pid, started=started)
                for lr, (pid, started) in ranks.items()]).save(record_path(workdir, "n0"))
    session.close(revoke=False)
    return session.lease


class Running:
    """An agent's main loop in a thread, stopped as SIGTERM stops it."""

    def __init__(self, etcd, keys, workdir):
        self.agent = Agent(etcd, keys, AgentConfig(node="n0", nproc=2, role="active",
                                                   workdir=workdir, park=False, lease_ttl_s=10))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def _status(etcd, keys) -> NodeStatus | None:
    kv = etcd.get(keys.nodestatus_key("n0"))
    return NodeStatus.from_json(kv.value) if kv is not None else None


def _until(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := pred():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met")


def test_agents_restarting_take_over_the_ranks_and_the_lease(etcd, keys, tmp_path):
    ranks = [_standin(tmp_path), _standin(tmp_path)]
    try:
        _run_status(etcd, keys)
        lease = _agent_died(etcd, keys, tmp_path, {lr: (p.pid, start_time(p.pid))
                                                   for lr, p in enumerate(ranks)})
        first = Running(etcd, keys, tmp_path)
        assert first.agent.session.resumed and first.agent.session.lease == lease
        # the node record names the new agent; the status goes on from the old one's step
        _until(lambda: NodeRecord.from_json(etcd.get(keys.node_key("n0")).value).pid
               == os.getpid())
        st = _until(lambda: (s := _status(etcd, keys)) and s.pids and s)
        assert (st.round, st.workers, st.step, st.pids) == (
            ROUND, W_RUNNING, 42, [p.pid for p in ranks])

        first.halt()  # an upgrade: the ranks and the lease stay for the next agent
        assert all(p.poll() is None for p in ranks)
        assert etcd.refresh(lease) > 0 and etcd.get(keys.node_key("n0")) is not None
        assert Left.load(record_path(tmp_path, "n0")).lease == lease

        second = Running(etcd, keys, tmp_path)
        assert second.agent.session.lease == lease
        for p in ranks:  # what a rank leaves to answer the agent (stacks, flight record)
            for path in worker_files(tmp_path / "stacks" / "n0", p.pid):
                path.write_text("")
        _end(ranks[0], 0)
        _end(ranks[1], 0)
        st = _until(lambda: (s := _status(etcd, keys)) and s.workers == W_SUCCEEDED and s)
        assert st.exit_codes == {"0": 0, "1": 0}
        # both under the node's one lease, or the daemon would not count the status
        assert etcd.get(keys.node_key("n0")).lease == lease
        assert etcd.get(keys.nodestatus_key("n0")).lease == lease
        # the notes were read and cleared, and the ranks' other files with them
        assert not any(path.exists() for p in ranks
                       for path in [exit_note_path(tmp_path / "stacks" / "n0", p.pid),
                                    *worker_files(tmp_path / "stacks" / "n0", p.pid)])
        second.halt()  # no ranks left to leave: the node leaves at once
        assert etcd.get(keys.node_key("n0")) is None
        assert Left.load(record_path(tmp_path, "n0")) is None
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_ranks_that_ended_unwatched_are_reported_and_a_reused_pid_is_left_alone(
        etcd, keys, tmp_path):
    crashed = _standin(tmp_path)
    crashed_started = start_time(crashed.pid)
    _end(crashed, 3)  # while no agent watched
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _run_status(etcd, keys)
        # the record's second rank had the pid `stranger` has now, but started earlier
        _agent_died(etcd, keys, tmp_path, {0: (crashed.pid, crashed_started),
                                           1: (stranger.pid, start_time(stranger.pid) - 60)})
        agent = Running(etcd, keys, tmp_path)
        st = _until(lambda: (s := _status(etcd, keys)) and s.workers == W_FAILED and s)
        # the crash keeps its code; the rank whose pid was reused vanished, as far as we know
        assert st.exit_codes == {"0": 3, "1": -1} and st.failed_rank == 0
        agent.halt()
        assert stranger.poll() is None  # never signalled: it is not ours
    finally:
        stranger.send_signal(signal.SIGKILL)
        stranger.wait()


def test_an_expired_lease_is_not_resumed(etcd):
    old = E.Session(etcd, ttl_s=3)
    old.close(revoke=True)
    new = E.Session(etcd, ttl_s=3, resume=old.lease)
    try:
        assert not new.resumed and new.lease != old.lease
    finally:
        new.close()


def test_one_agent_per_node_and_workdir(tmp_path):
    lock = NodeLock(tmp_path / "n0.lock", "n0")
    try:
        with pytest.raises(UserError, match=f"another agent runs node n0 from this workdir "
                                            f"\\(pid {os.getpid()}\\)"):
            NodeLock(tmp_path / "n0.lock", "n0")
    finally:
        lock.release()
    NodeLock(tmp_path / "n0.lock", "n0").release()  # free again once the holder is gone
