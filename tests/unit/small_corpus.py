"""A 100-sequence corpus and its loader, for tests of data windows and data faults."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lazarus.trainer.corpus import write_corpus
from lazarus.trainer.data import SequenceLoader, TokenDataset

SEQ = 8
BATCH = 8


@pytest.fixture
def dataset(tmp_path: Path) -> TokenDataset:
    d = tmp_path / "corpus"
    d.mkdir()
    write_corpus(d, [np.arange(0, 801) % 128], vocab_size=256)
    return TokenDataset(d, SEQ)  # 100 sequences: 12 steps of 8 per epoch


def loader(ds: TokenDataset, *, dp_rank: int = 0, dp_size: int = 1, micro_batch: int = 2) -> SequenceLoader:
    return SequenceLoader(ds, seed=3, global_batch=BATCH, dp_rank=dp_rank, dp_size=dp_size, micro_batch=micro_batch)
