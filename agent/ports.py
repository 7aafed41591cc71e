"""What an agent drives outside itself -- its lease, its reads of the assignment, the ranks'
processes, the worker channel's socket, the rendezvous stores, the GPU and host monitors, the
record its ranks outlive it by -- behind one face, `Ports`, that `Agent` is built with.

`NodePorts` is a real node's. The fleet simulator (lazarus.sim.fleet) builds the same `Agent`
with ports of its own (no processes, sockets or devices; reads and leases served by the
fleet), and so do the tests: what the agent decides and writes is never replaced, only what
it drives. The shape is the daemon's (docs/architecture.md, "The agent"): the view and the
decisions are the agent's, the effects are here and in the executors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

from lazarus.agent import collective_check as coll
from lazarus.agent import preflight as pre
from lazarus.agent.adopt import Left, NodeLock, forget, record_path
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.assignment import read as read_assignment
from lazarus.agent.channel import Channel
from lazarus.agent.health import NodeHealth
from lazarus.agent.netif import collective_env
from lazarus.agent.stacks import flight_recorder_env
from lazarus.agent.tier0_agent import Tier0
from lazarus.agent.workers import Workers
from lazarus.core import etcd as E
from lazarus.core import rankfiles, settings
from lazarus.core.contract import (AGENT_GRACE_ENV, PROGRESS_ENV, SCRIPT_PG_TIMEOUT_ENV,
                                   SHARD_STORES, SHARD_STORES_KEY, STACKS_ENV, replicas_prefix,
                                   round_port_key, without_secrets)
from lazarus.core.errors import UserError
from lazarus.core.jobuser import job_dir
from lazarus.core.privatedir import private_dir
from lazarus.core.records import Keys, NodeRecord, RoundRecord, RunStatus

log = logging.getLogger("lazarus.agent")

# Ranks whose agent is gone wait one lease TTL and this much for the next one before they
# stop (lazarus.agent.adopt): an agent back within the TTL still needs a moment to listen.
ORPHAN_MARGIN_S = 5.0


class Ports(Protocol):
    """An agent's outside. Built once per agent, before anything else of it; the agent asks
    for each part once, in its constructor, except the reads and the round stores."""

    def left(self) -> Left | None:
        """The ranks a previous agent of this node left running, if any."""

    def save_left(self, left: Left | None) -> None:
        """Write down the running round's ranks for the next agent (None: forget them)."""

    def session(self, etcd: E.Etcd, *, ttl_s: int, on_lost: Callable[[], None],
                resume: int | None): ...

    def read_assignment(self, etcd: E.Etcd, keys: Keys, unreadable: dict[str, int],
                        on_request: Callable[[E.KV | None], None]
                        ) -> tuple[RunStatus | None, RoundRecord | None]: ...

    def health(self) -> NodeHealth: ...

    def workers(self, agent_grace_s: float, script_pg_timeout_s: float) -> Workers: ...

    def channel(self, *, on_message: Callable[[dict], dict | None],
                admit: Callable[[int], bool]): ...

    def store(self):
        """The store this node hosts (its port goes into the node record)."""

    def host_round_store(self, rec: RoundRecord, store) -> None:
        """Host `rec`'s own store when this node is its first member."""

    def tier0(self, *, lookup: Callable[[str], NodeRecord | None],
              on_kept: Callable[[int, int, bool], None]) -> Tier0 | None: ...

    def preflight(self, *, run: Callable[[], list], on_done: Callable[[], None],
                  store) -> tuple[pre.Runner | None, coll.PeerTests | None]: ...

    def close(self) -> None: ...


def host_shard_stores(host: str, store, *, job_id: str, epoch: int, shards: int) -> list:
    """Host the stores a replica epoch's cross-replica groups rendezvous on -- one per shard,
    at most SHARD_STORES, each with a loop thread of its own -- and publish their ports in
    `store` (this agent's, where the epoch's quorum lives) under the epoch's namespace."""
    import torch.distributed as dist  # imported already by store(); kept local with it

    own = [dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
           for _ in range(max(1, min(SHARD_STORES, shards)))]
    # through a PrefixStore, as the ranks read it (it joins prefix and key with a "/")
    dist.PrefixStore(replicas_prefix(job_id, epoch), store).set(
        SHARD_STORES_KEY, ",".join(str(s.port) for s in own))
    return own


class NodePorts:
    """A real node's: the directories of `config.workdir` made private (and passable by the
    job user), one agent per node and workdir (a lock), a lease in etcd, parked workers, a
    unix socket, TCP stores, GPU and host monitors, tier-0 copies, preflight."""

    def __init__(self, config: AgentConfig):
        self.config = c = config
        job_gid = c.run_as.gid if c.run_as else None
        private_dir(c.workdir, "--workdir", pass_gid=job_gid)
        if c.run_as is not None:
            # What the ranks write, theirs; the agent's directories above, to pass through.
            rankfiles.trust(c.run_as.uid)
            for sub in ("stacks", "logs"):
                private_dir(c.workdir / sub, "--workdir", pass_gid=job_gid)
                c.run_as.give(c.workdir / sub / c.node)
            for sub in ("nccl", "nccl-pipes"):  # the flight recorder's, in theirs
                c.run_as.give(c.stacks_dir / sub, in_theirs=True)
            c.run_as.give(job_dir(c.workdir))
            if not c.run_as.can_pass(job_dir(c.workdir)):
                raise UserError(f"--run-as {c.run_as.name}: that user cannot reach --workdir "
                                f"{c.workdir} (a directory above it is closed to it); give a "
                                f"workdir it can pass through")
        self._node_lock = NodeLock(c.workdir / f"{c.node}.lock", c.node)
        self._left_path = record_path(c.workdir, c.node)
        self._round_stores: dict = {}       # round -> the store this node hosts for it
        # (job, replica epoch) -> the stores this node hosts for its cross-replica groups
        self._shard_stores: dict = {}
        self._socket = str(c.workdir / f"{c.node}.sock")

    def left(self) -> Left | None:
        return Left.load(self._left_path)

    def save_left(self, left: Left | None) -> None:
        if left is None:
            forget(self._left_path)
        else:
            left.save(self._left_path)

    def session(self, etcd: E.Etcd, *, ttl_s: int, on_lost: Callable[[], None],
                resume: int | None) -> E.Session:
        return E.Session(etcd, ttl_s=ttl_s, on_lost=on_lost, resume=resume)

    def read_assignment(self, etcd, keys, unreadable, on_request):
        return read_assignment(etcd, keys, unreadable, on_request)

    def health(self) -> NodeHealth:
        c = self.config
        return NodeHealth(gpu_backend=c.gpu_backend, gpus=c.nproc,
                          fault_script=c.gpu_faults or c.workdir / f"{c.node}.gpu-faults.json",
                          # its probe writes under the allowed roots only (lazarus.agent.host)
                          host_limits={**(c.host_limits or {}),
                                       "allowed_roots": c.allowed_roots})

    def workers(self, agent_grace_s: float, script_pg_timeout_s: float) -> Workers:
        c = self.config
        # The ranks run the job's code: none of this process's secrets (an API token, etcd
        # credentials) go to them.
        env = {**without_secrets(os.environ),
               **(c.run_as.env(fallback_home=job_dir(c.workdir)) if c.run_as else {}),
               "LAZARUS_AGENT_SOCKET": self._socket, "LAZARUS_NODE": c.node,
               STACKS_ENV: str(c.stacks_dir),
               AGENT_GRACE_ENV: str(agent_grace_s),
               **collective_env(c.host, dict(os.environ)),
               **settings.rank_threads_env(c.nproc),
               # what each process group's collectives were when a round hangs
               **flight_recorder_env(c.stacks_dir, entries=c.flight_entries),
               SCRIPT_PG_TIMEOUT_ENV: str(script_pg_timeout_s)}
        if not c.monitors:
            env[PROGRESS_ENV] = "off"
        return Workers(nproc=c.nproc, env=env, log_dir=c.workdir / "logs" / c.node,
                       notes_dir=c.stacks_dir, park=c.park, log_bytes=c.rank_log_bytes,
                       user=c.run_as, fence_jobs=c.fence_jobs)

    def channel(self, *, on_message, admit) -> Channel:
        return Channel(self._socket, on_message=on_message, admit=admit,
                       job_user=self.config.run_as)

    def store(self):
        import torch.distributed as dist  # slow to import: after the channel listens

        return dist.TCPStore(self.config.host, 0, is_master=True, wait_for_workers=False)

    def host_round_store(self, rec: RoundRecord, store) -> None:
        """The first member hosts a store of the round's own (torch's env:// rendezvous
        prefixes no key: a store shared across rounds hands a restarted rank the dead round's
        entries) and publishes its port in this agent's store, where every rank looks."""
        import torch.distributed as dist  # imported already by store(); kept local with it

        # A carried replica's ranks (docs/replicas.md) still use the store of their round.
        oldest = min(rec.replica_rounds, default=rec.round)
        self._round_stores = {r: s for r, s in self._round_stores.items() if r >= oldest}
        first = rec.members[0] == self.config.node
        # The epoch's cross-replica groups' stores, hosted once for the epoch's rounds (its
        # carried ranks go on using them) and let go with it.
        epoch = (rec.job_id, rec.replica_epoch)
        self._shard_stores = {
            epoch: self._shard_stores.get(epoch)
            or host_shard_stores(self.config.host, store, job_id=rec.job_id,
                                 epoch=rec.replica_epoch, shards=rec.world_size // rec.replicas)
        } if first and rec.replicas > 1 else {}
        if not first or rec.round in self._round_stores:
            return
        own = dist.TCPStore(self.config.host, 0, is_master=True, wait_for_workers=False)
        self._round_stores[rec.round] = own
        store.set(round_port_key(rec.round), str(own.port))

    def tier0(self, *, lookup, on_kept) -> Tier0 | None:
        c = self.config
        if c.tier0 is None:
            return None
        return Tier0(node=c.node, host=c.host, options=c.tier0, lookup=lookup,
                     on_kept=on_kept, user=c.run_as)

    def preflight(self, *, run, on_done, store):
        c = self.config
        if c.preflight_every_s is None or not c.monitors:
            return None, None
        return (pre.Runner(every_s=c.preflight_every_s, run=run, on_done=on_done),
                # idle nodes' collective tests against this one
                coll.PeerTests(store, host=c.host, port=store.port))

    def close(self) -> None:
        self._node_lock.release()

