"""`lazarus report` rendered by a real headless browser (Debian chromium): the page loads, and
the DOM chromium built holds a marker for every fault, recovery, skipped batch and checkpoint
of the run, plus the incidents table; the PNG is a real, non-blank picture."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest

from lazarus import cli
from lazarus.core import etcd as E
from lazarus.core.records import CheckpointRecord, EventRecord
from lazarus.daemon.history import CHECKPOINTS, EVENTS, History
from lazarus.ops.report import CHROMIUM_FLAGS

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; "
                             "deploy/setup-local.sh does it)")


def write_run(workdir: Path) -> None:
    """A run as `lazarus up` leaves it: a worker crash after step 13 (restored from step 10,
    steps 11-13 redone), a loss spike skipped at step 22, a node lost after step 30 (restored
    from 30, nothing redone), then success at step 40; checkpoints every 5 steps."""
    rows, t = [], 0

    def train(first, last):
        for s in range(first, last + 1):
            rows.append({"step": s, "loss": 5.5 * math.exp(-s / 25) + 0.05 * math.sin(s),
                         "grad_norm": 1.0, "lr": 1e-3, "tokens": 512, "step_time_s": 0.1})

    train(1, 13)
    train(11, 21)
    rows.append({"step": 22, "loss": 40.0, "grad_norm": 300.0, "lr": 1e-3, "tokens": 512,
                 "step_time_s": 0.1, "skipped": True,
                 "spike": {"reason": "loss 40.0 > 3.0 x median", "window": [84, 87]}})
    train(22, 30)
    train(31, 40)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    t0 = 1_700_000_000.0
    evs = [(0, "job_accepted", 0, {"id": "J1"}), (1, "round_started", 1, {"restore_step": 0}),
           (4, "running", 1, {}),
           (6.4, "fault_detected", 1, {"kind": "worker_crash", "culprit": "n1",
                                       "fault_at": t0 + 6.0, "detected_at": t0 + 6.4}),
           (6.5, "round_started", 2, {"restore_step": 10}), (8.0, "running", 2, {}),
           (8.1, "recovered", 2, {"recovered_at": t0 + 8.1, "first_step": 11}),
           (18.0, "fault_detected", 2, {"kind": "node_lost", "culprit": "n1",
                                        "fault_at": t0 + 18.0, "detected_at": t0 + 18.0}),
           (18.1, "round_started", 3, {"restore_step": 30}), (20.5, "running", 3, {}),
           (20.6, "recovered", 3, {"recovered_at": t0 + 20.6, "first_step": 31}),
           (21.0, "straggler", 3, {"culprit": "n0", "ratio": 1.6}),
           (22.0, "checkpoint_failed", 3, {"step": 35, "reported_by": "n0"}),
           (25.0, "succeeded", 3, {})]
    state = {"job_accepted": "PENDING", "round_started": "RENDEZVOUS", "running": "RUNNING",
             "fault_detected": "RECOVERING", "recovered": "RUNNING", "succeeded": "SUCCEEDED",
             "straggler": "RUNNING", "checkpoint_failed": "RUNNING"}
    (workdir / "events.jsonl").write_text("".join(
        EventRecord(time=t0 + dt, kind=k, message=k, round=r, state=state[k],
                    fields=f).to_json().decode() + "\n" for dt, k, r, f in evs))
    (workdir / "checkpoints.jsonl").write_text("".join(
        CheckpointRecord(step=s, path=f"/ck/{s}", round=1, job_id="J1").to_json().decode() + "\n"
        for s in range(5, 41, 5)))


def chromium(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="test-chromium-") as profile:
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120)


def png_pixels(path: Path) -> tuple[int, int, set]:
    """(width, height, distinct RGB colours of a sample of pixels) of an 8-bit RGB(A) PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, ctype = ihdr[:4]
    assert depth == 8 and ctype in (2, 6), ihdr
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for row in range(height):
        f = raw[row * (stride + 1)]
        line = bytearray(raw[row * (stride + 1) + 1:(row + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG row filter
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        if row % 4 == 0:
            colours |= {bytes(line[i:i + 3]) for i in range(0, stride, bpp * 4)}
    return width, height, colours


def test_report_command_marks_faults_recoveries_skips_and_checkpoints(tmp_path, capsys):
    write_run(tmp_path)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = tmp_path / "report.html"
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<script" not in page  # self-contained: inline SVG only
    alerts = re.findall(r'<tr class="alert" data-kind="(\w+)"><td>(.*?)</td><td>\w+</td>'
                        r'<td>(\w+)</td>', page)
    assert alerts == [("straggler", "+21.0 s", "n0"), ("checkpoint_failed", "+22.0 s", "n0")]


def test_report_without_events_names_the_missing_file(tmp_path, capsys):
    write_run(tmp_path)
    (tmp_path / "events.jsonl").unlink()
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "events.jsonl: no events file" in capsys.readouterr().err


@needs_chromium
def test_chromium_renders_the_report_with_every_marker(tmp_path):
    write_run(tmp_path)
    png = tmp_path / "report.png"
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r.html"),
                     "--png", str(png)]) == 0

    dom = chromium("--dump-dom", (tmp_path / "r.html").as_uri()).stdout
    markers = re.findall(r'data-marker="(\w+)" data-step="(\d+)"', dom)
    by_kind = {k: sorted(int(s) for m, s in markers if m == k)
               for k in ("fault", "recovery", "skip", "checkpoint")}
    assert by_kind == {"fault": [13, 30], "recovery": [11, 31], "skip": [22],
                       "checkpoint": [5, 10, 15, 20, 25, 30, 35, 40]}
    assert 'data-kind="worker_crash"' in dom and 'data-kind="node_lost"' in dom
    assert dom.count('data-segment="') == 2  # steps 11-13 were trained twice
    rows = re.findall(r'<tr class="incident" data-outcome="(\w+)">(.*?)</tr>', dom)
    cells = [re.findall(r"<td>(.*?)</td>", r) for _, r in rows]
    assert [c[1:5] for c in cells] == [["worker_crash", "n1", "13", "10"],
                                       ["node_lost", "n1", "30", "30"]]
    assert [(c[6], c[7]) for c in cells] == [("0.40 s", "2.10 s"), ("0.00 s", "2.60 s")]
    # productive: 4.0-6.0, 8.1-18.0 and 20.6-25.0 of the 25 s since the job was accepted
    assert "<dd>succeeded</dd>" in dom and "<dd>65.2% (16.3 s productive of 25.0 s)</dd>" in dom

    width, height, colours = png_pixels(png)
    assert (width, height) == (1200, 800)
    assert len(colours) > 20  # text, a curve and coloured markers, not a blank page
    assert bytes.fromhex("c62828") in colours or any(  # the fault lines' red is on it
        c[0] > 180 and c[1] < 80 and c[2] < 80 for c in colours)


def test_report_from_etcd_and_the_daemons_history_tells_the_whole_run(etcd, keys, tmp_path,
                                                                       capsys):
    """Retention moved the run's first half out of etcd: with the daemon's data dir
    (--history), the report is the one the whole run's files give."""
    write_run(tmp_path)
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "files.html")]) == 0
    evs = [line.encode() for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    ckpts = [line.encode() for line in (tmp_path / "checkpoints.jsonl").read_text().splitlines()]
    kvs = [(f"{keys.events}{int(EventRecord.from_json(v).time * 1e9):020d}-d-{i}", v)
           for i, v in enumerate(evs)]
    kvs += [(keys.checkpoint_key(CheckpointRecord.from_json(v).step), v) for v in ckpts]
    pruned = kvs[:7] + kvs[len(evs):len(evs) + 4]
    for key, value in kvs:
        etcd.put(key, value)
    history = History.at(tmp_path / "data", keys)
    for kind, prefix in ((EVENTS, keys.events), (CHECKPOINTS, keys.checkpoints)):
        history.append(kind, [E.KV(key=k, value=v, create_revision=1, mod_revision=1,
                                   version=1, lease=0) for k, v in pruned if k.startswith(prefix)])
    for key, _ in pruned:
        etcd.delete(key)
    argv = ["report", str(tmp_path), "--etcd", etcd.endpoint, "--root", keys.root]
    assert cli.main([*argv, "--out", str(tmp_path / "etcd-only.html")]) == 0
    assert cli.main([*argv, "--history", str(tmp_path / "data"),
                     "--out", str(tmp_path / "both.html")]) == 0
    capsys.readouterr()
    whole = (tmp_path / "files.html").read_text()
    assert (tmp_path / "both.html").read_text() == whole
    assert (tmp_path / "etcd-only.html").read_text() != whole
    assert cli.main([*argv, "--history", str(tmp_path / "nowhere")]) == 2
    assert "--history" in capsys.readouterr().err
