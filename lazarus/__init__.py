"""Lazarus: keeps large PyTorch training runs alive.

Import packages: ``lazarus`` (shared core), ``lazarus.daemon``, ``lazarus.agent``,
``lazarus.trainer``, ``lazarus.proto`` -- mapped onto the repository's top-level folders.
"""

__version__ = "0.1.0"
