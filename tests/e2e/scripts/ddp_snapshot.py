"""A training script written for torchrun and nothing else, in the shape of torch's own DDP
example (pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py) on CPU: it
joins the process group from torchrun's environment, trains a DDP model, saves a snapshot at
the end of every epoch (rank 0) and, when a snapshot exists, resumes from it. It knows nothing
of Lazarus: the e2e tests run it unmodified under `lazarus up --` and `lazarus run --`.

With --lazarus it adopts Lazarus's API (level 1, docs/adopting.md) in the lines marked
`# level 1`: a step report per epoch and a snapshot in memory, restored from when the round
restores from memory, before the script's own snapshot file; and `lazarus.trainer.run(main)`,
so that a rank that loses a peer goes on in its process in the next round."""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--snapshot", required=True, help="where rank 0 saves, and every rank resumes")
    p.add_argument("--pause", type=float, default=0.5, help="seconds of extra work per epoch")
    p.add_argument("--lazarus", action="store_true", help="the level-1 lines")
    args = p.parse_args()
    if args.lazarus:                                                       # level 1
        import lazarus.trainer                                             # level 1
        session = lazarus.trainer.connect()                                # level 1

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    epochs_run = 0
    restored = session.restore() if args.lazarus else None                 # level 1
    if restored is not None:                                               # level 1
        _, state = restored                                                # level 1
        model.load_state_dict(state["model"])                              # level 1
        optimizer.load_state_dict(state["optimizer"])                      # level 1
        epochs_run = state["epochs_run"]                                   # level 1
        print(f"[rank {rank}] resuming training from memory at epoch {epochs_run}", flush=True)
    elif os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        epochs_run = snapshot["epochs_run"]
        print(f"[rank {rank}] resuming training from snapshot at epoch {epochs_run}", flush=True)
    ddp = DDP(model)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, rank))
    for epoch in range(epochs_run, args.epochs):
        started = time.perf_counter()
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
        time.sleep(args.pause)
        print(f"[rank {rank}] world {world} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} "
              f"epoch {epoch} loss {loss.item():.6f}", flush=True)
        if args.lazarus:                                                   # level 1
            session.report(step=epoch + 1, loss=loss.item(), tokens=len(data),   # level 1
                           step_time_s=time.perf_counter() - started)     # level 1
            session.snapshot(epoch + 1, {"model": model.state_dict(),      # level 1
                                         "optimizer": optimizer.state_dict(),
                                         "epochs_run": epoch + 1})
        if rank == 0 and epoch % 5 == 4:
            tmp = args.snapshot + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epochs_run": epoch + 1}, tmp)
            os.replace(tmp, args.snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    if "--lazarus" in sys.argv:                                            # level 1
        import lazarus.trainer                                             # level 1
        lazarus.trainer.run(main)  # a lost peer's survivor runs main again, in this process
    else:
        main()
