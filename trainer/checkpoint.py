"""Sharded, asynchronous, verifiable checkpoints through torch.distributed.checkpoint (DCP).

On disk, one directory per checkpoint::

    ROOT/step-00001200/
      __0_0.distcp ...        DCP shards of model + optimizer (each rank writes its own)
      .metadata               DCP's index of those shards
      rng-00000.json ...      each rank's RNG state (torch CPU, and CUDA where present)
      manifest.json           written LAST, by rank 0: the commit marker

A checkpoint is *committed* when its manifest exists. The manifest lists every file with its
size and sha256, the step, the caller's `extra` (data position, schedule, ...), the world size
and the device mesh. Rank 0 writes it (temporary file, fsync, rename, fsync of the directory)
only after every rank's files are on disk and only if `commit_gate(step)` still says yes, so a
crash, a full disk or a fenced-off (stale) round leaves a directory that is never listed or
loaded. Because the layout is DCP's, a checkpoint taken at one (dp, tp) mesh loads into another.

A save the storage refuses (disk full, before or during the save; read-only; gone: an OSError,
torch's short-write RuntimeError, or DCP's exception wrapping either, on any rank) is not
fatal: every rank learns of it at the same point, rank 0 removes the directory and reports it
(`on_fail`), and training goes on; the last committed checkpoint stays the one to restore.
Rank 0 commits only files it sees as their writers wrote them: storage that is not shared
gives no checkpoint that only its writers could load (`check_shared` catches it at a job's
start).

A restore that fails says what each rank found (RestoreFailed: corrupt, missing, unreadable),
so that the daemon can tell a checkpoint that is wrong from a node that cannot read it.

A checkpoint directory belongs to one job: ROOT/.lazarus-job names it (`claim`), every
manifest carries its writer's job id, and retention deletes only its own job's checkpoints. A
job refuses a directory holding another job's checkpoints unless it was told to start from
them (checkpoint.resume); it then adopts them, and never deletes them.

Nothing read from disk is unpickled without restriction: DCP's `.metadata` is a pickle, so it
is read with an unpickler that only builds DCP's own metadata classes (plus torch.Size,
dtypes and pathlib paths); tensors and the optimizer's small non-tensor values are read with
torch.load(weights_only=True).
"""

from __future__ import annotations

import base64
import collections
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import socket
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
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (FileSystemReader, FileSystemWriter,
                                                     _StorageInfo)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lazarus.core.contract import ABSENT, CORRUPT, UNREADABLE
from lazarus.core.errors import CheckpointError, RestoreFailed
from lazarus.core.stall import CheckpointStall
from lazarus.trainer import exchange, optimstate

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
OWNER = ".lazarus-job"
FORMAT_VERSION = 1
_DIR_RE = re.compile(r"step-(\d+)")

# A single-process save or load (no process group) is intended here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to")


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


# ---------------------------------------------------------------------------------------------
# Small file helpers


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Write via a temporary name + fsync + rename, so `path` is absent or complete."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _file_entry(directory: Path, name: str) -> dict:
    path = directory / name
    return {"name": name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


# ---------------------------------------------------------------------------------------------
# RNG


def _shard_files(directory: Path, metadata: dcp_metadata.Metadata | None) -> set[str]:
    """The shard files of a save DCP just finished. torch 2.11's save returns metadata
    without its storage layout (seen on CUDA); the .metadata file it wrote has it."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        storage = FileSystemReader(directory).read_metadata().storage_data
    return {s.relative_path for s in storage.values()}


def rng_state() -> dict:
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    # Only a process that uses CUDA has a CUDA generator worth keeping: asking would make a
    # CUDA context in a CPU rank on a GPU machine.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
        state["torch_cuda"] = base64.b64encode(cuda).decode()
    return state


def set_rng_state(state: dict) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch_cpu"]))
    if torch.cuda.is_available() and torch.cuda.is_initialized() and "torch_cuda" in state:
        torch.cuda.set_rng_state(tensor(state["torch_cuda"]))


def reseed_value(step: int, rank: int) -> int:
    """The seed each rank takes when a checkpoint is loaded into a different world size.

    RNG streams cannot be split or merged across ranks, so a resized run reseeds instead:
    deterministically from (step, rank), so the same resize of the same checkpoint gives the
    same run twice.
    """
    digest = hashlib.sha256(f"lazarus-rng:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------------------------------------
# Reading DCP's files without unrestricted unpickling

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                 "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path,
    ("pathlib", "Path"): Path,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{module}.{name} is not allowed in DCP metadata: refusing to "
                              f"unpickle it")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointError:
                raise
            except Exception as e:  # whatever crafted bytes make the unpickler raise
                raise CheckpointError(f"{path} is malformed ({type(e).__name__}: "
                                      f"{str(e)[:80]})") from None
        if not isinstance(metadata, dcp_metadata.Metadata) \
                or not isinstance(metadata.state_dict_metadata, dict):
            raise CheckpointError(f"{path} is not DCP metadata (a {type(metadata).__name__})")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor values (optimizer hyper-parameters) are read with
    weights_only=True: plain numbers, strings, tuples, never arbitrary objects."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# Per-parameter state that torch's optimizers (Adam, AdamW, SGD) keep in the parameter's
# shape. A restore allocates the saved shapes as they are (optimstate.allocate), so a wrong
# one would pass the restore and fail the first step: a crash, retried on the same
# checkpoint, instead of a bad checkpoint the restore falls back from.
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def optim_state_problem(model: torch.nn.Module, saved: dict, *, local: bool) -> str | None:
    """What in `saved` (optimstate's parameter name -> {key: SavedTensor or value}) cannot
    be `model`'s optimizer state: a per-parameter entry not of its parameter's shape (its
    local shard's with `local`, else its global one) or not floating point, a step that is
    not a scalar. None when nothing; a name the model lacks is left to the load to name."""
    params = dict(model.named_parameters())
    for name, entries in saved.items():
        param = params.get(name)
        if param is None:
            continue
        own = tuple((param.to_local() if local and isinstance(param, DTensor) else param).shape)
        for key, value in entries.items():
            if not isinstance(value, optimstate.SavedTensor):
                continue
            want = own if key in PARAM_SHAPED else () if key == "step" else None
            if want is not None and tuple(value.shape) != want:
                return (f"optimizer state {key} of {name} is {tuple(value.shape)}, not {want} "
                        f"(the parameter is {own})")
            if key in PARAM_SHAPED and not value.dtype.is_floating_point:
                return f"optimizer state {key} of {name} is {value.dtype}, not floating point"
    return None


def read_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """DCP's index of a checkpoint directory (restricted unpickling)."""
    return _SafeReader(path).read_metadata()


def load_tensors(path: Path, state_dict: dict, *, no_dist: bool = False) -> None:
    """dcp.load into `state_dict` (in place) through the restricted reader and planner;
    a checkpoint that does not fit the state (another model) is a CheckpointError."""
    try:
        dcp.load(state_dict, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(),
                 no_dist=no_dist)
    except CheckpointException as e:
        rank, (first, _) = next(iter(e.failures.items()))
        raise CheckpointError(f"cannot load checkpoint {path} (rank {rank}): "
                              f"{str(first).splitlines()[0] if str(first) else first!r}") from None


# ---------------------------------------------------------------------------------------------
# Listing and verifying


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`; CheckpointError if it has none, or one
    that is malformed (naming what is wrong)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save never "
                              f"committed)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{mpath} is malformed (not JSON: {str(e)[:80]})") from None
    if problem := _manifest_problem(manifest):
        raise CheckpointError(f"{mpath} is malformed: {problem}")
    return manifest


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest) -> str | None:
    """What in a manifest the listing and the checks read is not as a save writes it. Anyone
    who can write the checkpoint dir can write a manifest: a file name in it is joined to the
    checkpoint's path, so it must name a file in that directory, never "../../etc/passwd" or
    "/etc/shadow"; and a field of the wrong type must be a bad checkpoint here, not a
    TypeError later that the worker would take for a crash."""
    if not isinstance(manifest, dict):
        return f"not a JSON object but a {type(manifest).__name__}"
    if (version := manifest.get("format_version")) != FORMAT_VERSION:
        return f"format_version is {str(version)[:20]!r}, not {FORMAT_VERSION}"
    for field in ("step", "commit_seq"):
        if not _whole(manifest.get(field)):
            return f"{field} is {str(manifest.get(field))[:20]!r}, not a whole number"
    if not isinstance(manifest.get("job_id", ""), str):
        return "job_id is not a string"
    files = manifest.get("files")
    if not isinstance(files, list):
        return "files is not a list"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return f"files[{i}] is not an object"
        if missing := [k for k in ("name", "bytes", "sha256") if k not in entry]:
            return f"files[{i}] has no {missing[0]!r}"
        name = entry["name"]
        if not isinstance(name, str):
            return f"files[{i}].name is a {type(name).__name__}, not a file name"
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            return (f"files[{i}].name {name[:80]!r} is not the name of a file in the "
                    "checkpoint directory")
        if not _whole(entry["bytes"]):
            return f"files[{i}].bytes is {str(entry['bytes'])[:20]!r}, not a size"
        if not isinstance(entry["sha256"], str) or not _SHA256_RE.fullmatch(entry["sha256"]):
            return f"files[{i}].sha256 is not a sha256 digest"
    return None


def committed_checkpoints(root: Path) -> list[tuple[Path, dict]]:
    """Committed checkpoints under `root`, oldest commit first, with their manifests.

    Ordered by commit, not by step: after a rollback the newest commit is the run's present,
    even if an abandoned timeline left checkpoints with higher step numbers.
    """
    root = Path(root)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if not _DIR_RE.fullmatch(d.name) or not (d / MANIFEST).is_file():
                continue
            try:
                found.append((d, read_manifest(d)))
            except CheckpointError as e:
                log.warning("ignoring checkpoint: %s", e)
    return sorted(found, key=lambda pm: pm[1]["commit_seq"])


def latest_checkpoint(root: Path) -> Path | None:
    """The most recently committed checkpoint under `root` (never an incomplete one)."""
    committed = committed_checkpoints(root)
    return committed[-1][0] if committed else None


def claim(root: Path, job_id: str, *, adopt: bool) -> str | None:
    """Make ROOT this job's checkpoint directory (rank 0, before anything is saved). Returns
    why the job must not run here, or None. `adopt`: the job was told to start from what is
    in ROOT (checkpoint.resume), another job's checkpoints included; they stay its writer's,
    and this job's retention never deletes them."""
    root = Path(root)
    owner_file = root / OWNER
    try:
        owner = json.loads(owner_file.read_text()).get("job_id")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, AttributeError) as e:
        return f"checkpoint dir {root}: {owner_file.name} cannot be read ({e})"
    if owner is None:
        # A directory from before ownership, or a `lazarus train` of its own: its committed
        # checkpoints are someone's all the same.
        owners = {m.get("job_id", "") for _, m in committed_checkpoints(root)}
        owner = next(iter(owners - {job_id}), None)
    if owner not in (None, job_id) and not adopt:
        steps = [int(m["step"]) for _, m in committed_checkpoints(root)]
        held = (f"checkpoints of steps {', '.join(map(str, steps[-5:]))}" if steps
                else "its checkpoint records")
        return (f"checkpoint dir {root} belongs to job {owner or '(unnamed)'} and holds {held}: "
                "give this job its own checkpoint.dir, or set checkpoint.resume = 'latest' to "
                "start from them (they are then kept, never deleted by this job)")
    if owner != job_id:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _write_durable(owner_file, (json.dumps(
                {"job_id": job_id, "adopted_from": owner}) + "\n").encode())
        except OSError as e:
            return f"checkpoint dir {root}: cannot write {owner_file.name} ({e.strerror or e})"
    return None


def _inspect(path: Path, rank: int, world: int) -> tuple[dict | None, tuple[str, str] | None]:
    """What this rank finds wrong with checkpoint `path`, hashing its share of the files:
    (the manifest if it could be read, (kind, reason) or None). The kinds (lazarus.core.contract)
    tell the checkpoint's fault from this node's: a checksum that fails is the checkpoint's;
    a root, a directory or a file this node cannot see or read while others can is the
    node's, which only the daemon, comparing every node's finding, can tell."""
    root = path.parent
    try:
        in_root = os.listdir(root)
    except FileNotFoundError:
        return None, (UNREADABLE, f"checkpoint root {root} is not there on this node (a storage "
                                  "mount missing?)")
    except OSError as e:
        return None, (UNREADABLE, f"checkpoint root {root} cannot be read: {e.strerror or e}")
    try:
        names = set(os.listdir(path))
    except FileNotFoundError:
        if OWNER not in in_root and not any(_DIR_RE.fullmatch(n) for n in in_root):
            # No trace of any checkpoint: not the storage the job wrote to (a mount missing
            # here, an empty directory in its place), not a checkpoint deleted from it.
            return None, (UNREADABLE, f"checkpoint root {root} holds no checkpoints on this node "
                                      f"(no {OWNER}, no step-*): its storage is not mounted here?")
        return None, (ABSENT, f"checkpoint {path} does not exist")
    except OSError as e:
        return None, (UNREADABLE, f"checkpoint {path} cannot be read: {e.strerror or e}")
    if MANIFEST not in names:
        return None, (ABSENT, f"checkpoint {path} is incomplete: no {MANIFEST} (the save never "
                               "committed)")
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return None, (CORRUPT, str(e))
    except OSError as e:
        return None, (UNREADABLE, f"{path / MANIFEST} cannot be read: {e.strerror or e}")
    # Every rank checks that every listed file is there (one listing); a file missing for one
    # node and not for the others is that node's view, not the checkpoint.
    if absent := [e["name"] for e in manifest["files"] if e["name"] not in names]:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        return manifest, (ABSENT, f"{absent[0]} is missing{more} (checkpoint {path} is "
                                   "incomplete)")
    for entry in manifest["files"][rank::world]:
        f = path / entry["name"]
        try:
            size = f.stat().st_size
            if size != entry["bytes"]:
                return manifest, (CORRUPT, f"{entry['name']} has {size} bytes, the manifest says "
                                           f"{entry['bytes']} (checkpoint {path} is corrupt)")
            if _sha256(f) != entry["sha256"]:
                return manifest, (CORRUPT, f"{entry['name']} fails its sha256 checksum "
                                           f"(checkpoint {path} is corrupt)")
        except OSError as e:
            return manifest, (UNREADABLE, f"{entry['name']} cannot be read: {e.strerror or e} "
                                          f"(checkpoint {path})")
    return manifest, None


def verify_checkpoint(path: Path) -> dict:
    """Manifest and every file's checksum, in this process; returns the manifest."""
    manifest, problem = _inspect(Path(path), 0, 1)
    if problem is not None:
        raise RestoreFailed(problem[1], kind=problem[0], own=problem[1])
    return manifest


def _verify_collectively(path: Path) -> dict:
    """verify_checkpoint with the hashing split across ranks. Every rank raises RestoreFailed
    with the first problem any rank found (none is left waiting in a collective the others
    abandoned), each with its own finding: the daemon compares the nodes' findings."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, problem = _inspect(Path(path), rank, world)
    problems = exchange.all_gather(problem)  # (kind, reason) pairs come back as lists
    # The checkpoint's own fault first: it names what to condemn.
    found = sorted((p for p in problems if p), key=lambda p: p[0] != CORRUPT)
    if found:
        kind, own = problem if problem else ("", "")
        raise RestoreFailed(found[0][1], kind=kind, own=own)
    assert manifest is not None
    return manifest


def check_shared(root: Path) -> str | None:
    """Whether every rank sees the same checkpoint dir (collective; a job's first round): why
    not, or None. The first rank of each (host, mount namespace) leaves a marker in ROOT and
    rank 0 looks for them all, so node-local checkpoint dirs fail the job at its start with
    one line, not at a restore that no node but the writer's can do."""
    rank = dist.get_rank()
    token = exchange.broadcast(secrets.token_hex(6) if rank == 0 else None, src=0)
    if not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{12}", token):
        # it names the files every rank writes: never a path
        raise exchange.ExchangeError(f"rank 0 sent {str(token)[:40]!r} for a marker's name")
    here = (socket.gethostname(), _mount_namespace())
    places = [tuple(p) for p in exchange.all_gather(here)]
    writers = sorted({places.index(p) for p in places})
    marker = root / f".lazarus-shared-{token}-{rank}"
    wrote = False
    if rank in writers:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _write_durable(marker, f"{here[0]}\n".encode())
            wrote = True
        except OSError as e:
            # A full or read-only disk at the start is the host monitor's and the saves'
            # business (a refused save costs that checkpoint), not a reason to refuse the job.
            log.warning("cannot check that checkpoint dir %s is shared: %s", root, e)
    written = exchange.all_gather(wrote)  # also: every marker is written by now
    verdict = None
    if rank == 0:
        unseen = [r for r in writers if written[r]
                  and not (root / f".lazarus-shared-{token}-{r}").is_file()]
        if unseen:
            verdict = (f"checkpoint dir {root} is not shared: rank 0 ({places[0][0]}) does not "
                       f"see what rank(s) {', '.join(map(str, unseen))} "
                       f"({', '.join(sorted({places[r][0] for r in unseen}))}) wrote there; "
                       "every node must see the same checkpoint dir (a shared filesystem)")
    verdict = exchange.broadcast(verdict, src=0)
    if wrote:
        try:
            marker.unlink(missing_ok=True)
        except OSError:
            pass  # a marker left behind is a few bytes nobody reads
    return verdict


def _mount_namespace() -> int:
    """This process's mount namespace (0 where /proc does not say): nodes simulated on one
    host differ in it when their storage differs."""
    try:
        return os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# Saving


def _storage_problem(e: CheckpointException, directory: Path) -> str | None:
    """'rank R: the OS error' when the storage refused a rank's part of a DCP save (a full
    disk, before or during the save; a read-only or vanished mount), whatever wraps it; None
    when something else failed (a bug to raise)."""
    for rank, failure in sorted(e.failures.items()):
        if why := _storage_error(failure[0] if isinstance(failure, tuple) else failure):
            if why.startswith(_SHORT_WRITE) and _nearly_full(directory):
                # the same words an OSError from a full disk carries, so an operator (and
                # anything matching on them) sees one cause whichever writer hit it
                why = f"{_SHORT_WRITE}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: " \
                      f"{directory} has under 1 MiB free ({why[len(_SHORT_WRITE):].lstrip(' :')})"
            return f"rank {rank}: {why}"
    return None


_SHORT_WRITE = "a short write"


def _nearly_full(directory: Path) -> bool:
    """Whether the file system holding `directory` (or its nearest existing parent) has under
    1 MiB free for this user."""
    for where in (directory, *directory.parents):
        try:
            st = os.statvfs(where)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < 1 << 20
    return False


def _storage_error(exc: BaseException | None, depth: int = 0) -> str | None:
    """The storage's refusal in `exc`, its causes or, for DCP's own exception, its failures."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return str(exc)
    # torch's zip writer turns a short write (the disk filled during the save) into an
    # enforce failure, not an OSError: "[enforce fail at inline_container.cc:N] . unexpected
    # pos 704 vs 598", or "... PytorchStreamWriter failed writing file ...".
    text = str(exc)
    if isinstance(exc, RuntimeError) and "inline_container.cc" in text and (
            "unexpected pos" in text or "failed writing file" in text):
        return f"{_SHORT_WRITE} (the storage is likely full): {text}"
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if why := _storage_error(inner, depth + 1):
                return why
    return _storage_error(exc.__cause__ or exc.__context__, depth + 1)


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
                _fsync_dir(directory)
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
            why = _storage_problem(e, directory)
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
                _write_durable(directory / _rng_file(self._rank), json.dumps(rng).encode())
                # DCP names each rank's shard files __{rank}_*: every rank hashes its own.
                mine = sorted(n for n in shards if n.startswith(f"__{self._rank}_"))
                mine.append(_rng_file(self._rank))
                if self._rank == 0:
                    mine.append(".metadata")
                entries = [_file_entry(directory, n) for n in mine]
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
        _write_durable(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
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
            if _DIR_RE.fullmatch(d.name) and d not in keep and d != committed:
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


# ---------------------------------------------------------------------------------------------
# Loading


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict:
    """Load a committed checkpoint into `model` and `optimizer` (collective: every rank),
    whatever (dp, tp) mesh it was saved from; returns its `extra`.

    The manifest and every file's checksum are verified first (RestoreFailed naming the
    problem, with this rank's own finding: missing, unreadable, corrupt). RNG states are restored when the world size is the
    one that saved; otherwise each rank reseeds from reseed_value(step, rank).
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    manifest = _verify_collectively(path) if distributed else verify_checkpoint(path)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # Every rank reads the same .metadata against the same model, so all refuse alike.
    try:
        saved = optimstate.from_dcp_metadata(read_dcp_metadata(path))
        if problem := optim_state_problem(model, saved, local=False):
            problem = f"checkpoint {path}: {problem}"
        else:
            # The state is read over, so allocated rather than made by a step
            # (trainer/optimstate.py); a size no memory holds is the checkpoint's fault.
            optimstate.allocate(model, optimizer, saved, local=False)
    except CheckpointError as e:
        problem = str(e)
    except (AttributeError, TypeError, RuntimeError) as e:
        problem = (f"checkpoint {path}: its DCP metadata is malformed ({type(e).__name__}: "
                   f"{str(e)[:120]})")
    if problem:
        raise RestoreFailed(problem, kind=CORRUPT, own=problem)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_tensors(path, state, no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    # The manifest is checked for what listing needs (read_manifest); what only a restore
    # reads is checked here. A KeyError would be a crash, retried on the same checkpoint,
    # where a bad checkpoint is condemned and the restore falls back.
    try:
        saved_world, extra = manifest["world_size"], manifest["extra"]
        if not isinstance(extra, dict):
            raise TypeError("extra is not an object")
        if not _whole(saved_world):
            raise TypeError("world_size is not a number")
        step = int(manifest["step"])
        if saved_world == world:
            set_rng_state(json.loads((path / _rng_file(rank)).read_text()))
        else:
            torch.manual_seed(reseed_value(step, rank))  # seeds CUDA generators too
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        problem = (f"checkpoint {path}: its manifest or RNG state is malformed "
                   f"({type(e).__name__}: {str(e)[:80]})")
        raise RestoreFailed(problem, kind=CORRUPT, own=problem) from None
    except OSError as e:
        problem = f"checkpoint {path}: {_rng_file(rank)} cannot be read ({e.strerror or e})"
        raise RestoreFailed(problem, kind=UNREADABLE, own=problem) from None
    return extra
