"""A user's own distributed script, as torchrun runs it: nothing of Lazarus in it.

usage: user_allreduce.py [--crash-once MARKER]
Every rank all-reduces rank + 1 and prints `result rank=R world=W sum=S`. With --crash-once,
rank 0 exits with 1 after init if MARKER does not exist yet (creating it): torchrun must then
restart the job for it to finish.
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if "--crash-once" in sys.argv and rank == 0:
        marker = sys.argv[sys.argv.index("--crash-once") + 1]
        if not os.path.exists(marker):
            open(marker, "w").close()
            print(f"crashing rank={rank}", flush=True)
            os._exit(1)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"result rank={rank} world={world} sum={int(total.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
