"""An HF Accelerate training loop as its users write one: `Accelerator().prepare(...)`, a
`save_state` every few steps and a `load_state` of the newest at start (with a marker written
once every rank's part of a save is down, so that a save cut short is never loaded). It knows
nothing of Lazarus; the e2e tests run it from a venv of its own (Accelerate is installed
there, not taken from Lazarus's), on CPU with gloo."""

import argparse
import sys
import time
from pathlib import Path

import accelerate
import torch
from accelerate import Accelerator


class Progress:
    """The loop's own state, saved and loaded with the model's (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def newest(ckpt_dir: Path) -> Path | None:
    done = [p.parent for p in ckpt_dir.glob("step-*/COMPLETE")]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=g)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    ckpt_dir = Path(args.ckpt_dir)
    last = newest(ckpt_dir)
    print(f"environment: {sys.prefix}", flush=True)
    print(f"accelerate from: {accelerate.__file__}", flush=True)
    print(f"resume from: {last}", flush=True)
    if last is not None:
        accelerator.load_state(str(last))
    print(f"started at step {progress.step}", flush=True)
    batches = iter(loader)
    while progress.step < args.max_steps:
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_time)  # stands in for a bigger model
        progress.step += 1
        if progress.step % args.save_every == 0:
            out = ckpt_dir / f"step-{progress.step}"
            accelerator.save_state(str(out))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (out / "COMPLETE").touch()
    accelerator.wait_for_everyone()
    print(f"done at step {progress.step}", flush=True)


if __name__ == "__main__":
    main()
