"""What a rank unpickles from its peers (lazarus.trainer.peerpickle): DCP's plans, metadata
and failure reports load; a pickle that names anything else is refused before it runs, also
when a peer rank sends it through torch's object collectives."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lazarus.trainer.peerpickle import PeerUnpickler


def _load(data: bytes):
    return PeerUnpickler(io.BytesIO(data)).load()


class _Touch:
    """What an attacker's rank sends: a pickle whose load runs a command."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_pickle_that_runs_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_Touch(marker))
    with pytest.raises(pickle.UnpicklingError, match="naming posix.system"):
        _load(data)
    assert not marker.exists()
    pickle.loads(data)  # the same bytes under torch's own unpickler: the attack works there
    assert marker.exists()


@pytest.mark.parametrize("named", [
    ("subprocess", "Popen"),                                   # a module not even imported
    ("builtins", "eval"),
    ("torch", "load"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),  # DCP, not a plan's
    ("lazarus.core.etcd", "connect"),
])
def test_globals_outside_the_plans_are_refused(named):
    module, name = named
    # GLOBAL opcode, then STOP: what a pickle naming that callable starts with
    data = b"c" + module.encode() + b"\n" + name.encode() + b"\n."
    with pytest.raises(pickle.UnpicklingError, match=f"naming {module}.{name}"):
        _load(data)


def _stack_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that loads `module`'s `name` (STACK_GLOBAL, whose names may be
    dotted paths), then STOP."""
    def short(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()
    return b"\x80\x04" + short(module) + short(name) + b"\x93."


@pytest.mark.parametrize("module, name", [
    # dotted paths through a DCP module's own imports: os.error is OSError, an exception
    ("torch.distributed.checkpoint.metadata", "os.error"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    # a class a DCP module imported from elsewhere, not one of DCP's own
    ("torch.distributed.checkpoint.utils", "Shard"),
])
def test_dotted_names_and_borrowed_classes_under_dcp_are_refused(module, name):
    with pytest.raises(pickle.UnpicklingError, match=f"naming {module}.{name}"):
        _load(_stack_global(module, name))
    with pytest.raises(pickle.UnpicklingError):  # the GLOBAL opcode alike
        _load(b"c" + module.encode() + b"\n" + name.encode() + b"\n.")


def test_a_dcp_class_by_its_own_name_still_loads():
    from torch.distributed.checkpoint.metadata import Metadata

    assert _load(_stack_global("torch.distributed.checkpoint.metadata", "Metadata")) is Metadata


def test_what_dcp_exchanges_loads(tmp_path):
    """Real plans of a real state dict (DCP's default planners, a model and its AdamW state),
    the metadata a save writes, and a rank's failure as DCP wraps it."""
    from torch.distributed.checkpoint.api import _wrap_exception
    from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                              DefaultSavePlanner)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
             "dtypes": [torch.bfloat16, torch.strided, torch.channels_last],
             "device": torch.device("cpu")}

    saver = DefaultSavePlanner()
    saver.set_up_planner(state, is_coordinator=True)
    local = saver.create_local_plan()
    writer = FileSystemWriter(str(tmp_path / "ckpt"))
    writer.set_up_storage_writer(is_coordinator=True)
    local = writer.prepare_local_plan(local)
    plans, metadata = saver.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)
    loader = DefaultLoadPlanner()
    loader.set_up_planner(state, metadata=metadata, is_coordinator=True)
    failure = _wrap_exception(_raised(OSError(28, "No space left on device")))

    for value in (local, plans, metadata, loader.create_local_plan(), failure,
                  Path("/ckpt/step-3"), {1, 2}, slice(0, 4)):
        back = _load(pickle.dumps(value))
        assert repr(back) == repr(value)


def _raised(e: BaseException) -> BaseException:
    try:
        raise e
    except BaseException as caught:  # noqa: BLE001 -- a traceback to wrap, as DCP has one
        return caught


_RANKS = """
import os, sys, torch, torch.distributed as dist
from lazarus.trainer import peerpickle

class Touch:
    def __reduce__(self):
        return os.system, ("touch " + sys.argv[3],)

rank = int(sys.argv[1])
peerpickle.install()
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, is_master=rank == 0,
                      wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
got = [None, None]
try:
    # rank 1 runs an attacker's code: it sends rank 0 a pickle that runs a command
    dist.all_gather_object(got, Touch() if rank == 1 else {"plan": [torch.Size([2, 3])]})
    print("loaded", flush=True)
except Exception as e:
    print("refused:", type(e).__name__, e, flush=True)
"""


def test_a_rank_running_an_attackers_code_cannot_run_code_on_its_peers(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(_RANKS))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port),
                               str(tmp_path / f"ran-on-{rank}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    # Every rank unpickles what every rank sent, its own too: none ran the command.
    assert not list(tmp_path.glob("ran-on-*")), outs
    assert all("refused: UnpicklingError" in out and "naming posix.system" in out
               for out in outs), outs
