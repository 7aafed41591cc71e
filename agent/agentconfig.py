"""What an agent is told when it starts (`lazarus agent`'s flags): one value, checked once,
that the agent and its executors read and nothing changes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lazarus.agent.hang import HangConfig
from lazarus.agent.stacks import FLIGHT_ENTRIES
from lazarus.agent.tier0_agent import Tier0Options
from lazarus.agent.workers import RANK_LOG_BYTES
from lazarus.core import settings
from lazarus.core.errors import UserError
from lazarus.core.jobuser import JobUser
from lazarus.core.records import ROLE_ACTIVE, ROLE_SPARE

# Node status is written at once on a change of state (workers, health, a hang, a long phase,
# a spike), else at most once a period while the step moves, with the throughput summary: the
# write budget (docs/architecture.md, "Write budget") is 0.1 writes/s per node in steady
# state. Liveness is the lease alone; nothing reads the age of a status as a sign of life.
STATUS_PERIOD_S = 15.0
# An idle node repeats its preflight checks this often (docs/operations.md, "Preflight").
PREFLIGHT_EVERY_S = 600.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """`lease_ttl_s`: how long after this agent dies the daemon declares the node lost. Must be
    longer than a stall of this process (GC, swap), or a live node gets evicted.
    `status_period_s`: how stale the step and throughput in the node status may get while
    nothing else changes; a straggler is seen up to this much later.
    `preflight_every_s`: how often a node that runs no ranks repeats its preflight checks
    (lazarus.agent.preflight; 0: only when the agent starts; None: never, and the node takes
    work without them). A failure found there keeps the node out of rounds until a later
    run passes, so this is also how long a fixed node waits to be used again.
    `monitors`: False (--monitors off) only to measure what the monitors cost: no GPU, host,
    hang or throughput monitoring, and no progress reports from the ranks.
    `allowed_roots`: where jobs may have this node's ranks write (lazarus.core.jobpaths);
    empty: anywhere (`lazarus agent` always passes some: its --allowed-root, else its
    workdir). `flight_entries`: the collectives torch's flight recorder keeps per process
    group of a rank; 0 turns it off. `run_as`: the user the ranks run as, when not this
    process's (lazarus.core.jobuser; the caller checked this process may)."""
    node: str
    nproc: int
    role: str
    workdir: Path
    host: str = "127.0.0.1"
    lease_ttl_s: int = settings.LEASE_TTL_S
    status_period_s: float = STATUS_PERIOD_S
    monitors: bool = True
    park: bool = True
    gpu_backend: str = "auto"
    gpu_faults: Path | None = None
    hang: HangConfig = dataclasses.field(default_factory=HangConfig)
    host_limits: dict | None = None
    preflight_every_s: float | None = PREFLIGHT_EVERY_S
    tier0: Tier0Options | None = None
    allowed_roots: tuple[str, ...] = ()
    flight_entries: int = FLIGHT_ENTRIES
    rank_log_bytes: int = RANK_LOG_BYTES
    run_as: JobUser | None = None
    # at a change of job, end every other process of the run_as user (lazarus.agent.jobfence);
    # off where several agents share the user on one host (a local cluster)
    fence_jobs: bool = True

    def __post_init__(self) -> None:
        if self.role not in (ROLE_ACTIVE, ROLE_SPARE):
            raise UserError(f"--role must be {ROLE_ACTIVE} or {ROLE_SPARE}, not {self.role!r}")
        if not self.node or "/" in self.node:
            raise UserError(f"--node {self.node!r}: a node id is a non-empty name without '/'")
        object.__setattr__(self, "workdir", Path(self.workdir))
        object.__setattr__(self, "allowed_roots", tuple(str(r) for r in self.allowed_roots))

    @property
    def stacks_dir(self) -> Path:
        """Where this node's ranks leave their stacks and flight records."""
        return self.workdir / "stacks" / self.node
