"""Tier-0 snapshots: each rank's shard of model and optimizer, its data position and RNG, in
host memory, taken every few steps (docs/architecture.md, "Checkpoints").

A snapshot is the same state a DCP checkpoint holds (trainer/checkpoint.py) for this rank
alone: the local shards of the model and optimizer state as `get_state_dict` gives them, the
caller's `extra` (data position, schedule, guard) and the RNG state. Restoring one therefore
gives the run the uninterrupted run's losses bit for bit; it needs the same mesh (the same
world size), since a shard is only this rank's piece.

The training loop pays for a copy of the shard into host memory (`Snapshotter.take`); a
background thread encodes it (safetensors, zstd: lazarus.core.snapshotfile) into a file in
the agent's snapshot directory and tells the agent, which owns it from then on: it outlives
this process, and the agent sends it to its peer node.
"""

from __future__ import annotations

import json
import math
import mmap
import operator
import os
import secrets
import statistics
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lazarus.core import snapshotfile
from lazarus.core.snapshotfile import SnapshotError
from lazarus.core.stall import CheckpointStall
from lazarus.trainer import optimstate
from lazarus.trainer.collprogress import collective_device
from lazarus.trainer.rngstate import rng_state, set_rng_state

# The stall a snapshot may cost, as a share of the step time, when the period is automatic.
STALL_SHARE = 0.01
MAX_AUTO_EVERY = 1000
# The automatic period follows the median stall of the last STALL_WINDOW snapshots, once it
# has MIN_STALLS of them: one slow copy (a page fault storm, a busy core) must not stretch it.
STALL_WINDOW = 5
MIN_STALLS = 3
# Snapshots settled as never durable (the peer refused them, or newer ones overtook them)
# after which the period may lengthen without a durable copy: snapshots every step do not
# make a peer that refuses them take one.
NEVER_DURABLE_LIMIT = 8
# How long a rank that finished its run waits for the agent to settle its last snapshots
# before it writes their stall lines without a durable time.
SETTLE_S = 2.0


def _leaves(tree, prefix: str = ""):
    """(path, value) of every leaf of a nested dict/list state, in a fixed order."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _leaves(tree[key], f"{prefix}{key}/")
    elif isinstance(tree, (list, tuple)) and not _scalar_list(tree):
        for i, item in enumerate(tree):
            yield from _leaves(item, f"{prefix}{i}/")
    else:
        yield prefix[:-1], tree


def _scalar_list(value) -> bool:
    # betas=(0.9, 0.95) and a param group's list of parameter names are values, not subtrees
    return all(isinstance(v, (int, float, str, bool)) or v is None for v in value)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            into: dict[str, torch.Tensor] | None = None
            ) -> tuple[dict[str, torch.Tensor], dict]:
    """Copies of this rank's tensors (local shards, in host memory) and its other values.
    `into`: the buffers of an earlier capture no longer in use, copied into where they still
    fit (a fresh allocation of a big shard costs page faults on every snapshot)."""
    tensors, values = {}, {}
    for path, value in _leaves(_state(model, optimizer)):
        if isinstance(value, torch.Tensor):
            local = _local(value).detach()
            buffer = (into or {}).get(path)
            if (buffer is not None and buffer.shape == local.shape
                    and buffer.dtype == local.dtype):
                tensors[path] = buffer.copy_(local)
            else:
                tensors[path] = host_copy(local)
        else:
            values[path] = _plain(value)
    return tensors, values


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in host memory, pinned when it comes from a GPU: a device-to-host
    copy into pageable memory goes through a staging buffer at a fraction of the link's speed,
    and the buffers are reused by every later snapshot (their allocation is paid once)."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True).contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


class ShardCopier:
    """`capture` for the same model and optimizer again and again, without walking their
    state each time: the first capture finds where every tensor of the shard lives (as
    `get_state_dict` names it), the next ones copy from there in one foreach copy and read
    the values (the param groups' settings, which change: the learning rate) from the
    optimizer directly. `get_state_dict` and a copy per tensor cost about 2 ms a snapshot of
    the tiny model (84 tensors) against a 0.2 ms copy; a large model has thousands.

    The state the first capture saw must still be the live one: every parameter and every
    optimizer state tensor the same object (FSDP2 keeps its sharded parameters, AdamW
    updates its moments in place). When not -- or when a value is not a param group's
    setting -- it captures the long way."""

    def __init__(self):
        self._objects: list[torch.Tensor] = []  # held: an identity is never reused meanwhile
        self._paths: list[str] = []
        self._sources: list[torch.Tensor] = []
        self._values: list[tuple[str, int, str]] = []  # (path, param group, setting)
        self._fixed: dict = {}
        self._made: dict | None = None  # what the last capture returned, in _paths' order

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                into: dict[str, torch.Tensor] | None = None
                ) -> tuple[dict[str, torch.Tensor], dict]:
        if not self._sources or not _same(_objects(model, optimizer), self._objects):
            self._made = None
            if not self._learn(model, optimizer):
                return capture(model, optimizer, into=into)
        if into is not None and into is self._made:
            # the last capture's own buffers, in its order: nothing to look up or check
            torch._foreach_copy_(list(into.values()), self._sources)
            tensors = into
        elif _fits(buffers := [(into or {}).get(path) for path in self._paths], self._sources):
            torch._foreach_copy_(buffers, self._sources)
            tensors = dict(zip(self._paths, buffers))
        else:
            tensors = {path: host_copy(src) for path, src in zip(self._paths, self._sources)}
        self._made = tensors  # fits the next capture as it is: no check of each buffer then
        groups = optimizer.param_groups
        values = {path: _plain(groups[i][key]) for path, i, key in self._values}
        values.update(self._fixed)
        return tensors, values

    def _learn(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Where the state lives now; False when a value is not one it can read again."""
        self._sources, self._paths, self._values, self._fixed = [], [], [], {}
        for path, value in _leaves(_state(model, optimizer)):
            if isinstance(value, torch.Tensor):
                self._paths.append(path)
                self._sources.append(_local(value).detach())
                continue
            parts = path.split("/")
            if parts[:2] != ["optim", "param_groups"] or len(parts) != 4 \
                    or not parts[2].isdigit():
                self._sources = []
                return False
            if parts[3] == "params":
                self._fixed[path] = _plain(value)  # names, not objects: they do not change
            else:
                self._values.append((path, int(parts[2]), parts[3]))
        self._objects = _objects(model, optimizer)
        return True


def _objects(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.parameters())
    for entry in optimizer.state.values():
        out.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    return out


def _fits(buffers: list, sources: list[torch.Tensor]) -> bool:
    return all(b is not None and b.shape == src.shape and b.dtype == src.dtype
               for b, src in zip(buffers, sources))


def _same(now: list, then: list) -> bool:
    # Identities, not values: the state's tensors are updated in place step after step.
    return len(now) == len(then) and all(map(operator.is_, now, then))


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def encode(tensors: dict[str, torch.Tensor], values: dict, *, header: dict) -> bytes:
    return b"".join(encode_parts(tensors, values, header=header))


def encode_parts(tensors: dict[str, torch.Tensor], values: dict, *,
                 header: dict) -> tuple[bytes, bytes, bytes]:
    return snapshotfile.pack_parts({**header, "values": values}, st_save(tensors))


def restore(data: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            rank: int, world_size: int, what: str = "snapshot") -> dict:
    """Load a snapshot file's shard into `model` and `optimizer` and set this process's RNG;
    returns its header (`extra` in it). SnapshotError when it is not this rank's, not of this
    mesh, corrupt, or does not fit the model."""
    header, raw = snapshotfile.unpack(data, what)
    if header["rank"] != rank or header["world_size"] != world_size:
        raise SnapshotError(f"{what} is rank {header['rank']} of {header['world_size']}, this "
                            f"is rank {rank} of {world_size}")
    tensors = tensors_of(raw, what)
    values = header.get("values") if isinstance(header.get("values"), dict) else {}
    return restore_captured(header, tensors, values, model, optimizer, what=what)


def restore_captured(header: dict, tensors: dict[str, torch.Tensor], values: dict,
                     model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                     what: str = "snapshot") -> dict:
    """`restore` from a capture this process still holds (Snapshotter.last: a survivor's
    own, lazarus.trainer.kept), not from its file: no read, no decode."""
    saved = optimstate.from_snapshot(tensors, values)
    _check_state_shapes(model, saved, what)
    # Read over below: allocated rather than made by a step (trainer/optimstate.py).
    optimstate.allocate(model, optimizer, saved, local=True)
    state = _state(model, optimizer)
    leaves = list(_leaves(state))
    want = {p for p, v in leaves if isinstance(v, torch.Tensor)}
    if want != set(tensors) or {p for p, v in leaves if not isinstance(v, torch.Tensor)} != set(values):
        missing = sorted((want - set(tensors)) | (set(tensors) - want))[:3]
        raise SnapshotError(f"{what} does not fit this model and optimizer (differs at "
                            f"{', '.join(missing) or 'the non-tensor values'})")
    with torch.no_grad():
        for path, value in leaves:
            if isinstance(value, torch.Tensor):
                local, saved = _local(value), tensors[path]
                if local.shape != saved.shape or local.dtype != saved.dtype:
                    raise SnapshotError(f"{what}: {path} is {tuple(saved.shape)} {saved.dtype}, "
                                        f"the model has {tuple(local.shape)} {local.dtype}")
                local.copy_(saved)
            else:
                if not _same_kind(values[path], value):
                    raise SnapshotError(f"{what}: {path} is {str(values[path])[:40]!r}, the "
                                        f"optimizer has a {type(value).__name__}")
                _set_leaf(state, path, values[path], value)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    try:
        set_rng_state(header["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"{what}: its RNG state is missing or garbled "
                            f"({type(e).__name__}: {str(e)[:80]})") from None
    return header


def _check_state_shapes(model: torch.nn.Module, saved: dict, what: str) -> None:
    if problem := optimstate.optim_state_problem(model, saved, local=True):
        raise SnapshotError(f"{what}: {problem}")


def _same_kind(saved, current) -> bool:
    """Whether a value read back from JSON can stand for the optimizer's own (a number for
    a number, a list for a tuple): an lr of "x" would fail the first step, not the restore."""
    if isinstance(current, bool) or current is None:
        return type(saved) is type(current)
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current)
    return isinstance(saved, type(current))


def _set_leaf(state: dict, path: str, saved, current) -> None:
    *parents, last = path.split("/")
    node = state
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(current, tuple):
        saved = tuple(saved)
    if isinstance(node, list):
        node[int(last)] = saved
    else:
        node[last if last in node else next(k for k in node if str(k) == last)] = saved


def load_file(path: str | Path) -> memoryview | bytes:
    """A snapshot file's bytes, mapped rather than read: it sits in host memory already (a
    tmpfs), and a restore reads it once, into the model (see `tensors_of`)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except OSError as e:
        raise SnapshotError(f"tier-0 snapshot {path} cannot be read ({e.strerror or e})") from None


# safetensors' dtype names (its format's header) -> torch's.
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
           "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2}


def tensors_of(raw: bytes | memoryview, what: str = "snapshot") -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes as views of those bytes, read-only: no copy. The
    restore copies each into the model once; `safetensors.torch.load` would copy the whole
    shard first (and `bytes` of a mapped file once more) -- fresh memory, page-faulted in
    while the new round waits. SnapshotError for bytes that are not safetensors."""
    view = memoryview(raw).cast("B")
    try:
        size = int.from_bytes(view[:8], "little")
        if len(view) < 8 or size > len(view) - 8:
            raise ValueError(f"a header of {size} bytes in {len(view)}")
        header = json.loads(bytes(view[8:8 + size]))
        start = 8 + size
        out = {}
        with warnings.catch_warnings():
            # read-only bytes: the tensors are only ever copied from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES[entry["dtype"]]
                shape = [int(d) for d in entry["shape"]]
                if any(d < 0 for d in shape):
                    raise ValueError(f"{name}: shape {shape}")
                begin, end = (int(x) for x in entry["data_offsets"])
                numel = math.prod(shape)
                if not 0 <= begin <= end <= len(view) - start \
                        or end - begin != numel * dtype.itemsize:
                    raise ValueError(f"{name}: offsets {begin}-{end} for {shape} {dtype}")
                out[name] = (torch.frombuffer(view, dtype=dtype, count=numel,
                                              offset=start + begin).view(shape)
                             if numel else torch.empty(shape, dtype=dtype))
        return out
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise SnapshotError(f"{what}: its tensors do not parse ({str(e)[:200]})") from None


def write_file(directory: Path, rank: int, step: int, parts: tuple[bytes, ...],
               on_written: Callable[[int, str], None]) -> None:
    """Write a snapshot's parts into `directory` whole or not at all, then hand it over."""
    final = Path(directory) / f"r{rank:05d}-s{step:010d}.t0"
    # The rank's weights and optimizer state: readable by this user only, from the first
    # byte. A fresh name, opened only if new and never through a symlink: nothing planted at
    # it (or left by a crashed write of another process of this pid) is written into.
    tmp = final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full tmpfs must not keep the half-written copy
        raise
    on_written(step, str(final))


def settle(inflight: Future | None) -> None:
    """Wait for a snapshot's write. A full /dev/shm, a value JSON cannot hold: that snapshot
    is lost and the restore point stays the one before; training goes on."""
    if inflight is None:
        return
    try:
        inflight.result()
    except (OSError, ValueError) as e:
        print(f"tier-0 snapshot not written: {type(e).__name__}: {e}", flush=True)


def auto_period(stall: float, step_times: list[float], durable_times: list[float]) -> int:
    """Steps between snapshots when the period is automatic: the stall under STALL_SHARE of
    the median step time, and no shorter than the median time to durable. 1 before any step
    has been timed."""
    typical = statistics.median(step_times) if step_times else 0.0
    if not typical > 0:
        return 1
    wish = math.ceil(stall / (STALL_SHARE * typical))
    if durable_times:
        wish = max(wish, math.ceil(statistics.median(durable_times) / typical))
    return min(MAX_AUTO_EVERY, max(1, wish))


def typical_stall(stalls: list[float]) -> float | None:
    """The stall the automatic period is sized on: the median of the last STALL_WINDOW
    (`stalls` leaves out a Snapshotter's first: it allocates the buffers and finds the
    state's tensors), None before MIN_STALLS of them."""
    recent = stalls[-STALL_WINDOW:]
    return statistics.median(recent) if len(recent) >= MIN_STALLS else None


def wished_period(*, current: int, stalls: list[float], step_times: list[float],
                  durable_times: list[float], replicated: bool) -> tuple[int, bool]:
    """(this rank's wish for the automatic period, whether it may lengthen it). It may not
    before its typical stall is known, nor before one of its copies since it (re)started is
    durable (`replicated`, on the peer): a rank that started anew has no replica there yet,
    and a period lengthened meanwhile leaves its peer nothing newer than storage."""
    stall = typical_stall(stalls)
    if stall is None:
        return current, False
    return auto_period(stall, step_times, durable_times), replicated


def agree_period(*, current: int, wish: int, all_ready: bool) -> int:
    """The period every rank takes: the largest wish (`wish`, all-reduced), but no longer
    than `current` while any rank may not lengthen it (`all_ready` False)."""
    return wish if all_ready else min(wish, current)


def snapshot_due(step: int, *, next_step: int, checkpoint: bool) -> bool:
    """Whether a step takes a snapshot: on the period, and at every checkpoint, so that
    memory holds a step at least as new as storage (a restore takes memory then)."""
    return checkpoint or step >= next_step


class Capture(NamedTuple):
    """A snapshot as still in the host buffers of the rank that took it."""
    step: int
    tensors: dict
    values: dict
    header: dict


class Snapshotter:
    """Takes this rank's tier-0 snapshots into `directory` (the agent's; it owns each file
    once `on_written(step, path)` has told it), at most one in flight.

    `every`: steps between snapshots; 0 means automatic -- after each snapshot the ranks agree
    (an all-reduce of the largest wish) on the smallest period whose stall (the median of the
    last few: `typical_stall`) stays under 1% of the median step time, and that is at least as
    long as a snapshot takes to be durable (on the peer node): one in flight end to end. A
    faster one would only be overtaken before it is sent, its encoding and sending paid for by
    the cores the step runs on. The period starts at every step and lengthens only once every
    rank has a durable copy of this round (`wished_period`). A checkpoint step always takes
    one (`due(step, checkpoint=True)`): memory is never older than storage. All ranks
    snapshot at the same steps: a restore needs every shard of one step.

    `kept()`: the (step, durable, time.perf_counter()) of the snapshots the agent settled
    since the last call (lazarus.trainer.session.Session.snapshots_kept); `stalls()` turns
    them into stall records: `blocked_s` what `take` held the loop, `durable_s` from its start
    until this rank's copy was on the peer node (on this node, without a peer), None when it
    never got there. They time this rank's copy, as tier 1's time rank 0's commit.
    """

    def __init__(self, directory: Path, *, every: int, header: dict,
                 on_written: Callable[[int, str], None], first_step: int,
                 kept: Callable[[], list[tuple[int, bool, float]]] = list,
                 buffers: dict[str, torch.Tensor] | None = None):
        self.directory = Path(directory)
        self.every = every
        self.header = header
        self.on_written = on_written
        self.kept = kept
        self._pending: dict[int, tuple[float, float]] = {}  # step -> (started, blocked)
        # the last capture's, reused by the next (`buffers`: an earlier Snapshotter's)
        self._buffers: dict[str, torch.Tensor] = dict(buffers or {})
        # (step, tensors, values, header) of the last capture, whose buffers hold it until
        # the next: a survivor restores from it in its next round (restore_captured)
        self.last: Capture | None = None
        self._copier = ShardCopier()
        self._done: list[CheckpointStall] = []
        self._period = every or 1
        self.next_step = first_step + self._period
        self._step_times: list[float] = []
        self._durable_times: list[float] = []  # of the last settled snapshots, seconds
        self._stalls: list[float] = []         # of the snapshots after this one's first
        self._taken = 0
        self._replicated = False  # one of this Snapshotter's copies was durable
        self._never_durable = 0   # of its copies settled as never durable
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazarus-tier0")
        self._inflight: Future | None = None
        self.last_stall_s = 0.0

    def observe_step(self, seconds: float) -> None:
        self._step_times.append(seconds)
        del self._step_times[:-20]

    def due(self, step: int, *, checkpoint: bool = False) -> bool:
        """Whether `step` takes a snapshot; `checkpoint`: the step is checkpointed too (every
        rank must pass the same: the checkpoint decision is agreed)."""
        return snapshot_due(step, next_step=self.next_step, checkpoint=checkpoint)

    def take(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict) -> float:
        """Snapshot at `step` (every rank, the same step); returns the stall in seconds: the
        wait for the previous one to be written, plus the copy into host memory."""
        t0 = time.perf_counter()
        self.wait()  # the previous snapshot is encoded: its buffers are free again
        # The copy overwrites the buffers `last` names: from here until the new `last`, they
        # hold no step (a copy that fails halfway leaves none).
        self.last = None
        tensors, values = self._copier.capture(model, optimizer, into=self._buffers)
        self._buffers = tensors
        header = {**self.header, "step": step, "extra": extra, "rng": rng_state()}
        self.last = Capture(step, tensors, values, header)
        stall = time.perf_counter() - t0
        self._inflight = self._executor.submit(self._write, step, tensors, values, header)
        self.last_stall_s = stall
        self._pending[step] = (t0, stall)
        self._plan(step, stall)
        return stall

    def _plan(self, step: int, stall: float) -> None:
        self._taken += 1
        if self._taken > 1:  # the first allocates the buffers and learns the state's tensors
            self._stalls = [*self._stalls[-(STALL_WINDOW - 1):], stall]
        if self.every:
            # a checkpoint's snapshot off the period leaves the period as it was
            if step >= self.next_step:
                self.next_step = step + self.every
            return
        wish, ready = wished_period(
            current=self._period, stalls=self._stalls, step_times=self._step_times,
            durable_times=self._durable_times,
            replicated=self._replicated or self._never_durable >= NEVER_DURABLE_LIMIT)
        all_ready = ready
        if dist.is_available() and dist.is_initialized():
            # On the device the default group's backend runs on: NCCL has no CPU tensors.
            agreed = torch.tensor([wish, int(not ready)], device=collective_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            wish, unready = (int(v) for v in agreed.tolist())
            all_ready = not unready
        self._period = agree_period(current=self._period, wish=wish, all_ready=all_ready)
        self.next_step = step + self._period

    def _write(self, step: int, tensors: dict, values: dict, header: dict) -> None:
        write_file(self.directory, header["rank"], step,
                   encode_parts(tensors, values, header=header), self.on_written)

    def wait(self) -> None:
        inflight, self._inflight = self._inflight, None
        settle(inflight)

    def stalls(self) -> list[CheckpointStall]:
        """The stall records of the snapshots settled since the last call, oldest first."""
        for step, durable, at in self.kept():
            if step in self._pending:
                started, blocked = self._pending.pop(step)
                self._done.append(self._record(step, blocked,
                                               at - started if durable else None))
                if durable:
                    self._durable_times = [*self._durable_times[-4:], at - started]
                    self._replicated = True
                else:
                    self._never_durable += 1
        done, self._done = sorted(self._done, key=lambda s: s.step), []
        return done

    def _record(self, step: int, blocked: float, durable: float | None) -> CheckpointStall:
        return CheckpointStall(step=step, tier="memory", blocked_s=blocked,
                               durable_s=None if durable is None else max(0.0, durable),
                               ranks=self.header.get("world_size"))

    def close(self, *, settle_s: float = 0.0) -> None:
        """Waits for the last snapshot to be written and, up to `settle_s`, for the agent to
        settle the ones in flight. With `settle_s`, `stalls()` then has a record of every
        snapshot taken (those still unsettled without a durable time); without, the unsettled
        ones are left out: a rank stopping early cannot tell a lost copy from a late answer."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
        deadline = time.monotonic() + settle_s
        while self._pending and time.monotonic() < deadline:
            self._done.extend(self.stalls())
            if self._pending:
                time.sleep(0.02)
        self._done.extend(self.stalls())
        if settle_s > 0:
            for step, (_, blocked) in sorted(self._pending.items()):
                self._done.append(self._record(step, blocked, None))
        self._pending.clear()
