"""Lazarus: keeps large PyTorch training runs alive.

This is the top package: the entry point ``lazarus.cli`` (the ``lazarus`` command), torchrun's
rendezvous backend ``lazarus.rendezvous``, and the subpackages ``lazarus.core`` (what the
components share: records, the etcd client, the wire contract, the job spec),
``lazarus.ops`` (operator tools) and ``lazarus.sim`` (local cluster, fault injection, the
fleet simulator). The components ``lazarus.daemon``, ``lazarus.agent``, ``lazarus.trainer``
and ``lazarus.proto`` are mapped onto the repository's top-level folders daemon/, agent/,
trainer/ and proto/ (pyproject.toml, ``[tool.setuptools] package-dir``).
"""

__version__ = "0.1.0"
