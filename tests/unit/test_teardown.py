"""A rank stuck in torch's final destroy_process_group() ends instead of holding its node."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import os, sys, tempfile, time
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1)
""")


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=120)


def test_a_destroy_that_never_returns_ends_the_rank_with_its_stacks():
    proc = _run("""
        real = c10d.destroy_process_group
        def stuck(group=None):      # the torch hang, as the rank sees it: a call that never returns
            while True:
                time.sleep(1)
        c10d.destroy_process_group = stuck
        from lazarus.trainer.teardown import bound_destroy
        bound_destroy(grace_s=1)
        dist.destroy_process_group()
        print("after the destroy")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "after the destroy" not in proc.stdout
    assert "did not return in 1 s" in proc.stderr
    assert "in stuck" in proc.stderr  # the main thread's stack, where it hung


def test_a_destroy_that_returns_goes_on_and_one_group_is_left_alone():
    proc = _run("""
        from lazarus.trainer.teardown import bound_destroy
        bound_destroy(grace_s=1)
        bound_destroy(grace_s=1)     # twice: still one wrapper
        assert not hasattr(dist.destroy_process_group.__wrapped__, "_lazarus_bounded")
        group = dist.new_group([0])
        dist.destroy_process_group(group)
        dist.destroy_process_group()
        assert not dist.is_initialized()
        time.sleep(2)                # past the grace: the watcher stood down
        print("after the destroy")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "after the destroy" in proc.stdout and "did not return" not in proc.stderr
