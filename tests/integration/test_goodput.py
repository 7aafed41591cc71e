"""Checkpoint stall lines from real `lazarus train` runs, and what reads them: the report's
stall table and `lazarus goodput`."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus import cli
from lazarus.core import ettr
from lazarus.core.records import EventRecord
from lazarus.core.stall import CheckpointStall, is_stall, is_step
from tests.integration.test_report import write_run
from tests.integration.test_train_cli import train_ok

RUN = ["--model", "tiny", "--steps", "4", "--global-batch", "2", "--seq-len", "16",
       "--nproc", "1", "--ckpt-every", "2", "--warmup-steps", "1"]


def run(tmp: Path, *extra: str) -> tuple[list[dict], list[CheckpointStall]]:
    metrics = tmp / "metrics.jsonl"
    train_ok(RUN + ["--ckpt-dir", str(tmp / "ckpt"), "--metrics", str(metrics), *extra])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return ([r for r in rows if is_step(r)],
            [CheckpointStall.from_row(r) for r in rows if is_stall(r)])


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("async")
    steps, stalls = run(tmp)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [(s.step, s.tier, s.ranks) for s in stalls] == [(2, "storage", 1), (4, "storage", 1)]
    assert all(s.durable_s is not None for s in stalls)  # both committed
    return tmp


def test_a_sync_checkpoint_holds_the_loop_until_it_is_durable(tmp_path):
    # --sync-checkpoint: save() returns only after the commit, so what it held the loop
    # contains the whole time to durable; step_time_s (ends before the save) does not.
    _, stalls = run(tmp_path, "--sync-checkpoint")
    assert [s.step for s in stalls] == [2, 4]
    for s in stalls:
        assert s.blocked_s >= s.durable_s > 0


def test_report_shows_the_stall_table(async_run, capsys):
    events = async_run / "events.jsonl"
    events.write_text("")  # `lazarus train` has no daemon, hence no events
    assert cli.main(["report", str(async_run / "metrics.jsonl"), "--events", str(events)]) == 0
    page = (async_run / "report.html").read_text()
    rows = re.findall(r'<tr class="stall" data-tier="(\w+)">(.*?)</tr>', page)
    assert [tier for tier, _ in rows] == ["storage"]
    cells = re.findall(r"<td>(.*?)</td>", rows[0][1])
    assert cells[:2] == ["storage (tier 1)", "2"]
    assert all(c.endswith(" ms") for c in cells[2:6]) and cells[6].endswith("%")


def test_goodput_from_the_runs_metrics(async_run, capsys):
    metrics = async_run / "metrics.jsonl"
    assert cli.main(["goodput", "--metrics", str(metrics), "--restart-s", "3"]) == 0
    out = capsys.readouterr().out
    table = {cells[0]: cells[1:] for line in out.splitlines()[2:]
             if len(cells := re.split(r" {2,}", line)) > 1}
    assert "1 GPU (the ranks of the last checkpoint)" in out
    assert table["checkpoint every"] == ["2 steps (measured)", "not measured"]
    assert table["ETTR"][1] == "not measured"  # no tier-0 figures: none invented
    # The figure printed is the model's over the medians of the file.
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    stalls = [CheckpointStall.from_row(r) for r in rows if is_stall(r)]
    tier = ettr.Tier(every=2, blocked_s=statistics.median(s.blocked_s for s in stalls),
                     durable_s=statistics.median(s.durable_s for s in stalls))
    want = ettr.expected_ettr(step_s=statistics.median(r["step_time_s"] for r in rows
                                                       if is_step(r)),
                              tiers=[tier], restore_from=tier, restart_s=3.0,
                              mtbf_s=ettr.job_mtbf_s(1))
    assert table["ETTR"][0] == f"{want.ettr:.2%}"
    assert table["lost to checkpoint stalls"][0] == f"{want.stalls:.2%}"


def test_goodput_names_what_it_lacks(async_run, capsys):
    metrics = str(async_run / "metrics.jsonl")
    assert cli.main(["goodput", "--metrics", metrics, "--interruptions", "-4"]) == 2
    assert capsys.readouterr().err.strip() == \
        "lazarus goodput: error: interruptions must be > 0, not -4"
    assert cli.main(["goodput", "--metrics", metrics, "--t0-blocked-s", "-0.1"]) == 2
    assert capsys.readouterr().err.strip() == \
        "lazarus goodput: error: --t0-blocked-s must be >= 0, not -0.1"
    # No restart measured (no recoveries, no events): the table says so and names the flag.
    assert cli.main(["goodput", "--metrics", metrics]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ETTR +not measured +not measured$", out, re.MULTILINE)
    assert "give them to fill the table: --restart-s --t0-every" in out


def test_goodput_command_line(async_run):
    # the installed entry point, as an operator runs it
    done = subprocess.run([sys.executable, "-m", "lazarus.cli", "goodput", "--metrics",
                           str(async_run / "metrics.jsonl"), "--restart-s", "2",
                           "--gpus", "16384"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "scaled to 16,384 GPUs (given): one every 3.1 h" in done.stdout


def stall_lines(tier: str, every: int, blocked: float, durable: float) -> str:
    return "".join(json.dumps(CheckpointStall(step=s, tier=tier, blocked_s=blocked,
                                              durable_s=durable, ranks=4).to_row()) + "\n"
                   for s in range(every, 41, every))


def test_goodput_takes_the_restart_cost_from_the_recoveries(tmp_path, capsys):
    # The report's test run: 0.1 s steps, recovered 2.1 s and 2.6 s after its two faults.
    write_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(stall_lines("storage", 5, 0.02, 0.3))
    assert cli.main(["goodput", "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "scaled to 4 GPUs (the ranks of the last checkpoint)" in out
    # median 2.35 s, less the first step after the restore (one step time, 0.1 s)
    assert re.search(r"^restart per failure +2\.25 s \(median of 2 recoveries\) +not measured$",
                     out, re.MULTILINE)
    assert re.search(r"^ETTR +\d+\.\d\d% +not measured$", out, re.MULTILINE)


def test_goodput_with_tier_0_lines(tmp_path, capsys):
    # A run with both tiers: its recoveries are not attributed to one (the events do not
    # say which tier a restore used), so the restart costs come from flags.
    write_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(stall_lines("storage", 10, 0.5, 1.0) + stall_lines("memory", 2, 0.01, 0.05))
    metrics = str(tmp_path / "metrics.jsonl")
    assert cli.main(["goodput", "--metrics", metrics]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^restart per failure +not measured +not measured$", out, re.MULTILINE)
    assert cli.main(["goodput", "--metrics", metrics, "--restart-s", "9",
                     "--t0-restart-s", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^checkpoint every +10 steps \(measured\) +2 steps \(measured\)$", out,
                     re.MULTILINE)
    storage = ettr.Tier(every=10, blocked_s=0.5, durable_s=1.0)
    memory = ettr.Tier(every=2, blocked_s=0.01, durable_s=0.05)
    mtbf = ettr.job_mtbf_s(4)
    t1 = ettr.expected_ettr(step_s=0.1, tiers=[storage], restore_from=storage, restart_s=9,
                            mtbf_s=mtbf)
    t0 = ettr.expected_ettr(step_s=0.1, tiers=[storage, memory], restore_from=memory,
                            restart_s=3, mtbf_s=mtbf)
    assert re.search(rf"^ETTR +{t1.ettr:.2%} +{t0.ettr:.2%}$", out, re.MULTILINE)


def test_goodput_takes_each_tiers_restart_from_the_recoveries_that_restored_from_it(
        tmp_path, capsys):
    # The report's run, its round_started events saying the tier as the daemon's do: the
    # crash restored from storage (2.1 s), the node loss from memory (2.6 s).
    write_run(tmp_path)
    events = tmp_path / "events.jsonl"
    lines = []
    for line in events.read_text().splitlines():
        ev = EventRecord.from_json(line.encode())
        if ev.kind == "round_started" and ev.round > 1:
            ev.fields["restore_tier"] = 1 if ev.round == 2 else 0
        lines.append(ev.to_json().decode() + "\n")
    events.write_text("".join(lines))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(stall_lines("storage", 10, 0.5, 1.0) + stall_lines("memory", 2, 0.01, 0.05))
    assert cli.main(["goodput", "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    # less the first step after the restore (one step time, 0.1 s)
    assert re.search(r"^restart per failure +2 s \(1 recovery\) +2\.5 s \(1 recovery\)$",
                     out, re.MULTILINE), out
    assert re.search(r"^ETTR +\d+\.\d\d% +\d+\.\d\d%$", out, re.MULTILINE), out


def test_checkpoint_lines_do_not_move_the_faults_in_the_report(tmp_path):
    # An async save's line comes steps after the step it names: step 10's after step 13,
    # just before the crash that restores step 10. The fault stays after step 13.
    write_run(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 13) + 1
    late = json.dumps(CheckpointStall(step=10, tier="storage", blocked_s=0.01,
                                      durable_s=0.2).to_row()) + "\n"
    metrics.write_text("".join(lines[:at] + [late] + lines[at:]))
    assert cli.main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    incidents = [re.findall(r"<td>(.*?)</td>", r)
                 for r in re.findall(r'<tr class="incident" data-outcome="\w+">(.*?)</tr>', page)]
    assert [c[1:5] for c in incidents] == [["worker_crash", "n1", "13", "10"],
                                           ["node_lost", "n1", "30", "30"]]
    assert page.count('data-segment="') == 2


def test_goodput_from_flags_alone_as_the_docs_type_it(capsys):
    """docs/operations.md's "no run: all from flags" line, then tier 0's figures and a failure
    rate of one's own: each given figure is shown as given and counted."""
    given = ["goodput", "--step-time-s", "2.1", "--every", "500", "--blocked-s", "4",
             "--durable-s", "40", "--restart-s", "90", "--gpus", "4096"]
    assert cli.main(given) == 0
    out = capsys.readouterr().out
    assert out.startswith("failures: 419 interruptions in 54 days on 16,384 GPUs (Llama 3), "
                          "scaled to 4,096 GPUs (given): one every 12.4 h\n"), out
    assert re.search(r"^durable after +40 s \(given\) +not measured$", out, re.MULTILINE)
    assert re.search(r"^ETTR +98\.16% +not measured$", out, re.MULTILINE)
    assert cli.main([*given, "--t0-every", "10", "--t0-blocked-s", "0.05", "--t0-durable-s",
                     "1", "--t0-restart-s", "20", "--interruptions", "100", "--days", "10",
                     "--on-gpus", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("failures: 100 interruptions in 10 days on 1,000 GPUs, scaled to "
                          "4,096 GPUs (given): one every 2,109 s\n"), out
    assert re.search(r"^checkpoint every +500 steps \(given\) +10 steps \(given\)$", out,
                     re.MULTILINE)
    assert re.search(r"^blocked per checkpoint +4 s \(given\) +50 ms \(given\)$", out,
                     re.MULTILINE)
    assert re.search(r"^restart per failure +90 s \(given\) +20 s \(given\)$", out, re.MULTILINE)
    assert re.search(r"^ETTR +68\.78% +97\.90%$", out, re.MULTILINE)
