"""Exit codes a worker uses to tell the agent why it stopped, beyond "it failed".

When one rank dies, its peers fail too, inside a collective ("connection reset by peer").
Those are not the culprit: a worker that failed because a peer went away exits with PEER_LOST,
and the daemon waits briefly for the root cause (another rank's crash, a node's lease) before
it names a culprit.
"""

from __future__ import annotations

import re

PEER_LOST = 75          # a collective failed because a peer is gone (secondary failure)
BAD_CHECKPOINT = 76     # the checkpoint to restore is missing, incomplete or corrupt
ORPHANED = 77           # the rank's agent stayed away past the grace (AGENT_GRACE_ENV)
REFUSED = 78           # the job cannot run as configured (another job's checkpoints in its
                        # dir): restarting would fail the same way, so the run fails at once
ZYGOTE_UNFIT = 79       # the worker zygote found its imports initialised CUDA: forks from it
                        # could not use the GPU, so the node's workers start cold for good
INJECTED_FAULT = 43     # fault injection: a crash@STEP of lazarus.sim.trainer_faults


# What torch prints when NCCL's watchdog, not the rank's own code, ends the process: a
# collective timed out, or a peer's error reached this rank's communicator.
WATCHDOG_SIGNS = ("watchdog caught collective operation timeout",
                  "some nccl operations have failed or timed out",
                  "processgroupnccl's watchdog", "nccl communicator was aborted",
                  "c10::distbackenderror")


def watchdog_abort(code: int, output: str) -> bool:
    """Whether an exit `code` with the rank's last `output` is NCCL's watchdog aborting the
    process because a collective failed (a peer is gone or stalled), which says nothing
    about this rank. Ranks ask NCCL not to abort (contract.NCCL_DEFAULTS), but a job may set
    TORCH_NCCL_ASYNC_ERROR_HANDLING itself."""
    if code not in (-6, 128 + 6):  # SIGABRT, as a signal or through a shell
        return False
    text = output.lower()
    return any(sign in text for sign in WATCHDOG_SIGNS)


# Messages of the errors gloo / NCCL / the c10d store raise when a peer vanished.
PEER_SIGNS = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "connection refused", "socket timeout", "nccl communicator was aborted",
              "gloo", "nccl error", "timed out", "connectfullmesh")
# torch.distributed's own errors of a peer or the store going away, as a traceback names them
_DIST_ERRORS = ("DistError", "DistNetworkError", "DistBackendError", "DistStoreError")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
_PEER_ERRORS = ("RuntimeError", "ConnectionError", "ConnectionResetError",
                "ConnectionRefusedError", "BrokenPipeError", "TimeoutError")


def names_lost_peer(text: str) -> bool:
    """Whether an error's message says a peer (or the round's store) went away."""
    text = text.lower()
    return any(sign in text for sign in PEER_SIGNS)


def peer_lost_in_output(code: int, output: str) -> bool:
    """Whether a rank that exited with `code` ended on a Python exception of a lost peer, as
    its last `output` shows: the error a rank's collective raises when its peer is gone,
    uncaught. Read for ranks whose process Lazarus does not run itself (a shell wrapper's
    python): one that runs in a parked worker says so with PEER_LOST."""
    if code != 1:  # an uncaught exception; a signal or the script's own exit code is not
        return False
    # torch prefixes what an uncaught exception prints with the rank, once it has a group
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in output.splitlines()]
    try:
        start = max(i for i, line in enumerate(lines)
                    if line.startswith("Traceback (most recent call last):"))
    except ValueError:
        return False
    # The exception's line: the traceback's first unindented line after its frames.
    last = next((line for line in lines[start + 1:] if line and not line[0].isspace()), "")
    name, _, message = last.partition(":")
    name = name.rpartition(".")[2]
    return name in _DIST_ERRORS or (name in _PEER_ERRORS and names_lost_peer(message))
