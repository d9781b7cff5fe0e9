"""FP8 formats and the delayed-scaling recipe (TransformerEngine's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

__all__ = ["Format", "DelayedScaling", "fp8_dtype", "fp8_max"]


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
