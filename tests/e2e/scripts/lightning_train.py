"""A PyTorch Lightning script as its users write one: a LightningModule, a Trainer with DDP,
`ModelCheckpoint(save_last=True)` and `fit(ckpt_path="last")` to resume. It knows nothing of
Lazarus; the e2e tests run it from a venv of its own (Lightning is not in Lazarus's), as
`VENV/bin/python lightning_train.py` and through a shell wrapper, on CPU with gloo."""

import argparse
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Regression(L.LightningModule):
    def __init__(self, step_time: float):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.step_time = step_time

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        time.sleep(self.step_time)  # stands in for a bigger model
        return loss

    def on_train_start(self):
        print(f"started at step {self.trainer.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05)
    # what torchrun says of the world, as elastic Lightning scripts read it
    p.add_argument("--nodes", type=int, default=int(os.environ.get("GROUP_WORLD_SIZE", 1)))
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1,
                                  every_n_train_steps=args.save_every)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                        strategy="ddp", max_steps=args.max_steps, callbacks=[checkpoints],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    print(f"environment: {sys.prefix}", flush=True)
    print(f"collective timeout: {trainer.strategy._timeout}", flush=True)
    trainer.fit(Regression(args.step_time), torch.utils.data.DataLoader(data, batch_size=8),
                ckpt_path="last")
    print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
