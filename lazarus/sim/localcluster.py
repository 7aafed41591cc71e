"""A whole Lazarus cluster on this machine: embedded etcd, daemons, agents as simulated nodes.

Every part is a real process talking over real sockets; each node is an agent process with its
own ranks (gloo on CPU). Used by `lazarus up` and by the end-to-end tests, which stop parts by
pid to inject faults.

etcd runs in secure mode by default (lazarus.core.etcd_secure), as a production etcd should:
TLS with client certificates and authentication on; daemons get the `lazarus-daemon` user,
agents the `lazarus-agent` one (lazarus.core.etcd_rbac). So the secure path is the one every
demo and end-to-end test takes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lazarus.agent import tier0_agent
from lazarus.agent.adopt import left_ranks
from lazarus.core import etcd as E
from lazarus.core import procstop
from lazarus.core.embedded_etcd import EmbeddedCluster, EmbeddedEtcd, die_with_parent, free_port
from lazarus.core.errors import UserError
from lazarus.core.eventfeed import EventFeed
from lazarus.core.etcd_rbac import AGENT_USER, DAEMON_USER
from lazarus.core.jobspec import JobSpec
from lazarus.sim import trainer_faults
from lazarus.sim.chaos import (inject_gpu_fault, inject_slowdown, slowdown_script,
                               write_cluster_access)
from lazarus.sim.diskfault import Ballast, mount_small
from lazarus.core.records import (CheckpointRecord, EventRecord, Keys, NodeStatus, RecordError,
                             RunStatus, load_json)


# Shorter than the production default (core.settings.LEASE_TTL_S): on one machine there is no
# network to wait out, and a node loss shows within a demo's attention span.
LOCAL_LEASE_TTL_S = 3
# Node status refresh while only the step moves (the agent's default is 15 s, for the write
# budget): a demo's steps take milliseconds, and its stragglers show within its few seconds.
LOCAL_STATUS_PERIOD_S = 1.0


@dataclass(slots=True)
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a node's agent runs: the address its peers reach it at, and the command prefix
    that puts it there (`ip netns exec NS`: lazarus.sim.netns)."""
    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()


@dataclass(slots=True)
class ClusterState:
    status: RunStatus | None = None
    leader_pid: int | None = None
    node_status: dict[str, NodeStatus] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)


class LocalCluster:
    """`lease_ttl_s` applies to agents and daemons: it is the node-loss detection time and the
    leader failover time of this cluster. `secure`: the embedded etcd it starts runs in
    secure mode (one a caller starts is as the caller made it)."""

    def __init__(self, workdir: Path, *, lease_ttl_s: int = LOCAL_LEASE_TTL_S,
                 log_level: str = "INFO", secure: bool = True):
        self.workdir = workdir
        self.secure = secure
        self.lease_ttl_s = lease_ttl_s
        self.log_level = log_level
        self.keys = Keys()
        self.etcd_server: EmbeddedEtcd | EmbeddedCluster | None = None
        self.etcd: E.Etcd | None = None
        self.daemons: list[Proc] = []
        self.api_addresses: list[str] = []  # one per daemon started, in order
        self.token = secrets.token_urlsafe(24)
        self.token_file = workdir / "api-token"
        self.agents: dict[str, Proc] = {}
        self._agent_spec: dict[str, tuple[int, str]] = {}
        self._events: EventFeed | None = None  # once etcd is up: what new_events reads
        self.agent_args: list[str] = []    # extra `lazarus agent` flags for every node
        self.job_uid: int | None = None    # whom the ranks run as (--run-as in agent_args)
        # Where jobs may write (`lazarus agent --allowed-root`): beside the cluster's workdir,
        # where the tests and `lazarus up` keep their metrics and checkpoints.
        self.allowed_roots: list[Path] = [workdir.resolve().parent]
        self.daemon_args: list[str] = []   # extra `lazarus daemon` flags for every daemon
        self.trainer_faults: list[str] = []  # what every rank injects (lazarus.sim.trainer_faults)
        # node -> where its agent runs; all on this host's loopback unless set
        self.placement: Callable[[str], Placement] = lambda node: Placement()
        self.ballast = None                # diskfault.Ballast, once small_checkpoint_fs ran
        workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        # The key the agents share to send tier-0 snapshots to each other.
        self.replica_key_file = workdir / "replica-key"
        fd = os.open(self.replica_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))

    @property
    def endpoint(self) -> str:
        assert self.etcd_server is not None
        return self.etcd_server.endpoint

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               wrap: tuple[str, ...] = ()) -> Proc:
        log = self.workdir / f"{name}.log"
        out = open(log, "ab")
        try:
            popen = subprocess.Popen([*wrap, sys.executable, "-m", "lazarus.cli", *args],
                                     stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        finally:
            out.close()
        return Proc(name=name, popen=popen, log=log)

    def start_etcd(self, server: EmbeddedEtcd | EmbeddedCluster | None = None) -> None:
        """One embedded etcd, or `server` started by the caller (a several-member cluster:
        every process then gets all of its members as --etcd)."""
        self.etcd_server = server or EmbeddedEtcd(self.workdir / "etcd",
                                                  secure=self.secure).start()
        # What the tests and `lazarus up` do through it (submit, read, inject) is the
        # daemon's and the operator's to do.
        self.etcd = E.Etcd(self.endpoint, auth=self.etcd_server.auth(DAEMON_USER))
        # ... and `lazarus chaos --workdir WORKDIR`'s, typed beside it
        write_cluster_access(self.workdir, self.endpoint, self.etcd_server.auth(DAEMON_USER))

    def etcd_args(self, user: str) -> list[str]:
        """The etcd flags of a process of ours that acts as `user`."""
        assert self.etcd_server is not None
        return ["--etcd", self.endpoint, *self.etcd_server.auth(user).args()]

    def start_daemon(self) -> Proc:
        api = f"127.0.0.1:{free_port()}"
        proc = self._spawn(f"daemon-{len(self.daemons)}",
                           ["daemon", *self.etcd_args(DAEMON_USER), "--lease-ttl",
                            str(self.lease_ttl_s), "--log-level", self.log_level,
                            "--api", api, "--token-file", str(self.token_file),
                            "--endpoint-file", "",
                            # one data dir for the leader and its standbys: one history
                            "--data-dir", str(self.workdir / "daemon"), *self.daemon_args])
        self.daemons.append(proc)
        self.api_addresses.append(api)
        return proc

    def start_agent(self, node: str, *, nproc: int, role: str) -> Proc:
        place = self.placement(node)
        proc = self._spawn(f"agent-{node}",
                           ["agent", *self.etcd_args(AGENT_USER), "--node", node, "--nproc",
                            str(nproc), "--role", role, "--workdir", str(self.workdir / "nodes"),
                            "--host", place.host,
                            "--gpu-backend", "sim",
                            "--replica-key-file", str(self.replica_key_file),
                            "--lease-ttl", str(self.lease_ttl_s), "--log-level",
                            self.log_level, "--status-period", str(LOCAL_STATUS_PERIOD_S),
                            *(a for r in self.allowed_roots for a in ("--allowed-root", str(r))),
                            *self.agent_args],
                           # An agent passes its environment on to its ranks: this is how the
                           # trainer faults, and `lazarus chaos slow-rank` on one node, reach them.
                           env=trainer_faults.worker_env(
                               self.trainer_faults, slowdown=slowdown_script(self.workdir / "nodes", node)),
                           wrap=place.wrap)
        self.agents[node] = proc
        self._agent_spec[node] = (nproc, role)
        return proc

    def revive_node(self, node: str) -> str:
        """Start a killed node's agent again, as the same node id with the same role."""
        assert not self.agents[node].alive, f"node {node} is alive"
        nproc, role = self._agent_spec[node]
        self.start_agent(node, nproc=nproc, role=role)
        return node

    def submit(self, job: JobSpec, *, register_timeout_s: float = 120.0) -> None:
        """Hand `job` to the daemon once every running agent has registered: the daemon takes
        whatever nodes are there, so a spare that registered before a slow active node would
        otherwise stand in the first round and the roles asked for would not hold."""
        assert self.etcd is not None
        deadline = time.monotonic() + register_timeout_s
        while True:
            waiting = sorted(set(n for n, p in self.agents.items() if p.alive)
                             - set(E.retry(lambda: self.state().nodes, deadline_s=30)))
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise UserError(f"node(s) {', '.join(waiting)} did not register within "
                                f"{register_timeout_s:.0f} s; see "
                                + ", ".join(str(self.agents[n].log) for n in waiting))
            time.sleep(0.1)
        E.retry(lambda: self.etcd.put(self.keys.job, job.to_json()), deadline_s=30)

    # -- observing -----------------------------------------------------------------------------
    def state(self) -> ClusterState:
        assert self.etcd is not None
        snap = self.etcd.snapshot([self.keys.status, self.keys.leader, self.keys.nodes,
                                   self.keys.nodestatus, self.keys.checkpoints,
                                   self.keys.cordon])
        st = ClusterState()
        for key, kv in snap.kvs.items():
            try:
                if key == self.keys.status:
                    st.status = RunStatus.from_json(kv.value)
                elif key == self.keys.leader:
                    st.leader_pid = load_json(kv.value, key).get("pid")
                elif key.startswith(self.keys.nodestatus):
                    ns = NodeStatus.from_json(kv.value)
                    st.node_status[ns.node] = ns
                elif key.startswith(self.keys.nodes):
                    st.nodes.append(key[len(self.keys.nodes):])
                elif key.startswith(self.keys.checkpoints):
                    st.checkpoints.append(CheckpointRecord.from_json(kv.value))
                elif key.startswith(self.keys.cordon):
                    st.cordoned.append(key[len(self.keys.cordon):])
            except (RecordError, ValueError, AttributeError):
                continue
        return st

    def new_events(self) -> list[EventRecord]:
        """Events not returned before, oldest first within a call (lazarus.core.eventfeed)."""
        assert self.etcd is not None
        if self._events is None:
            self._events = EventFeed(self.etcd, self.keys)
        return self._events.new_events()

    # -- faults --------------------------------------------------------------------------------
    def kill_worker(self, node: str, sig: int = signal.SIGKILL) -> str:
        """Send `sig` to one rank of `node` (its last): SIGKILL a crash, SIGSTOP a freeze."""
        st = self.state().node_status.get(node)
        if st is None or not st.pids:
            raise RuntimeError(f"node {node} runs no workers")
        pid = st.pids[-1]
        os.kill(pid, sig)
        return f"{node} pid {pid}"

    def kill_node(self, node: str) -> str:
        """The host is lost: its agent, then its ranks (they would outlive the agent alone,
        waiting for the next one). The agent goes first, or it would report their deaths."""
        self.kill_agent(node)
        self._kill_ranks(node)
        return node

    def kill_agent(self, node: str, sig: int = signal.SIGKILL) -> str:
        """Stop the node's agent alone (SIGTERM: as for an upgrade); its ranks train on."""
        proc = self.agents[node]
        proc.popen.send_signal(sig)
        proc.popen.wait()
        return node

    def _kill_ranks(self, node: str) -> None:
        ranks = left_ranks(self.workdir / "nodes", node)
        for rank in ranks:
            rank.kill()
        for rank in ranks:
            rank.wait()

    def gpu_fault(self, node: str, kind: str) -> str:
        inject_gpu_fault(self.workdir / "nodes", node, kind)
        return f"{node} gpu0"

    def small_checkpoint_fs(self, path: Path, size_bytes: int) -> None:
        """Put the checkpoint dir on a tmpfs of its own, so that disk-full fills that and
        nothing else (lazarus.sim.diskfault: only inside a private mount namespace)."""
        mount_small(path, size_bytes)
        self.ballast = Ballast(path)

    def fill_disk(self) -> str:
        assert self.ballast is not None, "small_checkpoint_fs first"
        size = self.ballast.fill()
        return f"{self.ballast.path.parent} ({size >> 20} MiB ballast)"

    def free_disk(self) -> str:
        assert self.ballast is not None, "small_checkpoint_fs first"
        return f"{self.ballast.path.parent} ({self.ballast.free() >> 20} MiB freed)"

    def keep_disk_full(self) -> None:
        """Take back what a failed save's clean-up freed, as the other writers of a really
        full disk would: without this the next save could fit in its predecessor's room."""
        if self.ballast is not None:
            self.ballast.top_up()

    def slow_node(self, node: str, factor: float) -> str:
        inject_slowdown(self.workdir / "nodes", node, factor)
        return node

    def kill_daemon(self) -> str:
        pid = self.state().leader_pid
        for proc in self.daemons:
            if proc.popen.pid == pid and proc.alive:
                proc.popen.send_signal(signal.SIGKILL)
                proc.popen.wait()
                return f"daemon pid {pid}"
        raise RuntimeError("no live leading daemon found")

    def stop(self) -> None:
        procstop.stop_all([p.popen for p in [*self.agents.values(), *self.daemons]], 10)
        for node in self.agents:  # ranks a stopped agent left running for its successor
            self._kill_ranks(node)
            # the host memory a killed agent's snapshots held
            shutil.rmtree(tier0_agent.default_dir(self.workdir / "nodes", node,
                                                  self.job_uid), ignore_errors=True)
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None
        if self.etcd_server is not None:
            self.etcd_server.stop()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
