"""A cluster started by hand, as docs/operations.md ("Deploying") has an operator start one:
`lazarus daemon --etcd embedded --job JOB.toml` with its API over mutual TLS (certificates
from `lazarus etcd certs`), Prometheus, OTLP and compaction flags, and two `lazarus agent`s
with their tier-0, host-monitor, hang and GPU flags. Each flag is checked by what it changes
where an operator looks: `lazarus nodes`, `lazarus events`, the scrape, the collector, etcd's
own metrics."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd, die_with_parent, free_port
from lazarus.core.records import Keys, NodeStatus, RunStatus

STEPS = 120  # seconds of training, for the checks of a running cluster
TIER0_MB = 64
HUGE_MB = 1e9  # no disk has this much free: the host monitor's threshold is crossed


def lazarus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def spawn(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "lazarus.cli", *args],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)


def wait_until(what: str, probe, procs: list[subprocess.Popen], logs: Path, timeout=180):
    """A hang guard, not a timing: poll `probe` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[3]} exited {proc.returncode}; logs in {logs}"
        try:
            value = probe()
        except E.EtcdUnavailable:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; logs in {logs}")


def nvml_sees_a_gpu() -> bool:
    """What `--gpu-backend auto` picks NVML by."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that keeps the paths it was sent to."""
    posts: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).posts.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_cluster_started_by_hand_does_what_its_flags_say(tmp_path):
    pki = tmp_path / "pki"
    certs = lazarus("etcd", "certs", str(pki), "--host", "127.0.0.1")
    assert certs.returncode == 0, certs.stderr
    assert {Path(p).name for p in certs.stdout.split()} >= {"ca.pem", "server.pem", "client.pem"}
    token = tmp_path / "token"
    token.write_text("by-hand-token-0123456789\n")
    token.chmod(0o600)  # a token file others may read is refused
    Collector.posts = []
    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    ckpt, metrics, tier0_dir = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "tier0"
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nname = "by-hand"\nnodes = 2\nnproc_per_node = 1\n'
                   f'[train]\nsteps = {STEPS}\nmetrics = "{metrics}"\n'
                   '[train.model]\nname = "tiny"\n'
                   '[train.data]\nglobal_batch = 4\nseq_len = 32\n'
                   f'[train.checkpoint]\ndir = "{ckpt}"\nevery = 10\nmemory_every = 1\n')
    api, prometheus = f"127.0.0.1:{free_port()}", free_port()
    client = ["--address", api, "--token-file", str(token), "--tls-ca", str(pki / "ca.pem"),
              "--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client-key.pem")]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(spawn(
            tmp_path / "daemon.log", "daemon", "--etcd", "embedded", "--job", str(job),
            "--data-dir", str(tmp_path / "daemon"), "--lease-ttl", "3", "--api", api,
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server-key.pem"),
            "--tls-client-ca", str(pki / "ca.pem"), "--token-file", str(token),
            "--endpoint-file", "", "--metrics-port", str(prometheus), "--metrics-host",
            "127.0.0.1", "--otlp-endpoint", f"http://127.0.0.1:{collector.server_port}",
            "--compact-every", "1"))
        endpoint = wait_until("the embedded etcd", lambda: re.search(
            r"embedded etcd at (\S+)", (tmp_path / "daemon.log").read_text()), procs, tmp_path)[1]
        common = ["--etcd", endpoint, "--nproc", "1", "--role", "active", "--host", "127.0.0.1",
                  "--lease-ttl", "3", "--status-period", "1", "--allowed-root", str(tmp_path)]
        # n0: tier 0 in a dir of ours, bounded; a low-space threshold no disk meets (degraded:
        # shown, nothing done); the hang detector's knobs; the GPU backend as it finds it
        procs.append(spawn(tmp_path / "agent-n0.log", "agent", *common, "--node", "n0",
                           "--workdir", str(tmp_path / "w0"), "--gpu-backend", "auto",
                           "--tier0", "on", "--tier0-dir", str(tier0_dir),
                           "--tier0-memory-mb", str(TIER0_MB), "--low-free-mb", str(HUGE_MB),
                           "--hang-k", "4", "--hang-floor", "60", "--long-phase-floor", "120",
                           "--flight-entries", "100"))
        # n1: no tier 0; a free-space floor no disk meets (failed: a host alert, training on)
        procs.append(spawn(tmp_path / "agent-n1.log", "agent", *common, "--node", "n1",
                           "--workdir", str(tmp_path / "w1"), "--gpu-backend", "sim",
                           "--tier0", "off", "--min-free-mb", str(HUGE_MB)))
        etcd = E.Etcd(endpoint)
        keys = Keys()

        def status() -> RunStatus | None:
            kv = etcd.get(keys.status)
            return RunStatus.from_json(kv.value) if kv else None

        def holds_a_snapshot():
            kv = etcd.get(keys.nodestatus + "n0")
            return kv and NodeStatus.from_json(kv.value).tier0.get("bytes", 0) > 0 \
                and (st := status()) and st.state == "RUNNING"

        def host_state(node: str) -> str | None:
            kv = etcd.get(keys.nodestatus + node)
            host = NodeStatus.from_json(kv.value).health.get("host") if kv else None
            return host.get("state") if isinstance(host, dict) else None

        wait_until("a tier-0 snapshot on n0", holds_a_snapshot, procs, tmp_path)
        # The host monitor starts with the round (it watches the round's checkpoint dir) and
        # reports a state once it has held a second: the first snapshot may come before that.
        wait_until("n0's and n1's host alerts", lambda: (host_state("n0"), host_state("n1"))
                   == ("degraded", "failed"), procs, tmp_path)

        def nodes_seen():
            # the daemon answers from its cache of etcd, a moment behind it
            nodes = lazarus("nodes", "--json", *client)
            assert nodes.returncode == 0, nodes.stderr
            seen = {n["node"]: n for n in json.loads(nodes.stdout)["nodes"]}
            states = {n: {h["monitor"]: h["state"] for h in seen[n]["health"]} for n in seen}
            return seen if (states["n0"].get("host"), states["n1"].get("host")) == (
                "degraded", "failed") else None
        by_node = wait_until("the API to show the host alerts", nodes_seen, procs, tmp_path,
                             timeout=30)
        n0, n1 = by_node["n0"], by_node["n1"]
        assert (n0["gpu_backend"], n1["gpu_backend"]) == ("nvml" if nvml_sees_a_gpu() else "sim",
                                                          "sim")
        assert int(n0["tier0_limit_bytes"]) == TIER0_MB << 20 and int(n0["tier0_bytes"]) > 0
        assert int(n1.get("tier0_limit_bytes", 0)) == 0 and int(n1.get("tier0_bytes", 0)) == 0
        assert any(tier0_dir.rglob("*")), "no snapshot under --tier0-dir"
        host = {n: {h["monitor"]: h for h in by_node[n]["health"]} for n in ("n0", "n1")}
        assert host["n0"]["host"]["state"] == "degraded", host
        assert "free (below" in " ".join(host["n0"]["host"]["reasons"]), host
        assert host["n1"]["host"]["state"] == "failed", host
        # without a client certificate the API's mutual TLS turns the CLI away
        bare = lazarus("status", "--address", api, "--token-file", str(token), "--tls-ca",
                       str(pki / "ca.pem"))
        assert bare.returncode == 3 and bare.stdout == "", bare.stderr
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{prometheus}/metrics",
                                        timeout=30).read().decode()
        assert re.search(r'^lazarus_run_state\{[^}]*state="(RUNNING|SUCCEEDED)"[^}]*\} 1', scrape,
                         re.M), scrape

        final = wait_until("the run's end", lambda: (st := status()) and st.state in (
            "SUCCEEDED", "FAILED") and st, procs, tmp_path)
        assert final.state == "SUCCEEDED", final.reason
        done = lazarus("status", "--json", *client)
        assert done.returncode == 0 and json.loads(done.stdout)["state"] == "SUCCEEDED"
        alerts = lazarus("events", "--kind", "host_alert", "--json", *client)
        assert [json.loads(line)["fields"]["node"] for line in alerts.stdout.splitlines()] \
            == ["n1"], alerts.stdout + alerts.stderr
        tiers = {json.loads(line).get("tier") for line in metrics.read_text().splitlines()}
        assert {"memory", "storage"} <= tiers
        # --compact-every 1: the leader compacted etcd's history (etcd's own metric)
        etcd_metrics = urllib.request.urlopen(f"http://{endpoint}/metrics",
                                              timeout=30).read().decode()
        assert int(re.search(r"^etcd_debugging_mvcc_compact_revision (\d+)", etcd_metrics,
                             re.M)[1]) > 0
        etcd.close()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0
        # the OTLP exporter flushed its metrics on the way out
        assert "/v1/metrics" in Collector.posts, Collector.posts
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        collector.shutdown()


def test_gpu_backend_nvml_is_nvml_or_one_line_saying_why_not(tmp_path):
    """`--gpu-backend nvml` never falls back to simulated GPUs: without NVML the agent stops
    with NVML's reason; with it, it monitors through NVML."""
    with EmbeddedEtcd(tmp_path / "etcd") as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "agent", "--etcd", server.endpoint, "--node",
             "g0", "--workdir", str(tmp_path / "w"), "--gpu-backend", "nvml", "--tier0", "off",
             "--preflight", "off"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=die_with_parent)
        first = next((line for line in proc.stdout if "GPU monitor:" in line
                      or "error:" in line), "")
        if "error:" not in first:
            proc.terminate()  # it runs: monitoring through NVML
        code = proc.wait(timeout=60)
    if "error:" in first:
        assert code == 2 and first.startswith(
            "lazarus agent: error: GPU backend nvml: NVML did not initialise ("), first
    else:
        assert "GPU monitor: nvml" in first, first
