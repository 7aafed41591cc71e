"""Reading DCP's files without unrestricted unpickling.

DCP's `.metadata` is a pickle: it is read with an unpickler that only builds DCP's own
metadata classes (plus torch.Size, dtypes and pathlib paths). Tensors and the optimizer's
small non-tensor values are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import collections
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

from lazarus.core.errors import CheckpointError

# A single-process load (no process group) is intended here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to load")

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
