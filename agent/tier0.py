"""The agent's tier-0 store: snapshot files of its own ranks and of its ring predecessor's,
in host memory (a tmpfs such as /dev/shm), bounded in bytes (docs/architecture.md,
"Checkpoints").

A rank writes its snapshot file into `incoming/` and tells the agent; `add_local` takes a
copy of it into a file of the agent's own (the rank's descriptor must not reach what the agent
keeps), so it outlives the rank. Copies received from the peer node
(lazarus.agent.replica) go into `replica/`. Per rank the store keeps the `keep` newest steps
plus the steps its last node status named (`pin`): what the daemon may choose to restore
from stays here until a newer status replaced that promise. Its own ranks' copies are kept
further back, down to the step the ring has caught up with (the newest step it holds of
every peer rank, and the newest of its own it has sent): a lost peer's ranks restore from
their replicas here together with this node's own copies of the same step, and replicas lag
the ranks by a step or more when the copies are big or the cores busy. Past `limit_bytes` the oldest
copies go first, promised or not: the bound is hard, and a restore that misses a copy falls
back to storage (tier 1). A copy only ever pushes out copies of its own job: another job's go
when a round of this node's job forgets them, never to make room for a copy sent to it.

The directory is this user's alone (lazarus.core.privatedir), and every file in it is 0600:
another local user must not read a shard, swap one in, or plant a symlink a write here follows
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser
from lazarus.core.privatedir import private_dir

log = logging.getLogger(__name__)


def _discard(path: Path) -> None:
    """Remove whatever is at `path` (a directory swapped in too), never following a link."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


@dataclass(frozen=True, slots=True)
class Copy:
    job: str
    rank: int
    step: int
    path: Path
    size: int
    local: bool   # this node's own rank's; else a replica of the peer's


def _name(job: str, rank: int, step: int) -> str:
    # The readable part may be the same for two jobs ("a/b", "a_b", a long common prefix):
    # the digest keeps one job's copy from landing on the other's file.
    tag = hashlib.sha256(job.encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job)[:48]}-{tag}-r{rank:05d}-s{step:010d}.t0"


class Tier0Store:
    """`root`: created 0700 when missing; UserError when it is a symlink, another user's, or
    open to others (lazarus.core.privatedir). `user`: the ranks' user when not the agent's:
    `incoming/` is theirs to write, and the copies kept are readable by their group (a
    round restores from them), never writable."""

    def __init__(self, root: Path, *, limit_bytes: int, keep: int = 2,
                 user: JobUser | None = None):
        self.user = user
        gid = user.gid if user else None
        self.root = private_dir(Path(root), "tier-0 directory", pass_gid=gid)
        self.limit_bytes = limit_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int, int], Copy] = {}
        self._pinned: set[tuple[str, int, int]] = set()
        self._sent: dict[tuple[str, int], int] = {}  # (job, rank) -> newest step on the peer
        for sub in ("incoming", "local", "replica"):
            # Leftovers of an earlier agent of this node: of no known job now.
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
            if user is not None:
                if sub == "incoming":
                    user.give(self.root / sub)
                    if not user.can_pass(self.root / sub):
                        raise UserError(f"tier-0 directory {str(self.root)!r}: the ranks' user "
                                        f"{user.name} cannot reach it (a directory above it "
                                        f"is closed to it)")
                else:
                    private_dir(self.root / sub, "tier-0 directory", pass_gid=gid)

    @property
    def incoming(self) -> Path:
        return self.root / "incoming"

    def add_local(self, job: str, rank: int, step: int, path: Path) -> Copy | None:
        """Take a rank's snapshot file (it must be in `incoming/`): copied into a file of the
        agent's own, the rank's removed. Not renamed: the rank keeps a descriptor that can
        write what it wrote, and a truncate through it would be SIGBUS in the agent that maps
        the file to send it, a file grown sparse a huge read for a peer that fetches it
        (docs/security.md, "The job's own code"). The copy is the kernel's (sendfile, within
        host memory) and of the size seen when the file was opened."""
        path = Path(path)
        fd = -1
        try:
            if path.parent == self.incoming:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            pass
        if fd < 0:
            log.warning("ignoring tier-0 snapshot %s: not a file in %s", path, self.incoming)
            if path.parent == self.incoming:
                _discard(path)  # a FIFO or a link the rank left: taken and dropped
            return None
        try:
            st = os.fstat(fd)
            # A hard link planted in incoming/ names another file: what is kept must be a
            # file the ranks wrote for this (with --run-as, the ranks' own).
            owner = self.user.uid if self.user else os.geteuid()
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != owner:
                log.warning("ignoring tier-0 snapshot %s: not a file of the ranks' own, linked "
                            "once", path)
                return None
            if st.st_size > self.limit_bytes:
                log.warning("ignoring tier-0 snapshot %s: %d bytes, over the store's %d",
                            path, st.st_size, self.limit_bytes)
                return None
            dest = self.root / "local" / _name(job, rank, step)
            if not self._copy_in(fd, st.st_size, dest):
                log.warning("ignoring tier-0 snapshot %s: it shrank while it was taken", path)
                return None
        finally:
            os.close(fd)
            _discard(path)
        return self._add(Copy(job, rank, step, dest, st.st_size, True))

    def _copy_in(self, src: int, size: int, dest: Path) -> bool:
        """`size` bytes of `src` into a new file at `dest` (unique name, 0600, sealed);
        False, and nothing at `dest`, when `src` ends sooner."""
        out, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".tmp")
        try:
            done = 0
            while done < size:
                n = os.sendfile(out, src, done, min(size - done, 1 << 30))
                if n == 0:
                    break
                done += n
            if done < size:
                os.close(out)
                out = -1
                os.unlink(tmp)
                return False
            self._seal(out)
            os.close(out)
            out = -1
            os.replace(tmp, dest)
            return True
        except BaseException:
            if out >= 0:
                os.close(out)
            Path(tmp).unlink(missing_ok=True)
            raise

    def _seal(self, fd: int) -> None:
        """A kept copy: the agent's, read-only to the ranks' group (they restore from it)
        when they run as a user of their own, else to nobody but the agent."""
        if self.user is None:
            os.fchmod(fd, 0o600)
        else:
            os.fchown(fd, os.geteuid(), self.user.gid)
            os.fchmod(fd, 0o640)

    def add_replica(self, job: str, rank: int, step: int, data: bytes) -> Copy:
        dest = self.root / "replica" / _name(job, rank, step)
        # A new file of a unique name (O_EXCL, 0600): never one that was there before.
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                self._seal(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self._add(Copy(job, rank, step, dest, len(data), False))

    def _add(self, copy: Copy) -> Copy:
        with self._lock:
            old = self._copies.pop((copy.job, copy.rank, copy.step), None)
            if old is not None and old.path != copy.path:
                old.path.unlink(missing_ok=True)
            self._copies[(copy.job, copy.rank, copy.step)] = copy
            self._evict(copy.job, copy.rank)
        return copy

    def sent(self, job: str, rank: int, step: int) -> None:
        """The peer node holds this node's copy of (rank, step)."""
        with self._lock:
            key = (job, rank)
            self._sent[key] = max(step, self._sent.get(key, step))

    def _caught_up(self, job: str) -> int | None:
        """(lock held) The newest step the ring has caught up with: of every peer rank held
        here and of every own rank sent, the smallest newest step; None before any."""
        newest: dict[tuple[bool, int], int] = {}
        for c in self._copies.values():
            if c.job == job and not c.local:
                newest[False, c.rank] = max(c.step, newest.get((False, c.rank), c.step))
        for (j, rank), step in self._sent.items():
            if j == job:
                newest[True, rank] = step
        return min(newest.values(), default=None)

    def _kept(self, job: str, rank: int) -> list[Copy]:
        """(lock held) A rank's copies worth keeping, newest first: the `keep` newest, and an
        own rank's back to the step the ring has caught up with."""
        mine = sorted((c for c in self._copies.values() if (c.job, c.rank) == (job, rank)),
                      key=lambda c: c.step, reverse=True)
        floor = self._caught_up(job)
        return [c for i, c in enumerate(mine)
                if i < self.keep or (c.local and floor is not None and c.step >= floor)]

    def _evict(self, job: str, rank: int) -> None:
        """(lock held)"""
        kept = {c.step for c in self._kept(job, rank)}
        for c in [c for c in self._copies.values() if (c.job, c.rank) == (job, rank)]:
            if c.step not in kept and (c.job, c.rank, c.step) not in self._pinned:
                self._drop(c)
        by_age = sorted((c for c in self._copies.values() if c.job == job), key=lambda c: c.step)
        total = sum(c.size for c in self._copies.values())
        for c in by_age:
            if total <= self.limit_bytes:
                break
            total -= c.size
            self._drop(c)
            log.warning("tier-0 memory limit (%.1f MiB) reached: dropped rank %d step %d",
                        self.limit_bytes / (1 << 20), c.rank, c.step)

    def _drop(self, c: Copy) -> None:
        self._copies.pop((c.job, c.rank, c.step), None)
        self._pinned.discard((c.job, c.rank, c.step))
        c.path.unlink(missing_ok=True)

    def path(self, job: str, rank: int, step: int) -> Path | None:
        with self._lock:
            c = self._copies.get((job, rank, step))
        return c.path if c is not None and c.path.is_file() else None

    def forget(self, *, job: str, after_step: int | None = None) -> None:
        """Drop every copy of another job, and this job's copies newer than `after_step` (a
        round that restores an older step starts a new timeline from it)."""
        with self._lock:
            for c in list(self._copies.values()):
                if c.job != job or (after_step is not None and c.step > after_step):
                    self._drop(c)

    def holdings(self, job: str, world_size: int) -> dict:
        """What the node status says of this store: {"job", "world", "ranks": {rank: steps},
        "bytes", "limit"}; the steps kept per rank (`_kept`), which are pinned from now on."""
        with self._lock:
            ranks: dict[str, list[int]] = {}
            for rank in sorted({c.rank for c in self._copies.values() if c.job == job}):
                ranks[str(rank)] = [c.step for c in self._kept(job, rank)]
            self._pinned = {(job, int(r), s) for r, steps in ranks.items() for s in steps}
            used = sum(c.size for c in self._copies.values())
        return {"job": job, "world": world_size, "ranks": ranks, "bytes": used,
                "limit": self.limit_bytes}

    def used_bytes(self) -> int:
        with self._lock:
            return sum(c.size for c in self._copies.values())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
