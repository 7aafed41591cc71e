"""What a node agent trusts, with real sockets and processes: only its workers (and what they
start) may use its channel, its workdir is private, and its ranks get none of its secrets."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.agent.adopt import start_time
from lazarus.agent.channel import Channel, descends_from
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.service import Agent
from tests.integration.test_agent_adopt import ROUND, _agent_died, _run_status

# A process that talks on the channel, from `depth` generations below the one started: it
# waits for a go line on stdin (so the test knows its pid first), connects, sends a message
# and says whether the agent answered.
CLIENT = """
import socket, subprocess, sys
path, depth = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()
if depth:
    child = subprocess.run([sys.executable, __file__, path, str(depth - 1)], input="go\\n",
                           text=True)
    sys.exit(child.returncode)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(path)
try:
    s.sendall(b'{"type": "ping"}\\n')
    answer = s.makefile().readline()
except ConnectionError:  # closed with our message unread
    answer = ""
print("answered" if answer else "hung up", flush=True)
"""


# A rank of round ROUND as the trainer runs one: it reconnects to the next agent on the same
# socket, and, told to, asks that agent whether it may commit until it gets an answer.
RANK = f"""
import sys, time
from lazarus.trainer.session import Session
session = Session(socket_path=sys.argv[1], rank=0, round={ROUND}, agent_grace_s=60)
print("connected", flush=True)
sys.stdin.readline()
deadline = time.monotonic() + 60
while not (ok := session.may_commit(12)) and time.monotonic() < deadline:
    time.sleep(0.1)
print("may_commit", ok, flush=True)
sys.stdin.readline()
"""


def _start_agent(etcd, keys, workdir: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "agent", "--etcd", etcd.endpoint, "--root",
             keys.root, "--node", "n0", "--workdir", str(workdir), "--no-park",
             "--monitors", "off", "--lease-ttl", "10"], stdout=out, stderr=subprocess.STDOUT)


def _client(script: Path, path: str, depth: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), path, str(depth)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _talk(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate("go\n", timeout=60)
    return out.strip()


def _hung_up_on(path: str) -> bool:
    """Connect from this process; True when the other end closes without a word."""
    deadline = time.monotonic() + 30
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        while True:
            try:  # the socket file exists from bind(); it answers from listen(), just after
                s.connect(path)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, f"nobody listens on {path}"
                time.sleep(0.05)
        return s.recv(1) == b""


def test_only_workers_and_what_they_start_may_talk_to_the_agent(tmp_path, caplog):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    path = str(tmp_path / "agent.sock")
    workers: set[int] = set()
    channel = Channel(path, on_message=lambda msg: {"type": "pong"},
                      admit=lambda pid: descends_from(pid, workers))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        worker = _client(script, path)
        workers.add(worker.pid)
        assert _talk(worker) == "answered"
        # a rank's own child (a torch helper process, say), two generations down
        starter = _client(script, path, depth=2)
        workers.add(starter.pid)
        assert _talk(starter) == "answered"

        # the same user, but no worker's descendant: this test process, and its other child
        stranger = _client(script, path)
        assert _talk(stranger) == "hung up"
        assert _hung_up_on(path) and _hung_up_on(path)
        refusals = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("refused a connection")]
        assert refusals == [
            f"refused a connection to {path} from pid {stranger.pid} (uid {os.geteuid()}): "
            "not one of this agent's workers",
            f"refused a connection to {path} from pid {os.getpid()} (uid {os.geteuid()}): "
            "not one of this agent's workers"]  # each once, however often it tries
    finally:
        channel.close()


def test_an_agent_hangs_up_on_a_process_it_did_not_start(etcd, keys, tmp_path):
    workdir = tmp_path / "agent"  # created by the agent
    log = tmp_path / "agent.log"
    agent = _start_agent(etcd, keys, workdir, log)
    try:
        sock = workdir / "n0.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert agent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
        # This test started the agent: its parent, same user, but none of its workers.
        assert _hung_up_on(str(sock)) and _hung_up_on(str(sock))
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    text = log.read_text()
    assert text.count(f"refused a connection to {sock} from pid {os.getpid()}") == 1, text


def test_a_rank_left_by_the_previous_agent_is_admitted_by_the_next(etcd, keys, tmp_path):
    """The ranks a new agent adopts are not its descendants (their parent was the agent
    before it): they are admitted as its workers all the same."""
    workdir = tmp_path / "agent"
    workdir.mkdir(mode=0o700)
    sock = str(workdir / "n0.sock")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # The agent before: this test process, whose child the rank is.
    before = Channel(sock, on_message=lambda msg: None,
                     admit=lambda pid: descends_from(pid, {os.getpid()}))
    rank = subprocess.Popen([sys.executable, str(script), sock], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    agent = None
    try:
        assert rank.stdout.readline() == "connected\n"
        _run_status(etcd, keys)
        _agent_died(etcd, keys, workdir, {0: (rank.pid, start_time(rank.pid))})
        before.close()
        log = tmp_path / "agent.log"
        agent = _start_agent(etcd, keys, workdir, log)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert rank.stdout.readline() == "may_commit True\n", log.read_text()
        assert "refused a connection" not in log.read_text()
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=60)
        rank.kill()
        rank.wait()


@pytest.mark.parametrize("mode, message", [
    (0o755, "is open to other users (mode 0755); `chmod 700"),
    (None, "is a symlink; give the directory itself"),
])
def test_an_agent_refuses_a_workdir_others_can_enter(etcd, keys, tmp_path, mode, message):
    workdir = tmp_path / "shared"
    if mode is None:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        workdir.symlink_to(tmp_path / "elsewhere")
    else:
        workdir.mkdir()
        workdir.chmod(mode)
    proc = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "agent", "--etcd", etcd.endpoint, "--root",
         keys.root, "--node", "n0", "--workdir", str(workdir), "--no-park"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"lazarus agent: error: --workdir {str(workdir)!r} {message}" + (
            f" {workdir}`, or give another directory" if mode else "")]


def test_ranks_get_none_of_the_agents_secrets(etcd, keys, tmp_path, monkeypatch):
    secrets = {"LAZARUS_TOKEN": "admin-secret", "LAZARUS_READ_TOKEN": "reader-secret",
               "LAZARUS_RDZV_KEY": "rendezvous-secret", "ETCDCTL_PASSWORD": "etcd-secret"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    agent = Agent(etcd, keys, AgentConfig(node="n0", nproc=1, role="active",
                                          workdir=tmp_path / "agent", park=True))
    try:
        for _ in range(2400):  # a parked worker, the process a rank runs in, forked from
            agent.workers.refill()  # the zygote once that has imported everything
            if agent.workers.parked:
                break
            time.sleep(0.05)
        (worker,) = agent.workers.parked
        environ = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
        names = {entry.partition(b"=")[0].decode() for entry in environ if entry}
        assert "LAZARUS_AGENT_SOCKET" in names and not names & set(secrets)
        # and a share of the host's cores for its intra-op threads, not one thread per core
        # in every rank
        assert f"OMP_NUM_THREADS={len(os.sched_getaffinity(0))}".encode() in environ
        assert not any(v.encode() in entry for v in secrets.values() for entry in environ)
    finally:
        agent.shutdown()
