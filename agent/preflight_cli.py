"""`lazarus preflight`: run a node's preflight checks by hand and print what each found.

The same checks the agent runs before its node joins a round and while it is idle
(lazarus.agent.preflight). Exit 0 when every check passed, 1 when one failed, 2 on bad
arguments. With `--peers`, the collective test runs between nodes: start it on each with the
same list and its own `--rank`; rank 0's node hosts the rendezvous on its port.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lazarus.agent import preflight as P
from lazarus.agent.gpu import GpuMonitor, open_backend
from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UserError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lazarus preflight", description=__doc__.splitlines()[0])
    settings.add_etcd_args(p, etcd_help="etcd whose leader's clock this host's is compared "
                                        "with (default: $LAZARUS_ETCD, else 127.0.0.1:2379)")
    p.add_argument("--workdir", type=Path,
                   default=Path(os.environ.get("LAZARUS_WORKDIR", "/tmp/lazarus")),
                   help="the agent's work dir: storage is tested there (default: "
                        "$LAZARUS_WORKDIR, else /tmp/lazarus)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="the job's checkpoint dir: storage and a checkpoint round trip are "
                        "tested there (default: the work dir only)")
    p.add_argument("--gpu-backend", default="auto", choices=("auto", "nvml", "sim"))
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs this node must have (default: as many as the backend sees)")
    p.add_argument("--gpu-faults", type=Path, default=None,
                   help="fault script of the simulated GPU backend (lazarus.agent.gpu_sim)")
    p.add_argument("--host", default="127.0.0.1",
                   help="this node's address for the collective test (the agent's --host)")
    p.add_argument("--peers", default="",
                   help="HOST:PORT of every rank of a collective test between nodes, in "
                        "rank order (default: two ranks on this node)")
    p.add_argument("--rank", type=int, default=0, help="this node's place in --peers")
    p.add_argument("--min-bandwidth", type=float, default=0.0,
                   help="fail the collective test below this bus bandwidth, GB/s "
                        "(default: measure only)")
    p.add_argument("--size-mb", type=float, default=4.0,
                   help="MiB written and read back per directory (default %(default)s)")
    p.add_argument("--skew-limit", type=float, default=0.5,
                   help="seconds this host's clock may be off the etcd leader's "
                        "(default %(default)s)")
    p.add_argument("--skip", default="",
                   help=f"checks not to run, comma-separated: {', '.join(P.CHECKS)}")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


def config_from(args: argparse.Namespace, expected_gpus: int) -> P.PreflightConfig:
    skip = frozenset(s.strip() for s in args.skip.split(",") if s.strip())
    unknown = sorted(skip - set(P.CHECKS))
    if unknown:
        raise UserError(f"--skip: unknown check(s) {', '.join(unknown)} "
                        f"(known: {', '.join(P.CHECKS)})")
    if not 0 < args.size_mb <= 1024:
        raise UserError(f"--size-mb must be above 0 and at most 1024, got {args.size_mb:g}")
    if not args.skew_limit > 0:
        raise UserError(f"--skew-limit must be positive, got {args.skew_limit:g}")
    if args.min_bandwidth < 0:
        raise UserError(f"--min-bandwidth must not be negative, got {args.min_bandwidth:g}")
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    for peer in peers:
        E.parse_endpoint(peer)  # a UserError naming it
    if peers and len(peers) < 2:
        raise UserError("--peers needs at least two HOST:PORT entries (one per rank)")
    if peers and not 0 <= args.rank < len(peers):
        raise UserError(f"--rank {args.rank} is not a place in --peers (0..{len(peers) - 1})")
    if not args.workdir.is_dir():
        raise UserError(f"--workdir {args.workdir} is not a directory")
    return P.PreflightConfig(
        workdir=args.workdir, checkpoint_dir=args.checkpoint_dir,
        storage_bytes=int(args.size_mb * P.MiB), skew_limit_s=args.skew_limit, host=args.host,
        min_bus_gbps=args.min_bandwidth, peers=peers, rank=args.rank,
        expected_gpus=expected_gpus, skip=skip)


def render(checks: list[P.Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for col, just in (("CHECK", "left"), ("RESULT", "left"), ("TIME", "right"),
                      ("REASON", "left")):
        t.add_column(col, justify=just, no_wrap=col != "REASON")
    for c in checks:
        result = "skipped" if c.skipped else "pass" if c.ok else "FAIL"
        t.add_row(c.name, result, f"{c.cost_s:.2f} s", c.reason)
    failed = [c.name for c in checks if not c.ok]
    t.add_row("total", "FAIL" if failed else "pass", f"{sum(c.cost_s for c in checks):.2f} s",
              f"failed: {', '.join(failed)}" if failed else "")
    Console(width=max(120, Console().width), soft_wrap=False).print(t)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        raise UserError(f"--gpus must not be negative, got {args.gpus}")
    skip_gpu = "gpu" in args.skip
    monitor = None if skip_gpu else GpuMonitor(open_backend(
        args.gpu_backend, gpus=max(1, args.gpus or 1), fault_script=args.gpu_faults))
    expected = args.gpus if args.gpus is not None else (
        monitor.backend.device_count() if monitor is not None else 0)
    config = config_from(args, expected)
    if "checkpoint" not in config.skip:
        # torch's import (seconds, cold) is no check's cost: the agent has paid it already.
        # The collective test imports it in a process of its own (collective_check).
        import torch.distributed.checkpoint  # noqa: F401
    etcd = None
    if "clock" not in config.skip:
        etcd = E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    try:
        checks = P.run_checks(config, etcd=etcd,
                              gpu_verdicts=lambda: (monitor.poll(), monitor.backend.name))
    finally:
        if etcd is not None:
            etcd.close()
        if monitor is not None:
            monitor.close()
    if args.json:
        print(json.dumps({**P.summary(checks, at=time.time()),
                          "checks": [{"name": c.name, "ok": c.ok, "skipped": c.skipped,
                                      "reason": c.reason, "cost_s": round(c.cost_s, 4)}
                                     for c in checks]}))
    else:
        render(checks)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
