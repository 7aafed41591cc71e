"""`lazarus export CKPT_DIR OUT.safetensors`: a checkpoint's full model weights as one
safetensors file, readable anywhere without pickle (safetensors.torch.load_file).

Runs in one process, whatever the mesh that saved the checkpoint: DCP's metadata gives every
weight's full shape and dtype, and DCP assembles the shards of all ranks into plain tensors.
The checkpoint is verified (manifest, checksums) first; the output appears only when complete.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lazarus.core.errors import UserError
from lazarus.trainer.ckptverify import verify_checkpoint
from lazarus.trainer.dcpread import load_tensors, read_dcp_metadata

_MODEL_PREFIX = "model."


def full_model_weights(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(unsharded model weights by parameter name, manifest) of a committed checkpoint."""
    manifest = verify_checkpoint(ckpt_dir)
    metadata = read_dcp_metadata(ckpt_dir)
    state = {fqn: torch.empty(md.size, dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith(_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    load_tensors(ckpt_dir, state, no_dist=True)
    return {fqn.removeprefix(_MODEL_PREFIX): t for fqn, t in state.items()}, manifest


def export_safetensors(ckpt_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    weights, manifest = full_model_weights(ckpt_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(weights, str(tmp), metadata={"step": str(manifest["step"]),
                                               "source": str(ckpt_dir)})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return weights


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lazarus export",
        description="Write a checkpoint's full (unsharded) model weights as safetensors.")
    parser.add_argument("ckpt_dir", type=Path, help="a committed checkpoint directory")
    parser.add_argument("out", type=Path, help="output file, e.g. model.safetensors")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        raise UserError(f"{args.out} exists; pass --force to overwrite it")
    if not args.out.parent.is_dir():
        raise UserError(f"output directory {args.out.parent} does not exist")
    weights = export_safetensors(args.ckpt_dir, args.out)
    params = sum(t.numel() for t in weights.values())
    print(f"exported {len(weights)} tensors ({params:,} parameters) from {args.ckpt_dir} "
          f"to {args.out}")
    return 0
