"""How the optimizer holds its state in fewer bytes: FP8 blocks for the moments, a bf16 weight plus
an 8-bit remainder for the master weight. Pure functions of tensors, on any device.

Moments are stored in blocks of `BLOCK` consecutive elements of the flattened parameter, each block
as E4M3 codes with one float32 scale (decoded value = code * scale, the block's amax mapped to 448).
Requantizing an EMA every step with round-to-nearest rounds small updates away: the second moment
with beta2 = 0.999 changes by 0.1% a step, under E4M3's half step of 6.25%, so it would never decay
("stall"). Rounding is therefore stochastic and unbiased (the rule of `microscaling.e2m1_round`: |x|
between grid neighbours lo < hi rounds up when u < (|x| - lo) / (hi - lo)), so each stored moment is
in expectation the EMA it stands for.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "to_blocks",
    "stochastic_e4m3",
    "encode_blocks",
    "decode_blocks",
    "keep_positive",
    "encode_expanded",
    "decode_expanded",
    "split_master",
    "join_master",
    "round_master",
]

BLOCK = 128
E4M3_MAX = 448.0
_E4M3_MANTISSA_BITS = 3
_E4M3_SUBNORMAL_STEP = 2.0**-9  # the spacing below the smallest normal, 2**-6


def to_blocks(flat: torch.Tensor) -> torch.Tensor:
    """A flat float32 tensor as [ceil(n / BLOCK), BLOCK] rows, zero-padded (a copy)."""
    rows = -(-flat.numel() // BLOCK)
    out = flat.new_zeros(rows * BLOCK)
    out[: flat.numel()] = flat
    return out.view(rows, BLOCK)


def stochastic_e4m3(x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """x (float32, |x| <= 448) rounded stochastically to the E4M3 grid, as float32 on the grid.

    The grid step at |x| is 2**(e - 3) in binade 2**e (normals) and 2**-9 below 2**-6; lo, (|x| - lo)
    and the quotient by a power-of-two step are exact, so P(up) is the exact fraction up to the
    resolution of torch.rand (2**-24): unbiased to that resolution. Grid values never move."""
    magnitude = x.abs()
    binade = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)
    step = (binade * 2.0**-_E4M3_MANTISSA_BITS).clamp_(min=_E4M3_SUBNORMAL_STEP)
    low = torch.floor(magnitude / step).mul_(step)
    u = torch.rand(magnitude.shape, generator=generator, device=magnitude.device)
    up = u < (magnitude - low).div_(step)
    return low.add_(step * up).copysign_(x)


def encode_blocks(
    values: torch.Tensor,
    generator: Optional[torch.Generator],
    stochastic: bool = True,
    positive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, BLOCK] float32 -> (E4M3 codes [rows, BLOCK], float32 scales [rows, 1]).

    scale = amax / 448 (1 for an all-zero block); the quotient values / scale is correctly rounded
    and at most 448 in magnitude. A non-finite block stays non-finite (its scale is NaN or inf), as
    fp32 AdamW's state would. positive: a second moment (see `keep_positive`)."""
    amax = values.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (values / scale).clamp_(-E4M3_MAX, E4M3_MAX)
    if stochastic:
        scaled = stochastic_e4m3(scaled, generator)
    if positive:
        scaled = keep_positive(scaled, values)
    return scaled.to(torch.float8_e4m3fn), scale


def keep_positive(stored: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(float32, before the E4M3 cast) A positive second moment that would round to 0 is stored as the
    smallest E4M3 value instead: a
    zero denominator beside a nonzero first moment would make the update m / eps (an explosion);
    rounding up is the safe direction (a smaller step)."""
    return torch.where(values > 0, stored.clamp(min=_E4M3_SUBNORMAL_STEP), stored)


def decode_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values that `encode_blocks` stored."""
    return codes.float() * scale


# ---- dynamic range expansion (COAT, arXiv:2410.19313) for non-negative blocks ---------------------
# A block's nonzero values span [low, high]; stored as (v / high) ** k with k chosen so that low maps
# to E4M3's smallest normal relative to its largest (2**-6 / 448): every nonzero value lands among
# the normals, where E4M3's relative step is uniform, and decoding (the 1/k-th power) divides the
# relative rounding error by k. k is capped (an all-equal block would ask for infinity).
_NORMAL_RANGE = math.log(E4M3_MAX / 2.0**-6)
EXPANSION_CAP = 16.0


def encode_expanded(
    values: torch.Tensor, generator: Optional[torch.Generator], stochastic: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, BLOCK] float32, >= 0 -> (E4M3 codes, float32 block maxima [rows, 1], exponents k [rows, 1])."""
    high = values.amax(dim=1, keepdim=True)
    low = torch.where(values > 0, values, torch.full_like(values, math.inf)).amin(dim=1, keepdim=True)
    spread = torch.log(high / low)
    k = torch.where(spread > 0, _NORMAL_RANGE / spread, EXPANSION_CAP).clamp_(1.0, EXPANSION_CAP)
    safe_high = torch.where(high > 0, high, torch.ones_like(high))
    expanded = (values / safe_high).pow_(k).mul_(E4M3_MAX).clamp_(max=E4M3_MAX)
    if stochastic:
        expanded = stochastic_e4m3(expanded, generator)
    return keep_positive(expanded, values).to(torch.float8_e4m3fn), high, k


def decode_expanded(codes: torch.Tensor, high: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The float32 values that `encode_expanded` stored."""
    return (codes.float() / E4M3_MAX).pow_(1.0 / k).mul_(high)


# ---- master weight: a bf16 weight and an 8-bit remainder ------------------------------------------
# The master is a float32 with 24 significant bits of pattern (its low 8 bits zero). Its bf16 weight
# is the pattern rounded half-up at bit 16 (a rounding that the remainder can undo, unlike ties to
# even), and the remainder is pattern bits 8..15. Patterns are sign-magnitude, so integer arithmetic
# on them rounds the magnitude and keeps the sign.


def round_master(master: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """float32 -> float32 whose low 8 pattern bits are zero, rounded stochastically (unbiased: an
    update smaller than the kept precision, 2**-16 relative, still moves the weight on average)."""
    bits = master.view(torch.int32)
    noise = torch.randint(0, 256, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    return ((bits + noise) & ~0xFF).view(torch.float32)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rounded master (see `round_master`) -> (bf16 weight, uint8 remainder); `join_master`
    inverts it exactly."""
    bits = master.view(torch.int32)
    weight = ((bits + 0x8000) >> 16).to(torch.int16).view(torch.bfloat16)
    remainder = ((bits >> 8) & 0xFF).to(torch.uint8)
    return weight, remainder


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master from its bf16 weight and remainder (exact inverse of `split_master`)."""
    low = remainder.to(torch.int32)
    high = weight.view(torch.int16).to(torch.int32) - (low >= 128).to(torch.int32)
    return ((high << 16) | (low << 8)).view(torch.float32)
