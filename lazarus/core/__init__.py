"""The core: records and keys in etcd, the etcd client, the job spec, the worker <-> agent
contract and the settings every process shares. It imports no component (docs/architecture.md)."""
