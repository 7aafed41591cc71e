"""`lazarus export`: a checkpoint's weights as a safetensors file anyone can read without pickle.
(The multi-rank case, dp2 x tp2 shards reassembled, is in tests/integration/test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lazarus import cli
from lazarus.core.errors import UserError
from lazarus.trainer.ckptfiles import MANIFEST, checkpoint_dir
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer import export


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8, bias=False)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(4)).float().sum().backward()
    optimizer.step()
    Checkpointer(tmp_path / "ckpt", keep_last=1).save(
        42, model, optimizer, {"step": 42}, async_save=False)
    return model, checkpoint_dir(tmp_path / "ckpt", 42)


def test_export_writes_every_weight_with_its_dtype(saved, tmp_path, capsys):
    model, path = saved
    out = tmp_path / "model.safetensors"
    assert export.main([str(path), str(out)]) == 0
    assert capsys.readouterr().out.startswith("exported 2 tensors (192 parameters)")
    weights = load_file(str(out))
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], value), name
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == "42"


def test_export_refuses_to_overwrite_without_force(saved, tmp_path):
    _, path = saved
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(UserError, match="exists; pass --force"):
        export.main([str(path), str(out)])
    assert out.read_bytes() == b"precious"
    assert export.main([str(path), str(out), "--force"]) == 0
    assert load_file(str(out)).keys() == {"0.weight", "1.weight"}
    with pytest.raises(UserError, match="output directory .* does not exist"):
        export.main([str(path), str(tmp_path / "no" / "such.safetensors")])


def test_export_of_an_incomplete_checkpoint_is_one_clear_line(saved, tmp_path, capsys):
    _, path = saved
    (path / MANIFEST).unlink()
    out = tmp_path / "model.safetensors"
    assert cli.main(["export", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"lazarus export: error: checkpoint {path} is incomplete: no manifest.json "
        f"(the save never committed)"]
    assert not out.exists() and list(tmp_path.glob(".model.safetensors*")) == []
