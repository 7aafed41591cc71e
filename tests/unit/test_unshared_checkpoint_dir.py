"""A checkpoint dir that is not shared storage: rank 1 sees its own (a tmpfs mounted over the
directory in a mount namespace of its own), rank 0 the real one. The job-start check says so
in one line, and a save is not committed: rank 0 does not see rank 1's shard where it would
write the manifest, so no "committed" checkpoint exists that only rank 1 could load."""

import json
import textwrap

from tests.unit.mountns import run_in_mount_namespace

_RANK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from lazarus.trainer.ckptdir import check_shared
    from lazarus.trainer.ckptlist import committed_checkpoints
    from lazarus.trainer.ckptsave import Checkpointer
    from lazarus.trainer.models import Transformer, get_model_config

    root, rank, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    model = Transformer(get_model_config("tiny"))
    opt = torch.optim.AdamW(model.parameters())
    shared = check_shared(root)
    failed = []
    c = Checkpointer(root, keep_last=2)
    c.save(1, model, opt, {"step": 1}, on_fail=lambda s, why: failed.append(why))
    committed = c.wait()
    c.close()
    if rank == 0:
        print(json.dumps({"shared": shared, "committed": str(committed), "failed": failed,
                          "listed": [str(p) for p, _ in committed_checkpoints(root)]}))
    dist.destroy_process_group()
""")

_DRIVER = textwrap.dedent("""
    import socket, subprocess, sys
    from pathlib import Path
    mnt, script = Path(sys.argv[1]), sys.argv[2]
    root = mnt / "ckpt"
    root.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
    own_view = ["unshare", "--mount", "sh", "-c",
                f'mount -t tmpfs -o size=16m tmpfs {root} && exec "$@"', "--"]
    ranks = [subprocess.Popen([*(own_view if r else []), sys.executable, "-c", script,
                               str(root), str(r), port]) for r in (0, 1)]
    codes = [p.wait(timeout=240) for p in ranks]
    assert codes == [0, 0], codes
""")


def test_a_checkpoint_dir_that_is_not_shared_is_named_and_never_committed(tmp_path):
    mnt, proc = run_in_mount_namespace(tmp_path, _DRIVER, _RANK, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    root = mnt / "ckpt"
    assert out["shared"].startswith(f"checkpoint dir {root} is not shared: rank 0 ("), out
    assert "does not see what rank(s) 1 (" in out["shared"]
    assert out["committed"] == "None" and out["listed"] == []
    (why,) = out["failed"]
    assert "rank 0 does not see __1_0.distcp as rank 1 wrote it (absent" in why, why
    assert "not storage every node shares" in why
