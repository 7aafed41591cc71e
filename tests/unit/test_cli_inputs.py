"""Bad input to the control-plane commands: one clear line, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lazarus.sim import chaos
from lazarus.core.errors import UserError
from lazarus.core.etcd import parse_endpoint
from lazarus.core.records import NodeStatus, RecordError, RunStatus
from tests.forkedcli import run_cli_forked


def lazarus(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_chaos_schedule_parses_and_sorts():
    faults = chaos.parse_schedule("kill-node@30:n1, kill-worker@10,kill-daemon@20")
    assert [(f.kind, f.step, f.target) for f in faults] == [
        ("kill-worker", 10, None), ("kill-daemon", 20, None), ("kill-node", 30, "n1")]
    assert chaos.parse_schedule("") == []


@pytest.mark.parametrize("spec, expect", [
    ("explode@3", "unknown fault 'explode'"),
    ("kill-worker", "is not KIND@STEP"),
    ("kill-worker@x", "is not KIND@STEP"),
    ("kill-worker@0", "at least 1"),
    ("kill-daemon@5:n1", "takes no target"),
    ("diverge@5:n1", "takes no target"),
])
def test_bad_chaos_schedule(spec, expect):
    with pytest.raises(UserError, match=expect):
        chaos.parse_schedule(spec)


@pytest.mark.parametrize("endpoint, expect", [
    ("127.0.0.1:2379", ("127.0.0.1", 2379)),
    ("http://etcd.local:23790/", ("etcd.local", 23790)),
])
def test_endpoint_parsing(endpoint, expect):
    assert parse_endpoint(endpoint) == expect


@pytest.mark.parametrize("endpoint", ["localhost", ":2379", "host:99999", "host:abc", ""])
def test_bad_endpoint(endpoint):
    with pytest.raises(UserError, match="is not HOST:PORT"):
        parse_endpoint(endpoint)


@pytest.mark.parametrize("raw, expect", [
    (b"nope", "not JSON"),
    (b"[1]", "expected a JSON object"),
    (b'{"job_id": "J"}', "missing field 'state'"),
    (b'{"job_id": "J", "state": "DANCING"}', "unknown state"),
    (b'{"job_id": "J", "state": "RUNNING", "round": "3"}', "wrong type"),
    (b'{"job_id": "J", "state": "RUNNING", "round": true}', "wrong type"),
])
def test_garbage_run_status_is_a_record_error(raw, expect):
    with pytest.raises(RecordError, match=expect):
        RunStatus.from_json(raw)


def test_record_round_trip():
    ns = NodeStatus(node="n0", round=3, workers="running", step=7, exit_codes={"1": -9})
    assert NodeStatus.from_json(ns.to_json()) == ns


@pytest.mark.parametrize("anew", ['["failed first"]', '{"failed first": 1}',
                                  '{"failed first": ["1"]}'])
def test_a_garbled_reason_for_ranks_started_anew_is_a_record_error(anew):
    raw = ('{"node": "n0", "round": 3, "workers": "running", "anew": %s}' % anew).encode()
    with pytest.raises(RecordError, match="field 'anew' has the wrong type"):
        NodeStatus.from_json(raw)


BAD_COMMAND_LINES = [
    (["up", "--nodes", "2", "--dp", "3"], "--dp 3 x --tp 1 = 3 ranks"),
    (["up", "--chaos", "kill-everything@3"], "unknown fault"),
    (["up", "--nproc-per-node", "2", "--tp", "4"], "tp=4 must divide nproc_per_node=2"),
    (["up", "--lease-ttl", "1"], "--lease-ttl must be a whole number of seconds >= 2"),
    (["agent", "--lease-ttl", "1"], "--lease-ttl must be a whole number of seconds >= 2"),
    (["daemon", "--lease-ttl", "0"], "--lease-ttl must be a whole number of seconds >= 2"),
    (["up", "--hang-k", "1"], "--hang-k must be above 1"),
    (["up", "--rdzv-timeout", "0"], "--rdzv-timeout must be a positive number of seconds"),
    (["up", "--hang-floor", "0"], "--hang-floor must be positive"),
    (["up", "--model", "gigantic"], "gigantic"),
    (["up", "--steps", "0"], "--steps must be at least 1"),
    (["up", "--replicas", "0"], "--replicas must be at least 1"),
    (["up", "--replicas", "2", "--", "python", "train.py"], "a script of your own runs as one world"),
    (["up", "--nodes", "3", "--replicas", "2"], "replicas = 2 must divide nodes = 3"),
    (["up", "--replicas", "2", "--memory-every", "3"], "takes no tier-0 snapshots"),
    (["up", "--policy", "swap_cost_s"], "--policy 'swap_cost_s' is not KEY=VALUE"),
    (["up", "--policy", "straggler_margin=0.5"], "straggler_margin must be a number above 1"),
    (["up", "--policy", "swap_cost_s=soon"], "'soon' is not a number"),
    (["agent", "--nproc", "0"], "--nproc must be at least 1"),
    (["agent", "--role", "boss"], "--role must be active or spare"),
    (["daemon", "--etcd", "nonsense"], "is not HOST:PORT"),
    (["daemon", "--etcd", "a:2379,b"], "etcd endpoint 'b' (in 'a:2379,b') is not HOST:PORT"),
    (["daemon", "--compact-every", "-1"], "--compact-every must be 0 (never) or a number"),
    (["daemon", "--retention", "events=0"], "--retention events must be at least 1"),
    (["daemon", "--retention", "weeks=2"], "--retention: unknown kind 'weeks'"),
    (["agent", "--status-period", "0"], "--status-period must be positive"),
    (["agent", "--long-phase-floor", "0"], "--long-phase-floor must be above 0 and at most"),
    (["agent", "--preflight-every", "-1"], "--preflight-every must be 0 (only at start) or"),
    (["agent", "--flight-entries", "-5"], "--flight-entries must be 0 (no flight recorder) or"),
    (["agent", "--first-step-timeout", "0"], "--first-step-timeout and --rank-log-mb must be"),
    (["agent", "--hang-k", "1"], "--hang-k must be above 1 and --hang-floor positive"),
    (["agent", "--min-free-mb", "-1"], "--min-free-mb must not be negative"),
    (["agent", "--tier0-memory-mb", "0"], "--tier0-memory-mb must be positive"),
    (["agent", "--rank-log-mb", "-1"], "--first-step-timeout and --rank-log-mb must be"),
    (["up", "--first-step-timeout", "0"], "--first-step-timeout must be positive"),
    (["up", "--chaos", "hang@5s"], "injects hang at a step, not at a time"),
    (["up", "--chaos", "hang@5", "--", "python", "-c", "pass"], "the built-in trainer injects hang"),
    (["run", "--nodes", "2"], "no command: put it after --"),
    (["run", "--env", "NOEQUALS", "--", "python", "-c", "pass"], "--env 'NOEQUALS' is not NAME=VALUE"),
    (["run", "--nodes", "0", "--", "python", "-c", "pass"], "--nodes must be at least 1"),
    (["run", "--", "python", "missing-train.py"], "'missing-train.py' is not a readable file"),
    (["worker", "--zygote", "999"], "--zygote 999: not an open socket"),
    (["up", "--run-as", "no-such-user-x"], "--run-as 'no-such-user-x': no such user"),
    (["up", "--run-as", "root"], "--run-as 'root': that is root"),
    (["agent", "--run-as", "someone:wheel"], "give a user name, or UID[:GID] in numbers"),
    (["agent", "--run-as", "0"], "--run-as '0': that is root"),
]


def _argv(args: list[str], workdir) -> list[str]:
    if args[0] == "up":
        return [*args, "--workdir", str(workdir)]
    if args[0] == "agent":
        return [*args, "--etcd", "127.0.0.1:9", "--workdir", str(workdir)]
    return args


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[int, subprocess.CompletedProcess]:
    """Case index -> what `lazarus ARGS` did, every case of BAD_COMMAND_LINES."""
    root = tmp_path_factory.mktemp("bad-command-lines")
    argvs = [_argv(args, root / str(i)) for i, (args, _) in enumerate(BAD_COMMAND_LINES)]
    return dict(enumerate(run_cli_forked(argvs)))


@pytest.mark.parametrize("case", range(len(BAD_COMMAND_LINES)),
                         ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines(case, refused):
    expect = BAD_COMMAND_LINES[case][1]
    line = one_error_line(refused[case])
    assert expect in line, line


def test_missing_etcd_binary_says_how_to_install(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no etcd on this PATH
    line = one_error_line(lazarus("daemon", "--etcd", "embedded", env=env))
    assert "apt-get install -y etcd-server" in line


def test_chaos_gpu_fault_is_written_where_the_agent_reads_it(tmp_path):
    proc = lazarus("chaos", "gpu-xid", "--node", "n1", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    from lazarus.agent.gpu_sim import parse_faults
    (fault,) = parse_faults((tmp_path / "n1.gpu-faults.json").read_text())
    assert (fault.fault, fault.params["code"]) == ("xid", 79)


def test_chaos_needs_a_node():
    assert "needs --node" in one_error_line(lazarus("chaos", "kill-worker"))


def test_chaos_slow_rank_is_read_by_the_workers_of_that_node(tmp_path):
    from lazarus.sim.trainer_faults import Slowdown
    slow = Slowdown(str(chaos.slowdown_script(tmp_path, "n1")))
    assert slow.refresh() == 1.0                      # no script yet: full speed
    proc = lazarus("chaos", "slow-rank", "--node", "n1", "--workdir", str(tmp_path),
                   "--factor", "3")
    assert proc.returncode == 0, proc.stderr
    assert slow.refresh() == 3.0
    assert lazarus("chaos", "slow-rank", "--node", "n1", "--workdir", str(tmp_path),
                   "--factor", "1").returncode == 0
    assert slow.refresh() == 1.0
    assert "--factor must be at least 1" in one_error_line(
        lazarus("chaos", "slow-rank", "--node", "n1", "--workdir", str(tmp_path),
                "--factor", "0.5"))


def test_lazarus_up_refuses_a_workdir_that_holds_a_previous_run(tmp_path):
    """Run twice in one workdir, `lazarus up` reported the old run's SUCCEEDED from the etcd
    data left there, without training."""
    (tmp_path / "etcd" / "member").mkdir(parents=True)
    line = one_error_line(lazarus("up", "--workdir", str(tmp_path), "--steps", "4"))
    assert f"--workdir {tmp_path} holds a previous run (etcd)" in line
    assert "give a new --workdir" in line
