"""Token data: a corpus on disk, a memmapped dataset of fixed-length sequences, and a loader
whose position is a single cursor, so a run resumes (or reshards) without replaying or
skipping a sequence.

The corpus itself (its format, the built-in one) is lazarus.trainer.corpus.

Sequences and shuffling
-----------------------
`TokenDataset(dir, seq_len)` cuts every shard into windows of seq_len + 1 tokens with stride
seq_len (inputs = window[:-1], targets = window[1:]); a window never crosses a shard boundary.
`SequenceLoader` visits those windows in a random order drawn from (seed, epoch): each epoch is
one permutation of all windows, and an optimizer step consumes the next `global_batch` of them,
split into dp contiguous chunks (one per data-parallel rank) and each chunk into micro-batches.
The tail of an epoch too short for a whole step is skipped, so a step never straddles two
epochs. The loader's whole state is a cursor counting sequences (epoch x len + offset), which
does not depend on the dp degree: a checkpoint taken at dp=4 resumes at dp=2 on the same data.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from lazarus.core.errors import UserError
from lazarus.trainer.corpus import (DEFAULT_MAX_TOKENS, DEFAULT_SHARD_TOKENS, DTYPES, MANIFEST,
                                    default_corpus_dir, ensure_corpus, read_manifest,
                                    verify_corpus)


class TokenDataset:
    """Windows of seq_len + 1 tokens over memmapped shards; indexable, nothing loaded eagerly."""

    def __init__(self, corpus_dir: Path, seq_len: int):
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        self.corpus_dir = Path(corpus_dir)
        self.seq_len = seq_len
        self.manifest = read_manifest(self.corpus_dir)
        self.vocab_size = int(self.manifest["vocab_size"])
        np_dtype = DTYPES[self.manifest["dtype"]][0]
        self._shards = [np.memmap(self.corpus_dir / s["name"], dtype=np_dtype, mode="r")
                        for s in self.manifest["shards"]]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self._shards]
        # _starts[i] = index of shard i's first window.
        self._starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        if len(self) == 0:
            raise UserError(f"corpus {self.corpus_dir} has no shard longer than seq_len "
                            f"{seq_len} tokens")

    @property
    def fingerprint(self) -> str:
        """Identifies the corpus content: ranks can compare it to be sure they read the same."""
        digests = "".join(s["sha256"] for s in self.manifest["shards"])
        return hashlib.sha256(digests.encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        shard = bisect.bisect_right(self._starts, index) - 1
        begin = (index - self._starts[shard]) * self.seq_len
        return self._shards[shard][begin:begin + self.seq_len + 1]

    def batch(self, indices: Iterable[int]) -> torch.Tensor:
        """The windows at `indices` as an int64 tensor [len(indices), seq_len + 1]."""
        rows = np.stack([self[int(i)] for i in indices]).astype(np.int64)
        return torch.from_numpy(rows)


def check_model_vocab(dataset: TokenDataset, model_vocab: int, model: str) -> None:
    """UserError when the corpus may hold ids the model cannot embed: on a GPU that would
    surface as a device-side assert in the embedding, not as a message."""
    if dataset.vocab_size > model_vocab:
        raise UserError(f"corpus {dataset.corpus_dir} has vocab_size {dataset.vocab_size}, "
                        f"more than model {model}'s {model_vocab}: tokenize it for this "
                        f"model or pick a model whose vocabulary covers it")


# ---------------------------------------------------------------------------------------------
# Loading batches


def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    digest = hashlib.sha256(f"lazarus-data:{seed}:{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=g)


class SequenceLoader:
    """Feeds one data-parallel rank its share of each optimizer step.

    A step takes the next `global_batch` sequences of the epoch's permutation; rank r of
    `dp_size` gets the r-th contiguous chunk, cut into micro-batches of `micro_batch`
    (accumulation = global_batch / (dp_size * micro_batch)). Memory is one permutation of the
    dataset, whatever the number of steps.
    """

    def __init__(self, dataset: TokenDataset, *, seed: int, global_batch: int, dp_rank: int,
                 dp_size: int, micro_batch: int):
        if global_batch % (dp_size * micro_batch):
            raise UserError(f"global batch {global_batch} is not divisible by dp {dp_size} x "
                            f"micro-batch {micro_batch}")
        if global_batch > len(dataset):
            raise UserError(f"global batch {global_batch} is larger than the dataset "
                            f"({len(dataset)} sequences of {dataset.seq_len + 1} tokens)")
        assert 0 <= dp_rank < dp_size
        self.dataset = dataset
        self.seed = seed
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch = micro_batch
        self._cursor = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.dp_size * self.micro_batch)

    def _window(self, cursor: int) -> tuple[int, int]:
        """(epoch, offset) of the step starting at `cursor`, moved past a too-short tail."""
        n = len(self.dataset)
        epoch, offset = divmod(cursor, n)
        if offset + self.global_batch > n:
            epoch, offset = epoch + 1, 0
        return epoch, offset

    def position(self) -> dict:
        """The data window the next step will read: its epoch and first/last sequence cursor
        (inclusive). `skip_to(position()["last"] + 1)` drops exactly that window."""
        epoch, offset = self._window(self._cursor)
        first = epoch * len(self.dataset) + offset
        return {"epoch": epoch, "first": first, "last": first + self.global_batch - 1}

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        epoch, offset = self._window(self._cursor)
        if epoch != self._perm_epoch:
            self._perm = _epoch_permutation(self.seed, epoch, len(self.dataset))
            self._perm_epoch = epoch
        per_rank = self.global_batch // self.dp_size
        begin = offset + self.dp_rank * per_rank
        mine = self._perm[begin:begin + per_rank]
        self._cursor = epoch * len(self.dataset) + offset + self.global_batch
        out = []
        for chunk in mine.split(self.micro_batch):
            rows = self.dataset.batch(chunk.tolist())
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def skip(self, num_steps: int) -> None:
        """Advance past `num_steps` steps without reading them."""
        for _ in range(num_steps):
            epoch, offset = self._window(self._cursor)
            self._cursor = epoch * len(self.dataset) + offset + self.global_batch

    def skip_to(self, cursor: int) -> None:
        """Continue from sequence `cursor` (a value from position() or state_dict())."""
        assert cursor >= 0
        self._cursor = cursor

    def state_dict(self) -> dict:
        return {"seed": self.seed, "cursor": self._cursor, "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != len(self.dataset) or state["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's data position is for {state['num_sequences']} sequences "
                f"with seed {state['seed']}; this run has {len(self.dataset)} with seed "
                f"{self.seed} (same corpus, seq_len and seed are needed to resume)")
        self._cursor = int(state["cursor"])


# ---------------------------------------------------------------------------------------------
# `lazarus corpus`


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lazarus corpus",
        description="Build the built-in byte-level corpus (the Python standard library's "
                    "sources, no download), verify an existing corpus directory, or tokenize "
                    "your own text with a tokenizer.json (--from-text, --tokenizer).")
    parser.add_argument("dir", nargs="?", type=Path, default=None,
                        help=f"corpus directory (default: {default_corpus_dir()})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"cap on the number of tokens built (default {DEFAULT_MAX_TOKENS} "
                             f"for the built-in corpus, none with --from-text)")
    text = parser.add_argument_group(
        "tokenizing your own text", "e.g. lazarus corpus OUT --from-text books/ --tokenizer "
        "llama3/tokenizer.json (.txt: a file is a document; .jsonl: a line's \"text\" is)")
    text.add_argument("--from-text", nargs="+", type=Path, metavar="PATH",
                      help="text files, or directories searched for *.txt and *.jsonl")
    text.add_argument("--tokenizer", type=Path, metavar="FILE",
                      help="a Hugging Face tokenizer.json (needs the tokenizers package)")
    text.add_argument("--eod-token", metavar="TEXT",
                      help="the end-of-document token put after each document (default: "
                           "the tokenizer's <|end_of_text|>, <|endoftext|>, </s> or <eos>)")
    text.add_argument("--shard-tokens", type=int, metavar="N",
                      help="tokens per shard file (default 16 Mi)")
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.from_text or args.tokenizer:
        return _tokenize_main(args)
    if args.eod_token is not None or args.shard_tokens is not None:
        raise UserError("--eod-token and --shard-tokens go with --from-text and --tokenizer")
    path = args.dir if args.dir is not None else default_corpus_dir()
    existed = (path / MANIFEST).is_file()
    t0 = time.perf_counter()
    ensure_corpus(path, max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS)
    m = verify_corpus(path)
    print(f"{'verified' if existed else 'built'} {_summary(path, m, t0)}")
    return 0


def _tokenize_main(args: argparse.Namespace) -> int:
    from lazarus.trainer import tokenizing as tokenize  # imports the optional tokenizers package

    if not args.from_text or args.tokenizer is None:
        raise UserError("--from-text PATH... and --tokenizer FILE go together")
    if args.dir is None:
        raise UserError("name the new corpus directory: lazarus corpus OUT --from-text ...")
    t0 = time.perf_counter()
    shard_tokens = tokenize.DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    tokenize.tokenize_corpus(args.from_text, args.tokenizer, args.dir, eod_token=args.eod_token,
                             shard_tokens=shard_tokens, max_tokens=args.max_tokens,
                             log=lambda line: print(line, flush=True))
    print(f"built {_summary(args.dir, read_manifest(args.dir), t0)}")
    return 0


def _summary(path: Path, m: dict, t0: float) -> str:
    tokens = sum(s["tokens"] for s in m["shards"])
    return (f"corpus {path}: {len(m['shards'])} shards, {tokens:,} tokens, "
            f"vocab {m['vocab_size']} ({m['dtype']}), {time.perf_counter() - t0:.1f} s")
