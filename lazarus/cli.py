"""The `lazarus` command: a thin dispatcher to each subcommand's module.

Subcommands are imported lazily so that `lazarus status` does not pay for `import torch`.
"""

from __future__ import annotations

import importlib
import os
import sys

from lazarus.core.consoletext import printable
from lazarus.core.errors import UserError

# name -> (module, function, one-line help). Each function takes argv (list[str]) and returns
# an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("lazarus.trainer.launch", "main", "train locally on this machine (like torchrun --standalone)"),
    "worker": ("lazarus.trainer.worker", "main", "one trainer rank (launched by the agent)"),
    "corpus": ("lazarus.trainer.data", "main", "build a token corpus from local text"),
    "export": ("lazarus.trainer.export", "main", "export a checkpoint's weights as safetensors"),
    "up": ("lazarus.sim.up", "main", "run a whole local cluster (etcd, daemon, agents) with faults"),
    "report": ("lazarus.ops.report", "main", "an HTML page (and PNG) of a run: loss, faults, recoveries"),
    "goodput": ("lazarus.ops.goodput", "main", "the expected ETTR of a run from its measured figures and a failure rate"),
    "daemon": ("lazarus.daemon.service", "main", "the controller (leader-elected through etcd)"),
    "agent": ("lazarus.agent.cli", "main", "the node agent: runs and watches this node's ranks"),
    "preflight": ("lazarus.agent.preflight_cli", "main", "check this node before it takes work: GPUs, storage, clock, collectives"),
    "run": ("lazarus.ops.run", "main", "run your own script on the cluster: lazarus run -- python train.py ..."),
    "submit": ("lazarus.ops.submit", "main", "submit a job file to the daemon"),
    "chaos": ("lazarus.sim.chaos", "main", "inject a fault into a running cluster on this host"),
    "etcd": ("lazarus.ops.etcdsetup", "main", "secure an etcd: certificates, users and roles, authentication on"),
    "fleet": ("lazarus.sim.fleetrun", "main", "simulate thousands of nodes against etcd and the daemon, and measure"),
    "status": ("lazarus.ops.client", "status_main", "the run's health (asks the daemon's API)"),
    "nodes": ("lazarus.ops.client", "nodes_main", "nodes: role, state, ranks, progress"),
    "events": ("lazarus.ops.client", "events_main", "the run's events; --follow to keep watching"),
    "checkpoints": ("lazarus.ops.client", "checkpoints_main", "committed checkpoints"),
    "checkpoint": ("lazarus.ops.client", "checkpoint_main", "`checkpoint now`: ask for a checkpoint"),
    "drain": ("lazarus.ops.client", "drain_main", "checkpoint, then swap a spare in for NODE"),
    "cordon": ("lazarus.ops.client", "cordon_main", "NODE takes no new work"),
    "uncordon": ("lazarus.ops.client", "uncordon_main", "NODE may take work again"),
    "pause": ("lazarus.ops.client", "pause_main", "pause the run after a checkpoint"),
    "resume": ("lazarus.ops.client", "resume_main", "resume a paused run"),
    "cancel": ("lazarus.ops.client", "cancel_main", "end the current run as CANCELLED"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: lazarus COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`lazarus COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lazarus: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    # gRPC's C core logs a refused TLS handshake in three lines of its own on stderr; our
    # error says what happened and what to fix in one. GRPC_VERBOSITY=ERROR brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except UserError as e:
        # a message may quote what etcd holds (a job's id, a record's field): one line, inert
        print(printable(f"lazarus {name}: error: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not _etcd_outage(e):
            raise
        # etcd's error names the endpoint and what the connection met: all the user can act on
        print(printable(f"lazarus {name}: error: {e}"), file=sys.stderr)
        return 1


def _etcd_outage(error: Exception) -> bool:
    etcd = sys.modules.get("lazarus.core.etcd")  # not imported: nothing here talked to etcd
    return etcd is not None and isinstance(error, etcd.EtcdUnavailable)


if __name__ == "__main__":
    sys.exit(main())
