"""[job] command: its shape, whether this machine can run it, and how a Python command is run
inside a parked worker (lazarus.core.jobcommand)."""

from __future__ import annotations

import os
import sys

import pytest

from lazarus.core import jobcommand, jobspec
from lazarus.core.contract import WorkerAssignment, torchrun_env
from lazarus.core.errors import UserError
from lazarus.sim import chaos


def test_the_built_in_trainer_is_the_default_command():
    job = jobspec.from_dict({"job": {"name": "j"}, "train": {}}, source="t")
    assert job.builtin and tuple(job.command) == jobcommand.BUILTIN
    own = jobspec.from_dict({"job": {"command": ["python", "train.py"]}}, source="t")
    assert not own.builtin and own.train == {}
    assert jobspec.JobSpec.from_json(own.to_json()).command == ["python", "train.py"]


@pytest.mark.parametrize("job, words", [
    ({"command": []}, "[job] command must be a non-empty list of strings"),
    ({"command": "python train.py"}, "[job] command must be a non-empty list of strings"),
    ({"command": ["python", 3]}, "[job] command must be a non-empty list of strings"),
    ({"command": ["x"], "env": {"A=B": "1"}}, "[job] env must be a table"),
    ({"command": ["x"], "env": {"A": 1}}, "[job] env must be a table"),
    ({"command": ["x"], "cwd": "relative/dir"}, "[job] cwd must be an absolute path"),
    ({"command": ["x"], "env": {f"V{i}": "y" * 4000 for i in range(20)}},
     "[job] command and env hold 80051 characters; at most 65536"),
])
def test_a_malformed_command_is_one_line(job, words):
    with pytest.raises(UserError, match=r"^t: " + words.replace("[", r"\[").replace("]", r"\]")):
        jobspec.from_dict({"job": job}, source="t")


def test_runnable_here(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    jobcommand.check_runnable(["python", "train.py"], cwd=str(tmp_path))
    jobcommand.check_runnable(["python", "-u", str(script), "--lr", "1"], cwd=None)
    jobcommand.check_runnable(["python", "-m", "json.tool"], cwd=None)
    jobcommand.check_runnable(["sh", "-c", "true"], cwd=None)
    with pytest.raises(UserError, match="'missing.py' is not a readable file in"):
        jobcommand.check_runnable(["python", "missing.py"], cwd=str(tmp_path))
    with pytest.raises(UserError, match="'no-such-tool' is not on PATH here, nor a file"):
        jobcommand.check_runnable(["no-such-tool"], cwd=None)
    with pytest.raises(UserError, match="is not an executable file"):
        jobcommand.check_runnable([str(script)], cwd=None)  # not executable
    with pytest.raises(UserError, match="is not a directory here"):
        jobcommand.check_runnable(["python", "train.py"], cwd=str(tmp_path / "gone"))


@pytest.mark.parametrize("command, expect", [
    (["python", "train.py", "--lr", "1"], ("script", "train.py", ["train.py", "--lr", "1"])),
    (["python3", "-u", "-W", "ignore", "t.py"], ("script", "t.py", ["t.py"])),
    (["python", "-m", "pkg.train", "-x"], ("module", "pkg.train", ["pkg.train", "-x"])),
    (["python", "-mpkg"], ("module", "pkg", ["pkg"])),
    (["python", "-c", "print(1)", "a"], ("code", "print(1)", ["-c", "a"])),
])
def test_a_python_command_is_run_as_the_interpreter_would(command, expect):
    assert jobcommand.runs_warm(command)
    assert jobcommand.split_python(command) == expect


def test_other_programs_are_executed():
    assert jobcommand.how_run(["bash", "train.sh"]) == jobcommand.PROGRAM
    assert jobcommand.how_run(["/opt/other/bin/python", "t.py"]) == jobcommand.OWN_PYTHON
    assert jobcommand.how_run(["/opt/conda/envs/x/bin/python3.12", "t.py"]) == jobcommand.OWN_PYTHON
    assert jobcommand.how_run(["/usr/bin/pythonista", "t.py"]) == jobcommand.PROGRAM
    assert jobcommand.runs_warm([sys.executable, "t.py"])


def test_a_venvs_python_is_told_from_ours(tmp_path):
    """A venv's python is a symlink to the same base interpreter as ours: what tells them
    apart is the venv it belongs to (its pyvenv.cfg), not the binary."""
    import venv

    venv.create(tmp_path / "theirs", symlinks=True, with_pip=False)
    theirs = tmp_path / "theirs" / "bin" / "python"
    assert os.path.realpath(theirs) == os.path.realpath(sys.executable)
    assert jobcommand.how_run([str(theirs), "train.py"]) == jobcommand.OWN_PYTHON
    # ours by another of its names is still ours
    ours = os.path.join(os.path.dirname(sys.executable), "python3")
    assert jobcommand.how_run([ours, "train.py"]) == jobcommand.WARM
    # the script of another interpreter is checked as a warm command's is
    with pytest.raises(UserError, match="'missing.py' is not a readable file"):
        jobcommand.check_runnable([str(theirs), "missing.py"], cwd=str(tmp_path))
    assert jobcommand.python_options([str(theirs), "-u", "-X", "dev", "t.py", "-u"]) == [
        "-u", "-X", "dev"]


def test_torchruns_environment():
    a = WorkerAssignment(rank=5, world_size=8, local_rank=1, round=7, store_host="10.0.0.1",
                         store_port=29400, train={}, job_id="J", group_rank=2,
                         group_world_size=4, local_world_size=2, restart_count=3,
                         max_restarts=20)
    env = torchrun_env(a, master_port=41000)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                                "TORCHELASTIC_MAX_RESTARTS",
                                "TORCHELASTIC_USE_AGENT_STORE")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2", "ROLE_RANK": "5", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41000",
        "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_RUN_ID": "J",
        "TORCHELASTIC_MAX_RESTARTS": "20", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_chaos_items_timed_in_seconds():
    faults = chaos.parse_schedule("kill-node@40s:n1,kill-worker@20s,kill-worker@5")
    assert [f.label for f in faults] == ["kill-worker@5", "kill-worker@20s", "kill-node@40s:n1"]
    timed = faults[1]
    assert not timed.due(step=1000, running_s=None) and not timed.due(step=0, running_s=19.9)
    assert timed.due(step=0, running_s=20.0)
    assert faults[0].due(step=5, running_s=None)
    with pytest.raises(UserError, match="injects hang at a step, not at a time"):
        chaos.parse_schedule("hang@10s")


def test_rank_logs_stay_within_their_bound(tmp_path):
    from lazarus.agent.workers import Group, KEEP_ROUNDS, Workers, rank_log, tail

    workers = Workers(nproc=1, env={}, log_dir=tmp_path, notes_dir=tmp_path, park=False,
                      log_bytes=1000)
    workers.group = Group(round=30, procs={}, ranks={0: 4})
    log = rank_log(tmp_path, 30, 4)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(300)))  # 2,790 bytes
    workers.bound_logs()
    assert log.stat().st_size == 0
    assert log.with_name("rank-4.log.1").read_text().endswith("line 299\n")
    log.write_text("short\n")
    workers.bound_logs()
    assert log.read_text() == "short\n"  # within the bound: left alone
    for r in (5, 10, 11, 30):
        rank_log(tmp_path, r, 0).parent.mkdir(parents=True, exist_ok=True)
    workers.prune_logs(30)
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-11", "round-30"]
    assert KEEP_ROUNDS == 20
    # the last whole lines within the bytes asked for
    log.write_text("first\nsecond\nthird\n")
    assert tail(log, 13) == "third"
    assert tail(log, 100) == "first\nsecond\nthird"
    assert tail(tmp_path / "none.log", 100) == ""


def test_a_scripts_collective_timeout_is_the_agents_not_torchs(monkeypatch):
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d
    from lazarus.core.contract import PG_TIMEOUT_ENV, SCRIPT_PG_TIMEOUT_ENV
    from lazarus.trainer.rankrun import collective_timeout

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        monkeypatch.setattr(c10d, name, getattr(c10d, name))  # put back after the test
    monkeypatch.delenv(PG_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(SCRIPT_PG_TIMEOUT_ENV, "600.0")
    assert collective_timeout() == 600.0
    # what init_process_group() uses when the script passes no timeout
    assert c10d._get_default_timeout(c10d.Backend("gloo")) == timedelta(seconds=600)
    monkeypatch.setenv(PG_TIMEOUT_ENV, "90")  # the operator's, first
    assert collective_timeout() == 90.0
    assert c10d._get_default_timeout(c10d.Backend("gloo")) == timedelta(seconds=90)


def test_a_chaos_item_waits_for_the_round_that_answers_the_one_before():
    import time

    from lazarus.core.records import EventRecord
    from lazarus.sim.up import _unanswered

    schedule = chaos.parse_schedule("stop-worker@5s,kill-node@6s,slow-rank@7s")
    assert not _unanswered(schedule, [])                       # nothing fired yet
    hang, node, slow = schedule
    hang.fired_at = time.time() - 10                           # a hang takes ~16 s to be seen
    assert _unanswered(schedule, [])
    answer = EventRecord(time=time.time() - 1, kind="round_started", message="round 3")
    assert not _unanswered(schedule, [answer])
    hang.fired_at = time.time() - 61                           # never answered: give up waiting
    assert not _unanswered(schedule, [])
    slow.fired_at = time.time()                                # a straggler gets no new round
    assert not _unanswered(schedule, [])
    # a fault the trainer injects after a node was killed does not answer the kill (CI: a
    # slow-step struck a step after kill-node, and the revival came before the node was lost)
    schedule = chaos.parse_schedule("kill-node@10:n1,revive-node@11:n1,slow-step@13")
    kill, _revive, stall = schedule
    kill.fired_at, stall.fired_at = time.time() - 1, time.time()
    assert _unanswered(schedule, [])
    assert not _unanswered(schedule, [EventRecord(time=time.time(), kind="round_started",
                                                  message="round 2")])


def test_a_stall_neither_ends_a_lost_nodes_window_nor_takes_its_detection(tmp_path):
    """CI: chaos struck kill-node@10 late, the trainer's slow-step@13 fired before the loss
    was seen, and the summary lost the node's detection (the stall closed its window)."""
    from lazarus.core.records import EventRecord
    from lazarus.sim.up import MetricsTail, _recoveries

    schedule = chaos.parse_schedule("kill-node@10:n1,revive-node@11:n1,slow-step@13,hang@20")
    kill, _revive, stall, hang = schedule
    t = 1000.0
    kill.fired_at, stall.fired_at, hang.fired_at = t, t + 1, t + 30
    kill.fired_step, stall.fired_step, hang.fired_step = 10, 13, 20
    events = [EventRecord(time=t + 4, kind="fault_detected", message="n1 lost",
                          fields={"kind": "node_lost", "node": "n1"}),
              EventRecord(time=t + 40, kind="fault_detected", message="hang",
                          fields={"kind": "hang", "culprit": "n0"})]
    got = _recoveries(schedule, events, MetricsTail(tmp_path / "none.jsonl"), [])
    assert [(r["kind"], r.get("detected_as"), r["culprit"]) for r in got] == [
        ("kill-node", "node_lost", "n1"), ("slow-step", None, None), ("hang", "hang", "n0")]
