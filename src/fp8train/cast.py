"""Casts to FP8: the amax of a tensor, and its scaled, saturated, FP8-rounded values.

Two forms of the same values. `quantize` gives real FP8 tensors (for `torch._scaled_mm`).
`cast_operand` gives the operand a GEMM consumes: real FP8 for the hardware path, else the FP8
values held exactly in bf16 or fp32, rounded by `fp8_round` in ordinary float arithmetic. On CPUs
the conversions to and from FP8 dtypes are scalar code, several times slower than that arithmetic,
and under torch.compile the arithmetic fuses with the scaling into one pass.
"""

from __future__ import annotations

import torch

from .formats import fp8_dtype, fp8_max

__all__ = ["amax", "quantize", "fp8_round", "cast_operand"]

# mantissa bits and smallest normal exponent of each encoding
_FORMATS = {"e4m3": (3, -6), "e5m2": (2, -14)}


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a float32 scalar; NaN propagates, an empty tensor gives 0."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    low, high = torch.aminmax(x.detach())  # one pass; faster than abs().amax() on CPU
    return torch.maximum(high, -low).to(torch.float32)


def _scaled(x: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """saturate(x * scale) in float32. Clamping first makes overflow identical for every FP8 dtype."""
    limit = fp8_max(encoding)
    return (x.to(torch.float32) * scale).clamp_(-limit, limit)


def quantize(x: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """saturate(x * scale) as an FP8 tensor."""
    return _scaled(x, scale, encoding).to(fp8_dtype(encoding))


def fp8_round(magnitude: torch.Tensor, sign: torch.Tensor, encoding: str) -> torch.Tensor:
    """`magnitude` (float32, in [0, fp8_max]; overwritten) rounded to the nearest FP8 value, ties to
    even, with the sign of `sign`, in float32.

    Equal bit for bit to the FP8 cast (checked on every float32 bit pattern; the tests check every tie
    and a wide sample). Adding k = 1.5 * 2**(e + 23 - mantissa_bits), where 2**e is the value's binade
    (at least the smallest normal), leaves the sum in a binade whose float32 spacing is the FP8
    spacing there, so the addition rounds exactly as the cast does; subtracting k is exact. NaN stays
    NaN; copysign restores negative values and -0.0.
    """
    mantissa_bits, min_exponent = _FORMATS[encoding]
    k = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**e
    k.clamp_(min=2.0**min_exponent).mul_(1.5 * 2.0 ** (23 - mantissa_bits))
    return magnitude.add_(k).sub_(k).copysign_(sign)


def cast_operand(x: torch.Tensor, scale: torch.Tensor, encoding: str, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) rounded to FP8, as `dtype`: an FP8 dtype, or bfloat16/float32 holding FP8
    values exactly (every FP8 value is a bf16 value). Scales are positive: the sign is x's."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return quantize(x, scale, encoding)
    magnitude = (x.to(torch.float32) * scale).abs_().clamp_(max=fp8_max(encoding))
    return fp8_round(magnitude, x, encoding).to(dtype)
