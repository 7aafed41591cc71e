"""One training step of a rank in a job of replica groups (docs/replicas.md): quorum -> heal a
joiner -> micro-steps inside the replica -> gradient average across the quorum's replicas
(retried without a replica that broke it) -> clip -> optimizer step.

`average_over_quorum` is the part the built-in trainer's replica step shares
(lazarus.trainer.train, ReplicaRound); `replica_step` is the whole step on its own, around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lazarus.trainer.replicapolicy import Quorum

import torch
from torch.distributed.tensor import DTensor

from lazarus.trainer.replicagroup import ReplicaGroup
from lazarus.trainer.replicapolicy import divisor, shares

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class ReplicaStep:
    step: int
    members: tuple[int, ...]
    attempt: int      # 0, or how many tries a failed cross-replica collective cost
    loss: float       # this replica's share's mean loss
    grad_norm: float
    healed: bool      # this replica fetched its state from a peer before the step


def replica_step(rg: ReplicaGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 step: int, batches: Callable[[int], Batches], *, grad_clip: float,
                 policy: str = "drop") -> ReplicaStep:
    """Step `step` (a healing replica's step is the quorum's: read it from the result).
    `batches(k)`: this replica's micro-batches of step k."""
    q = rg.next_quorum(step)
    healed = rg.heal(model, optimizer) is not None
    step = q.step
    micro = batches(step)
    loss_sum = 0.0
    for inputs, targets in micro:
        loss = model.loss(model(inputs), targets) / len(micro)
        loss.backward()
        loss_sum += loss.item()
    params = [p for p in model.parameters() if p.grad is not None]
    q = average_over_quorum(rg, q, [p.grad for p in params], model, optimizer, policy=policy)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad()
    return ReplicaStep(step=step, members=q.members, attempt=q.attempt, loss=loss_sum,
                       grad_norm=grad_norm.item(), healed=healed)


def average_over_quorum(rg: ReplicaGroup, q: Quorum, grads: list[torch.Tensor],
                        model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                        policy: str = "drop", extra: dict | None = None) -> Quorum:
    """Average `grads` (plain tensors or DTensors: their local shards) over the quorum's
    replicas, in place; after a failed try, over the next try's quorum, until one holds. The
    quorum that did it. `extra`: what a joiner let in at a retry gets besides the model and
    optimizer (the state of the step before, as at the step's start)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    while not rg.average(local, divisor(shares(q.members, rg.replicas, policy))):
        # The same step's next try: the gradients are kept, the group is the survivors'. A
        # joiner let in now heals from a source that has not stepped yet.
        q = rg.next_quorum(q.step)
        rg.heal(model, optimizer, extra)
    return q
