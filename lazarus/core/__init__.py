"""The core: records and keys in etcd, the etcd client, the job spec and its trainer config
(torch-free, so the daemon checks jobs without the trainer), the worker <-> agent contract and
the settings every process shares. It imports no component (docs/architecture.md)."""
