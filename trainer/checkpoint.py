"""Sharded, asynchronous, verifiable checkpoints through torch.distributed.checkpoint (DCP): the
names a user's own script imports.

This module only re-exports: a script copied from trainer/examples/plain_fsdp.py imports
`Checkpointer`, `latest_checkpoint` and `load_checkpoint` from here, and must not break when
the code behind them moves. Lazarus's own modules import from the module that holds a name:

    ckptfiles    the directory's names (manifest.json, step-N/) and durable writes
    ckptlist     reading manifests, listing committed checkpoints
    ckptdir      claiming a root for a job, checking that every node shares it
    ckptverify   checksums before a restore, and what each rank found wrong
    ckptsave     Checkpointer (ckptrefusal: a save the storage refused)
    ckptload     load_checkpoint
    dcpread      DCP's files, read without unrestricted unpickling
    rngstate     a rank's RNG state; optimstate: the optimizer state's shapes

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

from lazarus.trainer.ckptdir import check_shared, claim
from lazarus.trainer.ckptfiles import FORMAT_VERSION, MANIFEST, OWNER, checkpoint_dir
from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint, read_manifest
from lazarus.trainer.ckptload import load_checkpoint
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer.ckptverify import verify_checkpoint
from lazarus.trainer.dcpread import load_tensors, read_dcp_metadata
from lazarus.trainer.optimstate import PARAM_SHAPED, optim_state_problem
from lazarus.trainer.rngstate import reseed_value, rng_state, set_rng_state

__all__ = ["FORMAT_VERSION", "MANIFEST", "OWNER", "PARAM_SHAPED", "Checkpointer",
           "check_shared", "checkpoint_dir", "claim", "committed_checkpoints",
           "latest_checkpoint", "load_checkpoint", "load_tensors", "optim_state_problem",
           "read_dcp_metadata", "read_manifest", "reseed_value", "rng_state", "set_rng_state",
           "verify_checkpoint"]
