"""FP8 formats and the delayed-scaling recipe (TransformerEngine's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

__all__ = [
    "Format",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "Recipe",
    "recipe_kind",
    "fp8_dtype",
    "fp8_max",
]


class Format(enum.Enum):
    """Which FP8 encoding each direction uses. HYBRID: E4M3 forward, E5M2 for gradients."""

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")

    @property
    def fwd(self) -> str:
        return self.value[0]

    @property
    def bwd(self) -> str:
        return self.value[1]


_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_dtype(encoding: str) -> torch.dtype:
    return _DTYPES[encoding]


def fp8_max(encoding: str) -> float:
    return _MAX[encoding]


AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each step's scale comes from the amax history of earlier steps.

    Callables are applied once to the whole contiguous storage of a group (one column per tensor
    role), so they must work column-wise: ``amax_compute_algo(history[H, N]) -> amax[N]`` and
    ``scaling_factor_compute_algo(amax[N], scale[N], fp8_max, recipe) -> scale[N]``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[ScaleAlgo] = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an integer >= 0, got {self.margin!r}")
        if not isinstance(self.fp8_format, Format) or self.fp8_format is Format.E5M2:
            raise ValueError(
                f"DelayedScaling.fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format!r} "
                "(pure E5M2 has too little precision for forward activations and weights)"
            )
        h = self.amax_history_len
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an integer >= 1, got {h!r}")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable "
                f"(amax_history) -> amax, got {algo!r}"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(
                "DelayedScaling.scaling_factor_compute_algo must be None or a callable "
                f"(amax, scale, fp8_max, recipe) -> scale, got {sf!r}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling.reduce_amax must be True or False, got {self.reduce_amax!r}")


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor current scaling: each tensor's scale from its own amax just before its cast
    (`scale_from_amax`), no history. No amax reduction: every tensor is cast where it is whole, so
    sequence-parallel inputs and FSDP2 weights are gathered in high precision first."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format) or self.fp8_format is Format.E5M2:
            raise ValueError(
                "Float8CurrentScaling.fp8_format must be Format.E4M3 or Format.HYBRID, "
                f"got {self.fp8_format!r}"
            )


@dataclass(frozen=True)
class Float8BlockScaling:
    """Block scaling (DeepSeek-V3's): E4M3 everywhere, one scale per 1x128 tile (128 consecutive
    elements along the GEMM's reduction dimension) of inputs and gradients and per 128x128 block of
    weights, each from its own amax; `power_2_scale` rounds scales down to a power of 2."""

    power_2_scale: bool = True
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"Float8BlockScaling uses Format.E4M3 everywhere, got {self.fp8_format!r}")
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(
                f"Float8BlockScaling.power_2_scale must be True or False, got {self.power_2_scale!r}"
            )


Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling]
RECIPE_KINDS = {DelayedScaling: "delayed", Float8CurrentScaling: "current", Float8BlockScaling: "block"}


def recipe_kind(recipe: Recipe) -> str:
    """'delayed', 'current' or 'block': what a checkpoint records of the recipe a module trained with."""
    return RECIPE_KINDS[type(recipe)]


def check_recipe(recipe, where: str) -> Recipe:
    if type(recipe) not in RECIPE_KINDS:
        raise ValueError(
            f"{where} must be a fp8train.DelayedScaling, Float8CurrentScaling or Float8BlockScaling, "
            f"got {type(recipe).__name__}"
        )
    return recipe
