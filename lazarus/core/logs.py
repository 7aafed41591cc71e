"""Log format shared by the daemon, agents and `lazarus up`: one line per record, with the
process role so interleaved logs of a local cluster stay readable."""

from __future__ import annotations

import logging
import sys

from lazarus.core.errors import UserError


def setup(level: str, role: str) -> None:
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise UserError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, not {level!r}")
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format=f"%(asctime)s.%(msecs)03d {role} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # aetcd logs every broken watch stream at ERROR; we resume them ourselves.
    logging.getLogger("aetcd").setLevel(logging.CRITICAL)
