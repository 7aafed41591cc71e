"""trainer/examples/plain_fsdp.py, the user's own FSDP2 loop with Lazarus's hooks, run as a user
runs it: torchrun with two gloo ranks, alone, under Lazarus's etcd rendezvous, and talking to a
real node agent that fences its commits.

About 1 torchrun launch in 40 here ends with a rank aborting in C++ teardown after the script
finished ("terminate called without an active exception", docs/constraints.md). `launch`
accepts a non-zero exit only with that message AND the script's last line printed: the work
was done.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.service import Agent
from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.records import CheckpointRecord, Keys
from lazarus.trainer.ckptverify import verify_checkpoint

SCRIPT = Path(__file__).parents[2] / "trainer" / "examples" / "plain_fsdp.py"
EXIT_ABORT = "terminate called without an active exception"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm (\S+)$", re.M)
pytestmark = pytest.mark.usefixtures("elastic_logs_in_tmp")


def launch(*args: str, rdzv: list[str] | None = None, env: dict | None = None) -> str:
    """The script on two ranks; rank 0's output once it finished."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *(rdzv or ["--standalone"]),
           "--nproc-per-node", "2", str(SCRIPT), *args]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        finished = EXIT_ABORT in proc.stderr and "done at step" in proc.stdout
        assert finished, proc.stdout + proc.stderr
    return proc.stdout


def losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss, _ in STEP_LINE.findall(out)}


def registered(client: E.Etcd, keys: Keys, step: int) -> CheckpointRecord:
    """The agent's claim of a commit (no daemon here to make it a record); the script's
    report of it may still be on its way."""
    deadline = time.monotonic() + 30
    while (kv := client.get(keys.claim_key(step))) is None:
        assert time.monotonic() < deadline, f"checkpoint {step} never registered"
        time.sleep(0.05)
    return CheckpointRecord.from_json(kv.value)


@pytest.fixture(scope="module")
def etcd_server():
    with EmbeddedEtcd() as server:
        yield server


def test_trains_commits_and_resumes_where_it_stopped(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = launch("--steps", "16", "--ckpt-every", "6", "--ckpt-dir", str(ckpt))
    run = losses(first)
    assert sorted(run) == list(range(1, 17)), first
    assert float(run[16]) < 0.6 * float(run[1]), run
    assert f"committed {ckpt / 'step-00000016'}" in first
    assert verify_checkpoint(ckpt / "step-00000016")["extra"]["step"] == 16
    # keep_last=2: step 12 is the one before; drop 16 and the next start resumes from 12
    shutil.rmtree(ckpt / "step-00000016")
    second = launch("--steps", "16", "--ckpt-every", "6", "--ckpt-dir", str(ckpt))
    assert f"resumed from {ckpt / 'step-00000012'} at step 12" in second
    # model, AdamW state and guard restored: the same numbers as the uninterrupted run
    assert losses(second) == {s: run[s] for s in (13, 14, 15, 16)}, second


def test_under_lazarus_rendezvous_and_agent_commits_are_registered(etcd_server, tmp_path):
    client = E.Etcd(etcd_server.endpoint)
    keys = Keys(f"/test/example/{uuid.uuid4().hex[:8]}/")
    agent = Agent(client, keys, AgentConfig(node="n0", nproc=2, role="active",
                                            workdir=tmp_path / "agent", park=False))
    try:
        client.put(keys.round, b"2")
        rdzv = ["--rdzv-backend", "lazarus-etcd", "--rdzv-endpoint", etcd_server.endpoint,
                "--rdzv-id", f"job-{uuid.uuid4().hex[:8]}", "--nnodes", "1"]
        ckpt = tmp_path / "ckpt"
        out = launch("--steps", "4", "--ckpt-every", "3", "--ckpt-dir", str(ckpt), rdzv=rdzv,
                     env={"LAZARUS_AGENT_SOCKET": agent.channel.path, "LAZARUS_ROUND": "2",
                          "LAZARUS_RDZV_KEY": uuid.uuid4().hex})
        assert "done at step 4" in out
        for step in (3, 4):  # the agent published each commit the current round made
            record = registered(client, keys, step)
            assert record.path == str(ckpt / f"step-{step:08d}") and record.round == 2

        # A worker of an old round writes its checkpoint but may not commit it.
        stale = tmp_path / "stale"
        out = launch("--steps", "3", "--ckpt-every", "3", "--ckpt-dir", str(stale),
                     env={"LAZARUS_AGENT_SOCKET": agent.channel.path, "LAZARUS_ROUND": "1"})
        assert "committed None" in out
        assert not (stale / "step-00000003" / "manifest.json").exists()
    finally:
        agent.shutdown()
        client.close()


@pytest.mark.parametrize("args,env,message", [
    (["--steps", "0"], {"RANK": "0"}, "--steps must be at least 1, got 0"),
    ([], {}, "not started by torchrun (RANK is unset); run: torchrun --standalone "
             "--nproc-per-node 2 trainer/examples/plain_fsdp.py"),
])
def test_bad_arguments_are_one_clear_line(args, env, message):
    base = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"plain_fsdp.py: error: {message}"
    assert "Traceback" not in proc.stderr
