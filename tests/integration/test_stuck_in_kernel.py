"""A rank stuck in the kernel on a mount that never answers (tests/integration/stuckfs.py: a
real FUSE filesystem whose reads are never answered) is named for what it is: its main
thread in D, where it sleeps and on which file -- even though another of its threads answers
the stack dump. One that SIGKILL cannot end says so, and its node is cordoned with that
reason and replaced by a spare (a daemon, agents and ranks started by hand)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lazarus.agent import frozen, hangreport
from lazarus.agent.hang import HangConfig, HangDetector
from lazarus.agent.stacks import capture, dumpable
from lazarus.agent.workers import Group
from lazarus.core.contract import STACK_CAPTURE_S, HangVerdict, Progress
from lazarus.core.culprits import combine

HELPER = Path(__file__).with_name("stuckfs.py")


class StuckFs:
    def __init__(self, proc: subprocess.Popen, mnt: Path):
        self.proc, self.mnt = proc, mnt
        self.pids: list[int] = []

    def start(self, what: str) -> int:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("pid "), line
        self.pids.append(int(line.split()[1]))
        return self.pids[-1]


@pytest.fixture
def stuckfs(tmp_path):
    if not os.path.exists("/dev/fuse") or shutil.which("unshare") is None:
        pytest.skip("no /dev/fuse or no unshare(1) here")
    mnt, dumps = tmp_path / "mnt", tmp_path / "dumps"
    mnt.mkdir()
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                             str(HELPER), str(mnt), str(dumps)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "mounted":
        proc.kill()
        pytest.skip(f"cannot mount a FUSE filesystem here: {proc.communicate()[1].strip()}")
    fs = StuckFs(proc, mnt)
    try:
        yield fs
    finally:
        # its /dev/fuse closed, the kernel aborts the mount's requests: the waits end
        proc.stdin.close()
        proc.wait()
        for pid in fs.pids:
            _until(lambda pid=pid: frozen.sample(pid).state in ("", "Z"), f"pid {pid} ends",
                   kill=pid)


def _until(pred, what: str, timeout_s: float = 30.0, kill: int | None = None):
    """Until `pred()` holds (the kernel's states change asynchronously to us)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if kill is not None:
            try:
                os.kill(kill, signal.SIGKILL)
            except ProcessLookupError:
                return True
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


def _in_d(pid: int) -> frozen.ProcSample:
    return _until(lambda: (s := frozen.sample(pid)).state == "D" and s, f"pid {pid} in D")


def test_a_rank_reading_a_mount_that_never_answers_is_stuck_in_the_kernel(stuckfs, tmp_path):
    pid = stuckfs.start("read")
    _in_d(pid)
    # as the agent's hang report takes it (lazarus.agent.hangreport)
    dumps = tmp_path / "dumps"
    asked = dumpable([pid], dumps)
    taken_at = time.monotonic()
    before = frozen.samples([pid])
    dump = capture([pid], dumps, timeout_s=STACK_CAPTURE_S)
    after = frozen.settled([pid], before, taken_at)

    # the stack dump was answered, by another thread: the main thread's frame is in it
    assert asked == [pid] and "in <module>" in dump[pid], dump
    main = after[pid]
    assert main.state == "D" and main.threads[0] == "D" and "D" not in main.threads[1:], main
    got = frozen.frozen({1: pid}, before, after, answered=dump, asked=asked)
    data = str(stuckfs.mnt / "data")
    assert got[1].startswith("stuck in the kernel (wchan "), got
    assert got[1].endswith(f", reading {data})"), got
    # a wait a SIGKILL ends: not unkillable, and it ends
    assert frozen.unkillable(pid) is None
    os.kill(pid, signal.SIGKILL)
    _until(lambda: frozen.sample(pid).state in ("", "Z"), "the killed rank ends")


def _opener_in_d(stuckfs: StuckFs, tries: int = 5) -> int:
    """A process whose open of `data` sleeps in D on the page the pending read locks. The
    reader shows D a moment before the page is locked (its lookup, its readahead's start):
    an open in that moment finds no page to wait on, succeeds and exits. Another is
    started then; one that stays in a wait other than D fails as before."""
    for _ in range(tries):
        opener = stuckfs.start("open")
        got = _until(lambda: frozen.sample(opener).state in ("D", "", "Z"), f"pid {opener} "
                     "in D or gone")
        if got and frozen.sample(opener).state == "D":
            return opener
    raise AssertionError(f"no open of {stuckfs.mnt / 'data'} waited in D in {tries} tries")


def test_a_process_that_sigkill_cannot_end_is_named_so(stuckfs):
    reader = stuckfs.start("read")
    _in_d(reader)  # its read is pending: the file's page stays locked
    opener = _opener_in_d(stuckfs)
    assert frozen.unkillable(opener) is None  # nobody asked it to end yet
    os.kill(opener, signal.SIGKILL)
    # the SIGKILL is pending at once, and the wait it cannot end holds the process in D
    why = frozen.unkillable(opener)
    data = str(stuckfs.mnt / "data")
    assert why is not None and why.startswith("stuck in the kernel (wchan "), why
    assert why.endswith(f", opening {data}); SIGKILL cannot end it"), why


def test_the_hang_event_names_the_kernel_wait_not_a_collective(stuckfs, tmp_path):
    """The incident as it was met: a level-0 script whose rank 1 (node n1) read a file on a
    mount that never answers, caught after the 20 s first-step allowance, while rank 0 (n0)
    waited in its 66th collective."""
    pid = stuckfs.start("read")
    _in_d(pid)
    now = time.monotonic()
    detectors = {}
    for node, rank, seq in (("n0", 0, 66), ("n1", 1, 65)):
        detectors[node] = HangDetector(HangConfig(first_step_timeout_s=20.0))
        detectors[node].observe(rank, Progress(step=0, phase="collective", seq=seq,
                                               since=now - 21.0))
    n1 = SimpleNamespace(cfg=SimpleNamespace(stacks_dir=tmp_path / "dumps", workdir=tmp_path,
                                             node="n1"),
                         report=SimpleNamespace(hang=None))
    hangreport.report(n1, Group(round=3, procs={0: SimpleNamespace(pid=pid)}, ranks={0: 1}),
                      detectors["n1"].check(now))

    data = str(stuckfs.mnt / "data")
    reports = {"n0": detectors["n0"].check(now), "n1": HangVerdict.from_dict(n1.report.hang)}
    hang = combine(reports)
    assert hang.culprit_nodes == ("n1",) and hang.culprit_ranks == (1,)
    assert hang.reason.startswith("node n1: rank 1 is frozen (stuck in the kernel (wchan ")
    assert hang.reason.endswith(f", reading {data}))") and "collective" not in hang.reason
    # the stacks file says it beside the stack another thread gave
    stacks = Path(n1.report.hang["stacks"]).read_text()
    assert "frozen: stuck in the kernel (wchan " in stacks and "in <module>" in stacks


class _Rank:
    """A process as the agent's Workers hold one (poll, send_signal, pid)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return -signal.SIGKILL if frozen.sample(self.pid).state in ("", "Z") else None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def test_the_agent_sets_aside_a_rank_sigkill_cannot_end_and_goes_on(stuckfs, tmp_path,
                                                                     monkeypatch):
    """Stopping a round used to wait for every killed rank: one that SIGKILL cannot end froze
    the agent's loop for good (lazarus.agent.workers.Workers._kill)."""
    from lazarus.agent import workers as workers_mod

    reader = stuckfs.start("read")
    _in_d(reader)
    opener = stuckfs.start("open")
    _in_d(opener)
    monkeypatch.setattr(workers_mod, "KILL_WAIT_S", 1.0)
    w = workers_mod.Workers(nproc=1, env={}, log_dir=tmp_path / "logs", notes_dir=tmp_path,
                            park=False)
    done = threading.Event()
    t = threading.Thread(target=lambda: (w._kill([_Rank(opener)], ranks={opener: 3}),
                                         done.set()), daemon=True)
    t.start()
    t.join(timeout=30)  # a hang guard, not a timing
    assert done.is_set(), "the agent still waits for a process SIGKILL cannot end"
    assert "SIGKILL cannot end it" in w.unkillable[opener][1], w.unkillable
    # what its node status says, for the daemon to cordon the node
    assert w.set_aside() == [{"pid": opener, "rank": 3, "why": w.unkillable[opener][1]}]
    # the mount goes away, the wait ends: the next poll reaps it
    stuckfs.proc.stdin.close()
    stuckfs.proc.wait()
    _until(lambda: (w.poll() or True) and opener not in w.unkillable, "the set-aside rank reaped")
    assert w.set_aside() == []


# A rank of the job's own: rank 1 of the first round opens the file on the mount that never
# answers, once a read of it is pending -- a wait no signal ends, as on an NFS hard mount --
# and the others wait for their round's end.
STUCK_RANK = """
import os, sys, time
if os.environ["LAZARUS_ROUND"] == "1" and os.environ["RANK"] == "1":
    open(sys.argv[1], "rb")
time.sleep(600)
"""


def test_the_daemon_cordons_and_replaces_a_node_whose_rank_sigkill_cannot_end(stuckfs,
                                                                             tmp_path, capsys):
    """A cluster started by hand (a daemon, two nodes and a spare): rank 1 sits in the kernel
    on the mount; its peer crashes, and the next round's kill cannot end it. The daemon
    cordons its node with that reason, in one event, and the spare takes its place;
    `lazarus nodes` says why and what to do."""
    # the cluster and the CLI: only this test of the module runs them
    from lazarus.core import jobspec
    from lazarus.core.records import load_json
    from lazarus.ops import client
    from lazarus.sim.localcluster import LocalCluster

    reader = stuckfs.start("read")
    _in_d(reader)  # a read pending: the page of `data` stays locked
    # the mount lives in the helper's mount namespace; its root reaches it from outside
    data = f"/proc/{stuckfs.proc.pid}/root{stuckfs.mnt}/data"
    script = tmp_path / "rank.py"
    script.write_text(STUCK_RANK)
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=3) as cluster:
        try:
            # nothing here needs warm workers, preflight or monitors: fewer processes on a
            # busy machine; and no allowance runs out before the peer's crash ends the round
            # (ranks that never join their process group: a rendezvous timeout, a hang)
            cluster.agent_args = ["--no-park", "--preflight", "off", "--monitors", "off",
                                  "--first-step-timeout", "900"]
            cluster.start_etcd()
            cluster.start_daemon()
            for name, role in (("n0", "active"), ("n1", "active"), ("n2", "spare")):
                cluster.start_agent(name, nproc=1, role=role)
            cluster.submit(jobspec.from_dict(
                {"job": {"name": "stuck", "nodes": 2, "min_nodes": 1, "nproc_per_node": 1,
                         "rendezvous_timeout_s": 900, "command": ["python", str(script), data]}},
                source="test"))

            def stuck_rank():
                st = cluster.state()
                if st.status is None:
                    return None
                for node, ns in st.node_status.items():
                    # in D opening the mount's file: a page-in from disk (a forked worker
                    # touching its libraries) is a D too, and a SIGKILL ends that one
                    if ns.round == 1 and ns.pids and (
                            (s := frozen.sample(ns.pids[0])).state == "D"
                            and f"opening {data}" in s.where):
                        others = [n for n in st.status.members if n != node]
                        peer = st.node_status.get(others[0]) if others else None
                        if peer is not None and peer.round == 1 and peer.pids:
                            return node, ns.pids[0], others[0], peer.pids[0]
                return None

            node, pid, other, peer_pid = _until(stuck_rank, "rank 1 in D and its peer up",
                                                timeout_s=240)
            os.kill(peer_pid, signal.SIGKILL)  # the peer crashes: the round ends

            def cordoned():
                kv = cluster.etcd.get(cluster.keys.cordon_key(node))
                return kv and load_json(kv.value, "cordon")
            # (beside a second suite, at a load of 13, it took over 180 s)
            cordon = _until(cordoned, f"{node} cordoned", timeout_s=360)
            said = (f"rank 1 (pid {pid}) stuck in the kernel (wchan ", f", opening {data}); "
                    "SIGKILL cannot end it")
            assert cordon["reason"].startswith(said[0]), cordon
            assert cordon["reason"].endswith(
                f"{said[1]}; reboot the node, then `lazarus uncordon {node}`"), cordon
            # the process is still there, in the kernel, with its SIGKILL pending
            assert "SIGKILL cannot end it" in (frozen.unkillable(pid) or ""), pid

            def replaced():
                st = cluster.state()
                return (st.status is not None and st.status.round >= 3
                        and st.status.state != "RECOVERING" and st.status)
            st = _until(replaced, "the round after the cordon", timeout_s=360)
            assert sorted(st.members) == sorted([other, "n2"]), st
            events = [e for e in cluster.new_events() if e.kind == "unkillable_rank" or (
                e.kind == "fault_detected" and e.fields.get("kind") == "unkillable_rank")]
            assert [(e.kind, e.fields["culprit"]) for e in events] == [
                ("fault_detected", node)], events
            assert events[0].message.startswith(f"{node} cannot serve: {said[0]}")
            assert events[0].message.endswith(
                f"{said[1]}; cordoned (reboot the node, then `lazarus uncordon {node}`), "
                "replaced")

            # `lazarus nodes`, in this process: an interpreter less to start
            rc = client.nodes_main(["--address", cluster.api_addresses[0], "--token-file",
                                    str(cluster.token_file)])
            out, err = capsys.readouterr()
            assert rc == 0, err
            line = " ".join(out.split())
            assert f"{node} cordoned: {said[0]}" in line and (
                f"{said[1]}; reboot the node, then `lazarus uncordon {node}`") in line, out
        finally:
            # the mount goes: the set-aside rank's wait ends and it dies
            stuckfs.proc.stdin.close()
            stuckfs.proc.wait()
