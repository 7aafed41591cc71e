"""`lazarus up --chaos`: whether a due item strikes, waits for its target or is skipped
(chaos.aim), decided from what the cluster shows; a skipped item is a line of the summary,
never a crash."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lazarus.core.errors import UserError
from lazarus.core.records import NodeStatus
from lazarus.sim import chaos, up
from lazarus.sim.chaos import FIRE, SKIP, TARGET_WAIT_S, WAIT, Aim, Sight

RUNNING = Sight(members=("n0", "n1"), working=frozenset({"n0", "n1"}), leader=True)
# n0 lost its GPU (gpu-xid): cordoned, its ranks gone, the spare n2 runs in its place
N0_CORDONED = Sight(members=("n1", "n2"), working=frozenset({"n1", "n2"}),
                    cordoned=frozenset({"n0"}), leader=True)
# n1 was killed (kill-node); the round that answers it has not started yet
N1_DOWN = Sight(members=("n0", "n1"), working=frozenset({"n0"}), down=("n1",), leader=True)
# the leader was killed a moment ago: its key outlives it until its lease runs out
NO_LEADER = Sight(members=("n0", "n1"), working=frozenset({"n0", "n1"}), leader=False)
STARTING = Sight(leader=True)


def _one(item: str) -> chaos.Fault:
    (fault,) = chaos.parse_schedule(item)
    return fault


@pytest.mark.parametrize("item, sight, waited_s, expect", [
    ("kill-worker@5", RUNNING, 0, Aim(FIRE, "n1")),                  # the last member
    ("kill-worker@5:n0", RUNNING, 0, Aim(FIRE, "n0")),
    ("stop-worker@5:n0", RUNNING, 0, Aim(FIRE, "n0")),
    ("kill-node@5", RUNNING, 0, Aim(FIRE, "n1")),
    ("gpu-xid@5:n0", RUNNING, 0, Aim(FIRE, "n0")),
    ("slow-rank@5", RUNNING, 0, Aim(FIRE, "n1")),
    ("kill-daemon@5", RUNNING, 0, Aim(FIRE)),
    ("disk-full@5", STARTING, 0, Aim(FIRE)),
    # issue 24: kill-worker@198:n0 after a gpu-xid cordoned n0 raised "n0 runs no workers"
    ("kill-worker@198:n0", N0_CORDONED, 0, Aim(SKIP, "n0", "n0 is cordoned: it runs no workers")),
    ("stop-worker@198:n0", N0_CORDONED, 0, Aim(SKIP, "n0", "n0 is cordoned: it runs no workers")),
    ("kill-node@198:n0", N0_CORDONED, 0, Aim(FIRE, "n0")),             # its agent still runs
    ("kill-worker@198", N0_CORDONED, 0, Aim(FIRE, "n2")),              # the spare in its place
    # a spare, not promoted yet: it may be, so the item waits -- for a while
    ("kill-worker@9:n2", RUNNING, 0, Aim(WAIT, why="n2 runs no workers")),
    ("kill-worker@9:n2", RUNNING, TARGET_WAIT_S - 1, Aim(WAIT, why="n2 runs no workers")),
    ("kill-worker@9:n2", RUNNING, TARGET_WAIT_S,
     Aim(SKIP, why=f"n2 runs no workers after {TARGET_WAIT_S:.0f} s")),
    # issue 24: a second kill-daemon before a new leader was elected raised
    # "no live leading daemon found"
    ("kill-daemon@60", NO_LEADER, 0, Aim(WAIT, why="no daemon leads yet")),
    ("kill-daemon@60", NO_LEADER, TARGET_WAIT_S,
     Aim(SKIP, why=f"no daemon leads yet after {TARGET_WAIT_S:.0f} s")),
    ("kill-worker@5", STARTING, 0, Aim(WAIT, why="the run has no nodes yet")),
    # a node that is down takes nothing until revive-node, which waits behind this item
    ("kill-worker@20:n1", N1_DOWN, 0, Aim(SKIP, "n1", "n1 is down")),
    ("kill-node@20:n1", N1_DOWN, 0, Aim(SKIP, "n1", "n1 is down")),
    ("gpu-ecc@20:n1", N1_DOWN, 0, Aim(SKIP, "n1", "n1 is down")),
    ("revive-node@30", N1_DOWN, 0, Aim(FIRE, "n1")),                   # the last one down
    ("revive-node@30:n1", N1_DOWN, 0, Aim(FIRE, "n1")),
    ("revive-node@30:n0", N1_DOWN, 0, Aim(SKIP, "n0", "n0 is not down")),
    ("revive-node@30", RUNNING, 0, Aim(SKIP, why="no node is down")),
])
def test_a_due_item_fires_waits_or_is_skipped(item, sight, waited_s, expect):
    assert chaos.aim(_one(item), sight, waited_s) == expect


def test_a_target_that_is_no_node_is_refused_before_the_cluster_starts():
    schedule = chaos.parse_schedule("kill-worker@5:n0,kill-node@9:n7")
    with pytest.raises(UserError, match=r"kill-node@9:n7: no node 'n7' here \(the nodes are "
                                        r"n0, n1, n2\)"):
        up._check_targets(schedule, ["n0", "n1", "n2"])
    up._check_targets(chaos.parse_schedule("kill-worker@5,revive-node@9:n2"), ["n0", "n1", "n2"])


def test_a_skipped_item_is_a_line_of_the_summary(capsys):
    fired, skipped = chaos.parse_schedule("gpu-xid@10:n0,kill-worker@198:n0")
    fired.fired_at, fired.fired_step, fired.hit = 1.0, 10, "n0 gpu0"
    skipped.skipped = "n0 is cordoned: it runs no workers"
    summary = {"final_state": "SUCCEEDED", "steps_completed": 200, "wall_time_s": 60.0,
               "final_loss": 2.0, "recoveries": [],
               "faults": [fired.as_dict(), skipped.as_dict()]}
    up.print_summary(summary)
    out = capsys.readouterr().out
    assert "not injected: kill-worker@198:n0 -- n0 is cordoned: it runs no workers" in out
    assert "gpu-xid@10:n0" not in out  # it was injected
    assert summary["faults"][1]["skipped"] == "n0 is cordoned: it runs no workers"


def test_up_leaves_what_reaching_its_etcd_takes_in_its_workdir(tmp_path):
    from lazarus.core.etcd_auth import EtcdAuth

    for name in ("ca.pem", "client.pem", "client-key.pem"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\n")
    (tmp_path / "lazarus-daemon.password").write_text("pw\n")
    (tmp_path / "lazarus-daemon.password").chmod(0o600)  # as `lazarus up` writes it
    auth = EtcdAuth.load(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "client.pem"),
                         key=str(tmp_path / "client-key.pem"), user="lazarus-daemon",
                         password_file=str(tmp_path / "lazarus-daemon.password"), env={})
    assert chaos.cluster_access(tmp_path) is None
    path = chaos.write_cluster_access(tmp_path, "127.0.0.1:41234", auth)
    assert path.stat().st_mode & 0o777 == 0o600
    assert "pw" not in path.read_text()  # the password stays in its own file
    endpoint, got = chaos.cluster_access(tmp_path)
    assert endpoint == "127.0.0.1:41234"
    assert (got.user, got.password, got.ca, got.key) == ("lazarus-daemon", "pw", auth.ca, auth.key)
    path.write_text("{")
    with pytest.raises(UserError, match="etcd-client.json is unreadable"):
        chaos.cluster_access(tmp_path)


def test_chaos_finds_the_running_up_cluster_by_its_endpoint_file(tmp_path, monkeypatch):
    from lazarus.core import endpoint_file
    from lazarus.sim.chaos import default_workdir

    monkeypatch.delenv("LAZARUS_WORKDIR", raising=False)
    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path / "home"))
    assert default_workdir() == Path("/tmp/lazarus")           # no cluster runs
    path = endpoint_file.default_path()
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=["127.0.0.1:1"], pid=os.getpid(),
                                                     workdir=str(tmp_path / "up")))
    assert default_workdir() == tmp_path / "up"                 # the live `lazarus up`'s
    monkeypatch.setenv("LAZARUS_WORKDIR", str(tmp_path / "mine"))
    assert default_workdir() == tmp_path / "mine"               # the operator's word first
    monkeypatch.delenv("LAZARUS_WORKDIR")
    dead = subprocess.Popen(["true"])
    dead.wait()
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=["127.0.0.1:1"], pid=dead.pid,
                                                     workdir=str(tmp_path / "up")))
    assert default_workdir() == Path("/tmp/lazarus")           # that cluster is gone


def test_an_endpoint_file_whose_workdir_is_garbage_is_no_cluster(tmp_path, monkeypatch):
    import json

    from lazarus.core import endpoint_file
    from lazarus.sim.chaos import default_workdir

    monkeypatch.delenv("LAZARUS_WORKDIR", raising=False)
    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path / "home"))
    path = endpoint_file.default_path()
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=["127.0.0.1:1"], pid=os.getpid()))
    for garbage in (123, ["/x"], {"a": 1}, None):
        doc = json.loads(path.read_text())
        doc["workdir"] = garbage
        path.write_text(json.dumps(doc))
        assert endpoint_file.read(path).workdir is None
        assert default_workdir() == Path("/tmp/lazarus")
    path.write_text("{not json")
    assert default_workdir() == Path("/tmp/lazarus")  # `lazarus status` names that file's fault


def test_the_clock_of_timed_items_runs_only_while_every_rank_is_joined():
    """A loaded machine's ranks that import their framework for 20 s, a recovery's restart:
    neither counts, so `kill-worker@6s` meets a script that has run 6 s."""
    clock = chaos.RunClock()
    assert clock.advance(100.0, False) is None          # the ranks still start
    assert clock.advance(120.0, True) == 0.0            # all joined: the clock starts
    assert clock.advance(124.0, True) == 4.0
    fault = chaos.parse_schedule("kill-worker@6s")[0]
    assert not fault.due(0, clock.advance(125.0, True))
    assert clock.advance(127.0, False) == 7.0           # struck at 6 s; a new round starts
    assert clock.advance(160.0, False) == 7.0           # its ranks import: stopped
    assert clock.advance(161.0, True) == 7.0
    assert clock.advance(163.5, True) == 9.5
    assert fault.due(0, clock.advance(163.5, True))


def test_a_scripts_run_counts_once_its_ranks_are_past_their_setups_collectives():
    """Joined is not running: Accelerate set itself up for over 3 s after its ranks joined on
    a loaded machine, and a fault at 3 s struck before its first step."""
    def status(node, *, round_=2, workers="running", collectives=-1):
        return NodeStatus(node=node, round=round_, workers=workers, collectives=collectives)

    members = ["n0", "n1"]
    past = {n: status(n, collectives=chaos.LOOP_COLLECTIVES) for n in members}
    assert chaos.running("RUNNING", members, 2, past)
    # a script whose collectives nobody counts (it reports its steps): joined is enough
    assert chaos.running("RUNNING", members, 2, {n: status(n) for n in members})
    setup = {**past, "n1": status("n1", collectives=3)}
    assert not chaos.running("RUNNING", members, 2, setup)
    assert not chaos.running("RUNNING", members, 2, {**past, "n1": status("n1", workers="starting")})
    assert not chaos.running("RUNNING", members, 2, {**past, "n1": status("n1", round_=1)})
    assert not chaos.running("RUNNING", members, 2, {"n0": past["n0"]})
    assert not chaos.running("RECOVERING", members, 2, past)
    assert not chaos.running("RUNNING", [], 2, past)
