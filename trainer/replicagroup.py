"""The cross-replica side of a rank in a job of replica groups (docs/replicas.md): the per-step
quorum, the gloo group of this rank's counterparts in the other replicas, the gradient
average over the replicas that took part, and healing a restarted replica from a live one.

Each replica is a world of its own (the default process group: its FSDP shards). Rank s of
every replica pairs with rank s of the others in a group of its own, rebuilt, under a new
store prefix, whenever the quorum changes: a lost replica is dropped by building a smaller
group among the survivors, with no round of the whole job. The quorum is kept in a store
shared by all replicas (a TCPStore, hosted by whoever supervises the job), written a few keys a
step: never etcd (docs/architecture.md, the write budget).

Only a replica's leader (its rank 0) takes part in the quorum (lazarus.trainer.quorum); it
hands the answer to its replica's ranks over the replica's own group, so all shards of a
replica agree on it.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lazarus.core.contract import SHARD_STORES_KEY, replicas_prefix
from lazarus.trainer.quorum import NEWS, LeftOut, QuorumClient, peek
from lazarus.trainer.replicapolicy import Quorum

# How often a rank whose cross-replica collective takes long looks for a member gone silent.
SILENCE_CHECK_S = 0.5


# How long a rank that leaves tries to tell the quorum so (mark_left): it is on its way out.
LEAVE_S = 5.0


def quorum_prefix(job_id: str, epoch: int) -> str:
    """The quorum's namespace in the store of members[0]'s agent: one per whole-world start
    of a job's replicas (the replica epoch), so a new epoch never reads an old one's keys."""
    return replicas_prefix(job_id, epoch)


def shard_store(quorum: dist.Store, host: str, *, shard: int, prefix: str) -> dist.Store:
    """A connection to the store shard `shard`'s cross-replica groups rendezvous on, under
    `prefix` (the quorum's namespace): one of the stores members[0]'s agent hosts for the
    epoch (their ports under SHARD_STORES_KEY in `quorum`, which waits for them), so that
    every live rank's rebuild at a replica's loss is spread over their loop threads."""
    raw = quorum.get(SHARD_STORES_KEY).decode()
    try:
        ports = [int(p) for p in raw.split(",")]
    except ValueError:
        ports = []
    assert ports and all(0 < p < 65536 for p in ports), f"shard stores {raw!r}"
    return dist.PrefixStore(prefix, dist.TCPStore(host, ports[shard % len(ports)],
                                                  is_master=False, wait_for_workers=False))


def quorum_store(host: str, port: int, job_id: str, epoch: int,
                 timeout: timedelta = timedelta(seconds=300)) -> dist.Store:
    """A connection of its own to the quorum's store."""
    return dist.PrefixStore(quorum_prefix(job_id, epoch),
                            dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                          timeout=timeout))


class ReplicaGroup:
    def __init__(self, store: Callable[[], dist.Store], *, replica: int, replicas: int,
                 min_replicas: int = 1, wait_s: float = 3.0, start_wait_s: float = 120.0,
                 timeout_s: float = 60.0, joining: bool | None = None,
                 shard_store: Callable[[dist.Store], dist.Store] | None = None):
        """`store()`: a new connection to the quorum's store, shared by every replica's ranks
        (two on the leader: its heartbeat thread has its own). `shard_store(quorum)`: a
        connection to the store this rank's cross-replica groups rendezvous on (default: the
        quorum's). `wait_s`: how long a replica's leader may stay silent before a quorum goes
        on without it; `timeout_s`: a cross-replica collective's (and a heal's) limit.
        `joining`: whether this start of the replica heals from a live one first (None: any
        start after its first does)."""
        self.store = store()
        self.groups_store = shard_store(self.store) if shard_store is not None else self.store
        self.replica, self.replicas = replica, replicas
        self.min_replicas = min_replicas
        self.wait_s, self.start_wait_s = wait_s, start_wait_s
        self.timeout = timedelta(seconds=timeout_s)
        self.local_rank = dist.get_rank()
        self.quorum: Quorum | None = None
        self.group: dist.ProcessGroup | None = None
        self._attempt = 0
        self._broken = False
        self._abandoned: list[dist.ProcessGroup] = []  # groups of collectives left in flight
        # Every start of this replica counts: any after the first is a restart that heals.
        incarnation = torch.tensor([self.store.add(f"incarnation/{replica}", 1)
                                    if self.local_rank == 0 else 0])
        dist.broadcast(incarnation, src=0)
        self.incarnation = int(incarnation)
        self.joining = self.incarnation > 1 if joining is None else joining
        self._quorums = QuorumClient(self.store, replica=replica, replicas=replicas,
                                     min_replicas=min_replicas, wait_s=wait_s,
                                     start_wait_s=start_wait_s, timeout_s=timeout_s)
        if self.local_rank == 0:
            # A connection of its own: the main thread's may be held for a whole rendezvous.
            beat_store = store()
            threading.Thread(target=self._beat, args=(beat_store,), daemon=True,
                             name="replica-heartbeat").start()

    def _beat(self, store: dist.Store) -> None:
        while True:
            store.add(f"hb/{self.replica}", 1)
            time.sleep(self.wait_s / 6)

    # -- the quorum -------------------------------------------------------------------------

    def next_quorum(self, step: int) -> Quorum:
        """The quorum of `step` (or of its next try, after a failed collective), with the
        cross-replica group built for it. Raises LeftOut if this replica is not in it."""
        if self.quorum is None or self.quorum.step != step:
            self._attempt = 0
        if self.local_rank == 0:
            expected = set(self.quorum.members) if self.quorum else set(range(self.replicas))
            q = (self._quorums.join() if self.joining
                 else self._quorums.ask(step, self._attempt, expected))
            box = [q.to_json()]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0)
        q = Quorum.from_json(box[0])
        self.joining = False
        if self.replica not in q.members:
            raise LeftOut(f"replica {self.replica} was left out of step {q.step}'s quorum "
                          f"{list(q.members)}")
        if (self.group is None or self._broken or self.quorum is None
                or q.members != self.quorum.members):
            self._build_group(q)
        self.quorum, self._attempt, self._broken = q, q.attempt, False
        return q

    def _build_group(self, q: Quorum) -> None:
        # A fresh prefix per quorum: a group's rendezvous keys are never reused by the next.
        prefix = dist.PrefixStore(f"g/{q.key}/{self.local_rank}/", self.groups_store)
        self.group = dist.ProcessGroupGloo(prefix, q.members.index(self.replica), len(q.members),
                                           self.timeout)

    # -- the step ---------------------------------------------------------------------------

    def average(self, grads: list[torch.Tensor], divisor: int) -> bool:
        """Sum this rank's gradient shards with its counterparts' in the quorum's replicas and
        divide by `divisor`, in place; every rank of this replica returns whether all its
        shards got the sum. False: the gradients are untouched, and the group is marked broken
        -- ask next_quorum again (the same step's next try) and call this again."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        ok = True
        if len(self.quorum.members) > 1:
            ok = self._finished(self.group.allreduce([flat]))
        # Every shard of this replica must apply the same sum, or none: one shard's peer may
        # still answer while another's is dead.
        agreed = torch.tensor([int(ok)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not agreed.item():
            self._broken = True
            self._attempt += 1
            return False
        flat /= divisor
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return True

    def _finished(self, work: dist.Work, others: set[int] | None = None, *,
                  point_to_point: bool = False) -> bool:
        """Whether a cross-replica collective completed. False once it failed (a counterpart
        gone: a reset connection) or, while it waits, once the leader of another member (of
        `others`, by default all) is gone (marked left, or silent for wait_s): a node that
        stops answering resets nothing, and gloo would wait out the group's timeout (a
        minute) with every live replica idle. A `point_to_point` work (a send) gloo marks
        complete only inside its wait(), never before: that wait runs on a thread of its own
        (left blocked, with its group, when the peer is gone), watched the same way."""
        began = checked = time.monotonic()
        if others is None:
            others = set(self.quorum.members) - {self.replica}
        failed: list[BaseException] = []
        if point_to_point:
            waited = threading.Event()

            def wait() -> None:
                try:
                    work.wait()
                except RuntimeError as e:
                    failed.append(e)
                finally:
                    waited.set()
            threading.Thread(target=wait, daemon=True, name="replica-send").start()
            completed = waited.is_set
        else:
            completed = work.is_completed
        while not completed():
            now = time.monotonic()
            if now - checked >= SILENCE_CHECK_S:
                checked = now
                if self._quorums.gone(others, began):
                    # Left in flight: its group is kept (destroyed, it would wait for the
                    # collective), and the step's next try builds another.
                    self._abandoned.append(self.group)
                    return False
            time.sleep(0.001)
        if point_to_point:
            return not failed
        try:
            work.wait()
        except RuntimeError:
            return False
        return True

    # -- healing ----------------------------------------------------------------------------

    def heal(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict | None = None) -> dict | None:
        """At the start of a quorum with healing members: the source's rank sends its shard
        of the model and optimizer (and `extra`, e.g. the data position) to each healing
        replica's rank of the same shard, which loads it. Returns `extra` as received on a
        healing rank, None elsewhere. Other members do nothing."""
        q = self.quorum
        if not q.healing or (self.replica != q.source and self.replica not in q.healing):
            return None
        src = q.members.index(q.source)
        if self.replica == q.source:
            buf = io.BytesIO()
            torch.save(_state_of(model, optimizer, extra), buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            for r in q.healing:
                dst = q.members.index(r)
                # A joiner gone (a reset connection, or its leader silent: a node stopped or
                # cut off mid-heal fills the send's buffers and resets nothing) breaks this
                # replica's average next, and the same step's next try is without it. A
                # source never dies of a joiner, nor waits out the group's timeout for one.
                if not (self._finished(self.group.send([size], dst, 0), {r},
                                       point_to_point=True)
                        and self._finished(self.group.send([payload], dst, 1), {r},
                                           point_to_point=True)):
                    self._broken = True
            return None
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([payload], src, 1).wait()
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        _load_state(model, optimizer, state)
        return state["extra"]


def mark_left(store: dist.Store, replica: int, incarnation: int | None = None) -> None:
    """Tell the quorum that `replica`, as it is now (or its start `incarnation`), is lost: for
    a rank of it on its way out, or its supervisor (an agent that saw one of its ranks die),
    so that the others go on at once rather than after wait_s of its silence. Its next start
    is a new incarnation, which this does not touch. `store`: the quorum's store, as
    ReplicaGroup's factory makes it."""
    if incarnation is None:
        incarnation = peek(store, f"incarnation/{replica}")
    store.set(f"left/{replica}/{incarnation}", "1")
    store.add(NEWS, 1)  # the quorum's watcher looks at once


@dataclass(kw_only=True)
class ReplicaPlace:
    """A rank's place in a job of replica groups, as its worker sets it up for the trainer:
    which replica, of how many, the quorum's store, and whether this start heals from a live
    replica (its ranks were launched after the replicas' whole-world start)."""
    replica: int
    replicas: int
    store: Callable[[], dist.Store]   # a new connection to the quorum's store
    joining: bool
    # a connection to this rank's cross-replica groups' store, given the quorum's (None:
    # the quorum's own)
    shard_store: Callable[[dist.Store], dist.Store] | None = None
    group: ReplicaGroup | None = None  # once the trainer made it

    def leave(self, timeout_s: float = LEAVE_S) -> bool:
        """Best effort, within `timeout_s`: mark this replica left in the quorum (this start of
        it, once the group counted it), so the other replicas go on without waiting out its
        silence. Whether that was said."""
        done = threading.Event()

        def mark() -> None:
            incarnation = self.group.incarnation if self.group is not None else None
            # The group's own connection first: this thread is its only user now (the rank is
            # on its way out), and a new one takes a connect (~0.1 s here) during which the
            # other replicas wait in a collective with this rank for its exit.
            own = [lambda: self.group.store] if self.group is not None else []
            for store in own + [self.store]:
                try:
                    mark_left(store(), self.replica, incarnation)
                    done.set()
                    return
                except Exception:  # noqa: BLE001 -- that connection is broken: the next
                    continue        # one, else silence says it later

        threading.Thread(target=mark, daemon=True, name="replica-leave").start()
        return done.wait(timeout_s)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None) -> dict:
    # Both replicas shard the same model over the same number of ranks, so rank s's local
    # shards are the same shapes on both sides: they travel as plain tensors.
    params = list(model.parameters())
    return {"params": [_local(p).detach() for p in params],
            "optim": [{k: _local(v) for k, v in optimizer.state.get(p, {}).items()}
                      for p in params],
            "extra": extra or {}}


@torch.no_grad()
def _load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    params = list(model.parameters())
    if len(params) != len(state["params"]):
        raise RuntimeError(f"the peer's model has {len(state['params'])} parameters, this one "
                           f"{len(params)}")
    for p, local, opt in zip(params, state["params"], state["optim"]):
        _local(p).copy_(local)
        optimizer.state[p] = {
            k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor) and v.dim() > 0 else v)
            for k, v in opt.items()}
