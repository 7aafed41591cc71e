"""Model presets as pure data: the shapes a job names in [train.model], and the sizes tensor
parallelism must divide. The architecture itself is lazarus.trainer.models; these numbers are
here so that a job is checked (by `lazarus submit`, and by the daemon) without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazarus.core.errors import UserError


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.dim * self.ffn_hidden
        per_layer = attn + ffn + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim


# tiny and small use byte-level tokens (vocab 256, see lazarus.trainer.corpus); 1b and 8b have the
# Llama 3 shapes and vocabulary for GPU clusters.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                        ffn_hidden=176, max_seq_len=1024),
    "small": ModelConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=256,
                         ffn_hidden=1536, max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0),
}


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_SIZES[name]
    except KeyError:
        raise UserError(f"unknown model size {name!r}; choose one of {', '.join(MODEL_SIZES)}") from None


def check_tp_fits(cfg: ModelConfig, tp: int, seq_len: int) -> None:
    """UserError unless every dimension TP splits divides by tp (lazarus.trainer.parallelize
    splits heads, the MLP and the vocabulary, and the sequence between blocks)."""
    splits = {
        "attention heads": cfg.n_heads,
        "key/value heads": cfg.n_kv_heads,
        "ffn hidden size": cfg.ffn_hidden,
        "vocabulary": cfg.vocab_size,
        "sequence length (sequence parallel)": seq_len,
    }
    for what, n in splits.items():
        if n % tp:
            raise UserError(f"tp={tp} does not divide the model's {what} ({n})")
