"""Block scaling (`Float8BlockScaling`, DeepSeek-V3's layout): one scale per 1x128 tile of inputs
and gradients along each GEMM's reduction dimension, one per 128x128 block of weights, each from its
own amax (docs/design.md, section 9).

The GEMM (`gemm.matmul`) is torch's 1x128/128x128 block-scaled `_scaled_mm` on Hopper (SM90,
cuBLASLt >= 12.9) for whole tiles (block_gemm.py), else emulated: operands dequantized tile by tile
(exact with power-of-2 scales) and multiplied in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cast import cast_operand
from ..formats import Format, fp8_max
from ..gemm import Operand
from .base import GemmCall, GradOperands, InputOperands, Quantization, WeightOperands, warn_emulated_on_cuda
from .current import scale_from_amax

__all__ = ["Float8BlockScaling", "BlockQuantization", "TILE", "quantize_tiles", "dequantize_tiles"]

TILE = 128


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


def quantize_tiles(
    x: torch.Tensor, rows: int, power_2: bool, encoding: str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [R, C] cast to FP8 values (float32) with one scale per `rows` x 128 tile along C (rows=1:
    1x128 tiles; rows=128: 128x128 blocks), and the scale_inv per tile [ceil(R/rows), ceil(C/128)].
    The last tiles may be smaller: their scales come from their own elements (zero padding does not
    change an amax)."""
    r, c = x.shape
    padded = F.pad(x.float(), (0, -c % TILE, 0, -r % rows))
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // TILE, TILE)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), fp8_max(encoding), power_2)
    q = cast_operand(tiles, scale[:, None, :, None], encoding, torch.float32)
    return q.view(padded.shape)[:r, :c], scale.reciprocal()


def dequantize_tiles(q: torch.Tensor, scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    return Operand(q, scale_inv, (rows, TILE)).dequantize()


def _tiles(x: torch.Tensor, power_2: bool, transposed: bool = False, fp8: bool = False) -> Operand:
    """`x` (or its transpose) in 1x128 tiles along its last dimension, as an operand of `x`'s
    orientation; `fp8` keeps the values as 1-byte FP8 (what backward saves)."""
    q, scale_inv = quantize_tiles(x.t() if transposed else x, 1, power_2)
    return Operand(q.to(torch.float8_e4m3fn) if fp8 else q, scale_inv, (1, TILE), transposed)


class BlockQuantization(Quantization):
    kind = "block"

    def quantize_weight(self, weight: torch.Tensor, call: GemmCall) -> WeightOperands:
        """128x128 blocks, which serve w and w.T alike: one quantization for forward and dgrad."""
        q, scale_inv = quantize_tiles(weight.detach(), TILE, self.recipe.power_2_scale)
        return WeightOperands.same(Operand(q.to(torch.float8_e4m3fn), scale_inv, (TILE, TILE)))

    def quantize_input(self, x2d: torch.Tensor, call: GemmCall) -> InputOperands:
        """Along in_features for the forward; along the tokens, 1-byte, for the weight gradient."""
        warn_emulated_on_cuda(x2d, "Float8BlockScaling")
        power_2 = self.recipe.power_2_scale
        return InputOperands(_tiles(x2d, power_2), _tiles(x2d, power_2, transposed=True, fp8=True))

    def quantize_grad(self, g2d: torch.Tensor, call: GemmCall, needs: tuple[bool, bool]) -> GradOperands:
        """Along out_features for dgrad, along the tokens for wgrad."""
        power_2 = self.recipe.power_2_scale
        dgrad = _tiles(g2d, power_2) if needs[0] else None
        wgrad = _tiles(g2d, power_2, transposed=True) if needs[1] else None
        return GradOperands(dgrad, wgrad)
