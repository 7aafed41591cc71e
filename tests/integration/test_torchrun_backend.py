"""`torchrun --rdzv-backend lazarus-etcd` with a user's plain script, against a real etcd.

Two torchrun processes on this machine play two nodes; their workers talk gloo. torchrun
finds the backend through the `torchrun.handlers` entry point of the installed package.

About 1 launch in 40 here ends with a rank aborting in C++ teardown after the script finished
("terminate called without an active exception", docs/constraints.md). `run_job` accepts a
non-zero exit only with that message AND every rank's result printed: the work was done. Any
other failure fails the test.
"""

import os
import pickle
import re
import socket
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.etcd import Etcd
from lazarus.core.sealed import seal
from lazarus.rendezvous import (
    KEY_ENV,
    EtcdRendezvousBackend,
    EtcdSpace,
    EtcdStore,
    RendezvousEtcdConfig,
    make_handler,
)

SCRIPT = Path(__file__).parent / "scripts" / "user_allreduce.py"
EXIT_ABORT = "terminate called without an active exception"
pytestmark = pytest.mark.usefixtures("elastic_logs_in_tmp")
# The key every agent of these jobs shares.
KEY = "k" * 16 + uuid.uuid4().hex


class Planted:
    """What someone who can write to etcd would put there: unpickled, it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        yield server


def torchrun(endpoint: str, run_id: str, *, nnodes: str, max_restarts: int = 0,
             script_args: tuple[str, ...] = (), rdzv_conf: str = "",
             key: str = KEY) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "lazarus-etcd",
           "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--nnodes", nnodes,
           "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
           "--monitor-interval", "0.1"]
    if rdzv_conf:
        cmd += ["--rdzv-conf", rdzv_conf]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE is left unset on purpose: the backend must make
    # restarts work by itself.
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return subprocess.Popen(cmd + [str(SCRIPT), *script_args],
                            env={**env, "OMP_NUM_THREADS": "1", KEY_ENV: key},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def new_run_id() -> str:
    return f"job-{uuid.uuid4().hex[:8]}"


def run_job(endpoint: str, run_id: str, *, nodes: int = 2, nnodes: str = "2", **kw) -> list[str]:
    """Start `nodes` torchrun agents of one job; all stdout lines once every agent finished."""
    agents = [torchrun(endpoint, run_id, nnodes=nnodes, **kw) for _ in range(nodes)]
    outs = [a.communicate(timeout=120) for a in agents]
    lines = [line for out, _ in outs for line in out.splitlines()]
    results = [line for line in lines if line.startswith("result ")]
    for agent, (out, err) in zip(agents, outs):
        if agent.returncode != 0:
            assert EXIT_ABORT in err and len(results) == nodes, f"agent failed:\n{out}\n{err}"
    return lines


def test_two_torchrun_agents_run_a_plain_script(etcd):
    run_id = new_run_id()
    # Elastic 1..2 nodes: both agents start together, so the round fills up to 2 at once.
    lines = run_job(etcd.endpoint, run_id, nnodes="1:2")
    assert sorted(line for line in lines if line.startswith("result ")) == [
        "result rank=0 world=2 sum=3", "result rank=1 world=2 sum=3"]

    # The finished job's rendezvous is closed; a new job under the same id is told why.
    again = torchrun(etcd.endpoint, run_id, nnodes="1")
    _, err = again.communicate(timeout=60)
    assert again.returncode != 0
    assert "give this job its own --rdzv-id" in err, err


def test_a_crashed_worker_is_restarted_and_the_job_completes(etcd, tmp_path):
    marker = tmp_path / "crashed"
    lines = run_job(etcd.endpoint, new_run_id(), max_restarts=1,
                    script_args=("--crash-once", str(marker)))
    assert "crashing rank=0" in lines  # the first attempt did fail
    assert sorted(line for line in lines if line.startswith("result ")) == [
        "result rank=0 world=2 sum=3", "result rank=1 world=2 sum=3"]


def test_a_planted_state_is_never_unpickled_and_the_job_runs_over_it(etcd, tmp_path):
    run_id = new_run_id()
    marker = tmp_path / "planted-ran"
    client = Etcd(etcd.endpoint)
    try:
        client.put(f"/lazarus/v1/torchrun/{run_id}/state", pickle.dumps(Planted(marker)))
    finally:
        client.close()
    agent = torchrun(etcd.endpoint, run_id, nnodes="1")
    out, err = agent.communicate(timeout=120)
    assert "result rank=0 world=1 sum=1" in out, out + err
    assert agent.returncode == 0 or EXIT_ABORT in err, err
    assert not marker.exists()
    assert f"refusing /lazarus/v1/torchrun/{run_id}/state in etcd" in err, err
    assert "it carries no tag" in err


@pytest.fixture
def space(etcd):
    client = Etcd(etcd.endpoint)
    yield EtcdSpace(client, RendezvousEtcdConfig(etcd_timeout_s=5, seal_key=KEY.encode()))
    client.close()


def test_only_values_sealed_with_the_jobs_key_are_unpickled(space, tmp_path):
    run_id = f"forged-{uuid.uuid4().hex[:8]}"
    backend = EtcdRendezvousBackend(space, run_id)
    marker = tmp_path / "planted-ran"
    evil = pickle.dumps(Planted(marker))
    forgeries = [evil,                                                    # no seal at all
                 seal(b"another key of 16+ chars", backend.key.encode(), evil),  # wrong key
                 seal(KEY.encode(), b"/elsewhere/state", evil)]           # sealed for elsewhere
    for forged in forgeries:
        space.etcd.put(backend.key, forged)
        state, token = backend.get_state()
        # What torch unpickles is an empty state of our own making, never the value in etcd.
        assert vars(pickle.loads(state)) == vars(_RendezvousState())
        assert not marker.exists()
    # The planted value counts as no state: the agents' next write replaces it.
    state, token2, won = backend.set_state(b"real state", token)
    assert (state, won) == (b"real state", True)
    assert backend.get_state() == (b"real state", token2)
    # ... and the store ignores a planted key.
    store = EtcdStore(space, backend.store_prefix, timeout=timedelta(seconds=0.2))
    space.etcd.put(backend.store_prefix + "addr", b"attacker:1")
    assert not store.check(["addr"])
    store.set("addr", "host:1")
    assert store.get("addr") == b"host:1"


def test_set_state_is_compare_and_set_on_the_token(space):
    run_id = f"cas-{uuid.uuid4().hex[:8]}"
    a, b = EtcdRendezvousBackend(space, run_id), EtcdRendezvousBackend(space, run_id)
    assert a.get_state() is None

    state1, token1, won = a.set_state(b"one")
    assert (state1, won) == (b"one", True)
    # Without a token a write only creates: b sees a's state and loses.
    assert b.set_state(b"two") == (b"one", token1, False)

    state2, token2, won = b.set_state(b"two", token1)
    assert (state2, won) == (b"two", True) and token2 != token1
    # a still holds token1: stale, so it loses and learns the current state and token.
    assert a.set_state(b"three", token1) == (b"two", token2, False)
    assert a.get_state() == (b"two", token2)


def test_store_counts_waits_and_is_cleared_for_a_new_run(space):
    run_id = f"store-{uuid.uuid4().hex[:8]}"
    backend = EtcdRendezvousBackend(space, run_id)
    store = EtcdStore(space, backend.store_prefix, timeout=timedelta(seconds=1))
    assert [store.add("n", 1), store.add("n", 2)] == [1, 3]
    with pytest.raises(dist.DistStoreError):
        store.get("never-set")
    # Wrapped the way torch wraps it per round.
    dist.PrefixStore("round.0", store).set("addr", "host:1")
    assert dist.PrefixStore("round.0", store).get("addr") == b"host:1"
    # The store keys above predate the state: creating the state (a new incarnation of this
    # run id) drops them, so a reused run id never reads an old job's round-0 address.
    backend.set_state(b"fresh")
    assert not store.check(["n"]) and not store.check(["round.0/addr"])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_etcd_fails_fast_with_a_clear_message():
    endpoint = f"127.0.0.1:{closed_port()}"
    agent = torchrun(endpoint, "job-unreachable", nnodes="1", rdzv_conf="etcd_timeout=2")
    # A hang would outlast this (torch's default join timeout is 600 s).
    _, err = agent.communicate(timeout=60)
    assert agent.returncode != 0
    assert f"etcd at {endpoint} did not answer for 2 s" in err, err


@pytest.mark.parametrize("endpoint, conf, message", [
    ("no-port-here", {}, "is not HOST:PORT"),
    ("127.0.0.1:2379", {"etcd_timeout": "soon"}, "etcd_timeout='soon' is not a number"),
    ("127.0.0.1:2379", {"state_ttl": "10"}, "state_ttl=10 must be at least three keep_alive"),
    ("127.0.0.1:2379", {"key_prefix": "jobs"}, "must start with '/'"),
    ("127.0.0.1:2379", {"insecure": "maybe"}, "insecure='maybe' is not 1 or 0"),
    ("127.0.0.1:2379", {"key_file": "/nonexistent/key"}, "key_file file '/nonexistent/key' is "
                                                         "unreadable"),
])
def test_bad_rendezvous_options_are_named(endpoint, conf, message, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    # Checked before any etcd client exists, so this costs no torchrun launch.
    params = RendezvousParameters("lazarus-etcd", endpoint, "job", 1, 2, **conf)
    with pytest.raises(ValueError, match=message):
        make_handler(params)


def test_a_secure_etcd_is_reached_with_the_tls_files_and_user_of_rdzv_conf():
    """torchrun hands --rdzv-conf over as strings: the TLS files and user come through."""
    with EmbeddedEtcd(secure=True) as server:
        security = server.security
        conf = ",".join([f"etcd_ca={security.ca.ca_file}", f"etcd_cert={security.client.cert}",
                         f"etcd_key={security.client.key}", "etcd_user=lazarus-daemon",
                         f"etcd_password_file={security.password_files['lazarus-daemon']}"])
        lines = run_job(f"https://{server.endpoint}", new_run_id(), nodes=1, nnodes="1",
                        rdzv_conf=conf)
    assert [line for line in lines if line.startswith("result ")] == ["result rank=0 world=1 sum=1"]


@pytest.mark.parametrize("conf, message", [
    ({"etcd_user": "trainer"}, "--etcd-user trainer needs its password"),
    ({"etcd_cert": "/etc/x.pem"}, "a client certificate needs both --etcd-cert and --etcd-key"),
    ({"etcd_ca": "/no/such/ca.pem"}, "--etcd-ca /no/such/ca.pem: cannot read it"),
])
def test_bad_etcd_security_options_are_named(conf, message):
    params = RendezvousParameters("lazarus-etcd", "127.0.0.1:2379", "job", 1, 2, **conf)
    with pytest.raises(ValueError, match=f"--rdzv-conf: {message}"):
        make_handler(params)


@pytest.mark.parametrize("env, message", [
    (None, "no rendezvous key: set $LAZARUS_RDZV_KEY (or --rdzv-conf key_file=PATH)"),
    ("short", "$LAZARUS_RDZV_KEY holds 5 characters; a key needs at least 16"),
])
def test_an_agent_without_a_proper_key_is_told_how_to_make_one(env, message, monkeypatch):
    if env is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, env)
    params = RendezvousParameters("lazarus-etcd", "127.0.0.1:2379", "job", 1, 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_handler(params)
