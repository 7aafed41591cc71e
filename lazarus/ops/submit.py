"""`lazarus submit JOB.toml`: validate a job file and hand it to the daemon, through its API
with a submit token (the default whenever a daemon is known) or, with --etcd, through etcd."""

from __future__ import annotations

import argparse
import sys

from lazarus.core import etcd as E
from lazarus.core import jobcommand, jobspec
from lazarus.core.consoletext import printable
from lazarus.core.errors import UserError
from lazarus.core.records import Keys
from lazarus.core import settings
from lazarus.ops import apirun, client
from lazarus.ops.run import WAYS_IN, add_ways_in, by_etcd


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus submit", description=f"{__doc__.splitlines()[0]} "
                                f"{WAYS_IN}")
    p.add_argument("job", help="job file (TOML with [job] and [train])")
    add_ways_in(p)
    p.add_argument("--no-local-check", action="store_true",
                   help="do not check that [job] command can start on this machine (the "
                        "agents check it on theirs)")
    args = p.parse_args(argv)
    spec, text = jobspec.read(args.job)  # every check before anything is written
    if not args.no_local_check:
        try:
            jobcommand.check_runnable(spec.command, cwd=spec.cwd)
        except UserError as e:
            raise UserError(f"{e} (--no-local-check when this is not an agents' machine)")
    if not by_etcd(args):
        try:
            # The file as written: the daemon checks it again, and names its fields as the
            # user wrote them.
            reply = apirun.submit(client.target(args), text)
        except client.Failed as e:
            print(printable(f"lazarus submit: error: {e}"), file=sys.stderr)
            return e.code
        print(printable(reply.message))
        return 0
    etcd = E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    try:
        etcd.put(Keys(args.root).job, spec.to_json())
    except E.EtcdUnavailable as e:
        print(f"lazarus submit: error: {e}", file=sys.stderr)
        return 1
    finally:
        etcd.close()
    print(f"submitted job {spec.name!r} ({spec.id}): {spec.nodes} node(s) x "
          f"{spec.nproc_per_node} rank(s), min {spec.min_nodes}")
    return 0
