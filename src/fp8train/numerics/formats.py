"""FP8 encodings: which one each direction uses (`Format`, TransformerEngine's name), their torch
dtypes and largest finite values."""

from __future__ import annotations

import enum

import torch

__all__ = ["Format", "fp8_dtype", "fp8_max", "FLOAT32_MAX"]

FLOAT32_MAX = torch.finfo(torch.float32).max


class Format(enum.Enum):
    """Which FP8 encoding each direction uses. HYBRID: E4M3 forward, E5M2 for gradients."""

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")

    @property
    def fwd(self) -> str:
        """The encoding of forward tensors (inputs, weights): "e4m3" or "e5m2"."""
        return self.value[0]

    @property
    def bwd(self) -> str:
        """The encoding of gradients: "e4m3" or "e5m2"."""
        return self.value[1]


_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_dtype(encoding: str) -> torch.dtype:
    return _DTYPES[encoding]


def fp8_max(encoding: str) -> float:
    return _MAX[encoding]
