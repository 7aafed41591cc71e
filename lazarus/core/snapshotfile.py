"""The file of one tier-0 snapshot: one rank's shard at one step, as it sits in host memory
and travels to a peer node (docs/architecture.md, "Checkpoints").

    MAGIC (6 bytes) | header length (4 bytes, big-endian) | header (JSON) | body | digest
    body   = zstd(safetensors of the rank's tensors), or those bytes as they are (below)
    digest = sha256 of everything before it (32 bytes)

The body is compressed when compression pays: when a sample of it (16 slices of 256 KiB,
spread over it) shrinks by at least MIN_SAVING at zstd level 1; the header's "codec" says
which ("zstd" | "none"; files without it are zstd). fp32 weights and AdamW moments --
what an FSDP2 shard holds, on GPUs too -- shrink by 8% (measured here), bf16 by 22%:
compressing fp32 costs a core 0.3 s per 230 MB each way for 8% fewer bytes to send.

The header says whose shard it is (job, round, rank, world size, mesh, step), carries what is
not a tensor (the data position and schedule as `extra`, the RNG state, the optimizer's
scalar settings) and the body's size; the digest covers header and body alike, so any byte
changed anywhere is caught. Nothing in it is a pickle: the header is
JSON, the tensors are safetensors. Reading is total: `read_header` and `unpack` return what
they promise or raise SnapshotError naming what is wrong, whatever the bytes.

This module knows no torch: the agent reads headers and checks bodies with it, the trainer
(lazarus.trainer.snapshot) puts tensors in and takes them out.
"""

from __future__ import annotations

import hashlib
import json

import zstandard

from lazarus.core.errors import CheckpointError

MAGIC = b"LZT0\x00\x01"
FORMAT_VERSION = 1
# A header holds a data position, an RNG state and a few hundred scalars: kilobytes. Anything
# near this is not ours.
MAX_HEADER_BYTES = 16 << 20
_LEN = 4
# Fields every header has, with their types; a reader may rely on them.
_FIELDS = {"format": int, "job": str, "round": int, "rank": int, "world_size": int,
           "step": int, "body_bytes": int, "raw_bytes": int}
_DIGEST = hashlib.sha256().digest_size
# The share of bytes compression must save for a body to be stored compressed.
MIN_SAVING = 0.10
_SAMPLE, _SLICES = 256 << 10, 16
CODECS = ("zstd", "none")
# The most a body may expand by. Tensors compress by 8-22% (above); zstd's own format allows
# 32000x (a run of zeros), and a few MB declaring 100 GB would be allocated before anything
# else could refuse them. A shard 98% zeros is refused too: the restore falls back to storage.
MAX_RATIO = 64


class SnapshotError(CheckpointError):
    """A snapshot that is not one, is cut short, or fails its checksum."""


def pack(header: dict, raw: bytes, *, level: int = 1, min_saving: float | None = None) -> bytes:
    """`pack_parts`, joined."""
    return b"".join(pack_parts(header, raw, level=level, min_saving=min_saving))


def pack_parts(header: dict, raw: bytes, *, level: int = 1,
               min_saving: float | None = None) -> tuple[bytes, bytes, bytes]:
    """The file of a snapshot, as its (start, body, digest), to write one after the other
    without joining hundreds of MB first: `header` (JSON-able: job, round, rank, world_size,
    step and whatever the trainer adds) and `raw`, the safetensors bytes, zstd-compressed if
    that saves `min_saving` (default MIN_SAVING; 0: always). Level 1: the fastest, since the
    point of this tier is a cheap save."""
    compressor = zstandard.ZstdCompressor(level=level)
    saving = MIN_SAVING if min_saving is None else min_saving
    if saving <= 0 or _sample_saving(compressor, raw) >= saving:
        body, codec = compressor.compress(raw), "zstd"
    else:
        body, codec = raw, "none"
    head = {**header, "format": FORMAT_VERSION, "body_bytes": len(body), "raw_bytes": len(raw),
            "codec": codec}
    text = json.dumps(head, sort_keys=True, allow_nan=False).encode()
    prefix = MAGIC + len(text).to_bytes(_LEN, "big") + text
    digest = hashlib.sha256(prefix)
    digest.update(body)
    return prefix, body, digest.digest()


def _sample_saving(compressor: zstandard.ZstdCompressor, raw: bytes) -> float:
    """The share of bytes zstd saves on 16 slices spread evenly over `raw`: a shard's tensors
    lie in name order, and a few slices at its ends can all fall on norms' weights (ones:
    they compress to nothing) while the moments that make up most of it do not."""
    if len(raw) <= _SLICES * _SAMPLE:
        slices = [raw]
    else:
        stride = (len(raw) - _SAMPLE) // (_SLICES - 1)
        slices = [raw[i * stride:i * stride + _SAMPLE] for i in range(_SLICES)]
    size = sum(len(x) for x in slices)
    packed = sum(len(compressor.compress(x)) for x in slices)
    return 1.0 - packed / size if size else 0.0


def read_header(data: bytes | memoryview, what: str = "snapshot") -> dict:
    """The header of a snapshot file (its body is not checked: see `unpack`)."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LEN or bytes(view[:len(MAGIC)]) != MAGIC:
        raise SnapshotError(f"{what} is not a tier-0 snapshot (no {MAGIC!r} at its start)")
    size = int.from_bytes(view[len(MAGIC):len(MAGIC) + _LEN], "big")
    start = len(MAGIC) + _LEN
    if size > MAX_HEADER_BYTES or start + size > len(view):
        raise SnapshotError(f"{what} is cut short or garbled: a header of {size} bytes in a "
                            f"file of {len(view)}")
    try:
        header = json.loads(bytes(view[start:start + size]))
    except (ValueError, RecursionError) as e:
        raise SnapshotError(f"{what}: its header is not JSON ({str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise SnapshotError(f"{what}: its header is not a JSON object")
    for name, kind in _FIELDS.items():
        value = header.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise SnapshotError(f"{what}: header field {name!r} is missing or not a "
                                f"{kind.__name__}")
    for name in ("body_bytes", "raw_bytes"):
        if header[name] < 0:  # a size; -1 would pass for zstd's "size unknown" (_check_frame)
            raise SnapshotError(f"{what}: header field {name!r} is {header[name]}, not a size")
    header.setdefault("codec", "zstd")
    if header["codec"] not in CODECS:
        raise SnapshotError(f"{what}: codec {str(header['codec'])[:40]!r}, this reader knows "
                            f"{', '.join(CODECS)}")
    if header["format"] != FORMAT_VERSION:
        raise SnapshotError(f"{what}: format {header['format']}, this reader knows "
                            f"{FORMAT_VERSION}")
    if start + size + header["body_bytes"] + _DIGEST != len(view):
        raise SnapshotError(f"{what} has {len(view) - start - size - _DIGEST} body bytes, its "
                            f"header says {header['body_bytes']}: cut short or garbled")
    header["_body_at"] = start + size
    return header


def verify(data: bytes | memoryview, what: str = "snapshot") -> dict:
    """The header, once the file's checksum holds."""
    view = memoryview(data)
    if len(view) < _DIGEST or hashlib.sha256(view[:-_DIGEST]).digest() != bytes(view[-_DIGEST:]):
        raise SnapshotError(f"{what} fails its sha256 checksum: corrupted or cut short")
    return read_header(data, what)


def unpack(data: bytes | memoryview, what: str = "snapshot"
           ) -> tuple[dict, bytes | memoryview]:
    """(header, safetensors bytes) of a snapshot file, checksum verified: a view into `data`
    when the body is stored as it is."""
    header = verify(data, what)
    body = memoryview(data)[header["_body_at"]:-_DIGEST]
    if header["codec"] == "none":
        if len(body) != header["raw_bytes"]:
            raise SnapshotError(f"{what}: {len(body)} body bytes, its header says "
                                f"{header['raw_bytes']}")
        return header, body  # a view: the caller copies what it needs, once
    _check_frame(body, header["raw_bytes"], what)
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=header["raw_bytes"])
    except zstandard.ZstdError as e:
        raise SnapshotError(f"{what}: its body does not decompress ({e})") from None
    if len(raw) != header["raw_bytes"]:
        raise SnapshotError(f"{what}: {len(raw)} bytes decompressed, its header says "
                            f"{header['raw_bytes']}")
    return header, raw


def _check_frame(body: memoryview, raw_bytes: int, what: str) -> None:
    """SnapshotError unless the zstd body declares the size the header does, within MAX_RATIO
    of its own: zstandard allocates what the frame declares (max_output_size or not), so this
    is checked before a byte is decompressed. A frame that declares no size (a streamed one,
    which this writer never makes) is refused whatever the header says."""
    if raw_bytes > MAX_RATIO * max(len(body), 1):
        raise SnapshotError(f"{what}: {raw_bytes} bytes from a body of {len(body)}, more than "
                            f"{MAX_RATIO}x: not a snapshot this writer made")
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise SnapshotError(f"{what}: its body is not a zstd frame ({e})") from None
    if declared < 0 or declared != raw_bytes:
        said = "no size" if declared < 0 else f"{declared} bytes"
        raise SnapshotError(f"{what}: its zstd frame declares {said}, its header says "
                            f"{raw_bytes}")
