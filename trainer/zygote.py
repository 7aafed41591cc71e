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
  - touch CUDA: a child of a process that initialised the driver cannot use it. torch's
    is_available() initialises the driver unless PYTORCH_NVML_BASED_CUDA_CHECK is set, so it
    is set here (and taken out again in each child that did not have it).
  - start threads: fork copies only the thread that calls it.

Protocol, over a SOCK_SEQPACKET socket the agent passes as --control-fd (lazarus.agent.zygote):
  agent -> zygote  b"spawn" with two descriptors: the child's stdin (the read end of the pipe
                   its assignment line comes on) and its log (stdout and stderr)
  zygote -> agent  b"ready" once imported; b"pid N" per spawn, in order; b"exit N CODE" when
                   a child ends (CODE as Popen.returncode: -SIGNAL for a signal)
The agent closing the socket ends the zygote and nothing else: its running children are
ranks, which outlive the agent (lazarus.agent.adopt); parked ones end when their stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _imports() -> None:
    """What a parked worker would import and build lazily, minus anything that runs a kernel."""
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import lazarus.trainer.train  # noqa: F401
    from lazarus.trainer.models import Transformer, get_model_config

    with torch.device("meta"):  # imports torch._dynamo (2-3 s) and runs nothing
        Transformer(get_model_config("tiny"))


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(control_fd: int) -> None:
    """Fork a child per request until the agent goes; returns only in a child, which then
    goes on as a parked worker (its stdin and output are its own by then)."""
    had_nvml_check = NVML_CHECK in os.environ
    os.environ.setdefault(NVML_CHECK, "1")
    _imports()
    import torch

    assert not torch.cuda.is_initialized(), "the zygote must not initialise CUDA"
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
            msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 2)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the agent is gone; its ranks go on without us
        if msg != b"spawn" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        stdin_fd, log_fd = fds
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_child(sock, wake_r, wake_w, stdin_fd, log_fd, had_nvml_check)
            return
        os.close(stdin_fd)
        os.close(log_fd)
        sock.send(f"pid {pid}".encode())


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


def _become_child(sock, wake_r: int, wake_w: int, stdin_fd: int, log_fd: int,
                  had_nvml_check: bool) -> None:
    """Make this fork look like the cold worker the agent would have started: a session of
    its own, its own stdin and output, none of the zygote's descriptors or handlers."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    os.close(wake_r)
    os.close(wake_w)
    os.setsid()  # as start_new_session: a signal to the agent's group does not reach ranks
    os.dup2(stdin_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(stdin_fd)
    os.close(log_fd)
    if not had_nvml_check:
        os.environ.pop(NVML_CHECK, None)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # Python's random reseeds at fork by itself; numpy's global one not
