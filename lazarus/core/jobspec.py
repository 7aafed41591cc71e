"""A job: what to train ([train], the trainer's own config) and on how many nodes ([job]).

    [job]
    name = "demo"
    nodes = 2              # active nodes wanted
    min_nodes = 1          # below this the run waits for nodes (and fails after the timeout)
    nproc_per_node = 2     # ranks per node; tp must divide it (TP stays inside a node)
    max_restarts = 20      # recoveries before the run is declared FAILED
    rendezvous_timeout_s = 60
    command = ["python", "train.py", "--config", "x.toml"]   # default: the built-in trainer
    env = { HF_HOME = "/data/hf" }                            # added to every rank's environment
    cwd = "/home/me/project"                                  # where the ranks start (absolute)
    failure_unit = "world" # or "replica": a failure stops only its replica (docs/replicas.md)
    replicas = 1           # replica groups, with failure_unit = "replica"; must divide nodes

    [policy]               # loss spikes, stragglers: lazarus.core.policy (optional)
    max_spikes = 3

    [train]                # lazarus.core.trainconfig.TrainConfig, in sections
    steps = 100
    [train.model]
    name = "tiny"
    [train.parallelism]    # dp is derived from the nodes
    tp = 1
    ...

The global batch is fixed by [train]; the data-parallel degree follows the number of live
nodes, so every node count the run may shrink to must divide it (checked here, up front).
A job of the user's own command (docs/adopting.md) needs no [train]: the script reads its own
configuration. [train] configures the built-in trainer only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core import jobcommand
from lazarus.core import policy as policies
from lazarus.core.policy import SpikePolicy, StragglerPolicy
from lazarus.core.records import MAX_RANKS_PER_NODE, RecordError, load_json, number
from lazarus.core.trainconfig import TrainConfig, check_types

_JOB_KEYS = {"name", "nodes", "min_nodes", "nproc_per_node", "max_restarts",
             "rendezvous_timeout_s", "id", "command", "env", "cwd", "start_on_spares",
             "failure_unit", "replicas"}
FAILURE_UNITS = ("world", "replica")


@dataclass(kw_only=True, slots=True)
class JobSpec:
    name: str = "job"
    nodes: int = 1
    min_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 20
    rendezvous_timeout_s: float = 60.0
    train: dict = field(default_factory=dict)
    policy: dict = field(default_factory=dict)
    id: str = ""
    command: list[str] = field(default_factory=lambda: list(jobcommand.BUILTIN))
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    # The first round may take spare nodes when too few active ones are free; False: spares
    # wait for a fault (`lazarus run` without --spares-ok)
    start_on_spares: bool = True
    # "world": every failure is a whole-world recovery (bit-exact); "replica": the job is
    # `replicas` replica groups and a failure stops only its own (docs/replicas.md)
    failure_unit: str = "world"
    replicas: int = 1

    @property
    def builtin(self) -> bool:
        """Whether the ranks run the built-in trainer (configured by [train])."""
        return jobcommand.is_builtin(self.command)

    @property
    def spike_policy(self) -> "SpikePolicy":
        return SpikePolicy.from_dict(self.policy, source=f"job {self.name}")

    @property
    def straggler_policy(self) -> "StragglerPolicy":
        return StragglerPolicy.from_dict(self.policy, source=f"job {self.name}")

    def world_size(self, n_nodes: int) -> int:
        return n_nodes * self.nproc_per_node

    @property
    def tp(self) -> int:
        return int(self.train.get("parallelism", {}).get("tp", 1))

    def dp_for(self, n_nodes: int) -> int:
        return self.world_size(n_nodes) // self.tp

    def train_config_for(self, n_nodes: int, *, good_after_steps: int | None = None,
                         skip_windows: list[list[int]] | None = None,
                         lr_scale: tuple[float, int] | None = None) -> dict:
        """The [train] table of a round of `n_nodes` nodes: parallelism.dp set for it, and
        what the daemon orders: retention's good_after_steps and, after rollbacks, data windows
        to skip and an lr x lr_scale[0] for lr_scale[1] steps."""
        train = copy.deepcopy(self.train)
        train.setdefault("parallelism", {})["dp"] = self.dp_for(n_nodes)
        if good_after_steps is not None:
            train.setdefault("checkpoint", {})["good_after_steps"] = good_after_steps
        if skip_windows:
            train.setdefault("data", {})["skip_windows"] = [list(w) for w in skip_windows]
        if lr_scale is not None:
            train.setdefault("optimizer", {}).update(lr_scale=lr_scale[0], lr_scale_steps=lr_scale[1])
        return train

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, what: str = "etcd job record") -> "JobSpec":
        """The job in `raw`, or RecordError; nothing else, whatever `raw` holds."""
        # Sizes were checked when the job was submitted (and are checked again when the
        # leader accepts it): every reader need not re-check each node count.
        try:
            return from_dict(load_json(raw, what), source=what, check_sizes=False)
        except UserError as e:
            raise RecordError(str(e)) from None


def _int(table: dict, key: str, default: int, *, minimum: int, source: str,
         maximum: int | None = None) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{source}: [job] {key} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise UserError(f"{source}: [job] {key} must be at most {maximum}, got {value}")
    return value


def from_dict(doc: dict, *, source: str, check_sizes: bool = True) -> JobSpec:
    if not isinstance(doc, dict):
        raise UserError(f"{source}: expected a table with [job] and [train]")
    unknown_tables = set(doc) - {"job", "train", "policy"} - _JOB_KEYS
    if unknown_tables:
        raise UserError(f"{source}: unknown table(s) {sorted(unknown_tables)}; "
                        "a job file has [job], [train] and optionally [policy]")
    # to_json writes a flat record (asdict); a TOML file nests [job].
    job = doc.get("job", {k: v for k, v in doc.items() if k in _JOB_KEYS})
    train = doc.get("train", {})
    if not isinstance(job, dict) or not isinstance(train, dict):
        raise UserError(f"{source}: [job] and [train] must be tables")
    try:
        check_types(train)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    _check_tp(train, source)
    policy = policies.parse(doc.get("policy", {}), source=source)
    unknown = set(job) - _JOB_KEYS
    if unknown:
        raise UserError(f"{source}: unknown key(s) in [job]: {sorted(unknown)}")
    name = job.get("name", "job")
    if not isinstance(name, str) or not name:
        raise UserError(f"{source}: [job] name must be a non-empty string")
    nodes = _int(job, "nodes", 1, minimum=1, source=source)
    min_nodes = _int(job, "min_nodes", nodes, minimum=1, source=source)
    if min_nodes > nodes:
        raise UserError(f"{source}: [job] min_nodes ({min_nodes}) is more than nodes ({nodes})")
    timeout = job.get("rendezvous_timeout_s", 60.0)
    if number(timeout) is None or timeout <= 0:
        raise UserError(f"{source}: [job] rendezvous_timeout_s must be a positive number")
    command, env, cwd = jobcommand.parse(job, source)
    start_on_spares = job.get("start_on_spares", True)
    if not isinstance(start_on_spares, bool):
        raise UserError(f"{source}: [job] start_on_spares must be true or false")
    failure_unit, replicas = _replicas(job, nodes, source)
    spec = JobSpec(
        failure_unit=failure_unit, replicas=replicas,
        command=command, env=env, cwd=cwd, start_on_spares=start_on_spares,
        name=name, nodes=nodes, min_nodes=min_nodes,
        nproc_per_node=_int(job, "nproc_per_node", 1, minimum=1, source=source,
                            maximum=MAX_RANKS_PER_NODE),
        max_restarts=_int(job, "max_restarts", 20, minimum=0, source=source),
        rendezvous_timeout_s=float(timeout), train=dict(train), policy=policy,
        id=str(job.get("id") or uuid.uuid4().hex[:12]))
    if check_sizes:
        validate_sizes(spec, source=source)
    return spec


def _replicas(job: dict, nodes: int, source: str) -> tuple[str, int]:
    unit = job.get("failure_unit", "world")
    if unit not in FAILURE_UNITS:
        raise UserError(f'{source}: [job] failure_unit must be "world" or "replica", got {unit!r}')
    replicas = _int(job, "replicas", 1, minimum=1, source=source)
    if unit == "world" and replicas != 1:
        raise UserError(f'{source}: [job] replicas = {replicas} needs failure_unit = "replica"')
    if unit == "replica":
        if replicas < 2:
            raise UserError(f'{source}: [job] failure_unit = "replica" needs replicas >= 2 '
                            f"(one replica is the whole world), got {replicas}")
        if nodes % replicas:
            raise UserError(f"{source}: [job] replicas = {replicas} must divide nodes = {nodes} "
                            "(every replica gets the same number of nodes)")
    return unit, replicas


def _check_tp(train: dict, source: str) -> None:
    # Every reader of a job divides by it (JobSpec.dp_for), so it is checked on every read.
    tp = train.get("parallelism", {}).get("tp", 1)
    if tp < 1:
        raise UserError(f"{source}: [train.parallelism] tp must be a positive integer")


def validate_sizes(spec: JobSpec, *, source: str) -> None:
    """Every node count from min_nodes to nodes must give a valid trainer config (the
    built-in trainer's; a command of the user's own has its own configuration). A job in
    replica mode gets its own checks (_check_replica_mode): each of its rounds trains one
    replica's world with dp for one replica."""
    if spec.failure_unit == "replica":
        _check_replica_mode(spec, source)
    if not spec.builtin:
        return
    if "dp" in spec.train.get("parallelism", {}):
        raise UserError(f"{source}: [train.parallelism] dp is derived from the node count; remove it")
    tp = spec.tp
    if spec.nproc_per_node % tp:
        raise UserError(f"{source}: tp={tp} must divide nproc_per_node={spec.nproc_per_node} "
                        "(tensor parallelism stays inside a node)")
    if spec.failure_unit == "replica":
        _check_replica_batch(spec, source)
    for n in range(spec.min_nodes, spec.nodes + 1):
        try:
            TrainConfig.from_dict(spec.train_config_for(n))
        except UserError as e:
            raise UserError(f"{source}: with {n} node(s) (dp={spec.dp_for(n)}): {e}")


def _check_replica_mode(spec: JobSpec, source: str) -> None:
    """What replica mode runs in this slice (docs/replicas.md): the built-in trainer (the
    quorum and the healing are its), checkpoints on storage but no tier-0 snapshots (a live
    replica is already a copy in memory), no shrink (a replica does not shrink inside
    itself, and a job that drops whole replicas is not built)."""
    mode = '[job] failure_unit = "replica"'
    if not spec.builtin:
        raise UserError(f"{source}: {mode} runs the built-in trainer only: a command of your "
                        "own has no replica quorum to heal a restarted replica from; leave "
                        "failure_unit out for the whole-world recovery")
    ckpt = spec.train.get("checkpoint", {})
    every = ckpt.get("memory_every") if isinstance(ckpt, dict) else None
    if isinstance(every, int) and not isinstance(every, bool) and every > 0:
        raise UserError(f"{source}: {mode} takes no tier-0 snapshots (a live replica is already "
                        f"a copy in memory; a whole-world restart restores from the checkpoint "
                        f"dir): remove [train.checkpoint] memory_every = {every}")
    if spec.replicas < 2 or spec.nodes % spec.replicas:
        raise UserError(f"{source}: {mode} needs replicas >= 2 that divide nodes = "
                        f"{spec.nodes}, got replicas = {spec.replicas}")
    if spec.min_nodes != spec.nodes:
        raise UserError(f"{source}: {mode} needs min_nodes = nodes ({spec.nodes}), got "
                        f"min_nodes = {spec.min_nodes}: a replica job does not shrink yet")


def _check_replica_batch(spec: JobSpec, source: str) -> None:
    """The global batch is the job's, over all replicas: each of the replicas x dp ranks
    takes an equal share of it, and one replica's config must be a valid one."""
    per = spec.nodes // spec.replicas
    try:
        cfg = TrainConfig.from_dict(spec.train_config_for(per))
    except UserError as e:
        raise UserError(f"{source}: with {per} node(s) per replica (dp={spec.dp_for(per)}): {e}")
    dp, batch = cfg.parallelism.dp, cfg.data.global_batch
    if batch % (spec.replicas * dp):
        raise UserError(f"{source}: data.global_batch = {batch} must be divisible by replicas x "
                        f"dp = {spec.replicas} x {dp} = {spec.replicas * dp} (each replica's "
                        f"{dp} data-parallel rank(s) take equal shares of it)")


def load(path: str | Path) -> JobSpec:
    return read(path)[0]


def read(path: str | Path) -> tuple[JobSpec, str]:
    """The job of a job file, and the file's text it was read from (what a submission through
    the API sends: the text checked here, read once)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"job file {str(p)!r} does not exist")
    try:
        text = p.read_text()
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"job file {str(p)!r} is not valid TOML: {e}")
    except UnicodeDecodeError:
        raise UserError(f"job file {str(p)!r} is not UTF-8 text")
    return from_dict(doc, source=f"job file {str(p)!r}"), text
