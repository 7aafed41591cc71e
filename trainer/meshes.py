"""Device meshes left over from an earlier world in this process -- a round this rank
survived (lazarus.trainer.inplace), or the zygote's rehearsal it was forked after
(lazarus.trainer.rehearsal) -- made into this world's before they can mislead it.

DTensor's caches (sharding propagation, redistribution plans) hold the DeviceMesh objects
of the specs they were filled with, and a hit hands those objects to the new tensors. A
DeviceMesh compares equal to another of the same shape, names and devices whatever rank
holds it, so the next world's identical mesh hits entries carrying the old world's mesh:
its coordinate, and its groups' names. Measured with torch 2.13 (docs/constraints.md,
"DTensor's caches"): a survivor that was rank 1 and became rank 0 kept coordinate (1,) on every
parameter, so it initialised rank 1's shard, and the step's loss changed.

Clearing those caches would be correct, and would cost the next first step 0.5-0.7 s of
propagation again (the point of keeping the process). Instead every old mesh equal to one
of the new world's takes the new one's state, so each cached entry means what a fresh
process would have computed.

Old meshes are found by walking the collector's objects; the zygote freezes its objects
before it forks (`freeze`), which hides them from that walk, so the meshes among them are
remembered here.
"""

from __future__ import annotations

import gc
import logging

from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

# DeviceMesh objects of earlier worlds of this process (inherited by a fork), until the next
# world's mesh adopts them.
_earlier: list[DeviceMesh] = []
# what filled the caches the earlier meshes sit in: "rehearsal", "round", or both
_sources: set[str] = set()
# Meshes made before the zygote froze the collector's objects (`freeze`): gc.get_objects()
# lists them no more, so they are kept here for every later `collect` to find.
_frozen: list[DeviceMesh] = []


def _tracked() -> list[DeviceMesh]:
    # type(), not isinstance: DeviceMesh's metaclass hook runs hasattr on every object it is
    # asked about, and a deprecated module attribute then warns
    return [o for o in gc.get_objects() if type(o) is DeviceMesh]


def freeze() -> None:
    """Collect, then move every object this process holds out of the cyclic collector's
    sight (gc.freeze), remembering the device meshes among them: the zygote does it before
    each fork. A child's collections and `collect`'s scan then walk only what the child made
    -- a survivor letting its round go scanned ~300,000 objects the imports left, twice
    (0.2 CPU-s, 1.4 s of wall time each with 8 ranks on 2 cores: docs/scale.md) -- and leave
    the pages it shares with the zygote unwritten."""
    gc.collect()
    _frozen.extend(_tracked())  # the meshes frozen before are listed no more: no repeats
    gc.freeze()


def collect(source: str) -> int:
    """Remember every DeviceMesh this process holds now, as an earlier world's: call it once
    a world's process groups are gone (after a rehearsal; when a round is let go). Every
    live mesh is found again each time, so the list is replaced, never grown: a process
    that never adopts (a script's) holds no more than what is alive. Returns how many."""
    _earlier[:] = _frozen + _tracked()
    _sources.add(source)
    return len(_earlier)


def adopt(root: DeviceMesh) -> set[str]:
    """Make every earlier mesh equal to `root` or to one of its slices into that mesh: call
    it right after this world's root mesh is built (its flattened dims included), before any
    DTensor op. Returns the sources of the earlier meshes adopted (empty: none were)."""
    earlier, sources = list(_earlier), set(_sources)
    _earlier.clear()
    _sources.clear()
    adopted = 0
    for old in earlier:
        new = _counterpart(root, old)
        if new is None or new is old:
            continue  # equal to nothing of this world: no cache lookup of it can hit
        # Everything a mesh is (layout, rank map, coordinate, group names, root) is in its
        # attributes; the identity is what the caches hold.
        old.__dict__.update(new.__dict__)
        assert old.get_coordinate() == new.get_coordinate()
        adopted += 1
    if adopted:
        log.debug("adopted %d device mesh(es) of an earlier world", adopted)
    return sources if adopted else set()


def _counterpart(root: DeviceMesh, old: DeviceMesh) -> DeviceMesh | None:
    """The mesh of `root`'s world that `old` equals, or None."""
    names = old.mesh_dim_names
    candidates = [root]
    if names and names != root.mesh_dim_names:
        try:
            candidates.append(root[names if len(names) > 1 else names[0]])
        except (KeyError, RuntimeError, ValueError):
            pass  # a slice this world does not have (another shape): nothing to adopt
    for mesh in candidates:
        if mesh == old:
            return mesh
    return None


def drop_caches() -> None:
    """Forget the earlier meshes and empty the DTensor caches that hold them, for a process
    whose next world's meshes are not ours to adopt (a script's own, under
    lazarus.trainer.run): its next first step pays the propagation again, and gets it right.
    torch keeps the sharding propagation's cache twice, in Python and in its C++ dispatch
    fast path; its debug module clears both."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _earlier.clear()
    _sources.clear()
    _clear_sharding_prop_cache()
    # These two hold specs and meshes as well (redistribution plans, a mesh's topology).
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
