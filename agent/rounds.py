"""This node's ranks of a round: started and stopped as the assignment says
(lazarus.agent.decide.converge), written down for the next agent of the node, and adopted
from the previous one (lazarus.agent.adopt).

Each executor does one thing; the agent owns the state. What they drive outside the agent
(a round's store, the record left for the next agent) goes through its ports
(lazarus.agent.ports), which the fleet simulator (lazarus.sim.fleet) gives its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import TYPE_CHECKING

from lazarus.agent import jobfence
from lazarus.agent.adopt import Left, LeftRank, adopt, start_time
from lazarus.agent.decide import (CarryOn, DropKept, Launch, Refill, ReleaseVictims, SeeRound,
                                  StopRound)
from lazarus.agent.roundreport import RoundReport
from lazarus.agent.workers import rank_log
from lazarus.core.contract import WorkerAssignment
from lazarus.core.records import NodeStatus, RecordError, RoundRecord

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

log = logging.getLogger("lazarus.agent")


def act(agent: Agent, action: StopRound | DropKept | SeeRound | Launch | CarryOn
        | ReleaseVictims | Refill) -> None:
    if isinstance(action, StopRound):
        log.info("stopping round %d workers (%s)%s", action.round, action.why,
                 f"; keeping the survivors of local ranks {sorted(action.keep)} for the next "
                 "round" if action.keep else "")
        agent.workers.stop(keep=action.keep)
        save_left(agent)
    elif isinstance(action, DropKept):
        log.info("letting the kept survivors go (%s)", action.why)
        agent.workers.drop_kept()
    elif isinstance(action, SeeRound):
        if agent.tier0 is not None:
            agent.tier0.round_seen(action.record)
        rec = action.record
        job_seen(agent, rec.job_id)
        # Not while the node's preflight runs: its tests fork from the same zygote, and a
        # spare is usable only once they pass (a rehearsal first held one back by seconds).
        if agent.preflight is None or not agent.preflight.busy:
            agent.workers.rehearse(rec.round, list(rec.command), rec.train, rec.rank_world)
    elif isinstance(action, Launch):
        launch(agent, action.record)
    elif isinstance(action, CarryOn):
        carry_on(agent, action.record)
    elif isinstance(action, ReleaseVictims):
        # Every pass of the victims' window: a rank that heard it once ignores the rest, and
        # one connected late (a slow start) still hears it. The ranks know the round they
        # were launched in, which a carried group's label is not.
        g = agent.workers.group
        round_ = g.rank_round if g is not None and g.round == action.round else action.round
        agent.channel.broadcast({"type": "abort_groups", "round": round_})
    elif isinstance(action, Refill):
        agent.workers.refill()
    else:
        raise AssertionError(f"unknown action {action!r}")


def launch(agent: Agent, rec: RoundRecord) -> None:
    """Start this node's ranks of `rec`, each with its assignment line, after forgetting
    what the previous round's ranks reported."""
    ranks = rec.ranks_of(agent.cfg.node)
    job_seen(agent, rec.job_id)
    run_as = agent.cfg.run_as
    # a home and caches of the job's own, when its ranks have a user of their own
    env = {**(jobfence.job_env(run_as, agent.cfg.workdir, rec.job_id) if run_as else {}),
           **rec.env}
    tier0 = agent.tier0
    snapshots = tier0.prepare(rec, ranks) if tier0 is not None else dict.fromkeys(ranks)
    agent.ports.host_round_store(rec, agent.store)
    agent.workers.prune_logs(rec.round)
    assignments = {
        local: WorkerAssignment(rank=rank, world_size=rec.world_size, local_rank=local,
                                round=rec.round, store_host=rec.store_host,
                                store_port=rec.store_port, train=rec.train,
                                restore=rec.restore, report_socket=agent.channel.path,
                                job_id=rec.job_id, snapshot=snapshots[rank],
                                restore_step=rec.restore_step,
                                snapshot_dir=str(tier0.store.incoming)
                                if tier0 is not None else None,
                                allowed_roots=list(agent.cfg.allowed_roots),
                                command=list(rec.command), env=env, cwd=rec.cwd,
                                log_path=str(rank_log(agent.workers.log_dir, rec.round, rank)),
                                group_rank=rec.members.index(agent.cfg.node),
                                group_world_size=len(rec.members),
                                local_world_size=rec.nproc_per_node,
                                restart_count=rec.restarts,
                                max_restarts=rec.max_restarts, issued_at=time.time(),
                                replicas=rec.replicas, replica_epoch=rec.replica_epoch)
        for local, rank in enumerate(ranks)}
    with agent._lock:
        agent.report = RoundReport(job_id=rec.job_id, world_size=rec.world_size,
                                   checkpoint_dir=rec.checkpoint_dir)
        agent.hangs.reset()
        agent.throughput.reset()
    agent.health.watch_checkpoint_dir(rec.checkpoint_dir)
    g = agent.workers.launch(rec.round, assignments, resume=functools.partial(resume, agent))
    save_left(agent)
    log.info("round %d: started ranks %s%s%s", rec.round, ranks,
             f", restoring step {rec.restore_step}" + (" from memory (tier 0)" if rec.tier0
                                                       else "")
             if rec.restore or rec.tier0 else "",
             f"; in place: ranks {sorted(g.ranks[lr] for lr in g.kept)} in their processes "
             f"{sorted(g.procs[lr].pid for lr in g.kept)}" if g.kept else "")


def carry_on(agent: Agent, rec: RoundRecord) -> None:
    """This node's ranks go on into `rec` untouched (docs/replicas.md): the group is relabelled
    (its node status reports `rec.round` at once: the round is part of the status's state)
    and written down so; what the ranks reported (step, loss) stays theirs."""
    with agent._lock:
        g = agent.workers.carry_on(rec.round)
        # A hang these ranks reported was the last round's: the round that answered it
        # restarted the replica they waited for. One that lasts is reported afresh, after a
        # whole allowance; kept, it would end every round the moment it starts.
        agent.report.hang = None
        agent.hangs.rearm(time.monotonic())
    # The first member hosts the round's store, which the restarted replica's ranks look up
    # (rankrun.enter), whether or not its own ranks start in it.
    agent.ports.host_round_store(rec, agent.store)
    save_left(agent)
    log.info("round %d: ranks %s go on untouched from round %d (replica %d of %d carried)",
             rec.round, sorted(g.ranks.values()), g.rank_round,
             rec.replica_of(agent.cfg.node), rec.replicas)


def job_seen(agent: Agent, job_id: str) -> None:
    """A round of `job_id`: at a change of job, the last job's processes and homes go
    (lazarus.agent.jobfence)."""
    if agent.workers.new_job(job_id) and agent.cfg.run_as is not None:
        jobfence.forget_homes(agent.cfg.workdir, keep_job=job_id)


def resume(agent: Agent, pid: int, a: WorkerAssignment) -> bool:
    """Hand a survivor (lazarus.trainer.inplace) its assignment over the worker channel:
    whether it reached the process."""
    return agent.channel.send_to(pid, {"type": "resume", "assignment": dataclasses.asdict(a)})


# -- ranks that outlive their agent (lazarus.agent.adopt) ----------------------------------------
def save_left(agent: Agent) -> None:
    """Write down the running round's ranks for a next agent of this node; forget them once
    the round is stopped. On each launch, stop and new lease: rare writes."""
    g = agent.workers.group
    if g is None or agent.session is None:
        agent.ports.save_left(None)
        return
    ranks = [LeftRank(local_rank=lr, rank=g.ranks[lr], pid=p.pid,
                      started=getattr(p, "started", None) or start_time(p.pid) or 0.0)
             for lr, p in sorted(g.procs.items())]
    report = agent.report
    agent.ports.save_left(Left(node=agent.cfg.node, round=g.round, job_id=report.job_id, world_size=report.world_size,
         lease=agent.session.lease, channel=agent.channel.path,
         checkpoint_dir=report.checkpoint_dir, agent_pid=os.getpid(),
         ranks=ranks, rank_round=g.rank_round))


def take_over(agent: Agent, left: Left) -> None:
    """Adopt the ranks a previous agent of this node left running, as this agent's round."""
    procs = adopt(left, agent.cfg.stacks_dir)
    agent.workers.adopt(left.round, procs, {r.local_rank: r.rank for r in left.ranks},
                        rank_round=left.rank_round)
    agent.workers.job = left.job_id  # its ranks are not another job's leftovers
    with agent._lock:
        agent.report = RoundReport(job_id=left.job_id, world_size=left.world_size,
                                   checkpoint_dir=left.checkpoint_dir, adopted=True)
    agent.health.watch_checkpoint_dir(left.checkpoint_dir)
    running = [p.pid for p in procs.values() if p.poll() is None]
    log.info("adopted round %d ranks %s left by agent pid %d: %s", left.round,
             [r.rank for r in left.ranks], left.agent_pid,
             f"pids {' '.join(map(str, running))} running" if running else
             "all of them exited meanwhile")


def resume_status(agent: Agent) -> None:
    """Carry on the adopted round's node status where the previous agent left it (the step,
    loss and data window until the ranks' next report), not from step 0."""
    g = agent.workers.group
    if not agent.report.adopted or g is None:
        return
    kv = agent.etcd.get(agent.keys.nodestatus_key(agent.cfg.node))
    agent.report.adopted, round_ = False, g.round
    try:
        old = NodeStatus.from_json(kv.value) if kv is not None else None
    except RecordError:
        old = None
    if old is None or old.round != round_:
        return
    with agent._lock:
        agent.report.step = {"step": old.step, "loss": old.loss,
                             "step_time_s": old.step_time_s,
                             "tokens_per_s": old.tokens_per_s, "window": old.window}
