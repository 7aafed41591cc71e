from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRunHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("step", "path", "round", "job_id", "committed_at", "good")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    GOOD_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    round: int
    job_id: str
    committed_at: float
    good: bool
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., round: _Optional[int] = ..., job_id: _Optional[str] = ..., committed_at: _Optional[float] = ..., good: _Optional[bool] = ...) -> None: ...

class Incident(_message.Message):
    __slots__ = ("kind", "culprit", "fault_at", "detected_at", "round", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_FIELD_NUMBER: _ClassVar[int]
    FAULT_AT_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    culprit: str
    fault_at: float
    detected_at: float
    round: int
    reason: str
    def __init__(self, kind: _Optional[str] = ..., culprit: _Optional[str] = ..., fault_at: _Optional[float] = ..., detected_at: _Optional[float] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Leader(_message.Message):
    __slots__ = ("id", "pid", "host", "api")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    id: str
    pid: int
    host: str
    api: str
    def __init__(self, id: _Optional[str] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., api: _Optional[str] = ...) -> None: ...

class RunHealth(_message.Message):
    __slots__ = ("job_id", "job_name", "state", "reason", "since", "round", "members", "restarts", "step", "total_steps", "loss", "tokens_per_s", "step_time_s", "goodput", "wall_time_s", "productive_time_s", "nodes_by_state", "last_checkpoint", "last_good_checkpoint", "incident", "leader", "served_by", "served_by_leader", "paused", "draining", "revision", "steps_unknown", "collectives", "collectives_per_s", "last_collective_age_s", "ranks_joined", "world_size", "replicas")
    class NodesByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCTIVE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NODES_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LAST_GOOD_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_LEADER_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    STEPS_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_COLLECTIVE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_JOINED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    state: str
    reason: str
    since: float
    round: int
    members: _containers.RepeatedScalarFieldContainer[str]
    restarts: int
    step: int
    total_steps: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    goodput: float
    wall_time_s: float
    productive_time_s: float
    nodes_by_state: _containers.ScalarMap[str, int]
    last_checkpoint: Checkpoint
    last_good_checkpoint: Checkpoint
    incident: Incident
    leader: Leader
    served_by: str
    served_by_leader: bool
    paused: bool
    draining: _containers.RepeatedScalarFieldContainer[str]
    revision: int
    steps_unknown: bool
    collectives: int
    collectives_per_s: float
    last_collective_age_s: float
    ranks_joined: int
    world_size: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., since: _Optional[float] = ..., round: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., restarts: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., goodput: _Optional[float] = ..., wall_time_s: _Optional[float] = ..., productive_time_s: _Optional[float] = ..., nodes_by_state: _Optional[_Mapping[str, int]] = ..., last_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., last_good_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., incident: _Optional[_Union[Incident, _Mapping]] = ..., leader: _Optional[_Union[Leader, _Mapping]] = ..., served_by: _Optional[str] = ..., served_by_leader: _Optional[bool] = ..., paused: _Optional[bool] = ..., draining: _Optional[_Iterable[str]] = ..., revision: _Optional[int] = ..., steps_unknown: _Optional[bool] = ..., collectives: _Optional[int] = ..., collectives_per_s: _Optional[float] = ..., last_collective_age_s: _Optional[float] = ..., ranks_joined: _Optional[int] = ..., world_size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica", "members", "since_round", "state")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    replica: int
    members: _containers.RepeatedScalarFieldContainer[str]
    since_round: int
    state: str
    def __init__(self, replica: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., since_round: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("node", "host", "role", "state", "cordoned", "draining", "ranks", "round", "step", "step_rate", "step_time_s", "loss", "tokens_per_s", "nproc", "parked", "pid", "last_report_age_s", "lease_ttl_s", "registered_for_s", "registered", "health", "gpu_backend", "tier0_bytes", "tier0_limit_bytes", "tier0_step", "cordon_reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_RATE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NPROC_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    GPU_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIER0_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER0_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER0_STEP_FIELD_NUMBER: _ClassVar[int]
    CORDON_REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    host: str
    role: str
    state: str
    cordoned: bool
    draining: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    round: int
    step: int
    step_rate: float
    step_time_s: float
    loss: float
    tokens_per_s: float
    nproc: int
    parked: int
    pid: int
    last_report_age_s: float
    lease_ttl_s: int
    registered_for_s: float
    registered: bool
    health: _containers.RepeatedCompositeFieldContainer[MonitorVerdict]
    gpu_backend: str
    tier0_bytes: int
    tier0_limit_bytes: int
    tier0_step: int
    cordon_reason: str
    def __init__(self, node: _Optional[str] = ..., host: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., cordoned: _Optional[bool] = ..., draining: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., step_rate: _Optional[float] = ..., step_time_s: _Optional[float] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., nproc: _Optional[int] = ..., parked: _Optional[int] = ..., pid: _Optional[int] = ..., last_report_age_s: _Optional[float] = ..., lease_ttl_s: _Optional[int] = ..., registered_for_s: _Optional[float] = ..., registered: _Optional[bool] = ..., health: _Optional[_Iterable[_Union[MonitorVerdict, _Mapping]]] = ..., gpu_backend: _Optional[str] = ..., tier0_bytes: _Optional[int] = ..., tier0_limit_bytes: _Optional[int] = ..., tier0_step: _Optional[int] = ..., cordon_reason: _Optional[str] = ...) -> None: ...

class MonitorVerdict(_message.Message):
    __slots__ = ("monitor", "state", "reasons")
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    monitor: str
    state: str
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, monitor: _Optional[str] = ..., state: _Optional[str] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "revision")
    NODES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    revision: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("start_revision", "kinds", "follow")
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    start_revision: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    follow: bool
    def __init__(self, start_revision: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ..., follow: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("revision", "time", "kind", "message", "round", "state", "fields")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    time: float
    kind: str
    message: str
    round: int
    state: str
    fields: _struct_pb2.Struct
    def __init__(self, revision: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...

class CommandReply(_message.Message):
    __slots__ = ("message", "revision", "id")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    message: str
    revision: int
    id: str
    def __init__(self, message: _Optional[str] = ..., revision: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class TriggerCheckpointRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class CordonNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class UncordonNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class PauseRunRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_toml",)
    JOB_TOML_FIELD_NUMBER: _ClassVar[int]
    job_toml: str
    def __init__(self, job_toml: _Optional[str] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id", "message", "revision")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    message: str
    revision: int
    def __init__(self, job_id: _Optional[str] = ..., message: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...
