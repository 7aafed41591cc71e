"""Model architectures. One family today: the Llama-style decoder in llama.py."""

from lazarus.core.modelconfig import MODEL_SIZES, ModelConfig, get_model_config
from lazarus.trainer.models.llama import (
    Transformer,
    apply_rope_ref,
    cross_entropy_ref,
    rms_norm_ref,
    swiglu_ref,
)

__all__ = [
    "MODEL_SIZES",
    "ModelConfig",
    "Transformer",
    "apply_rope_ref",
    "cross_entropy_ref",
    "get_model_config",
    "rms_norm_ref",
    "swiglu_ref",
]
