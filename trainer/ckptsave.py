"""Saving checkpoints: `Checkpointer`, asynchronous, at most one save in flight, through
torch.distributed.checkpoint (DCP); the layout and the commit are trainer/checkpoint.py's.

Rank 0 writes the manifest (the commit marker) only after every rank's files are on disk and
only if `commit_gate(step)` still says yes, so a crash, a full disk or a fenced-off (stale)
round leaves a directory that is never listed or loaded. A save the storage refuses
(trainer/ckptrefusal.py) is not fatal: every rank learns of it at the same point, rank 0
removes the directory and reports it (`on_fail`), and training goes on. Rank 0 commits only
files it sees as their writers wrote them: storage that is not shared gives no checkpoint
that only its writers could load.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from lazarus.core.errors import CheckpointError
from lazarus.core.stall import CheckpointStall
from lazarus.trainer import exchange
from lazarus.trainer.ckptfiles import (FORMAT_VERSION, MANIFEST, STEP_DIR, checkpoint_dir,
                                       file_entry, fsync_dir, rng_file, write_durable)
from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint
from lazarus.trainer.ckptrefusal import storage_problem
from lazarus.trainer.dcpread import read_dcp_metadata
from lazarus.trainer.glooinit import made_on_use
from lazarus.trainer.rngstate import rng_state

log = logging.getLogger(__name__)

# A single-process save (no process group) is intended here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to save")


def _shard_files(directory: Path, metadata: dcp_metadata.Metadata | None) -> set[str]:
    """The shard files of a save DCP just finished. torch 2.11's save returns metadata
    without its storage layout (seen on CUDA); the .metadata file it wrote has it."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        # the file is on shared storage others can write: never unpickle it unrestricted
        storage = read_dcp_metadata(directory).storage_data
    return {s.relative_path for s in storage.values()}



def _mesh_of(model: torch.nn.Module) -> dict | None:
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    if not meshes:
        return None
    mesh = max(meshes, key=lambda m: m.ndim)
    return {"dims": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape)}


@dataclass(slots=True)
class _Timing:
    step: int
    started: float  # time.perf_counter() when save() was called
    blocked_s: float = 0.0
    durable_s: float | None = None  # set on rank 0 once the manifest is durable


class Checkpointer:
    """Saves checkpoints under `root`, asynchronously, at most one in flight.

    Construct it on every rank at the same point (it creates its own gloo process group,
    a collective call, unless `process_group` is given; that group must span all ranks).
    Background saves talk over this separate group so they never interleave with the training
    collectives. `keep_last` committed checkpoints are kept; older ones, and incomplete
    directories left by crashed saves, are deleted when a newer one commits.
    """

    def __init__(self, root: Path, *, keep_last: int, process_group=None,
                 is_good: Callable[[int], bool] | None = None, job_id: str = ""):
        """`is_good(step)`: whether a committed checkpoint is known good (no loss spike in
        the steps after it). Retention never deletes the newest good one, however old, so a
        rollback always has somewhere to go."""
        assert keep_last >= 1
        self.is_good = is_good
        self.job_id = job_id  # written into every manifest; retention deletes only these
        self.root = Path(root)
        self.keep_last = keep_last
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed and process_group is None:
            # Made on use: its saves' gathers and broadcasts connect a few pairs a rank,
            # where made eagerly it was a second full mesh of the world (docs/scale.md).
            with made_on_use():
                process_group = dist.new_group(backend="gloo")
        self._pg = process_group
        self._rank = dist.get_rank() if self._distributed else 0
        self._world = dist.get_world_size() if self._distributed else 1
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazarus-ckpt")
        self._inflight: Future | None = None
        self._stager: BlockingAsyncStager | None = None
        self._timings: list[tuple[_Timing, Future]] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {self.root}: "
                                  f"{e.strerror or e}") from None

    def _staging(self, model_sd: dict) -> dict:
        """async_save's stager: for state on a GPU, one set of pinned host buffers kept for
        every save (DCP's default stages each save into fresh pageable memory: the copy
        runs at a fraction of the link's speed and the allocation is paid every time). The
        previous save is written by the time the next one stages (save waits for it)."""
        if not any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                   for t in model_sd.values()):
            return {}
        if self._stager is None:
            self._stager = BlockingAsyncStager(cache_staged_state_dict=True)
        return {"async_stager": self._stager}

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict, *, async_save: bool = True,
             commit_gate: Callable[[int], bool] | None = None,
             on_commit: Callable[[int, Path], None] | None = None,
             on_fail: Callable[[int, str], None] | None = None) -> None:
        """Checkpoint model + optimizer + `extra` + RNG at `step` (collective: every rank).

        Waits for the previous save first. With `async_save` it returns once the state is
        copied off the live tensors; the write, checksums and commit happen in the background
        (`wait()` to finish). On rank 0, just before committing, `commit_gate(step)` is asked
        (from the background thread) whether this process may still commit; `on_commit(step,
        path)` is then called there, on rank 0 only, once the manifest is durable. If the
        storage refused the save, `on_fail(step, why)` is called there instead, after the
        directory is removed. What the save cost the caller's loop is in `stalls()`.
        """
        timing = _Timing(step=step, started=time.perf_counter())

        def committed(at_step: int, path: Path) -> None:
            timing.durable_s = time.perf_counter() - timing.started
            if on_commit is not None:
                on_commit(at_step, path)

        self.wait()
        extra_json = json.dumps(extra)  # fail now, in the caller, if it is not JSON-able
        directory = checkpoint_dir(self.root, step)
        refused = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if self._rank == 0 and (directory / MANIFEST).exists():
                # Saving a step again (after a rollback): uncommit before any shard is rewritten.
                (directory / MANIFEST).unlink()
                fsync_dir(directory)
        except OSError as e:
            # Not raised here: the other ranks are about to enter the save's collectives.
            # _finish fails the save on every rank alike.
            refused = f"rank {self._rank}: {e}"
        rng = rng_state()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        writer = FileSystemWriter(directory)
        if async_save:
            written = dcp.async_save(state, storage_writer=writer, process_group=self._pg,
                                     no_dist=not self._distributed, **self._staging(model_sd))
        else:
            written = Future()
            try:
                written.set_result(dcp.save(state, storage_writer=writer,
                                            process_group=self._pg,
                                            no_dist=not self._distributed))
            except CheckpointException as e:
                written.set_exception(e)  # judged in _finish, like an async failure
        commit = {"step": step, "extra": json.loads(extra_json), "world_size": self._world,
                  "mesh": _mesh_of(model)}
        future = self._inflight = self._executor.submit(self._finish, directory, written, rng,
                                                        commit, commit_gate, committed, on_fail,
                                                        refused)
        if not async_save:
            self.wait()
        timing.blocked_s = time.perf_counter() - timing.started
        self._timings.append((timing, future))

    def stalls(self) -> list[CheckpointStall]:
        """The stall records (tier "storage") of the saves finished since the last call, oldest
        first. `durable_s` is known on rank 0 only (it commits); elsewhere it is None."""
        done, pending = [], []
        for timing, future in self._timings:
            (done if future.done() else pending).append((timing, future))
        self._timings = pending
        return [CheckpointStall(step=t.step, tier="storage", blocked_s=t.blocked_s,
                                durable_s=t.durable_s, ranks=self._world) for t, _ in done]

    def _finish(self, directory: Path, written: Future, rng: dict, commit: dict,
                commit_gate: Callable[[int], bool] | None,
                on_commit: Callable[[int, Path], None] | None,
                on_fail: Callable[[int, str], None] | None, refused: str | None) -> Path | None:
        try:
            metadata = written.result()  # DCP has fsynced every shard and, on rank 0, .metadata
        except CheckpointException as e:
            # DCP ends a failed save collectively: every rank holds this same exception.
            why = storage_problem(e, directory)
            if why is None:
                raise
            return self._abandon(directory, commit["step"], why, on_fail)
        problem, entries = refused, []
        try:
            shards = _shard_files(directory, metadata)
        except (OSError, ValueError) as e:
            shards, problem = set(), problem or f"rank {self._rank}: {e}"
        try:
            if problem is None:
                write_durable(directory / rng_file(self._rank), json.dumps(rng).encode())
                # DCP names each rank's shard files __{rank}_*: every rank hashes its own.
                mine = sorted(n for n in shards if n.startswith(f"__{self._rank}_"))
                mine.append(rng_file(self._rank))
                if self._rank == 0:
                    mine.append(".metadata")
                entries = [file_entry(directory, n) for n in mine]
        except OSError as e:
            problem = f"rank {self._rank}: {e}"
        if self._distributed:
            gathered = exchange.gather((problem, entries), dst=0, group=self._pg)
            gathered = [tuple(g) for g in gathered] if gathered is not None else None
        else:
            gathered = [(problem, entries)]
        # (committed path, error, whether the storage refused it)
        outcome: list = [(None, None, False)]
        failure = None
        if self._rank == 0:
            problems = [p for p, _ in gathered if p]
            try:
                if problems:
                    outcome = [(None, "; ".join(problems), True)]
                else:
                    committed = self._commit(directory, gathered, shards, commit, commit_gate,
                                             on_commit)
                    outcome = [(str(committed) if committed else None, None, False)]
            except OSError as e:  # the manifest could not be written: nothing is committed
                outcome = [(None, f"rank 0: {e}", True)]
            except Exception as e:  # the other ranks must hear of it, not wait forever
                failure = e
                outcome = [(None, str(e), False)]
        if self._distributed:
            # Also keeps every rank from starting the next save before rank 0 has cleaned up.
            outcome = [exchange.broadcast(outcome[0], src=0, group=self._pg)]
        committed, error, refused_by_storage = outcome[0]
        if failure is not None:
            raise failure
        if refused_by_storage:
            return self._abandon(directory, commit["step"], error, on_fail)
        if error:
            raise CheckpointError(error)
        return Path(committed) if committed else None

    def _abandon(self, directory: Path, step: int, why: str,
                 on_fail: Callable[[int, str], None] | None) -> None:
        """The storage refused the save (every rank knows): remove what was written, so a
        partial checkpoint can never be taken for one, and let training go on."""
        if self._rank != 0:
            return None
        if str(directory) not in why:  # ENOSPC, say, comes without a file name
            why = f"{why} (writing {directory})"
        try:
            latest = latest_checkpoint(self.root)
        except OSError:
            latest = "unknown (the checkpoint directory cannot be read)"
        log.error("checkpoint step %d not written, nothing committed: %s. The newest committed "
                  "checkpoint is still %s", step, why, latest or "none")
        shutil.rmtree(directory, ignore_errors=True)
        if on_fail is not None:
            on_fail(step, why)
        return None

    def _commit(self, directory: Path, gathered: list, shards: set[str], commit: dict,
                commit_gate: Callable[[int], bool] | None,
                on_commit: Callable[[int, Path], None] | None) -> Path | None:
        files = sorted((e for _, es in gathered for e in es), key=lambda e: e["name"])
        assert {e["name"] for e in files} >= shards, "a shard file was not hashed by any rank"
        # What every rank wrote must be where this rank reads it, or the "committed"
        # checkpoint is one no other node can load (node-local checkpoint dirs).
        for rank, (_, entries) in enumerate(gathered):
            for e in entries:
                try:
                    seen = (directory / e["name"]).stat().st_size
                except FileNotFoundError:
                    seen = None
                if seen != e["bytes"]:
                    raise OSError(f"rank 0 does not see {e['name']} as rank {rank} wrote it "
                                  f"({'absent' if seen is None else f'{seen} bytes'}, not "
                                  f"{e['bytes']}): the checkpoint dir is not storage every "
                                  "node shares")
        step = commit["step"]
        if commit_gate is not None and not commit_gate(step):
            log.warning("checkpoint %s written but not committed: the commit gate refused",
                        directory)
            return None
        previous = committed_checkpoints(self.root)
        manifest = {"format_version": FORMAT_VERSION, "job_id": self.job_id,
                    "commit_seq": previous[-1][1]["commit_seq"] + 1 if previous else 1,
                    **commit, "files": files}
        write_durable(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        try:
            self._clean_up(directory, {e["name"] for e in files})
        except OSError as e:  # committed all the same: old checkpoints merely stay a while
            log.warning("checkpoint %s committed, but cleaning up older ones failed: %s",
                        directory, e)
        if on_commit is not None:
            on_commit(step, directory)
        return directory

    def _clean_up(self, committed: Path, listed: set[str]) -> None:
        # Leftovers of an earlier save of the same step (e.g. a larger world's shard files).
        for f in committed.iterdir():
            if f.name not in listed and f.name != MANIFEST:
                f.unlink()
        everyone = committed_checkpoints(self.root)
        committed_list = [(p, m) for p, m in everyone if m.get("job_id", "") == self.job_id]
        keep = {p for p, m in everyone if m.get("job_id", "") != self.job_id}  # not ours
        keep.update(p for p, _ in committed_list[-self.keep_last:])
        if self.is_good is not None:
            good = [p for p, m in committed_list if self.is_good(int(m["step"]))]
            keep.update(good[-1:])
        for d in self.root.iterdir():
            # Only one save is in flight (this one), so any other directory without a
            # manifest is a crashed save's remains.
            if STEP_DIR.fullmatch(d.name) and d not in keep and d != committed:
                shutil.rmtree(d, ignore_errors=True)

    def wait(self) -> Path | None:
        """Finish the in-flight save. Returns the checkpoint it committed (on every rank), or
        None if the gate refused, the storage refused (see `save`'s on_fail) or nothing was in
        flight; raises if the save failed otherwise."""
        inflight, self._inflight = self._inflight, None
        return inflight.result() if inflight is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
