"""Tier 0 for any state (docs/adopting.md, level 1): `Session.snapshot(step, state)` and
`Session.restore(into)` of a script of the user's own.

`state` is a nested structure of dicts, lists and tuples whose leaves are tensors (DTensors:
this rank's local shard is kept) or JSON values (numbers, strings, booleans, None, lists of
them): a model's and an optimizer's state dicts (torch.distributed.checkpoint.state_dict
gives both, sharded or not) and the script's own extras (a data loader's position). The
snapshot holds this rank's tensors (safetensors), a skeleton of the structure (JSON: dict keys
keep their type, so an optimizer's integer keys come back as integers) and torch's RNG
state; the file format is the built-in trainer's (lazarus.core.snapshotfile), and the agent
replicates it to its peer node as it does the trainer's. Taking one costs a copy of this
rank's tensors into host memory; encoding and writing run on a thread of their own, one
snapshot in flight.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save as st_save
from torch.distributed.tensor import DTensor

from lazarus.core import snapshotfile
from lazarus.core.snapshotfile import SnapshotError
from lazarus.trainer.rngstate import rng_state, set_rng_state
from lazarus.trainer.snapshot import load_file, settle, tensors_of, write_file

# Deeper than any state dict: a cycle or a runaway structure is refused, not recursed into.
MAX_DEPTH = 64


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by path, skeleton) of `state`: the tensors copied into host memory."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"the state is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, torch.Tensor):
            local = node.to_local() if isinstance(node, DTensor) else node
            path = str(len(tensors))
            tensors[path] = local.detach().to("cpu", copy=True).contiguous()
            return {"T": path}
        if isinstance(node, dict):
            items = []
            for key, value in node.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise ValueError(f"a state dict key must be a str or an int, got {key!r:.80}")
                items.append([key, walk(value, depth + 1)])
            return {"d": items}
        if isinstance(node, (list, tuple)):
            return {"t" if isinstance(node, tuple) else "l": [walk(v, depth + 1) for v in node]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"v": node}
        raise ValueError(f"a state leaf must be a tensor or a JSON value, got "
                         f"{type(node).__name__}")

    return tensors, walk(state, 0)


def rebuild(skeleton: Any, tensors: dict[str, torch.Tensor], what: str) -> Any:
    """The structure `flatten` described, with `tensors` at its leaves; SnapshotError when
    the skeleton is not one `flatten` wrote."""
    def walk(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise SnapshotError(f"{what}: its state skeleton is malformed")
        (kind, body), = node.items()
        if kind == "T":
            if body not in tensors:
                raise SnapshotError(f"{what}: tensor {str(body)[:40]!r} is missing")
            return tensors[body]
        if kind == "v":
            return body
        if kind == "d" and isinstance(body, list):
            out = {}
            for item in body:
                if not (isinstance(item, list) and len(item) == 2
                        and isinstance(item[0], (str, int))):
                    raise SnapshotError(f"{what}: its state skeleton is malformed")
                out[item[0]] = walk(item[1], depth + 1)
            return out
        if kind in ("l", "t") and isinstance(body, list):
            items = [walk(v, depth + 1) for v in body]
            return tuple(items) if kind == "t" else items
        raise SnapshotError(f"{what}: its state skeleton is malformed")

    return walk(skeleton, 0)


def copy_into(saved: Any, live: Any, what: str, path: str = "") -> Any:
    """`saved` poured into the live structure `live`: each saved tensor copied into the live
    tensor at its place (a DTensor's local shard), every other value taken as saved; the
    result has `live`'s tensors. SnapshotError where the two differ in shape."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise SnapshotError(f"{what}: {path or 'the state'} is no tensor in the snapshot")
        local = live.to_local() if isinstance(live, DTensor) else live
        if local.shape != saved.shape or local.dtype != saved.dtype:
            raise SnapshotError(f"{what}: {path} is {tuple(saved.shape)} {saved.dtype} in the "
                                f"snapshot, {tuple(local.shape)} {local.dtype} here")
        with torch.no_grad():
            local.copy_(saved)
        return live
    if isinstance(live, dict) and isinstance(saved, dict):
        out = dict(saved)  # keys only the snapshot has (optimizer state made by a step) stay
        for key, value in live.items():
            if key in saved:
                out[key] = copy_into(saved[key], value, what, f"{path}/{key}")
        return out
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) \
            and len(live) == len(saved):
        items = [copy_into(s, v, what, f"{path}/{i}") for i, (s, v) in enumerate(zip(saved, live))]
        return tuple(items) if isinstance(live, tuple) else items
    return saved


class StateSnapshots:
    """One rank's snapshots of a script's state into the agent's directory: the agent owns
    each file once `on_written(step, path)` has told it. At most one is being written."""

    def __init__(self, directory: Path, *, header: dict,
                 on_written: Callable[[int, str], None]):
        self.directory = Path(directory)
        self.header = header
        self.on_written = on_written
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazarus-tier0")
        self._inflight: Future | None = None
        self._lock = threading.Lock()

    def take(self, step: int, state: Any) -> float:
        """Snapshot `state` at `step`; returns the stall: the wait for the previous snapshot
        to be written and the copy into host memory. ValueError for a state it cannot hold."""
        t0 = time.perf_counter()
        with self._lock:
            self.wait()
            tensors, skeleton = flatten(state)
            header = {**self.header, "step": int(step), "skeleton": skeleton,
                      "rng": rng_state()}
            self._inflight = self._executor.submit(self._write, int(step), tensors, header)
        return time.perf_counter() - t0

    def _write(self, step: int, tensors: dict, header: dict) -> None:
        write_file(self.directory, header["rank"], step,
                   snapshotfile.pack_parts(header, st_save(tensors)), self.on_written)

    def wait(self) -> None:
        inflight, self._inflight = self._inflight, None
        settle(inflight)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def read(path: str, *, rank: int, world_size: int) -> tuple[int, Any]:
    """(step, state) of this rank's snapshot file, its RNG state set; SnapshotError when it
    is not this rank's, of another world size, corrupt, or not a script's state."""
    header, raw = snapshotfile.unpack(load_file(path), path)
    if header.get("rank") != rank or header.get("world_size") != world_size:
        raise SnapshotError(f"{path} is rank {header.get('rank')} of {header.get('world_size')}, "
                            f"this is rank {rank} of {world_size}")
    if "skeleton" not in header or not isinstance(header.get("step"), int):
        raise SnapshotError(f"{path} is not a snapshot of a script's state")
    # Copies, not views of the mapped file: the agent may delete the file, and a view the
    # script keeps (an optimizer's state) would then be read from nowhere.
    tensors = {name: t.clone() for name, t in tensors_of(raw, path).items()}
    state = rebuild(header["skeleton"], tensors, path)
    try:
        set_rng_state(header["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"{path}: its RNG state is malformed ({e!s:.100})") from None
    return header["step"], state
