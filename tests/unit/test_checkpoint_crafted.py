"""Crafted checkpoints (docs/security.md, "A compromised agent"): whoever writes the checkpoint
dir writes the manifest and DCP's .metadata too, checksums included. A manifest whose `files`
name a path outside the directory, or whose fields have the wrong type or are missing, and
optimizer state whose shapes do not fit the model, are a bad checkpoint -- RestoreFailed
(kind "corrupt") naming the problem, which the worker reports as BAD_CHECKPOINT so the restore
falls back to the next tier -- never a KeyError, a TypeError or a RuntimeError deep in torch
that the worker takes for a crash and retries on the same files."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from lazarus.core.errors import RestoreFailed
from lazarus.trainer.ckptfiles import MANIFEST, checkpoint_dir
from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint
from lazarus.trainer.ckptload import load_checkpoint
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer.dcpread import read_dcp_metadata
from tests.unit.tiny_model import trained, untrained

PASSWD = Path("/etc/passwd")


def _save(root: Path, model, opt, step: int = 1) -> Path:
    saver = Checkpointer(root, keep_last=5)
    try:
        saver.save(step, model, opt, {"step": step}, async_save=False)
    finally:
        saver.close()
    return checkpoint_dir(root, step)


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("honest") / "ckpt", *trained())


@pytest.fixture
def copy(honest, tmp_path) -> Path:
    dest = tmp_path / "ckpt" / honest.name
    shutil.copytree(honest, dest)
    return dest


def _rewrite(path: Path, change) -> None:
    manifest_file = path / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    change(manifest)
    manifest_file.write_text(json.dumps(manifest))


def _entry_of(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


MANIFESTS = {
    "a name up and out": (lambda m: m["files"].append(
        {"name": "../../../../../../etc/passwd", **_entry_of(PASSWD)}),
        "files[*].name '../../../../../../etc/passwd' is not the name of a file in the checkpoint"),
    "an absolute name": (lambda m: m["files"].append({"name": str(PASSWD), **_entry_of(PASSWD)}),
                         "files[*].name '/etc/passwd' is not the name of a file in the checkpoint"),
    "a name that is a list": (lambda m: m["files"][0].update(name=["__0_0.distcp"]),
                              "files[0].name is a list, not a file name"),
    "no checksum": (lambda m: m["files"][-1].pop("sha256"), "files[*] has no 'sha256'"),
    "no name": (lambda m: m["files"][0].pop("name"), "files[0] has no 'name'"),
    "an entry that is a string": (lambda m: m["files"].__setitem__(0, "__0_0.distcp"),
                                  "files[0] is not an object"),
    "a size that is text": (lambda m: m["files"][0].update(bytes="12"),
                            "files[0].bytes is '12', not a size"),
    "files that are not a list": (lambda m: m.update(files={"name": ".metadata"}),
                                  "files is not a list"),
    "a step that is text": (lambda m: m.update(step="1"), "step is '1', not a whole number"),
    "extra that is a list": (lambda m: m.update(extra=[1]), "extra is not an object"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_crafted_manifest_is_a_bad_checkpoint_naming_the_problem(copy, case):
    change, problem = MANIFESTS[case]
    _rewrite(copy, change)
    n = len(json.loads((copy / MANIFEST).read_text())["files"])
    with pytest.raises(RestoreFailed) as got:
        load_checkpoint(copy, *untrained())
    assert got.value.kind == "corrupt", got.value
    message = str(got.value).replace(f"files[{n - 1}]", "files[*]")
    assert problem in message, message


def test_a_manifest_with_a_commit_seq_of_text_is_not_listed_and_others_still_are(copy):
    other = _save(copy.parent, *trained(), step=2)
    _rewrite(copy, lambda m: m.update(commit_seq="99"))
    assert latest_checkpoint(copy.parent) == other
    assert [p for p, _ in committed_checkpoints(copy.parent)] == [other]


def _with_exp_avg(model, opt, value) -> None:
    param = next(iter(model.parameters()))
    opt.state[param]["exp_avg"] = value


@pytest.mark.parametrize("case", ["a flat moment", "a moment of ints"])
def test_optimizer_state_that_does_not_fit_the_model_is_a_bad_checkpoint(tmp_path, case):
    # An honest writer of crafted state: DCP saves it, checksums and all, and loads it back
    # as it is; only the first step after the restore would notice, as a crash.
    model, opt = trained()
    param = next(iter(model.parameters()))
    _with_exp_avg(model, opt, {"a flat moment": torch.zeros(param.numel() + 1),
                               "a moment of ints": torch.zeros(param.shape, dtype=torch.int64),
                               }[case])
    path = _save(tmp_path / "ckpt", model, opt)
    with pytest.raises(RestoreFailed) as got:
        load_checkpoint(path, *untrained())
    assert got.value.kind == "corrupt"
    name = next(iter(dict(model.named_parameters())))
    assert f"optimizer state exp_avg of {name} is" in str(got.value), got.value


def _rewrite_metadata(path: Path, change) -> None:
    metadata = read_dcp_metadata(path)
    change(metadata)
    metadata.storage_meta = None
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite(path, lambda m: [e.update(_entry_of(path / ".metadata")) for e in m["files"]
                              if e["name"] == ".metadata"])


def _huge(key: str):
    def change(metadata) -> None:
        flat = next(k for k in metadata.state_dict_metadata if k.endswith(".exp_avg"))
        entry = metadata.state_dict_metadata[flat]
        metadata.state_dict_metadata[flat[:-len("exp_avg")] + key] = \
            dcp_metadata.TensorStorageMetadata(properties=entry.properties,
                                               size=torch.Size([1 << 40]), chunks=[])
    return change


@pytest.mark.parametrize("case, change, problem", [
    ("a moment of a terabyte", _huge("exp_avg"), "optimizer state exp_avg of"),
    ("an unknown entry of a terabyte", _huge("mystery"), "its DCP metadata is malformed"),
    ("an index that is a list", lambda md: setattr(md, "state_dict_metadata", []),
     ".metadata is not DCP metadata"),
])
def test_crafted_dcp_metadata_is_a_bad_checkpoint(copy, case, change, problem):
    _rewrite_metadata(copy, change)
    with pytest.raises(RestoreFailed) as got:
        load_checkpoint(copy, *untrained())
    assert got.value.kind == "corrupt" and problem in str(got.value), got.value


def test_the_honest_checkpoint_still_loads(copy):
    model, opt = untrained()
    assert load_checkpoint(copy, model, opt) == {"step": 1}
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()
