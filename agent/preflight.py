"""Preflight: what a node must pass before it joins a round, and what an idle node repeats.

Each check is a small function that returns `(ok, reason)`; `timed` runs one, bounds what it
may raise to a failure with its reason, and measures its cost:

    gpu          every GPU the node should have is there and healthy by the GPU monitor's
                 rules (lazarus.agent.gpu: NVML, or the simulated backend without GPUs)
    storage      a file of a few MB written, fsynced, dropped from the page cache, read back
                 and compared, in the agent's work dir and the job's checkpoint dir (only
                 under the agent's allowed roots, reached through no symlink below them:
                 lazarus.core.jobpaths.open_dir; the job's user may own what is there)
    checkpoint   a small state dict saved and loaded through torch.distributed.checkpoint
                 (the trainer's path to storage) in the checkpoint dir, compared, removed
                 (as the ranks' user where they have one; skipped outside the allowed roots)
    clock        this host's wall clock against the etcd leader's (lazarus.agent.clockskew)
    collective   an all-reduce, checked, with its bus bandwidth (lazarus.agent.collective_check):
                 gloo with one member of the current round when there is one and the node
                 is not in it, else two ranks over the node's own address (NCCL with two
                 GPUs); by hand, also between nodes (`--peers`). In a child process, killed
                 when it overruns: the agent holds no CUDA context and outlives a hung NCCL

The agent runs them in a thread of its own (`Runner`): at its first pass with no ranks to
run, then every `every_s` while its node runs none, and publishes one compact verdict in its node status
(`summary`); the daemon cordons a node whose preflight failed (lazarus.daemon.preflight).
`lazarus preflight` (lazarus.agent.preflight_cli) runs them on a node by hand.
"""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.agent import clockskew
from lazarus.agent import collective_check as coll
from lazarus.agent.dcpprobe import checkpoint_round_trip, os_error
from lazarus.agent.gpu import HEALTHY, GpuVerdict
from lazarus.core import etcd as E
from lazarus.core import jobpaths
from lazarus.core.etcd_auth import EtcdAuth

log = logging.getLogger(__name__)
# DCP warns that it saves "in a single process" when there is no process group: that is the
# round trip's intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

CHECKS = ("gpu", "storage", "checkpoint", "clock", "collective")
PASSED, FAILED, RUNNING = "passed", "failed", "running"
MiB = 1 << 20
# What a node status carries of a failure: the daemon copies it into events and cordons.
REASON_CHARS = 300


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    reason: str
    cost_s: float
    skipped: bool = False


@dataclass(kw_only=True, slots=True)
class PreflightConfig:
    workdir: Path
    checkpoint_dir: Path | None = None
    # Bytes written and read back per directory: past the page cache's write-back batching,
    # small enough to cost tens of milliseconds on a healthy disk.
    storage_bytes: int = 4 * MiB
    skew_limit_s: float = 0.5
    host: str = "127.0.0.1"            # the address the collective test binds
    collective_bytes: int = 8 * MiB
    min_bus_gbps: float = 0.0          # 0: measured and shown, never failed for its speed
    peers: tuple[str, ...] = ()        # HOST:PORT of each rank; this node's at `rank`
    rank: int = 0
    pair: tuple[str, str, int] | None = None  # (node, store host, port): test with its agent
    expected_gpus: int = 0
    skip: frozenset[str] = frozenset()
    # The agent's worker zygote (lazarus.agent.zygote): the checkpoint and collective tests
    # then run in children forked from it; without one, in this process and a cold child.
    zygote: object = None
    # The ranks' user when not the agent's (lazarus.core.jobuser), and the ranks' environment:
    # the checkpoint test then runs as them, zygote or not.
    run_as: object = None
    child_env: dict | None = None
    # Where the agent lets jobs write (lazarus.core.jobpaths; empty: anywhere): the tests in
    # the job's checkpoint dir run only there.
    allowed_roots: tuple[str, ...] = ()


def timed(name: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    start = time.perf_counter()
    try:
        ok, reason = fn()
    except OSError as e:
        ok, reason = False, os_error(e)
    except (E.EtcdUnavailable, ValueError, RuntimeError) as e:
        ok, reason = False, str(e) or type(e).__name__
    return Check(name=name, ok=ok, reason=reason, cost_s=time.perf_counter() - start,
                 skipped=ok and reason.startswith("skipped:"))


# -- gpu ---------------------------------------------------------------------------------------
def gpus(verdicts: Sequence[GpuVerdict], expected: int, backend: str) -> tuple[bool, str]:
    """Every expected GPU seen, each healthy by the monitor's rules (a degraded GPU fails too:
    a node chosen with one would be swapped out again at its first checkpoint)."""
    if len(verdicts) < expected:
        return False, f"{len(verdicts)} of {expected} GPUs visible ({backend})"
    sick = [v for v in verdicts if v.state != HEALTHY]
    if sick:
        return False, "; ".join(f"GPU {v.index} {v.state}: {', '.join(v.reasons)}"
                                for v in sick)
    n = len(verdicts)
    return True, f"{n} GPU{'' if n == 1 else 's'} healthy ({backend})"


# -- storage -----------------------------------------------------------------------------------
def storage(directories: Sequence[Path], nbytes: int, *,
            allowed_roots: Sequence[str] = ()) -> tuple[bool, str]:
    """Write, fsync, read back and compare `nbytes` in each directory (one outside
    `allowed_roots` is skipped, reached as lazarus.core.jobpaths.open_dir does). The pages
    are dropped from the cache after the fsync so that the read comes from the device where
    the filesystem allows it (tmpfs and some network filesystems keep them)."""
    done = []
    for d in directories:
        if not d.is_dir():
            done.append(f"{d} not there yet")
            continue
        data = os.urandom(nbytes)
        try:
            fd = jobpaths.open_dir(d, allowed_roots)
        except ValueError:
            done.append(f"{d} skipped (outside the allowed roots)")
            continue
        except OSError as e:
            return False, f"{d}: {os_error(e)}"
        try:
            back = _write_read(fd, f".lazarus-preflight-{secrets.token_hex(8)}", data)
        except OSError as e:
            return False, f"{d}: {os_error(e)}"
        finally:
            os.close(fd)
        if back != data:
            return False, f"{d}: read back {len(back)} bytes that differ from those written"
        done.append(str(d))
    return True, f"{nbytes // MiB} MiB written, synced, read back: {', '.join(done)}"


def _write_read(directory: int, name: str, data: bytes) -> bytes:
    """Write `data` to a new file `name` in the directory open as `directory`, fsync it, drop
    it from the cache, read it back, remove it. The file is created here or not at all
    (O_EXCL, O_NOFOLLOW) and read back through the same descriptor: the checkpoint dir may be
    writable by others, who must not get a write through a symlink planted at its name, nor
    swap the file before the read."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                 dir_fd=directory)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        back = bytearray()
        while chunk := os.pread(fd, len(data) + 1 - len(back), len(back)):
            back += chunk
        return bytes(back)
    finally:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            pass


# -- clock -------------------------------------------------------------------------------------
def ssl_context(auth: EtcdAuth) -> ssl.SSLContext | None:
    """TLS for etcd's HTTP side, from the same material as the gRPC client's."""
    if not auth.tls:
        return None
    ctx = ssl.create_default_context(cadata=auth.ca.decode())
    if auth.cert is not None and auth.key is not None:
        # load_cert_chain reads files only: the key goes to a private file for the moment
        with tempfile.TemporaryDirectory() as d:
            cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
            cert.write_bytes(auth.cert)
            key.touch(0o600)
            key.write_bytes(auth.key)
            ctx.load_cert_chain(cert, key)
    return ctx


def clock(etcd: E.Etcd, limit_s: float, *, now: Callable[[], float] = time.time
          ) -> tuple[bool, str]:
    url = etcd.leader_url().rstrip("/") + "/version"
    context = ssl_context(etcd.auth)
    try:
        clockskew.stamp(url, context, 2.0)  # reachable at all?
    except (OSError, ValueError) as e:
        # The leader advertises a client URL this node may not route to (etcd behind a
        # proxy or a virtual address): no measurement, and no reason to cordon every node.
        return True, f"skipped: the etcd leader's client URL {url} did not answer ({e})"
    skew = clockskew.measure(url, context=context, clock=now)
    return clockskew.judge(skew, limit_s)


# -- all of them -------------------------------------------------------------------------------
def run_checks(config: PreflightConfig, *, gpu_verdicts: Callable[[], tuple[list, str]],
               etcd: E.Etcd | None, now: Callable[[], float] = time.time) -> list[Check]:
    """Every check not in `config.skip`, in order. `gpu_verdicts`: the GPU monitor's verdicts
    and its backend's name. Without `etcd` the clock check is skipped."""
    c = config
    out: list[Check] = []

    def skipped(name: str, why: str) -> None:
        out.append(Check(name=name, ok=True, reason=f"skipped: {why}", cost_s=0.0,
                         skipped=True))

    def gpu_check() -> tuple[bool, str]:
        verdicts, backend = gpu_verdicts()
        return gpus(verdicts, c.expected_gpus, backend)

    def storage_check() -> tuple[bool, str]:
        # the work dir is the agent's (or, under --run-as, the ranks' in the agent's): no root
        ok, said = storage([c.workdir], c.storage_bytes)
        if not ok or c.checkpoint_dir is None:
            return ok, said
        ok, more = storage([c.checkpoint_dir], c.storage_bytes, allowed_roots=c.allowed_roots)
        return ok, f"{said}; {more}" if ok else more

    def checkpoint_check() -> tuple[bool, str]:
        where = c.checkpoint_dir or c.workdir
        if c.checkpoint_dir is not None and jobpaths.outside(
                {"checkpoint dir": str(where)}, c.allowed_roots):
            return True, f"skipped: {where} is outside the allowed roots"
        if c.zygote is None and c.run_as is None:
            return checkpoint_round_trip(where)
        return coll.checkpoint(str(where), zygote=c.zygote, user=c.run_as, env=c.child_env)

    steps: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
        ("gpu", gpu_check),
        ("storage", storage_check),
        ("checkpoint", checkpoint_check),
        ("clock", lambda: clock(etcd, c.skew_limit_s, now=now)),
        ("collective", lambda: coll.with_peer(*c.pair, host=c.host, nbytes=c.collective_bytes,
                                              min_bus_gbps=c.min_bus_gbps, zygote=c.zygote)
         if c.pair else
         coll.collective(c.peers or coll.loopback_peers(c.host), c.rank,
                         nbytes=c.collective_bytes, min_bus_gbps=c.min_bus_gbps,
                         zygote=c.zygote)),
    ]
    for name, fn in steps:
        if name in c.skip:
            skipped(name, "--skip")
        elif name == "clock" and etcd is None:
            skipped(name, "no etcd")
        else:
            out.append(timed(name, fn))
    return out


def summary(checks: Sequence[Check], *, at: float) -> dict:
    """What a node status carries: the verdict, when, the whole cost, and why it failed --
    small, whatever the checks said (the etcd write budget, docs/architecture.md)."""
    failed = [c for c in checks if not c.ok]
    reason = "; ".join(f"{c.name}: {c.reason}" for c in failed)
    if len(reason) > REASON_CHARS:
        reason = reason[:REASON_CHARS - 3] + "..."
    return {"state": FAILED if failed else PASSED, "at": round(at, 3),
            "cost_s": round(sum(c.cost_s for c in checks), 3), "reason": reason}


@dataclass(kw_only=True, slots=True)
class Runner:
    """Runs the checks in a thread: at the first pass of the agent with no ranks to run, then every `every_s` while
    the node runs no ranks (0: never again). `result` is the last summary ({} before the
    first is done); `on_done` wakes the agent to publish it. The checks of a node chosen for
    a round meanwhile finish, but the node is not held back: its last verdict counted."""
    every_s: float
    run: Callable[[], list[Check]]
    on_done: Callable[[], None]
    result: dict = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _last: float | None = None

    def due(self, now: float, *, idle: bool) -> bool:
        """Only while idle, the first time too: an agent that adopted running ranks (a
        restart) checks once they end, not under a training node's feet."""
        if not idle or (self._thread is not None and self._thread.is_alive()):
            return False
        return self._last is None or (self.every_s > 0 and now - self._last >= self.every_s)

    def poll(self, now: float, *, idle: bool) -> None:
        """Start a run when one is due (called from the agent's loop)."""
        if not self.due(now, idle=idle):
            return
        self._last = now
        self._thread = threading.Thread(target=self._work, name="preflight", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            checks = self.run()
        except Exception as e:  # a bug of ours: said, not a thread dying with the node unusable
            log.exception("preflight crashed")
            checks = [Check(name="preflight", ok=False, reason=f"internal error: {e!r}",
                            cost_s=0.0)]
        self.result = summary(checks, at=time.time())
        level = logging.INFO if self.result["state"] == PASSED else logging.WARNING
        measured = next((c.reason for c in checks if c.name == "collective" and c.ok), "")
        log.log(level, "preflight %s in %.2f s%s: %s%s", self.result["state"],
                self.result["cost_s"], "" if self.result["state"] == PASSED else
                f" ({self.result['reason']})",
                ", ".join(f"{c.name} {c.cost_s:.2f} s" for c in checks),
                f"; {measured}" if measured else "")
        self.on_done()

    @property
    def state(self) -> str:
        return self.result.get("state", RUNNING)

    @property
    def busy(self) -> bool:
        """Its first run not done yet, or a run under way."""
        return not self.result or (self._thread is not None and self._thread.is_alive())
