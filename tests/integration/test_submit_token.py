"""Users submit through the daemons' API with a submit token, never etcd's credentials: real
`lazarus daemon` processes on a real etcd, the CLI as a user types it. The submit token runs
`lazarus run` (SubmitJob, then the run's events from WatchEvents) and `lazarus cancel`, and is
refused `lazarus drain` in one line with exit code 4; the read-only token cannot submit; a
job the daemon finds bad is refused naming its field; the follow survives the death of the
daemon it watched, printing each event once."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from lazarus.daemon import api
from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc

ADMIN = "admin-token-0123456789"
SUBMIT = "submit-token-0123456789"
READ = "read-token-0123456789"
DEADLINE_S = 120


def _token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def tokens(tmp_path) -> dict[str, Path]:
    return {name: _token_file(tmp_path / f"{name}-token", token)
            for name, token in (("admin", ADMIN), ("submit", SUBMIT), ("read", READ))}


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's shell: no token, address or etcd in the environment, no endpoint file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZARUS_")}
    env["LAZARUS_HOME"] = str(tmp_path / "user-home")
    return env


def _start_daemon(etcd, keys, tmp_path: Path, tokens, name: str) -> tuple[subprocess.Popen, str]:
    """A `lazarus daemon` with all three tokens, as docs/operations.md starts one; its API
    address once it serves."""
    endpoint = tmp_path / f"{name}-endpoint.json"
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "daemon", "--etcd", etcd.endpoint, "--root",
         keys.root, "--api", "127.0.0.1:0", "--token-file", str(tokens["admin"]),
         "--submit-token-file", str(tokens["submit"]), "--read-token-file", str(tokens["read"]),
         "--endpoint-file", str(endpoint), "--data-dir", str(tmp_path / "data"),
         "--lease-ttl", "2"],
        env={k: v for k, v in os.environ.items() if not k.startswith("LAZARUS_")},
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + DEADLINE_S
    while not endpoint.exists():
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        assert time.monotonic() < deadline, "the daemon never served its API"
        time.sleep(0.05)
    return proc, json.loads(endpoint.read_text())["addresses"][0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cli(env, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)


class _Lines:
    """A running command's stdout, line by line, waited on by content."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, text: str) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"never printed {text!r}; printed {self.seen}, stderr "
                             f"{self.proc.stderr.read() if self.proc.poll() is not None else ''}")

    def rest(self) -> list[str]:
        self.proc.wait(timeout=DEADLINE_S)
        while (line := self._q.get(timeout=DEADLINE_S)) is not None:
            self.seen.append(line)
        return self.seen


def test_a_submit_token_runs_and_cancels_a_job_but_cannot_drain(etcd, keys, tmp_path, tokens,
                                                                 user_env):
    daemon, address = _start_daemon(etcd, keys, tmp_path, tokens, "d0")
    user = ("--address", address, "--token-file", str(tokens["submit"]))
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "run", *user, "--nodes", "1", "--env",
             "GREETING=hello there", "--", "python", "-c", "pass"],
            env=user_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = _Lines(run)
        try:
            first = out.wait_for("lazarus run: job")
            job_id = first.split("(", 1)[1].split(")", 1)[0]
            # the daemon took the job (no agents here: it waits for nodes), and the run
            # follows its events from the API
            out.wait_for("[job_accepted]")
            stored = json.loads(etcd.get(keys.job).value)
            assert stored["id"] == job_id and stored["command"] == ["python", "-c", "pass"]
            assert stored["env"] == {"GREETING": "hello there"}
            assert stored["cwd"] == os.getcwd()

            drain = _cli(user_env, "drain", "n0", *user)
            assert drain.returncode == client.EXIT_AUTH and drain.stdout == ""
            assert drain.stderr == (
                f"lazarus drain: error: the daemon at {address} refused: DrainNode needs the "
                "admin token; this token is a submit token (it may call CancelJob, "
                "GetRunHealth, ListCheckpoints, ListNodes, SubmitJob, WatchEvents)\n")
            assert etcd.get(keys.drain_key("n0")) is None

            job = tmp_path / "job.toml"
            job.write_text("[job]\ncommand = ['python', '-c', 'pass']\n")
            reader = _cli(user_env, "submit", str(job), "--address", address, "--token-file",
                          str(tokens["read"]))
            assert reader.returncode == client.EXIT_AUTH
            assert "SubmitJob needs the submit or admin token; this token is read-only" in \
                reader.stderr and reader.stderr.count("\n") == 1, reader.stderr
            busy = _cli(user_env, "submit", str(job), *user)
            assert busy.returncode == client.EXIT_REFUSED
            assert f"run {job_id} is PENDING; cancel it first" in busy.stderr, busy.stderr

            cancel = _cli(user_env, "cancel", *user)
            assert cancel.returncode == 0, cancel.stderr
            assert cancel.stdout.strip() == f"cancelling run {job_id}"
            lines = out.rest()
        finally:
            _stop(run)
        assert run.returncode == 1, (lines, run.stderr.read())
        assert "  [cancelled] cancelled by the operator" in lines
        assert lines[-1] == f"CANCELLED: job 'pass' ({job_id})", lines

        # the next run follows its own job, not the one that ended before it
        again = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "run", *user, "--", "python", "-c", "pass"],
            env=user_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = _Lines(again)
        try:
            second_id = out.wait_for("lazarus run: job").split("(", 1)[1].split(")", 1)[0]
            out.wait_for("[job_accepted]")
            assert _cli(user_env, "cancel", "--job-id", second_id, *user).returncode == 0
            lines = out.rest()
        finally:
            _stop(again)
        assert again.returncode == 1 and second_id != job_id
        assert lines[-1] == f"CANCELLED: job 'pass' ({second_id})", lines

        # a job the daemon finds bad is refused by it, naming the field (the CLI checks a file
        # first; a client of the API's own does not)
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.LazarusStub(channel).SubmitJob(
                    pb.SubmitJobRequest(job_toml="[job]\nnodes = 0\ncommand = ['python']\n"),
                    metadata=[("authorization", f"Bearer {SUBMIT}")], timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "job_toml: [job] nodes must be an integer >= 1, got 0"
    finally:
        _stop(daemon)


def test_lazarus_run_follows_on_when_the_daemon_it_watched_dies(etcd, keys, tmp_path, tokens,
                                                                user_env):
    """Two daemons, `--address A,B`: the stream is on A; A is killed; the run's events go on
    from B where A's stopped, none printed twice, and the outcome is B's."""
    first, a = _start_daemon(etcd, keys, tmp_path, tokens, "d0")
    second, b = _start_daemon(etcd, keys, tmp_path, tokens, "d1")
    user = ("--address", f"{a},{b}", "--token-file", str(tokens["submit"]))
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "run", *user, "--", "python", "-c", "pass"],
            env=user_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = _Lines(run)
        try:
            out.wait_for("[job_accepted]")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=60)
            # the standby takes the lead once A's lease (2 s) runs out, and acts on the cancel
            cancel = _cli(user_env, "cancel", *user)
            assert cancel.returncode == 0, cancel.stderr
            lines = out.rest()
        finally:
            _stop(run)
        assert run.returncode == 1, (lines, run.stderr.read())
        assert lines[-1].startswith("CANCELLED: job 'pass'"), lines
        assert sum("[job_accepted]" in line for line in lines) == 1, lines
        assert sum("[cancelled]" in line for line in lines) == 1, lines
    finally:
        _stop(first)
        _stop(second)


def test_the_submit_token_must_differ_from_the_others(etcd, keys):
    with pytest.raises(api.UserError, match="the submit token is the admin token"):
        api.serve(etcd, keys, address="127.0.0.1:0", token=ADMIN, submit_token=ADMIN)
    with pytest.raises(api.UserError, match="the submit token is the read-only token"):
        api.serve(etcd, keys, address="127.0.0.1:0", token=ADMIN, read_token=READ,
                  submit_token=READ)
    with pytest.raises(api.UserError, match="a submit token needs an admin token"):
        api.serve(etcd, keys, address="127.0.0.1:0", submit_token=SUBMIT)
