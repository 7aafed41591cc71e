"""What the operator CLI prints and how it finds the daemon, without a daemon: the renderers
on given replies, the endpoint file, and the one-line failures with their exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lazarus.ops import client

from lazarus.core import endpoint_file
from lazarus.cli import main as cli_main
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from tests.unit.cli_home import lazarus_home  # noqa: F401 (fixture)


def _health(**kw) -> pb.RunHealth:
    now = time.time()
    h = pb.RunHealth(job_id="J1", job_name="demo", state="RUNNING", reason="all good",
                     since=now - 30, round=3, members=["n0", "n1"], restarts=2, step=41,
                     total_steps=100, loss=3.25, tokens_per_s=12345.0, step_time_s=0.5,
                     goodput=0.875, wall_time_s=80, productive_time_s=70,
                     served_by="d1", **{"served_by_leader": True, **kw})
    h.nodes_by_state["running"] = 2
    h.nodes_by_state["spare"] = 1
    h.last_checkpoint.CopyFrom(pb.Checkpoint(step=40, path="/ck/40", round=3, good=True,
                                             committed_at=now))
    h.leader.CopyFrom(pb.Leader(id="d1", pid=7, host="h", api="127.0.0.1:7070"))
    return h


def test_status_table_reads_like_a_summary(capsys):
    client.render_status(_health(), time.time())
    out = capsys.readouterr().out
    assert "demo (J1)  RUNNING" in out
    assert "41/100  loss 3.2500  12,345 tok/s  0.500 s/step" in out
    assert "goodput     87.5% (70 s of 80 s)" in out
    assert "running 2, spare 1" in out
    assert "step 40 at" in out and "/ck/40" in out
    assert "d1 at 127.0.0.1:7070" in out and "standby" not in out
    assert "incident" not in out


def test_status_table_shows_an_open_incident_and_a_standby_answering(capsys):
    h = _health(served_by_leader=False, paused=True, draining=["n1"])
    h.served_by = "d2"
    h.incident.CopyFrom(pb.Incident(kind="node_lost", culprit="n1", round=3,
                                    fault_at=time.time() - 5, reason="node(s) n1 lost"))
    client.render_status(h, time.time())
    out = capsys.readouterr().out
    assert "node_lost on n1 (round 3" in out and "node(s) n1 lost" in out
    assert "answered    standby d2" in out
    assert "paused" in out and "draining    n1" in out


def test_status_without_a_job_says_so(capsys):
    client.render_status(pb.RunHealth(goodput=-1, served_by="d1"), time.time())
    out = capsys.readouterr().out
    assert "no job submitted" in out and "none committed" in out and "leader      none" in out


def test_nodes_table_has_one_row_per_node_with_its_columns(capsys):
    client.render_nodes([
        pb.Node(node="n0", role="active", state="running", ranks=[0, 1], step=12,
                step_rate=2.0, tokens_per_s=900, loss=2.0, last_report_age_s=0.4,
                lease_ttl_s=5, registered=True, host="h0", tier0_bytes=3 << 19,
                tier0_limit_bytes=4096 << 20, tier0_step=12,
                health=[pb.MonitorVerdict(monitor="gpu", state="degraded",
                                          reasons=["gpu0: ECC rising"])]),
        pb.Node(node="n1", state="lost", ranks=[2, 3], last_report_age_s=-1),
        pb.Node(node="n2", role="spare", state="spare", cordoned=False, draining=True,
                registered=True, lease_ttl_s=5, last_report_age_s=3),
        pb.Node(node="n3", role="active", state="cordoned", cordoned=True, registered=True,
                cordon_reason="checkpoint step-00000008 cannot be read: holds no checkpoints "
                              "on this node (a missing mount?)")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["NODE", "ROLE", "STATE", "RANKS", "STEP", "STEP/S", "TOK/S", "LOSS",
                       "HEALTH", "MEMORY", "REPORTED", "LEASE", "HOST"]
    # MEMORY: what its tier-0 snapshots take of the bound
    assert rows[1] == ["n0", "active", "running", "0,1", "12", "2.00", "900", "2.0000", "gpu",
                       "degraded:", "gpu0:", "ECC", "rising", "1.5/4,096", "MiB", "0", "s", "ago",
                       "5", "s", "h0"]
    assert rows[2][:4] == ["n1", "-", "lost", "2,3"] and "expired" in rows[2]
    assert rows[3][:4] == ["n2", "spare", "spare", "(draining)"]
    assert rows[4][:3] == ["n3", "active", "cordoned"]
    # a cordon's reason, under the table
    assert " ".join(rows[5]) == ("n3 cordoned: checkpoint step-00000008 cannot be read: holds "
                                 "no checkpoints on this node (a missing mount?)")


def test_event_lines_and_json_lines():
    ev = pb.Event(revision=9, time=time.time(), kind="recovered", message="back at step 11")
    line = client.event_line(ev)
    assert line.endswith("recovered       back at step 11")
    doc = client._as_dict(ev)
    assert doc["kind"] == "recovered" and doc["revision"] == "9" and doc["round"] == "0"


def test_no_daemon_known_is_one_line_and_exit_3(capsys, lazarus_home):
    assert cli_main(["status"]) == client.EXIT_UNREACHABLE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "no daemon known" in err and str(lazarus_home / "endpoint.json") in err


def test_an_endpoint_file_left_by_a_dead_process_is_named(capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    endpoint_file.write(endpoint_file.default_path(), endpoint_file.Endpoint(
        addresses=["127.0.0.1:7070"], token="t", pid=int(dead)))
    assert cli_main(["nodes"]) == client.EXIT_UNREACHABLE
    assert f"(pid {dead}) has exited" in capsys.readouterr().err


def test_a_garbled_endpoint_file_is_a_usage_error(capsys):
    endpoint_file.default_path().write_text("{nope")
    assert cli_main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "endpoint file" in err and "unreadable" in err


def test_the_environment_overrides_the_endpoint_file(capsys, monkeypatch):
    endpoint_file.write(endpoint_file.default_path(), endpoint_file.Endpoint(
        addresses=["127.0.0.1:9"], token="t", pid=os.getpid()))
    monkeypatch.setenv("LAZARUS_ADDRESS", "127.0.0.1:1")
    assert cli_main(["status", "--timeout", "5"]) == client.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "127.0.0.1:1" in err and "$LAZARUS_ADDRESS" in err and "127.0.0.1:9" not in err


def test_endpoint_file_round_trips_and_is_private():
    path = endpoint_file.default_path()
    ep = endpoint_file.Endpoint(addresses=["a:1", "b:2"], token="tok", tls_ca="/ca.pem", pid=5)
    endpoint_file.write(path, ep)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert endpoint_file.read(path) == ep
    endpoint_file.remove_if_mine(path, 6)  # another process's file stays
    assert path.exists()
    endpoint_file.remove_if_mine(path, 5)
    assert not path.exists() and endpoint_file.read(path) is None


def test_a_symlink_planted_at_the_endpoint_file_is_replaced_not_followed(lazarus_home):
    path = endpoint_file.default_path()
    victim = lazarus_home / "victim"
    victim.write_text("someone's file\n")
    path.symlink_to(victim)
    # The CLI reads no endpoint through a symlink: its address could be anyone's.
    with pytest.raises(endpoint_file.UserError, match="a symlink is refused"):
        endpoint_file.read(path)
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=["a:1"], token="tok", pid=5))
    assert victim.read_text() == "someone's file\n"
    assert not path.is_symlink() and os.stat(path).st_mode & 0o777 == 0o600
    assert endpoint_file.read(path).token == "tok"
    assert sorted(p.name for p in lazarus_home.iterdir()) == ["endpoint.json", "victim"]


def test_the_endpoint_file_is_not_written_where_others_may_write(lazarus_home):
    lazarus_home.chmod(0o777)
    with pytest.raises(endpoint_file.UserError, match="is writable by other users"):
        endpoint_file.write(endpoint_file.default_path(),
                            endpoint_file.Endpoint(addresses=["a:1"], token="tok", pid=5))
    assert not endpoint_file.default_path().exists()


def test_bad_flags_are_usage_errors(capsys):
    assert cli_main(["status", "--address", "x:1", "--timeout", "0"]) == 2
    assert "--timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["checkpoint", "later"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, rc", [(["status"], "3"),
                                      # `lazarus up` once loaded torch (2-4 CPU-s a start) to
                                      # build the corpus and set the ranks' faults
                                      (["up", "--nodes", "0"], "2")])
def test_the_cli_does_not_import_torch(tmp_path, argv, rc):
    code = (f"import sys; from lazarus.cli import main; rc = main({argv!r}); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "LAZARUS_HOME": str(tmp_path)}, timeout=60)
    assert out.stdout.split()[-2:] == [rc, "False"], out.stderr
