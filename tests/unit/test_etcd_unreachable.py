"""Every command that talks to etcd, against an etcd that is not there: one line on stderr
that names the endpoint, a non-zero exit, no traceback.

Not here: `lazarus daemon` and `lazarus agent`, services that wait for etcd to come back
(their runs go on meanwhile); `lazarus etcd enable-auth`, which waits 30 s for an etcd a
script starts just before it; `lazarus preflight`, whose clock check fails in its table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def closed():
    """HOST:PORT where nothing listens: bound, never listening, so no one else takes it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("unreachable")
    (d / "job.toml").write_text('[job]\nname = "x"\nnodes = 1\n')
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "step_time_s": 0.1})
                                     + "\n")
    return d


COMMANDS = {
    "chaos kill-worker": ["chaos", "kill-worker", "--node", "n0", "--etcd", "{etcd}"],
    "chaos kill-node": ["chaos", "kill-node", "--node", "n0", "--etcd", "{etcd}"],
    "chaos kill-daemon": ["chaos", "kill-daemon", "--etcd", "{etcd}"],
    "submit": ["submit", "{dir}/job.toml", "--no-local-check", "--etcd", "{etcd}"],
    "run": ["run", "--etcd", "{etcd}", "--nodes", "1", "--", "python", "-c", "pass"],
    "report --etcd": ["report", "{dir}/metrics.jsonl", "--etcd", "{etcd}", "--out",
                      "{dir}/r.html"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_an_unreachable_etcd_is_one_line(name, closed, files):
    argv = [a.format(etcd=closed, dir=files) for a in COMMANDS[name]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZARUS_ETCD")}
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env, cwd=files)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"lazarus {argv[0]}: error: "), lines[0]
    assert closed in lines[0] and "unavailable" in lines[0], lines[0]


def test_chaos_at_a_lazarus_up_workdir_whose_cluster_is_gone_says_so(closed, tmp_path):
    from lazarus.core.etcd_auth import EtcdAuth
    from lazarus.sim import chaos

    chaos.write_cluster_access(tmp_path, closed, EtcdAuth())
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "chaos", "kill-worker", "--node",
                           "n1", "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert closed in line and f"is the `lazarus up` cluster of {tmp_path} still running?" in line


def test_the_dispatcher_answers_an_etcd_outage_in_one_line(monkeypatch, capsys):
    """Whatever command lets EtcdUnavailable through."""
    from lazarus import cli
    from lazarus.core import etcd as E

    def fails(argv):
        raise E.EtcdUnavailable("etcd at 10.0.0.9:2379 unavailable: connection refused")

    monkeypatch.setattr(sys.modules["lazarus.sim.chaos"], "main", fails)
    assert cli.main(["chaos", "kill-daemon"]) == 1
    assert capsys.readouterr().err == ("lazarus chaos: error: etcd at 10.0.0.9:2379 unavailable: "
                                       "connection refused\n")

    def bug(argv):
        raise KeyError("not an outage")

    monkeypatch.setattr(sys.modules["lazarus.sim.chaos"], "main", bug)
    with pytest.raises(KeyError):
        cli.main(["chaos", "kill-daemon"])
