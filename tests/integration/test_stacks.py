"""Stack capture of real processes: one asleep, two ranks of a real gloo group where one
waits in all_reduce for the other; and the NCCL flight recorder's files and pipes."""

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from lazarus.core.contract import dump_path
from lazarus.agent.stacks import (capture, collect_flight_recorder, handles_sigusr1,
                                  nccl_flight_recorder_env, request_flight_recorder_dumps)

SLEEPER = textwrap.dedent("""
    import sys, time
    from lazarus.trainer.stackdump import enable_stack_dumps
    enable_stack_dumps(sys.argv[1])

    def stuck_in_sleep():
        print("ready", flush=True)
        time.sleep(120)

    stuck_in_sleep()
""")

GLOO_RANK = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from lazarus.trainer.stackdump import enable_stack_dumps
    dump_dir, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    enable_stack_dumps(dump_dir)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def waits_in_all_reduce():
        print("ready", flush=True)
        dist.all_reduce(torch.ones(4))

    def lagging_rank():
        print("ready", flush=True)
        time.sleep(120)

    waits_in_all_reduce() if rank == 0 else lagging_rank()
""")


def start(args, **kw):
    return subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_capture_shows_the_frame_a_process_is_stuck_in(tmp_path):
    sleeper = start([SLEEPER, str(tmp_path)])
    # A process that never enabled dumps: SIGUSR1 would kill it, so it must not get one.
    bystander = start(["import time; print('ready', flush=True); time.sleep(120)"])
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        assert bystander.stdout.readline().strip() == "ready"
        assert handles_sigusr1(sleeper.pid) and not handles_sigusr1(bystander.pid)
        stacks = capture([sleeper.pid, bystander.pid], tmp_path, timeout_s=10)
        assert list(stacks) == [sleeper.pid]
        assert "in stuck_in_sleep" in stacks[sleeper.pid]
        assert "most recent call first" in stacks[sleeper.pid]
        assert sleeper.poll() is None and bystander.poll() is None   # nobody was killed
        # A second capture returns only the new dump, not the first one again.
        again = capture([sleeper.pid], tmp_path, timeout_s=10)[sleeper.pid]
        assert again.count("in stuck_in_sleep") == 1
        assert dump_path(tmp_path, sleeper.pid).read_text().count("in stuck_in_sleep") == 2
    finally:
        stop([sleeper, bystander])


def test_capture_shows_which_gloo_rank_waits_and_which_lags(tmp_path):
    store = tmp_path / "store"
    ranks = [start([GLOO_RANK, str(tmp_path), str(store), str(r)]) for r in (0, 1)]
    try:
        for p in ranks:
            assert p.stdout.readline().strip() == "ready"
        # "ready" is printed just before the call: capture again (bounded) until rank 0 is in
        # it, rather than guessing how long that takes on a loaded machine.
        for _ in range(50):
            stacks = capture([p.pid for p in ranks], tmp_path, timeout_s=10)
            if "in all_reduce" in stacks[ranks[0].pid]:
                break
        waiting, lagging = stacks[ranks[0].pid], stacks[ranks[1].pid]
        assert "in waits_in_all_reduce" in waiting and "in all_reduce" in waiting
        assert "in lagging_rank" in lagging and "all_reduce" not in lagging
        assert all(p.poll() is None for p in ranks)
    finally:
        stop(ranks)


def test_capture_of_a_process_that_exited_returns_nothing(tmp_path):
    done = start([SLEEPER.replace("time.sleep(120)", "pass"), str(tmp_path)])
    done.wait()
    assert capture([done.pid], tmp_path, timeout_s=1) == {}


def test_flight_recorder_env_files_and_dump_requests(tmp_path):
    env = nccl_flight_recorder_env(tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    # ProcessGroupNCCL writes <prefix><global rank>; the collector maps them back.
    for rank in (3, 0):
        with open(f"{prefix}{rank}", "wb") as f:
            f.write(b"dump")
    (tmp_path / "nccl" / "unrelated.txt").write_text("x")
    assert collect_flight_recorder(tmp_path) == {0: tmp_path / "nccl" / "nccl_trace_rank_0",
                                                 3: tmp_path / "nccl" / "nccl_trace_rank_3"}
    # ProcessGroupNCCL reads <pipe stem><rank>.pipe and dumps when a byte arrives.
    pipe = f"{env['TORCH_NCCL_DEBUG_INFO_PIPE_FILE']}1.pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert request_flight_recorder_dumps(tmp_path, [0, 1]) == [1]   # rank 0 has no pipe
        assert os.read(reader, 16) == b"1"
    finally:
        os.close(reader)
    assert request_flight_recorder_dumps(tmp_path, [1]) == []           # nobody reads it now


@pytest.fixture(autouse=True)
def _no_leftover_children():
    before = {c.pid for c in psutil.Process().children()}
    yield
    assert not [c for c in psutil.Process().children()
                if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
