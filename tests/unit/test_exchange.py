"""What ranks exchange (lazarus.trainer.exchange) travels as JSON, on a real 2-process gloo
group: values come back as sent, and a rank that sends a pickle instead -- the very tensors
torch's all_gather_object / gather_object / broadcast_object_list exchange, which those
unpickle -- runs no code on its peer, whether it talks to the helpers or to the checkpoint
code that uses them (the agreement on a restore's findings, the shared-dir check at a job's
start)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import time
from pathlib import Path

import pytest

from tests.forkedranks import run_ranks

JOIN_TIMEOUT_S = 120  # a hang guard, not a timing


class _Boom:
    """Unpickled, it makes a directory: proof that a peer's bytes ran as code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _pickle_tensor(payload: bytes):
    import torch
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _raw_all_gather(payload: bytes, *, gather_to: int | None = None) -> None:
    """all_gather_object's (or gather_object's) tensors, carrying `payload` as they would."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.long))
    padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
    padded[:len(payload)] = _pickle_tensor(payload)
    if gather_to is None:
        dist.all_gather([torch.empty_like(padded) for _ in range(world)], padded)
    else:
        dist.gather(padded, None, dst=gather_to)


def _raw_broadcast(payload: bytes) -> None:
    """broadcast_object_list's tensors for a one-object list, from rank 0."""
    import torch
    import torch.distributed as dist
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.long), src=0)
    dist.broadcast(_pickle_tensor(payload), src=0)


def _roundtrip(rank: int, out: Path) -> dict:
    import torch.distributed as dist
    from lazarus.trainer import exchange
    group = dist.new_group(backend="gloo")
    mine = {"rank": rank, "text": "é" * (rank * 100 + 1), "none": None, "pair": [rank, True]}
    return {"all": exchange.all_gather(mine),
            "gathered": exchange.gather(("problem", [{"name": f"__{rank}_0.distcp"}]), dst=1,
                                        group=group),
            "from_1": exchange.broadcast("verdict" if rank == 1 else None, src=1),
            "none_from_0": exchange.broadcast(None, src=0, group=group)}


def _attack(case: str, rank: int, out: Path) -> dict:
    from lazarus.trainer import exchange
    from lazarus.trainer.ckptdir import check_shared
    from lazarus.trainer.ckptverify import verify_collectively
    payload = pickle.dumps(_Boom(str(out / "pwned")))
    attacker = 0 if case == "broadcast to check_shared" else 1
    if rank == attacker:
        if case == "broadcast to check_shared":
            _raw_broadcast(payload)
        elif case == "length of a terabyte":  # the sizes only: nobody sets memory aside
            import torch
            import torch.distributed as dist
            sizes = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
            dist.all_gather(sizes, torch.tensor([1 << 40], dtype=torch.long))
        else:
            _raw_all_gather(payload, gather_to=0 if case == "gather" else None)
        return {"attacker": True}
    try:
        if case in ("all_gather", "length of a terabyte"):
            exchange.all_gather("honest")
        elif case == "gather":
            exchange.gather("honest", dst=0)
        elif case == "all_gather to verify_collectively":
            verify_collectively(out / "ckpt" / "step-00000001")
        elif case == "broadcast to check_shared":
            check_shared(out / "ckpt")
        return {"raised": None}
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}


def _rank(rank: int, case: str, store: str, out: str) -> None:
    import torch.distributed as dist
    out = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = _roundtrip(rank, out) if case == "roundtrip" else _attack(case, rank, out)
        (out / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _launch(case: str, out: Path) -> list[dict]:
    """Both ranks' results, each rank forked from a server that imported torch once."""
    store = out / f"store-{time.monotonic_ns()}"
    run_ranks(f"{__name__}:_rank", 2, out, case, str(store), str(out), timeout_s=JOIN_TIMEOUT_S)
    return [json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1)]


def test_values_come_back_as_sent_on_a_real_gloo_group(tmp_path):
    r0, r1 = _launch("roundtrip", tmp_path)
    values = [{"rank": r, "text": "é" * (r * 100 + 1), "none": None, "pair": [r, True]}
              for r in (0, 1)]
    assert r0["all"] == r1["all"] == values
    assert r0["gathered"] is None
    assert r1["gathered"] == [["problem", [{"name": f"__{r}_0.distcp"}]] for r in (0, 1)]
    assert r0["from_1"] == r1["from_1"] == "verdict"
    assert r0["none_from_0"] is None and r1["none_from_0"] is None


@pytest.mark.parametrize("case", ["all_gather", "gather", "all_gather to verify_collectively",
                                  "broadcast to check_shared", "length of a terabyte"])
def test_a_peers_pickle_is_never_unpickled(tmp_path, case):
    results = _launch(case, tmp_path)
    assert not (tmp_path / "pwned").exists(), "a peer's pickle ran on this rank"
    victim = results[1 if case == "broadcast to check_shared" else 0]
    assert victim.get("raised") == "ExchangeError", results
    want = "a length of 1099511627776 bytes" if "terabyte" in case else "not JSON"
    assert want in victim["message"], victim
