"""A checkpoint root as a job's: whose it is (`claim`, ROOT/.lazarus-job) and whether every
node sees the same one (`check_shared`), both settled before anything is saved.

A job refuses a directory holding another job's checkpoints unless it was told to start from
them (checkpoint.resume); it then adopts them, and never deletes them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from lazarus.trainer import exchange
from lazarus.trainer.ckptfiles import OWNER, write_durable
from lazarus.trainer.ckptlist import committed_checkpoints

log = logging.getLogger(__name__)


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
            write_durable(owner_file, (json.dumps(
                {"job_id": job_id, "adopted_from": owner}) + "\n").encode())
        except OSError as e:
            return f"checkpoint dir {root}: cannot write {owner_file.name} ({e.strerror or e})"
    return None


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
            write_durable(marker, f"{here[0]}\n".encode())
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
