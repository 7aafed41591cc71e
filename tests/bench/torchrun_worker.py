"""The Lazarus trainer run under plain torchrun, as the baseline of bench_recovery.py and
bench_hang.py (tests/bench/runs.py starts it).

torchrun restarts every worker of the job after a failure; each restart resumes from the
newest committed checkpoint, exactly what a Lazarus round does, so the comparison is of the
recovery machinery and not of the training code.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 torchrun_worker.py TRAIN.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lazarus.trainer.ckptlist import latest_checkpoint
from lazarus.core.contract import WorkerAssignment
from lazarus.trainer.worker import run


def main() -> int:
    train = json.loads(Path(sys.argv[1]).read_text())
    latest = latest_checkpoint(Path(train["checkpoint"]["dir"]))
    a = WorkerAssignment(
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        round=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        store_host=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        train=train, restore=str(latest) if latest else None)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
