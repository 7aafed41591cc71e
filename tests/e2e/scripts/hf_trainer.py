"""A training script of HF transformers' Trainer, as its users write one: a small GPT-2 built
from a config (no download), a dataset, TrainingArguments, and a resume from the newest
checkpoint in the output dir when there is one (`get_last_checkpoint`, as the library's own
examples do). It knows nothing of Lazarus: the e2e tests run it unmodified under
`lazarus up --`, on CPU with gloo, through a worker kill and a node loss."""

import argparse
import os
import time

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)
from transformers.trainer_utils import get_last_checkpoint


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int):
        self.tokens = torch.randint(0, vocab, (n, seq_len),
                                    generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Pace(TrainerCallback):
    """Stands in for a bigger model: each step takes at least this long."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args()
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps,
        save_total_limit=2, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo", seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    print(f"resume from: {last}", flush=True)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(2048, 32, 256),
                      callbacks=[Pace(args.step_time)])
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
