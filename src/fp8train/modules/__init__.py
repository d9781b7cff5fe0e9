"""The FP8 modules: TransformerEngine's names, every recipe through the same modules."""

from .base import FP8Module
from .grouped_experts import ExpertsLinear, FusedExperts, grouped_linear
from .grouped_linear import GroupedLinear, pad_groups, unpad_groups
from .layernorm_linear import LayerNormLinear, LayerNormMLP
from .linear import Linear
from .norms import LayerNorm, RMSNorm
from .stored_experts import StoredFP8Experts
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
    "GroupedLinear",
    "ExpertsLinear",
    "FusedExperts",
    "grouped_linear",
    "pad_groups",
    "unpad_groups",
    "StoredFP8Experts",
]
