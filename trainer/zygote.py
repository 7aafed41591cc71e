"""The worker zygote: one process per agent that has imported torch and the trainer once,
and forks each parked worker from that (docs/constraints.md, "Worker starts").

A cold worker pays its interpreter's start, `import torch`, DCP, FSDP and the trainer: 5.6
CPU-s here, measured (under load) against 0.2-0.3 CPU-s for a child forked from this process
to the same point (warm-up included). Every recovery refills the agent's pool, so on a busy
node that is CPU the ranks training beside it lose.

What it must not do before a fork, and why:
  - run a torch op on real tensors: the first parallel region starts OpenMP's thread pool,
    and a child of a process with a GNU OpenMP pool hangs in its first parallel region
    (pytorch#41197). The warm-up (lazarus.trainer.worker._warm_up) runs in each child;
    here only what builds on the meta device, which runs no kernel.
  - initialise CUDA: a child of a process that initialised the driver cannot use it. torch's
    is_available() initialises the driver unless PYTORCH_NVML_BASED_CUDA_CHECK is set, so it
    is set while the imports run (`import_for_fork`). The driver library being mapped is
    harmless (`driver_initialised`).
  - start threads: fork copies only the thread that calls it.

Protocol, over a SOCK_SEQPACKET socket the agent passes as --zygote FD (lazarus.agent.zygote):
  agent -> zygote  b"run " + JSON {"module": M, "argv": [...], "session": bool}, with three
                   descriptors: the child's stdin, stdout and stderr. The child is then
                   `python -m M ARGV...` without the interpreter's start or the imports: a
                   parked worker (`lazarus.cli worker --park`), a preflight test
                   (lazarus.agent.collective_check). "session": in a session of its own.
  agent -> zygote  b"rehearse " + JSON {"train": TrainConfig dict, "world_size": N}, no
                   descriptors: one step of that job on a fake world, here, so that the forks
                   that follow start with DTensor's caches filled (lazarus.trainer.rehearsal)
  zygote -> agent  b"ready" once imported; b"pid N" per run request, in order; b"exit N CODE"
                   when a child ends (CODE as Popen.returncode: -SIGNAL for a signal);
                   b"rehearsed WORD" per rehearse request (rehearsed, skipped, failed)
The agent closing the socket ends the zygote and nothing else: its running children are
ranks, which outlive the agent (lazarus.agent.adopt); parked ones end when their stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import socket
import sys
import time

from lazarus.core import exitcodes

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
MAX_REQUEST = 64 << 10


def import_for_fork() -> bool:
    """Import what a rank imports and build the model on the meta device (it imports
    torch._dynamo, 2-3 s, and runs nothing), without initialising the CUDA driver. True when
    this process may still fork ranks: neither torch nor the driver has initialised CUDA."""
    had_nvml_check = NVML_CHECK in os.environ
    os.environ.setdefault(NVML_CHECK, "1")  # is_available() without loading the driver
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    # here: these imports are this function's work, done with NVML_CHECK set
    import lazarus.trainer.train  # noqa: F401
    import lazarus.trainer.worker  # noqa: F401
    from lazarus.trainer.models import Transformer, get_model_config

    with torch.device("meta"):
        Transformer(get_model_config("tiny"))
    if not had_nvml_check:
        os.environ.pop(NVML_CHECK, None)
    return not torch.cuda.is_initialized() and not driver_initialised()


# cuInit's documented contract: before it, every driver call answers this and does nothing.
CUDA_ERROR_NOT_INITIALIZED = 3


def driver_initialised() -> bool:
    """True when this process's CUDA driver has run cuInit, so that a child could not use it.
    The driver library being mapped is not that: torch's CUDA libraries map it at import on
    some builds (torch 2.11+cu130: cuBLASLt dlopens it), and a child initialises it itself
    (docs/constraints.md, "Worker starts")."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            if "libcuda.so" not in f.read():
                return False
    except OSError:
        return False
    try:
        # RTLD_NOLOAD: the copy already mapped, never a load of our own
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return True  # mapped under a name we cannot reach: assume the worst
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def reseed_after_fork() -> None:
    """Python's random reseeds itself at fork; numpy's global generator does not, and a fresh
    process would have seeded it from the OS."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(control_fd: int) -> tuple[str, list[str]]:
    """Fork a child per request until the agent goes; returns only in a child, with the
    module to run as __main__ and its arguments (its stdin and output are its own by then)."""
    if not import_for_fork():
        # Not a bug of ours to assert on: a torch build or a plugin that initialises CUDA at
        # import. The agent reads this code and starts every worker cold from then on.
        print(json.dumps({"event": "zygote_unfit", "pid": os.getpid(),
                          "why": "CUDA was initialised by the imports"}), flush=True)
        sys.exit(exitcodes.ZYGOTE_UNFIT)
    from lazarus.trainer import meshes  # here: it imports torch, which import_for_fork sets up
    sock = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
    signal.set_wakeup_fd(wake_w)
    # numpy's OpenBLAS keeps a thread pool of its own; it is fork-safe (it parks its threads
    # at fork). Anything more is a thread a child would not have.
    print(json.dumps({"event": "zygote", "pid": os.getpid(), "threads": _threads()}),
          flush=True)
    sock.send(b"ready")
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(sock)
        if sock not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 3)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the agent is gone; its ranks go on without us
        if msg.startswith(b"rehearse "):
            for fd in fds:
                os.close(fd)
            sock.send(b"rehearsed " + _rehearse(msg[len(b"rehearse "):]).encode())
            continue
        request = _request(msg, fds)
        if request is None:
            for fd in fds:
                os.close(fd)
            sock.send(b"pid 0")  # refused: the agent's waiting request ends
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        meshes.freeze()
        pid = os.fork()
        if pid == 0:
            _become_child(sock, wake_r, wake_w, fds, request["session"])
            return request["module"], request["argv"]
        for fd in fds:
            os.close(fd)
        sock.send(f"pid {pid}".encode())


def _request(msg: bytes, fds: list[int]) -> dict | None:
    """A well-formed run request, or None (the agent is trusted; this guards our own bugs)."""
    if not msg.startswith(b"run ") or len(fds) != 3:
        return None
    try:
        req = json.loads(msg[4:])
    except ValueError:
        return None
    ok = (isinstance(req, dict) and isinstance(req.get("module"), str)
          and isinstance(req.get("argv"), list) and all(isinstance(a, str) for a in req["argv"]))
    return {"module": req["module"], "argv": req["argv"],
            "session": bool(req.get("session"))} if ok else None


def _rehearse(body: bytes) -> str:
    """Rehearse the step the request describes (lazarus.trainer.rehearsal): the word the
    agent gets back; the reason goes to this process's log. Exits when the rehearsal left
    this process unable to fork usable workers (a thread started, CUDA initialised)."""
    from lazarus.trainer import rehearsal  # here: only a rehearse request needs it

    threads = _threads()
    try:
        req = json.loads(body)
        train, world_size = req["train"], req["world_size"]
        if not isinstance(train, dict) or not isinstance(world_size, int):
            raise ValueError("train must be an object and world_size an integer")
        t0 = time.process_time()
        said = rehearsal.rehearse(train, world_size, rehearsal.zygote_device())
        word = said.partition(":")[0]
        line = {"event": "rehearsal", "result": said,
                "cpu_s": round(time.process_time() - t0, 3)}
    except Exception as e:  # noqa: BLE001 -- a step it cannot rehearse costs only the speedup
        word, line = "failed", {"event": "rehearsal", "result": "failed",
                                "error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(line), flush=True)
    import torch

    if _threads() != threads or torch.cuda.is_initialized() or driver_initialised():
        print(json.dumps({"event": "zygote_unfit", "pid": os.getpid(),
                          "why": "the rehearsal left a thread or CUDA behind"}), flush=True)
        os._exit(1)
    return word


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())
        except OSError:
            os._exit(0)  # the agent is gone


def _become_child(sock, wake_r: int, wake_w: int, fds: list[int], session: bool) -> None:
    """Make this fork look like the process the agent would have started cold: its own stdin
    and output, none of the zygote's descriptors or handlers, a session of its own if asked."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    os.close(wake_r)
    os.close(wake_w)
    if session:
        os.setsid()  # as start_new_session: a signal to the agent's group does not reach it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    reseed_after_fork()


def run_child(module: str, argv: list[str]) -> None:
    """Run `module` as `python -m module argv...` would, in this (forked) process."""
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
