"""A rank whose agent goes away, over the real channel: it reconnects to the next agent on
the same socket, hands it what it still owed (a commit), starts no checkpoint meanwhile, and
stops by itself, with an exit note, when no agent comes back within its grace."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys

import psutil

from lazarus.agent.channel import Channel, descends_from
from lazarus.core import exitcodes
from lazarus.core.contract import AGENT_GRACE_ENV, SOCKET_ENV, STACKS_ENV, exit_note_path

# A rank's side, driven line by line from stdin; it answers on stdout.
RANK = """
import sys
from lazarus.trainer.session import connect
session = connect(rank=3, round=7)
print("connected", flush=True)
for line in sys.stdin:
    cmd, step = line.split()
    if cmd == "committed":
        session.checkpoint_committed(int(step), "/ckpt/" + step)
    elif cmd == "checkpoint":
        print("checkpoint", session.should_checkpoint(int(step), every=4), flush=True)
    elif cmd == "commit?":
        print("may_commit", session.may_commit(int(step)), flush=True)
"""


class Agent:
    """The agent's end: a real Channel; what it receives, in order."""

    def __init__(self, path: str):
        self.got: queue.Queue[dict] = queue.Queue()
        # The ranks are this test's children, as an agent's workers are its own.
        self.channel = Channel(path, on_message=self._on_message,
                               admit=lambda pid: descends_from(pid, {os.getpid()}))

    def _on_message(self, msg: dict) -> dict | None:
        self.got.put(msg)
        return {"type": "may_commit", "ok": True} if msg["type"] == "may_commit" else None

    def next(self, kind: str) -> dict:
        while True:
            msg = self.got.get(timeout=30)
            if msg["type"] == kind:
                return msg


def _rank(tmp_path, grace_s: float) -> subprocess.Popen:
    env = {**os.environ, SOCKET_ENV: str(tmp_path / "agent.sock"), AGENT_GRACE_ENV: str(grace_s),
           STACKS_ENV: str(tmp_path / "stacks")}
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline() == "connected\n"
    return proc


def _tell(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_a_rank_reconnects_to_the_next_agent_and_hands_over_its_commit(tmp_path):
    first = Agent(str(tmp_path / "agent.sock"))
    proc = _rank(tmp_path, grace_s=60)
    try:
        assert first.next("hello")["pid"] == proc.pid
        first.channel.close()  # the agent dies (or stops for an upgrade)
        _tell(proc, "committed 8")  # a checkpoint the rank committed while no agent was there
        second = Agent(str(tmp_path / "agent.sock"))
        hello = second.next("hello")
        assert (hello["pid"], hello["rank"], hello["round"]) == (proc.pid, 3, 7)
        committed = second.next("committed")
        assert (committed["step"], committed["path"]) == (8, "/ckpt/8")
        _tell(proc, "commit? 12")
        assert proc.stdout.readline() == "may_commit True\n"
        second.channel.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_whose_agent_stays_away_starts_no_checkpoint_and_stops_itself(tmp_path):
    agent = Agent(str(tmp_path / "agent.sock"))
    proc = _rank(tmp_path, grace_s=1)
    started = psutil.Process(proc.pid).create_time()
    agent.next("hello")
    agent.channel.close()
    assert "the agent is gone" in proc.stderr.readline()
    _tell(proc, "checkpoint 4")  # due, but nobody can say whether its round is still current
    assert proc.wait(timeout=60) == exitcodes.ORPHANED  # stdin still open: it did not just end
    assert "checkpoint" not in proc.stdout.read()
    assert "no agent came back within 1 s" in proc.stderr.read()
    # the note an adopting agent would read: this process's code, with its start time
    note = json.loads(exit_note_path(tmp_path / "stacks", proc.pid).read_text())
    assert note == {"pid": proc.pid, "started": started, "code": exitcodes.ORPHANED}
