"""What a rank of the built-in trainer unpickles from its peers (docs/security.md).

torch's object collectives (gather_object, all_gather_object, broadcast_object_list,
scatter_object_list) pickle on one rank and unpickle on the others; DCP exchanges its save
and load plans, its metadata and its ranks' failures that way. A pickle may name any
importable callable, so a rank running an attacker's code -- or anything that joined the
round's store -- could run code on every peer through a checkpoint save or restore. What the
trainer itself exchanges travels as JSON (lazarus.trainer.exchange); this narrows what DCP's
exchanges may hold to what they are made of:

- DCP's own data classes and enums (plans, write and read items, metadata, storage info);
- torch's Size, device, dtypes, layouts and memory formats;
- plain containers (set, frozenset, OrderedDict, defaultdict, slice, range), POSIX paths;
- exceptions of modules already loaded from builtins, torch or lazarus, with the traceback
  summary DCP sends along with a rank's failure.

Everything else is refused before its module is imported (an import runs the module's code):
`pickle.UnpicklingError`, which DCP raises on the receiving rank like any failed exchange.
`install()` sets c10d's unpickler (`distributed_c10d._unpickler`, the class its object
collectives load with) for this process; the built-in trainer's ranks call it before their
process groups exist. A script of the user's own keeps torch's unpickler: it may exchange
objects of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import sys

import torch

_DCP = "torch.distributed.checkpoint"
_PLAIN = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "range"), ("builtins", "complex"), ("builtins", "bytearray"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("traceback", "StackSummary"), ("traceback", "FrameSummary"),
    # how a torch.layout pickles: a lookup of the layout by its name
    ("torch.serialization", "_get_layout"),
})
_TORCH_CLASSES = frozenset({"Size", "device"})
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_EXCEPTION_MODULES = ("builtins", "torch", "lazarus")


class PeerUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals DCP's exchanges are made of."""

    def find_class(self, module: str, name: str):
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if name in _TORCH_CLASSES or isinstance(value, _TORCH_VALUES):
                return value
        elif (module == _DCP or module.startswith(_DCP + ".")) and "." not in name:
            # No dotted name: protocol 4 would follow "os.system" through the module's own
            # imports to anything. And the class must be the module's own (pickle names a
            # class by its __module__), not one it imported from elsewhere.
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module and (
                    dataclasses.is_dataclass(found)
                    or issubclass(found, (enum.Enum, BaseException))):
                return found
        elif module.split(".")[0] in _EXCEPTION_MODULES and module in sys.modules \
                and "." not in name:
            found = getattr(sys.modules[module], name, None)
            if isinstance(found, type) and issubclass(found, BaseException):
                return found
        raise pickle.UnpicklingError(
            f"a peer sent a pickle naming {module}.{name}: ranks accept only checkpoint plans "
            f"from each other (docs/security.md)")


def install() -> None:
    """Load every object a peer sends this process through c10d with `PeerUnpickler`."""
    from torch.distributed import distributed_c10d

    distributed_c10d._unpickler = PeerUnpickler
