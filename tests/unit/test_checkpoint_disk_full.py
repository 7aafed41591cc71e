"""A checkpoint save the storage refuses (a really full, then a really read-only filesystem,
mounted in a private namespace) costs that checkpoint only: both gloo ranks learn of it at the
same point and go on, nothing of it is ever listed or loaded, and saves work again once the
space is back."""

import json
import os
import textwrap

from tests.unit.mountns import run_in_mount_namespace

_RANK = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint, read_manifest
    from lazarus.trainer.ckptload import load_checkpoint
    from lazarus.trainer.ckptsave import Checkpointer
    from lazarus.trainer.models import Transformer, get_model_config

    mnt, rank, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    model = Transformer(get_model_config("tiny"))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().mean().backward()
    opt.step()
    root = mnt / "ckpt"
    failed = []
    c = Checkpointer(root, keep_last=2)

    def save(step, async_save=True):
        c.save(step, model, opt, {"step": step}, async_save=async_save,
               on_fail=lambda s, why: failed.append((s, why)))
        committed = c.wait()
        # the ranks still agree on what comes next: a collective on the training group
        flag = torch.tensor([step])
        dist.all_reduce(flag)
        assert int(flag) == 2 * step
        return committed

    def step_of(path):
        return read_manifest(path)["step"] if path else None

    def phase(name):  # the driver acts on the filesystem between phases
        dist.barrier()
        if rank == 0:
            print(json.dumps({"phase": name}), flush=True)
            sys.stdin.readline()
        dist.barrier()

    out = {"first": step_of(save(1))}
    phase("fill")
    out["full"] = str(save(2))
    out["full_latest"] = step_of(latest_checkpoint(root))
    out["full_dirs"] = sorted(p.name for p in root.iterdir())
    phase("read-only")
    out["ro"] = str(save(3, async_save=False))
    phase("free")
    out["again"] = step_of(save(4))
    out["listed"] = [m["step"] for _, m in committed_checkpoints(root)]
    out["failed"] = failed
    load_checkpoint(latest_checkpoint(root), model, opt)
    c.close()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
""")

_DRIVER = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    from pathlib import Path
    mnt, script = Path(sys.argv[1]), sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(mnt), str(r), port],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    r0 = ranks[0]

    def fill():
        with open(mnt / "ballast", "ab", buffering=0) as f:
            for chunk in (1 << 20, 4096):
                try:
                    while True:
                        f.write(b"x" * chunk)
                except OSError:
                    pass

    acts = {"fill": fill,
            "read-only": lambda: (os.unlink(mnt / "ballast"), subprocess.run(
                ["mount", "-o", "remount,ro", str(mnt)], check=True)),
            "free": lambda: subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)}
    for line in r0.stdout:
        msg = json.loads(line)
        if "phase" not in msg:
            print(line, end="", flush=True)
            continue
        acts[msg["phase"]]()
        r0.stdin.write("go\\n"); r0.stdin.flush()
    codes = [p.wait(timeout=120) for p in ranks]
    assert codes == [0, 0], codes
""")


def test_refused_saves_leave_nothing_and_training_goes_on(tmp_path):
    _, proc = run_in_mount_namespace(tmp_path, _DRIVER, _RANK, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["first"] == 1
    # disk full: nothing committed, the partial directory gone, the last good one still latest
    assert out["full"] == "None"
    assert out["full_latest"] == 1
    assert out["full_dirs"] == ["step-00000001"]
    assert out["ro"] == "None"
    assert out["again"] == 4
    assert out["listed"] == [1, 4]
    # reported once per refused save (rank 0), naming the OS error
    (s2, why2), (s3, why3) = out["failed"]
    assert (s2, s3) == (2, 3)
    assert "No space left on device" in why2
    assert "Read-only file system" in why3
    assert proc.stderr.count("checkpoint step 2 not written") == 1, proc.stderr[-3000:]


def test_a_short_write_from_torchs_zip_writer_is_a_storage_problem_not_a_bug(tmp_path,
                                                                              monkeypatch):
    """A disk that fills during a save: torch's zip writer reports an enforce failure, not an
    OSError. The save is refused like any other storage failure, and where the disk is indeed
    full it says so in the OS's words; other errors stay bugs."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lazarus.trainer import ckptrefusal

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    why = ckptrefusal.storage_problem(CheckpointException("save", {0: (short, None)}), tmp_path)
    assert why is not None and why.startswith("rank 0: a short write")
    assert "No space left" not in why  # tmp_path's disk has room: no claim it is full
    bug = RuntimeError("shape mismatch in tensor 'w'")
    assert ckptrefusal.storage_problem(CheckpointException("save", {1: (bug, None)}),
                                       tmp_path) is None

    real = os.statvfs

    def full(path):
        st = real(path)
        return os.statvfs_result((*st[:4], 0, *st[5:]))  # f_bavail = 0

    monkeypatch.setattr(ckptrefusal.os, "statvfs", full)
    why = ckptrefusal.storage_problem(CheckpointException("save", {0: (short, None)}),
                                      tmp_path / "step-00000008")
    assert why.startswith("rank 0: a short write: [Errno 28] No space left on device"), why
    assert "unexpected pos 704" in why
    # However DCP or torch wrap it: a CheckpointException inside one, an OSError as the cause
    # of a RuntimeError.
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as full:
            raise RuntimeError("writing failed") from full
    except RuntimeError as wrapped:
        nested = CheckpointException("save", {0: (wrapped, None)})
    why = ckptrefusal.storage_problem(CheckpointException("save", {1: (nested, None)}), tmp_path)
    assert why == "rank 1: [Errno 28] No space left on device"
