"""The agent's part in preflight (lazarus.agent.preflight): the checks of this node, with what
the agent knows of the job -- its checkpoint dir, and a member of its round to test the
collective path with when this node is not one. Run in the preflight thread.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from lazarus.agent import preflight as pre
from lazarus.agent.zygote import ZYGOTE_START_S
from lazarus.core import etcd as E
from lazarus.core.jobuser import job_dir
from lazarus.core.records import NodeRecord, RecordError, RoundRecord

if TYPE_CHECKING:
    from lazarus.agent.service import Agent


def checks(agent: Agent) -> list[pre.Check]:
    """Storage and a checkpoint round trip in the job's checkpoint dir (the newest round's,
    once one was read), the GPU monitor's verdicts, this host's clock against etcd's leader,
    and a collective -- with one member of the round when the node is not in it (the path a
    promotion would use), else over the node's own address."""
    _, rec = agent.assignments.current
    ckpt = rec.checkpoint_dir if rec is not None else agent.report.checkpoint_dir
    peer = _test_peer(agent, rec)
    # a directory the ranks' user may write: the checkpoint test runs as that user
    config = pre.PreflightConfig(workdir=job_dir(agent.cfg.workdir) if agent.cfg.run_as
                                 else agent.cfg.workdir,
                                 checkpoint_dir=Path(ckpt) if ckpt else None,
                                 host=agent.cfg.host, expected_gpus=agent.cfg.nproc,
                                 pair=(peer.node, peer.host, peer.store_port) if peer
                                 else None,
                                 # its tests' processes are forked: no torch import of their
                                 # own, none in the agent (docs/constraints.md)
                                 zygote=agent.workers.ready_zygote(ZYGOTE_START_S),
                                 run_as=agent.cfg.run_as,
                                 child_env=agent.workers.env if agent.cfg.run_as else None,
                                 # the job's dir is tested only under them
                                 allowed_roots=agent.cfg.allowed_roots)
    gpu = agent.health.gpu
    done = pre.run_checks(config, etcd=agent.etcd,
                          gpu_verdicts=lambda: (list(gpu.verdicts), gpu.backend.name))
    if peer is not None and not done[-1].ok and _test_peer(agent, rec) != peer:
        # The peer left (its lease ran out while the test waited for it): no verdict on this
        # node, which a recovery may want now.
        done[-1] = dataclasses.replace(done[-1], ok=True, skipped=True, reason=(
            f"skipped: {peer.node} left during the test ({done[-1].reason})"))
    return done


def _test_peer(agent: Agent, rec: RoundRecord | None) -> NodeRecord | None:
    """The member of `rec` this node tests its collective path with, when it is not one
    itself: picked by this node's name, so that the spares of a large run spread their tests
    over its members."""
    if rec is None or not rec.members or agent.cfg.node in rec.members:
        return None
    peer = rec.members[zlib.crc32(agent.cfg.node.encode()) % len(rec.members)]
    try:
        kv = agent.etcd.get(agent.keys.node_key(peer))
        return NodeRecord.from_json(kv.value, kv.key) if kv is not None else None
    except (E.EtcdUnavailable, RecordError):
        return None
