"""The agent's side of in-place recovery on real processes (lazarus.agent.workers): the
survivors of a lost peer outlive their round's end and take the next round's assignment;
a survivor that died meanwhile, or that the channel cannot reach, is replaced by a fresh
worker -- the process restart of before."""

from __future__ import annotations

import json
import subprocess

import pytest

from lazarus.agent import workers as W
from lazarus.agent.workers import Group, Workers
from lazarus.core.contract import WorkerAssignment


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def _assignment(local_rank: int, round_: int = 3) -> WorkerAssignment:
    return WorkerAssignment(rank=local_rank, world_size=2, local_rank=local_rank, round=round_,
                            store_host="127.0.0.1", store_port=1, train={})


@pytest.fixture
def workers(tmp_path):
    w = Workers(nproc=2, env={}, log_dir=tmp_path, notes_dir=tmp_path, park=False)
    spawned: list[subprocess.Popen] = []

    def spawn() -> subprocess.Popen:  # a fresh worker: reads its assignment line, then waits
        p = subprocess.Popen(["sh", "-c", "cat >/dev/null; sleep 60"], stdin=subprocess.PIPE)
        spawned.append(p)
        return p

    w._spawn = spawn
    w.spawned = spawned
    yield w
    w.shutdown()
    for p in spawned:
        p.kill()
        p.wait()


def _round_two(w: Workers, survivors: set[int]) -> tuple[subprocess.Popen, subprocess.Popen]:
    a, b = _sleeper(), _sleeper()
    w.group = Group(round=2, procs={0: a, 1: b}, ranks={0: 0, 1: 1}, survivors=survivors)
    return a, b


def test_a_survivor_outlives_its_round_and_takes_the_next_one(workers):
    a, b = _round_two(workers, survivors={0})
    workers.stop(keep={0, 1})  # 1 asked for too, but it never said it survived
    assert b.poll() is not None and a.poll() is None
    sent = []
    g = workers.launch(3, {0: _assignment(0), 1: _assignment(1)},
                       resume=lambda pid, asg: sent.append((pid, asg.round)) or True)
    assert sent == [(a.pid, 3)]
    assert g.procs[0] is a and g.kept == {0}  # the same process, now rank 0 of round 3
    assert g.procs[1] is workers.spawned[0] and workers.kept == {}
    assert g.anew == {1: W.ANEW_STOPPED}  # running, never said it survived: killed


def test_a_survivor_killed_while_it_waits_is_replaced_by_a_fresh_worker(workers):
    a, _ = _round_two(workers, survivors={0, 1})
    workers.stop(keep={0, 1})
    a.kill()  # a second fault, during the recovery
    a.wait()
    sent = []
    g = workers.launch(3, {0: _assignment(0), 1: _assignment(1)},
                       resume=lambda pid, asg: sent.append(pid) or True)
    assert g.procs[0] is workers.spawned[0] and g.kept == {1}
    assert len(sent) == 1
    assert g.anew == {0: W.ANEW_SURVIVOR_GONE}


def test_a_survivor_the_channel_cannot_reach_is_let_go(workers):
    a, _ = _round_two(workers, survivors={0})
    workers.stop(keep={0})
    g = workers.launch(3, {0: _assignment(0)}, resume=lambda pid, asg: False)
    assert g.procs[0] is workers.spawned[0] and g.kept == set()
    assert g.anew == {0: W.ANEW_NOT_REACHED}
    assert a.wait(timeout=10) is not None  # killed, not left behind


def test_each_rank_started_anew_says_why(workers):
    """What the recovered event says of the ranks not in place (daemon/decide.py): the
    fault's own rank, a rank that exited on its lost peer, survivors the agent let go, a rank
    this node did not run before."""
    a, b = _round_two(workers, survivors=set())
    workers.group.procs[2] = _sleeper()
    workers.group.ranks[2] = 2
    a.kill()
    a.wait()
    workers.poll()  # rank 0 failed first
    b.kill()
    b.wait()
    workers.group.exit_codes[1] = 75  # exitcodes.PEER_LOST: did not stay for the next round
    workers.stop()
    g = workers.launch(3, {lr: _assignment(lr) for lr in range(4)})
    assert g.anew == {0: W.ANEW_FAILED, 1: W.ANEW_PEER_LOST, 2: W.ANEW_STOPPED, 3: W.ANEW_NEW}
    workers.stop()

    _round_two(workers, survivors={0, 1})
    workers.stop(keep={0, 1})
    workers.drop_kept()  # the agent's decision: no round of this node takes them
    g = workers.launch(4, {0: _assignment(0, 4), 1: _assignment(1, 4)},
                       resume=lambda pid, asg: True)
    assert g.kept == set() and g.anew == {0: W.ANEW_LET_GO, 1: W.ANEW_LET_GO}


def test_survivors_no_round_takes_are_killed(workers):
    a, b = _round_two(workers, survivors={0, 1})
    workers.stop(keep={0, 1})
    g = workers.launch(3, {0: _assignment(0)}, resume=lambda pid, asg: True)  # one rank now
    assert g.procs == {0: a}
    assert b.wait(timeout=10) is not None
    workers.stop()
    assert a.poll() is not None  # an ordinary stop ends it like any rank

    c, d = _round_two(workers, survivors={0, 1})
    workers.stop(keep={0, 1})
    workers.drop_kept()  # the run ended, or the next round leaves this node out
    assert c.wait(timeout=10) is not None and d.wait(timeout=10) is not None


# -- the rank's side, over a real worker channel (lazarus.trainer.inplace) --------------------
@pytest.fixture
def channel(tmp_path):
    from lazarus.agent.channel import Channel

    got: list[dict] = []
    ch = Channel(str(tmp_path / "agent.sock"), on_message=lambda m: got.append(m) or None,
                 admit=lambda pid: True)
    ch.got = got
    yield ch
    ch.close()


def _wait(pred, timeout=10.0):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _surviving(channel, mine, session, step: int, reason: str, *, wait_s: float):
    """`inplace.survive` in a thread, once its agent has heard it: the thread, and the dict
    that gets its answer under "nxt"."""
    import threading

    from lazarus.trainer import inplace

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(
        nxt=inplace.survive(mine, session, step, reason, wait_s=wait_s)))
    t.start()
    assert _wait(lambda: any(m.get("type") == "survivor" for m in channel.got))
    return t, out


def test_a_survivor_tells_its_agent_and_takes_the_assignment_sent_to_its_pid(channel):
    import os

    from lazarus.trainer.session import Session

    session = Session(socket_path=channel.path, rank=1, round=2)
    mine = _assignment(1, round_=2)
    mine.report_socket = channel.path
    try:
        t, out = _surviving(channel, mine, session, 17, "Connection reset by peer", wait_s=20)
        said = next(m for m in channel.got if m.get("type") == "survivor")
        assert (said["pid"], said["rank"], said["round"], said["step"]) == (os.getpid(), 1, 2,
                                                                          17)
        assert not channel.send_to(os.getpid() + 1_000_000, {"type": "resume"})  # nobody
        nxt = _assignment(1, round_=3)
        assert channel.send_to(os.getpid(), {"type": "resume",
                                             "assignment": json.loads(nxt.to_json())})
        t.join(20)
        assert out["nxt"] == nxt
    finally:
        session.close()


@pytest.mark.parametrize("sent", ["nothing", "another local rank", "an older round", "garbage"])
def test_a_survivor_without_a_fitting_assignment_gives_up(channel, sent):
    import os

    from lazarus.trainer import inplace
    from lazarus.trainer.session import Session

    session = Session(socket_path=channel.path, rank=1, round=2)
    mine = _assignment(1, round_=2)
    mine.report_socket = channel.path
    try:
        assert _wait(lambda: channel._pids)  # connected
        body = {"another local rank": json.loads(_assignment(0, round_=3).to_json()),
                "an older round": json.loads(_assignment(1, round_=2).to_json()),
                "garbage": {"rank": "one"}}.get(sent)
        if body is None:
            assert inplace.survive(mine, session, 5, "reset", wait_s=0.5) is None
            return
        # Sent once the survivor waits (what came before is an earlier agent's, dropped):
        # it is the assignment that is refused, long before the wait would run out.
        t, out = _surviving(channel, mine, session, 5, "reset", wait_s=120)
        assert channel.send_to(os.getpid(), {"type": "resume", "assignment": body})
        t.join(60)
        assert not t.is_alive() and out["nxt"] is None
    finally:
        session.close()


def test_a_survivor_whose_agent_goes_away_gives_up_at_once(channel):
    """The next agent does not know the survivors the last one kept: waiting out the rest of
    twice the grace would only hold the device."""
    import time

    from lazarus.trainer.session import Session

    session = Session(socket_path=channel.path, rank=1, round=2)
    mine = _assignment(1, round_=2)
    try:
        t, out = _surviving(channel, mine, session, 9, "reset", wait_s=120)
        gone = time.monotonic()
        channel.close()
        t.join(30)
        assert not t.is_alive() and out == {"nxt": None}
        assert time.monotonic() - gone < 30
    finally:
        session.close()


def test_a_survivor_waits_twice_its_agents_grace_for_the_next_round(monkeypatch):
    """A node cut off from etcd is declared lost after its lease TTL: its survivors must not
    hold their devices much past that (tests/e2e/test_partition.py)."""
    from lazarus.core.contract import AGENT_GRACE_ENV
    from lazarus.trainer import inplace

    monkeypatch.setenv(AGENT_GRACE_ENV, "8")
    assert inplace.resume_wait_s() == 16
    for unset in ("", "soon"):
        monkeypatch.setenv(AGENT_GRACE_ENV, unset)
        assert inplace.resume_wait_s() == inplace.RESUME_WAIT_S


def test_survivors_still_in_their_round_are_let_go_too(workers):
    """A node cut off from etcd past its lease: its survivors have not been stopped into the
    kept ones (no round end was read), and go all the same."""
    a, b = _round_two(workers, survivors={0})
    workers.drop_kept()
    assert a.wait(timeout=10) is not None and b.poll() is None


def test_in_place_is_on_under_an_agent_unless_the_job_says_off(monkeypatch):
    from lazarus.core.contract import IN_PLACE_ENV
    from lazarus.trainer import inplace

    under_agent = _assignment(0)
    under_agent.report_socket = "/run/agent.sock"
    monkeypatch.delenv(IN_PLACE_ENV, raising=False)
    assert inplace.enabled(under_agent) and not inplace.enabled(_assignment(0))
    for off in ("off", "OFF"):
        monkeypatch.setenv(IN_PLACE_ENV, off)
        assert not inplace.enabled(under_agent)


_SCRIPT = """
import json, sys, threading, time
import lazarus.trainer
from lazarus.trainer import session as sessions

calls = []

def main():
    calls.append(1)
    if len(calls) == 1:  # a round whose main opened a session and then lost a peer
        lazarus.trainer.connect().report(step=1, loss=1.0, tokens=1, step_time_s=0.1)
        raise RuntimeError("Connection reset by peer")
    end = time.monotonic() + 10  # a closed session's reader ends at once; a hang guard
    while time.monotonic() < end and any(
            t.name == "lazarus-session" for t in threading.enumerate()):
        time.sleep(0.05)
    print(json.dumps({"calls": len(calls), "open": len(sessions.script_sessions()),
                      "readers": sum(t.name == "lazarus-session"
                                     for t in threading.enumerate())}), flush=True)

lazarus.trainer.run(main)
"""


def test_a_scripts_round_run_again_in_place_leaves_no_session_behind(channel, tmp_path):
    """`lazarus.trainer.run(main)`: the session the failed round's main opened is closed
    before main runs again -- no connection or reader thread per round left in the process
    (a week of recoveries would pile them up)."""
    import os
    import sys

    from lazarus.core.contract import ASSIGNMENT_ENV, SOCKET_ENV

    mine = _assignment(1, round_=2)
    mine.report_socket = channel.path
    env = {**os.environ, ASSIGNMENT_ENV: mine.to_json(), SOCKET_ENV: channel.path,
           "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert _wait(lambda: any(m.get("type") == "survivor" for m in channel.got), 60), \
            proc.stderr.read() if proc.poll() is not None else "no survivor message"
        # the next round's store, where its hosting agent publishes the round's port
        import torch.distributed as dist

        from lazarus.core.contract import round_port_key
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store.set(round_port_key(3), "29555")
        nxt = _assignment(1, round_=3)
        nxt.report_socket, nxt.store_port = channel.path, store.port
        assert channel.send_to(proc.pid, {"type": "resume",
                                          "assignment": json.loads(nxt.to_json())})
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    finally:
        proc.kill()
    assert proc.returncode == 0, (out, err)
    assert json.loads(out.splitlines()[-1]) == {"calls": 2, "open": 0, "readers": 0}


_TOLD = """
import json, sys, time
import torch, torch.distributed as dist
from lazarus.core.contract import WorkerAssignment
from lazarus.trainer import collprogress, inplace, rankprocess
from lazarus.trainer.session import Session

collprogress.uses_nccl = lambda: {nccl}  # gloo's groups, taken for NCCL's
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
session = Session(socket_path=sys.argv[1], rank=0, round=2)
a = WorkerAssignment(rank=0, world_size=1, local_rank=0, round=2, store_host="127.0.0.1",
                     store_port=1, train={{}})

def state():
    try:
        dist.all_reduce(torch.ones(1))
        raised = None
    except Exception as e:
        raised = type(e).__name__
    return {{"told": rankprocess.this_process().told, "initialized": dist.is_initialized(),
            "lost_peer": inplace.lost_peer(a, ValueError("anything")), "raised": raised}}

print("ready", flush=True)
sys.stdin.readline()                 # the agent spoke of round 1 only
print(json.dumps(state()), flush=True)
end = time.monotonic() + 10
while time.monotonic() < end and (rankprocess.this_process().told != 2 or dist.is_initialized() == {nccl}):
    time.sleep(0.02)
print(json.dumps(state()), flush=True)
session.close()
# As every rank Lazarus starts ends (trainer/exitnote.finish): the interpreter's teardown
# of the aborted group's threads aborts now and then (docs/constraints.md, "Aborts and
# hangs at exit"; once in CI).
import os
os._exit(0)
"""


@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "gloo"])
def test_a_rank_told_that_a_peer_elsewhere_is_gone_aborts_its_groups_on_nccl(channel, tmp_path,
                                                                           nccl):
    """The agent's `abort_groups` (decide.ReleaseVictims) for the rank's round: on NCCL the
    groups are aborted (a collective waiting on the gone peer would never fail by itself
    there), so the next collective fails, and any failure then counts as a lost peer's. On
    gloo the groups are left alone. A message of another round changes nothing."""
    import sys

    script = tmp_path / "told.py"
    script.write_text(_TOLD.format(nccl=nccl))
    proc = subprocess.Popen([sys.executable, str(script), channel.path], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert _wait(lambda: any(m.get("type") == "hello" for m in channel.got))
        channel.broadcast({"type": "abort_groups", "round": 1})
        import time
        time.sleep(0.5)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        before = json.loads(proc.stdout.readline())
        assert before == {"told": None, "initialized": True, "lost_peer": False, "raised": None}
        channel.broadcast({"type": "abort_groups", "round": 2})
        after = json.loads(proc.stdout.readline())
        assert after["told"] == 2 and after["lost_peer"] is True
        if nccl:
            assert after["initialized"] is False and after["raised"] is not None, after
        else:
            assert after["initialized"] is True and after["raised"] is None, after
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
