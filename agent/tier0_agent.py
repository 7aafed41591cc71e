"""The agent's part in tier 0 (docs/architecture.md, "Checkpoints"): take over the snapshot
files its ranks write, send each to the next member of the round (the ring), serve copies to
the agent that restores a rank, and gather the copies a round restores from before its ranks
start.

Which node holds which (rank, step) goes to the daemon in the node status (`holdings`); the
daemon picks the step a round restores and, for each rank, the node to take it from
(RoundRecord.tier0). Tier 0 on a node needs a directory in host memory (a tmpfs); sending
copies to a peer needs the key the job's agents share: without one a node keeps its own
ranks' snapshots only (a crash restores from them, a lost node's ranks from storage).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.core import sealed
from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser
from lazarus.core.privatedir import private_dir
from lazarus.core.records import NodeRecord, RoundRecord

log = logging.getLogger(__name__)

KEY_ENV = "LAZARUS_REPLICA_KEY"
DEFAULT_MEMORY_MB = 4096


@dataclass(frozen=True, slots=True)
class Tier0Options:
    directory: Path
    limit_bytes: int
    key: bytes | None       # shared by the job's agents; None: no replication
    # The directory's parent is this user's alone too (the default /dev/shm/lazarus-UID,
    # a name anyone could take first); a --tier0-dir's parent may be /dev/shm itself.
    private_parent: bool = False
    # Copies on the wire encrypted (lazarus.agent.replica), and none taken in the clear.
    encrypt: bool = False


def default_dir(workdir: Path, node: str, job_uid: int | None = None) -> Path:
    """A directory in host memory (/dev/shm when there is one) private to this user, one per
    (workdir, node): several local clusters on one machine do not share it. Ranks of a user
    of their own (`job_uid`) get a parent of their own as well: theirs to pass through,
    where the agent's other parent is its alone."""
    tag = hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:12]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(workdir)
    parent = f"lazarus-{os.geteuid()}" + (f"-as-{job_uid}" if job_uid is not None else "")
    return base / parent / f"{tag}-{node}"


def add_tier0_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier0", choices=("on", "off"), default="on",
                   help="in-memory snapshots of the ranks, replicated to a peer node")
    p.add_argument("--tier0-dir", type=Path, default=None,
                   help="where snapshots are kept: a tmpfs (default /dev/shm/lazarus-UID/...)")
    p.add_argument("--tier0-memory-mb", type=float, default=DEFAULT_MEMORY_MB,
                   help="host memory the node's snapshots and its peer's copies may take "
                        "(default %(default)s)")
    p.add_argument("--replica-key-file", default=None,
                   help=f"the key the job's agents share to send snapshots to each other "
                        f"(default: ${KEY_ENV}; without one, none are sent)")
    p.add_argument("--replica-encrypt", action="store_true",
                   help="encrypt the snapshots sent to and fetched from peers (AES-256-GCM "
                        "under a key derived from the replica key), and take none in the "
                        "clear; costs a pass over each copy on both sides")


def tier0_options(args: argparse.Namespace, workdir: Path,
                  job_uid: int | None = None) -> Tier0Options | None:
    if args.tier0 == "off":
        return None
    if not args.tier0_memory_mb > 0:
        raise UserError("--tier0-memory-mb must be positive")
    key = sealed.load_key(file=args.replica_key_file, env=KEY_ENV, what="--replica-key-file")
    if args.replica_encrypt and key is None:
        raise UserError("--replica-encrypt needs a replica key (--replica-key-file or "
                        f"${KEY_ENV}): it is what the encryption key is derived from")
    return Tier0Options(directory=args.tier0_dir or default_dir(workdir, args.node, job_uid),
                        limit_bytes=int(args.tier0_memory_mb * (1 << 20)), key=key,
                        private_parent=args.tier0_dir is None, encrypt=args.replica_encrypt)


def ring_peer(members: list[str], node: str) -> str | None:
    """The member that holds `node`'s copies: the next one in rank order, the last one's
    the first's. None for a node outside the round, or alone in it."""
    if node not in members or len(members) < 2:
        return None
    return members[(members.index(node) + 1) % len(members)]


class Tier0:
    """`lookup(node)`: a node's registration (its host and replica port), from etcd.
    `on_kept(rank, step, durable)`: a rank's snapshot is as safe as tier 0 makes it (True:
    its peer holds a copy, or this node does when it has no peer) or never will be (False:
    a newer one overtook it on the way to the peer, or the peer refused it); the rank times
    its snapshot's `durable_s` by it (lazarus.trainer.snapshot)."""

    def __init__(self, *, node: str, host: str, options: Tier0Options,
                 lookup: Callable[[str], NodeRecord | None],
                 on_kept: Callable[[int, int, bool], None] = lambda rank, step, durable: None,
                 user: JobUser | None = None):
        self.node = node
        self.key = options.key
        self.encrypt = options.encrypt
        self.lookup = lookup
        self.on_kept = on_kept
        try:
            if options.private_parent:
                private_dir(options.directory.parent, "tier-0 directory",
                            pass_gid=user.gid if user else None)
            self.store = Tier0Store(options.directory, limit_bytes=options.limit_bytes,
                                    user=user)
        except OSError as e:
            raise UserError(f"--tier0-dir {options.directory}: {e.strerror or e} (give a "
                            "writable directory in host memory, or --tier0 off)") from None
        self.server = (replica.ReplicaServer(host, key=self.key, accept=self._accept,
                                             find=self._find, max_bytes=options.limit_bytes,
                                             node=node, encrypt=options.encrypt)
                       if self.key is not None else None)
        if self.encrypt:
            log.info("tier 0: copies to and from peers encrypted on the wire (%s)", replica.ENC)
        if self.key is None:
            log.warning("tier 0: no replica key (--replica-key-file or $%s): snapshots stay "
                        "on this node; a lost node's ranks restore from storage", KEY_ENV)
        self._round: int | None = None
        self._job: str | None = None
        self._world: int | None = None
        self._peer: tuple[str, str, int] | None = None   # (node, host, port)
        self._outbox: dict[int, tuple[str, int, Path]] = {}  # rank -> newest (job, step, path)
        self._cv = threading.Condition()
        self._closed = False
        threading.Thread(target=self._replicate, daemon=True, name="tier0-replicate").start()

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    # -- the ranks' snapshots ----------------------------------------------------------------
    def taken(self, job: str, msg: dict) -> None:
        """A rank's "snapshot" message: take the file over and queue it for the peer."""
        try:
            rank, step, path = int(msg["rank"]), int(msg["step"]), Path(str(msg["path"]))
        except (KeyError, TypeError, ValueError):
            log.warning("dropping malformed snapshot report %r", msg)
            return
        copy = self.store.add_local(job, rank, step, path)
        if copy is None:
            self.on_kept(rank, step, False)
            return
        with self._cv:
            if self._peer is None or self.key is None:
                overtaken = None
            else:
                overtaken = self._outbox.get(rank)
                self._outbox[rank] = (job, step, copy.path)
                self._cv.notify()
        if self._peer is None or self.key is None:
            self.on_kept(rank, step, True)  # held here, and no peer to send it to
        elif overtaken is not None:
            self.on_kept(rank, overtaken[1], False)

    def _replicate(self) -> None:
        while True:
            with self._cv:
                while not self._outbox and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                rank, (job, step, path) = self._outbox.popitem()
                peer = self._peer
            if peer is None or self.key is None:
                self.on_kept(rank, step, True)  # the round changed meanwhile: held here
                continue
            try:
                # Mapped, not read: the file is in host memory already, and is sent as it is.
                with open(path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                self.on_kept(rank, step, False)
                continue  # dropped meanwhile (a newer one follows), or empty
            try:
                replica.push(peer[1], peer[2], self.key, node=self.node, to=peer[0], job=job,
                             rank=rank, step=step, data=data, round_=self._round or 0,
                             encrypt=self.encrypt)
            except replica.ReplicaError as e:
                log.warning("tier 0: rank %d step %d not sent to %s: %s", rank, step, peer[0], e)
                self.on_kept(rank, step, False)
                continue
            finally:
                data.close()
            self.store.sent(job, rank, step)
            self.on_kept(rank, step, True)

    def _accept(self, job: str, rank: int, step: int, data: bytes, round_: int) -> None:
        # A copy sent before the sender saw the round this node is in may be of a timeline
        # that round abandoned.
        if self._round is not None and round_ < self._round:
            raise replica.ReplicaError(f"a copy of round {round_}; this node is in round "
                                       f"{self._round}")
        # The key may be shared beyond this job: another job's copies would only take the
        # room of this one's.
        if self._job is not None and job != self._job:
            raise replica.ReplicaError(f"a copy of job {job[:64]!r}; this node runs "
                                       f"{self._job[:64]!r}")
        self.store.add_replica(job, rank, step, data)

    def _find(self, job: str, rank: int, step: int) -> Path | None:
        return self.store.path(job, rank, step)

    # -- rounds ------------------------------------------------------------------------------
    def round_seen(self, rec: RoundRecord) -> None:
        """A new round: copies of another job, of another mesh, or newer than the step it
        restores are of no use any more (the last begin another timeline); the peer is the
        next member of the ring."""
        if rec.round == self._round:
            return
        peer = None
        nxt = ring_peer(rec.members, self.node)
        if nxt is not None:
            registered = self.lookup(nxt)  # etcd away: raised, and tried again next pass
            if registered is not None and registered.replica_port:
                peer = (nxt, registered.host, registered.replica_port)
            elif self.key is not None:
                log.warning("tier 0: peer %s takes no copies (tier 0 off there, or no key)", nxt)
        self._round = rec.round
        self._job = rec.job_id
        keep = rec.restore_step if (rec.restore or rec.tier0) else 0
        if self._world is not None and self._world != rec.world_size:
            keep = -1
        self._world = rec.world_size
        self.store.forget(job=rec.job_id, after_step=keep)
        with self._cv:
            self._peer = peer

    def prepare(self, rec: RoundRecord, ranks: list[int]) -> dict[int, str | None]:
        """The snapshot file each local rank restores from (None: the round restores from
        storage or from scratch): ours, or fetched from the node the round names. A copy that
        cannot be had is named by a path that does not exist, with the reason: the rank
        fails to restore (exit BAD_CHECKPOINT) and the daemon goes back to storage."""
        self.round_seen(rec)
        plan = rec.tier0 or {}
        step, sources = plan.get("step"), plan.get("sources") or {}
        if not isinstance(step, int) or isinstance(step, bool):
            return dict.fromkeys(ranks)
        out: dict[int, str | None] = {}
        for rank in ranks:
            have = self.store.path(rec.job_id, rank, step)
            if have is None:
                source = sources.get(str(rank))
                why = self._fetch(rec.job_id, rank, step, source)
                have = self.store.path(rec.job_id, rank, step)
                if have is None:
                    log.warning("tier 0: rank %d step %d unavailable: %s", rank, step, why)
                    have = self.store.root / f"unavailable-r{rank:05d}-s{step:010d}.t0"
            out[rank] = str(have)
        return out

    def _fetch(self, job: str, rank: int, step: int, source: object) -> str:
        if not isinstance(source, str) or source == self.node:
            return "not on this node"
        if self.key is None:
            return "no replica key to fetch it with"
        registered = self.lookup(source)
        if registered is None or not registered.replica_port:
            return f"{source} is gone"
        try:
            data = replica.fetch(registered.host, registered.replica_port, self.key,
                                 node=self.node, to=source, job=job, rank=rank, step=step,
                                 max_bytes=self.store.limit_bytes, encrypt=self.encrypt)
        except (replica.ReplicaError, ValueError) as e:
            return f"fetch from {source} failed ({e})"
        self.store.add_replica(job, rank, step, data)
        log.info("tier 0: rank %d step %d fetched from %s (%d bytes)", rank, step, source,
                 len(data))
        return ""

    def holdings(self, job: str, world_size: int) -> dict:
        return self.store.holdings(job, world_size) if job else {}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self.server is not None:
            self.server.close()
        self.store.close()
