"""The Kubernetes manifests' users (deploy/kubernetes/lazarus.yaml): the daemon pod shares
neither its uid nor its group with the agents' ranks, who run the job's code (docs/security.md,
"A job submitter"); a daemon pod scheduled beside an agent would otherwise be theirs to signal
and its token theirs to read."""

from __future__ import annotations

from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def test_the_daemon_runs_as_neither_the_ranks_user_nor_their_group():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((DEPLOY / "lazarus.yaml").read_text()) if d]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")}
    daemon = pods["lazarus-daemon"]["securityContext"]
    agent = pods["lazarus-agent"]
    args = " ".join(agent["containers"][0]["args"])
    uid, gid = (int(x) for x in args.split("--run-as ")[1].split()[0].split(":"))
    assert (uid, gid) == (agent["securityContext"]["runAsUser"],
                          agent["securityContext"]["runAsGroup"])
    assert daemon["runAsUser"] not in (0, uid)
    assert not {daemon["runAsGroup"], daemon["fsGroup"]} & {0, gid}
