"""Hostile job code benchmark (on demand): `pytest tests/bench/bench_hostile_flood.py -m bench -s`.

`lazarus up` on 2 nodes x 1 rank runs a plain gloo DDP script of the user's own (written
below, in the shape of tests/e2e/scripts/ddp_snapshot.py with the level-1 step reports). At
step FLOOD_AT its rank 1 opens a connection of its own to its agent's socket
($LAZARUS_AGENT_SOCKET) and sends 300 `committed` messages with 100 KB paths and 300
`checkpoint_failed` messages whose error begins with ESC[2J ESC[H ESC[31m (clear the screen,
home, red); then `kill-worker` strikes the other node's rank (n0). Recorded (docs/security.md,
"The job's own code"): the run's final state, whether the crash was recovered, the size of
etcd's data dir after the run, the longest `lazarus status` answer (GetRunHealth through the
CLI's own client, in this process, every POLL_S during the run) and whether a raw ESC byte
reached what `lazarus up` printed. Nothing here asserts a time: the figures are for reading.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from lazarus.ops import client
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.sim import up

pytestmark = pytest.mark.bench

EPOCHS = 14
FLOOD_AT = 3
KILL_AT = 7
POLL_S = 0.5
ESC = "\x1b[2J\x1b[H\x1b[31m"

SCRIPT = '''
import json, os, socket, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
import lazarus.trainer

epochs, flood_at, mark, snapshot = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
ESC = "\\x1b[2J\\x1b[H\\x1b[31m"


def flood():
    """What hostile job code can say: a connection of its own, 600 lines it wrote itself."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ["LAZARUS_AGENT_SOCKET"])
    rnd = int(os.environ["LAZARUS_ROUND"])
    for i in range(300):
        s.sendall((json.dumps({"type": "committed", "rank": 1, "round": rnd, "step": 1000 + i,
                               "path": "/ckpt/" + "x" * 100_000}) + "\\n").encode())
    for i in range(300):
        s.sendall((json.dumps({"type": "checkpoint_failed", "rank": 1, "round": rnd, "step": i,
                               "error": ESC + "disk on fire " + "z" * 1000}) + "\\n").encode())
    s.close()


session = lazarus.trainer.connect()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(snapshot):
    saved = torch.load(snapshot, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start = saved["epochs_run"]
ddp = DDP(model)
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, rank))
for epoch in range(start, epochs):
    began = time.perf_counter()
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
    time.sleep(0.5)
    session.report(step=epoch + 1, loss=loss.item(), tokens=len(data),
                   step_time_s=time.perf_counter() - began)
    if rank == 1 and epoch + 1 == flood_at and not os.path.exists(mark):
        open(mark, "w").close()   # once per run, not again after the restart
        flood()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epochs_run": epoch + 1}, snapshot + ".tmp")
        os.replace(snapshot + ".tmp", snapshot)
dist.destroy_process_group()
'''


class StatusPoller:
    """GetRunHealth, as `lazarus status` asks it, every POLL_S: how long each answer took."""

    def __init__(self):
        self.times: list[float] = []
        self.failures: list[tuple[float, str]] = []   # (when, why)
        self.first_answer = self.last_answer = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="status-poller")
        self._thread.start()

    def _run(self) -> None:
        args = argparse.Namespace(address=None, token=None, token_file=None, tls=False,
                                  tls_ca=None, tls_cert=None, tls_key=None, timeout=10.0)
        while not self._stop.wait(POLL_S):
            try:
                target = client.target(args)   # the endpoint file `lazarus up` leaves
            except client.Failed:
                continue                        # no daemon published yet
            began = time.perf_counter()
            try:
                client.call_at(target, "GetRunHealth", pb.GetRunHealthRequest())
                self.last_answer = time.perf_counter()
                self.first_answer = self.first_answer or self.last_answer
            except client.Failed as e:
                self.failures.append((time.perf_counter(), str(e)[:200]))
            self.times.append(time.perf_counter() - began)

    def failed_during_run(self) -> list[str]:
        """Failures between the first answer and the last: before, the daemons published
        their addresses before they listened; after, the cluster is shutting down (the
        endpoint file outlives it until this process exits)."""
        return [why for at, why in self.failures if self.first_answer < at < self.last_answer]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _tree_bytes(path: Path, pattern: str = "*") -> tuple[int, int]:
    """(apparent bytes, bytes allocated on disk) of the files under `path`: etcd preallocates
    its WAL segments (64 MB each), which says nothing of what was written."""
    files = [p.stat() for p in path.rglob(pattern) if p.is_file()]
    return sum(f.st_size for f in files), sum(f.st_blocks * 512 for f in files)


def test_hostile_rank_flood_with_a_worker_kill(tmp_path):
    script = tmp_path / "hostile_ddp.py"
    script.write_text(SCRIPT)
    workdir = tmp_path / "up"
    args = up._parse(["--workdir", str(workdir), "--nodes", "2", "--spares", "0",
                      "--chaos", f"kill-worker@{KILL_AT}:n0", "--first-step-timeout", "60",
                      "--timeout", "600", "--",
                      sys.executable, str(script), str(EPOCHS), str(FLOOD_AT),
                      str(tmp_path / "flooded"), str(tmp_path / "snapshot.pt")])
    poller = StatusPoller()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            summary = up.run(args)
            up.print_summary(summary)
    finally:
        poller.stop()
    console = printed.getvalue()
    etcd_apparent, etcd_allocated = _tree_bytes(workdir / "etcd")
    db_bytes, _ = _tree_bytes(workdir / "etcd", "db")
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["kind"] == "checkpoint_failed"]
    refused = [e for e in events if e["kind"] == "checkpoint_claim_refused"]
    kill = next((r for r in summary["recoveries"] if r["kind"] == "kill-worker"), None)
    result = {
        "final_state": summary["final_state"],
        "steps_completed": summary["steps_completed"],
        "flooded": (tmp_path / "flooded").exists(),
        "crash_recovered": kill is not None and kill["recovered_after_s"] is not None,
        "crash_culprit": kill and kill["culprit"],
        "recovered_after_s": kill and kill["recovered_after_s"],
        "etcd_data_dir_mb": round(etcd_apparent / 1e6, 1),
        "etcd_data_dir_allocated_mb": round(etcd_allocated / 1e6, 1),
        "etcd_db_file_mb": round(db_bytes / 1e6, 2),
        "checkpoint_failed_events": len(failures),
        "checkpoint_claim_refused_events": len(refused),
        "checkpoint_records": len((workdir / "checkpoints.jsonl").read_text().splitlines()),
        "status_polls": len(poller.times),
        "status_longest_s": round(max(poller.times, default=float("nan")), 3),
        "status_failures_during_run": len(poller.failed_during_run()),
        "raw_esc_in_console": "\x1b" in console,
        "escaped_esc_in_console": "\\x1b[2J" in console,
        "wall_time_s": summary["wall_time_s"],
    }
    print("\n" + console[-3000:].replace("\x1b", "<ESC>"))
    print("\nhostile flood:\n" + json.dumps(result, indent=2))
    if poller.failed_during_run():
        print("status failures:", poller.failed_during_run()[:3])
