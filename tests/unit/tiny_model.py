"""The tiny model and its optimizer, untrained or one step trained (moments in its state), for
tests of what a checkpoint or a snapshot holds."""

from __future__ import annotations

import torch

from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer


def untrained():
    model = Transformer(get_model_config("tiny"))
    return model, build_optimizer(model, lr=1e-3, weight_decay=0.1)


def trained(seed: int = 1):
    torch.manual_seed(seed)
    model, opt = untrained()
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt
