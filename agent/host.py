"""Host health: the checkpoint directory (free space, writable), memory, mounts, I/O errors.

`sample_host(config)` reads the host (psutil, a probe file, sysfs); `assess_host(previous,
sample, config)` is the pure verdict. Failed means the next checkpoint would not be written
(no space for it, directory unwritable or gone, a required mount missing, memory nearly
exhausted); the daemon alerts (lazarus.daemon.hostalert), the trainer goes on and drops the
saves the storage refuses, and a node whose own disk fails is swapped for an idle spare at a
checkpoint. Degraded means it is getting there.

The checkpoint dir is the job's: its user may own what lies in it, and the agent may hold
rights that user lacks (root's, under --run-as). So the agent writes its probe only in a
directory under its allowed roots, reached without following a symlink below them
(lazarus.core.jobpaths.open_dir); one outside them is not sampled at all (the ranks refuse
the job: docs/security.md, "The job's own code").
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lazarus.agent.gpu import DEGRADED, FAILED, HEALTHY
from lazarus.core import jobpaths

GiB = 1 << 30

# Hysteresis (docs/architecture.md, "Failure classes"): a free-space or memory level, once
# crossed, clears only this far on the other side of it -- free space at a threshold would
# otherwise raise and clear an alert with every save and every cleanup ...
CLEAR_MARGIN = 0.10          # of a free-space threshold
CLEAR_MEMORY = 0.02          # of the memory share
# ... and a new state (worse or better) is reported only once it has lasted this long -- two
# samples in a row at the agent's one-a-second polling: one odd sample is no alert, and no
# all-clear either. Longer would miss a disk that fills and is freed within seconds (the
# disk-full e2e does that in ~4 s).
HOLD_S = 1.0


@dataclass(kw_only=True, slots=True)
class HostConfig:
    checkpoint_dir: Path
    required_mounts: tuple[str, ...] = ()
    min_free_bytes: int = 1 * GiB      # failed below this (or below one checkpoint)
    low_free_bytes: int = 10 * GiB     # degraded below this (or below two checkpoints)
    checkpoint_bytes: int = 0          # size of the last checkpoint, once known
    memory_degraded: float = 0.90      # share of memory in use
    memory_failed: float = 0.97
    # where the agent lets jobs write (lazarus.core.jobpaths; empty: anywhere): the probe
    # writes nowhere else
    allowed_roots: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HostSample:
    checkpoint_dir: str
    free_bytes: int | None             # None: the directory is not there
    total_bytes: int | None
    write_error: str | None            # why the probe write failed; None = writable
    memory_used: float                 # share of memory not available to new work
    memory_available_bytes: int
    missing_mounts: tuple[str, ...] = ()
    io_errors: int | None = None       # the block device's error counter, where it has one
    # False: the directory is not there yet and was measured through the nearest existing
    # parent, where the trainer will create it (the first save of a run does).
    exists: bool = True
    # Why the directory was not sampled: it lies outside the agent's allowed roots.
    outside: str | None = None


@dataclass(frozen=True, slots=True)
class HostVerdict:
    state: str
    reasons: tuple[str, ...] = ()
    # Whether swapping the node out can help: memory exhaustion is the node's own. A storage
    # fault is not: draining needs a checkpoint the storage cannot take, and checkpoint
    # storage is usually shared, so the spare would meet the same fault.
    swap: bool = False
    # The levels crossed ("space_failed", "space_low", "memory_failed", "memory_high"): they
    # clear at the farther level next time (hysteresis). Not published.
    conditions: frozenset[str] = frozenset()

    def to_dict(self) -> dict:
        return {"state": self.state, "reasons": list(self.reasons), "swap": self.swap}


def _said(e: OSError) -> str:
    return f"{errno.errorcode.get(e.errno, 'error')}: {e.strerror}"


def _probe(directory: int) -> str | None:
    """Write, sync and remove a small file in the directory open as `directory`: what a
    checkpoint save will need. The file is a new one of an unguessable name: a checkpoint dir
    others may write to can hold a symlink planted where a predictable name would be, and a
    write must not go through it."""
    name = f".lazarus-probe-{secrets.token_hex(8)}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=directory)
        try:
            os.write(fd, b"lazarus probe\n" * 64)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=directory)
    except OSError as e:
        return _said(e)
    return None


def _device_of(path: Path) -> str | None:
    """The block device holding `path` (the longest mount point that contains it)."""
    best, device = "", None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (str(path) == mp or str(path).startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, device = mp, part.device
    return device


def _io_errors(device: str | None) -> int | None:
    """SCSI-style devices count failed commands in sysfs (hex); others have no counter."""
    if not device or not device.startswith("/dev/"):
        return None
    node = Path("/sys/class/block") / Path(device).name
    if not node.exists():
        return None
    real = node.resolve()
    for candidate in (real / "device" / "ioerr_cnt", real.parent / "device" / "ioerr_cnt"):
        try:
            return int(candidate.read_text().strip(), 16)
        except (OSError, ValueError):
            continue
    return None


def sample_host(config: HostConfig) -> HostSample:
    directory = Path(config.checkpoint_dir)
    mem = psutil.virtual_memory()
    missing = tuple(m for m in config.required_mounts if not os.path.ismount(m))
    host = {"checkpoint_dir": str(directory), "memory_used": 1 - mem.available / mem.total,
            "memory_available_bytes": mem.available, "missing_mounts": missing}
    unseen = {**host, "free_bytes": None, "total_bytes": None, "exists": False}
    if why := jobpaths.outside({"checkpoint dir": str(directory)}, config.allowed_roots):
        return HostSample(**unseen, write_error=None, outside=why)
    where = directory
    while not where.exists() and where != where.parent:
        where = where.parent   # a run's directory appears with its first save
    if not where.is_dir() or (where != directory and not os.access(where, os.W_OK | os.X_OK)):
        return HostSample(**unseen, write_error=f"the directory does not exist and {where} "
                                                "does not let it be created")
    try:
        fd = jobpaths.open_dir(where, config.allowed_roots)
    except ValueError as e:  # not made yet, nor is the root above it
        return HostSample(**unseen, write_error=None, outside=str(e))
    except OSError as e:     # a symlink swapped in below the root since it was resolved
        return HostSample(**unseen, write_error=f"{where}: {_said(e)}")
    try:
        usage = os.fstatvfs(fd)
        error = _probe(fd)
    finally:
        os.close(fd)
    return HostSample(**host, free_bytes=usage.f_bavail * usage.f_frsize,
                      total_bytes=usage.f_blocks * usage.f_frsize, write_error=error,
                      io_errors=_io_errors(_device_of(where.resolve())),
                      exists=where == directory)


def _gib(n: int) -> str:
    # A small checkpoint filesystem (a test's tmpfs) would read "0.0 GiB free, needs 0.0 GiB".
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def assess_host(previous: HostSample | None, sample: HostSample,
                config: HostConfig, *, existed: bool = False,
                held: frozenset[str] = frozenset()) -> HostVerdict:
    """`existed`: the checkpoint dir was there at some earlier sample (HostMonitor keeps it).
    `held`: the conditions of the verdict reported now, each judged at its clearing level."""
    failed: list[str] = []
    degraded: list[str] = []
    conditions: set[str] = set()
    s = sample
    if s.outside:
        pass  # not the node's to judge: the ranks refuse the job
    elif s.write_error:
        failed.append(f"checkpoint dir {s.checkpoint_dir} is not writable ({s.write_error})")
    elif existed and not s.exists:
        failed.append(f"checkpoint dir {s.checkpoint_dir} disappeared after it existed")
    if s.free_bytes is not None:
        need = max(config.min_free_bytes, config.checkpoint_bytes)
        want = max(config.low_free_bytes, 2 * config.checkpoint_bytes)
        if s.free_bytes < need * (1 + CLEAR_MARGIN if "space_failed" in held else 1):
            conditions.add("space_failed")
            failed.append(f"checkpoint dir has {_gib(s.free_bytes)} free, needs {_gib(need)}")
        elif s.free_bytes < want * (1 + CLEAR_MARGIN if held & {"space_failed", "space_low"}
                                    else 1):
            conditions.add("space_low")
            degraded.append(f"checkpoint dir has {_gib(s.free_bytes)} free "
                            f"(below {_gib(want)})")
    failed.extend(f"required mount {m} is not mounted" for m in s.missing_mounts)
    storage_failed = bool(failed)
    if s.memory_used >= config.memory_failed - (CLEAR_MEMORY if "memory_failed" in held else 0):
        conditions.add("memory_failed")
        failed.append(f"memory {s.memory_used:.0%} in use "
                      f"({_gib(s.memory_available_bytes)} available)")
    elif s.memory_used >= config.memory_degraded - (
            CLEAR_MEMORY if held & {"memory_failed", "memory_high"} else 0):
        conditions.add("memory_high")
        degraded.append(f"memory {s.memory_used:.0%} in use")
    if (previous is not None and previous.io_errors is not None and s.io_errors is not None
            and s.io_errors > previous.io_errors):
        degraded.append(f"{s.io_errors - previous.io_errors} new I/O errors on the "
                        "checkpoint device")
    state = FAILED if failed else DEGRADED if degraded else HEALTHY
    return HostVerdict(state=state, reasons=tuple(failed + degraded),
                       swap=state == FAILED and not storage_failed,
                       conditions=frozenset(conditions))


@dataclass(slots=True)
class HostMonitor:
    """Polled by the agent (about once a second). `verdict` is what it reports: a new state
    only once it has lasted `hold_s` (HOLD_S)."""
    config: HostConfig
    previous: HostSample | None = None
    verdict: HostVerdict = field(default_factory=lambda: HostVerdict(state=HEALTHY))
    existed: bool = False   # the checkpoint dir was seen: missing from then on is a failure
    hold_s: float = HOLD_S
    pending: tuple[str, float] | None = None   # (a new state seen, since when)

    def poll(self, now: float | None = None) -> HostVerdict:
        now = time.monotonic() if now is None else now
        sample = sample_host(self.config)
        seen = assess_host(self.previous, sample, self.config, existed=self.existed,
                           held=self.verdict.conditions)
        self.existed |= sample.exists
        self.previous = sample
        if seen.state == self.verdict.state:
            self.verdict, self.pending = seen, None   # same state: its reasons as they are now
        elif self.pending is None or self.pending[0] != seen.state:
            self.pending = (seen.state, now)
        if self.pending is not None and now - self.pending[1] >= self.hold_s:
            self.verdict, self.pending = seen, None
        return self.verdict
