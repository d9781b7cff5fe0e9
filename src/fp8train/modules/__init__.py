"""The FP8 modules: TransformerEngine's names, every recipe through the same modules."""

from .base import FP8Module
from .layernorm_linear import LayerNormLinear, LayerNormMLP
from .linear import Linear
from .norms import LayerNorm, RMSNorm
from .stored_linear import BlockFP8Linear, StoredFP8Linear

__all__ = [
    "FP8Module",
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "LayerNorm",
    "RMSNorm",
    "StoredFP8Linear",
    "BlockFP8Linear",
]
