"""Float8BlockScaling's quantization of a linear layer's operands (not the block-scaled GEMM:
numerics/block_scaled_mm.py; not checkpoints' block-FP8 weights: stored_block_weights.py).

Block scaling (`Float8BlockScaling`, DeepSeek-V3's layout): one scale per 1x128 tile of inputs
and gradients along each GEMM's reduction dimension, one per 128x128 block of weights, each from its
own amax (docs/design.md, section 9).

The GEMM (`gemm.matmul`) is torch's 1x128/128x128 block-scaled `_scaled_mm` on Hopper (SM90,
cuBLASLt >= 12.9) for whole tiles (block_scaled_mm.py), else emulated: operands dequantized tile by tile
(exact with power-of-2 scales) and multiplied in fp32.

The operands are cast by the fused Triton kernels where `kernels.use_fused_kernels` says so (CUDA with
Triton): 128x128 weight blocks by `cast_blocks_128x128`, an input's or a gradient's two copies by one
`cast_tiles_1x128` read; bit for bit the torch path here, which runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import kernels
from ..numerics.cast import cast_operand
from ..numerics.formats import fp8_max
from ..numerics.gemm import Operand
from ..runtime import Call
from .base import GradOperands, InputOperands, Quantization, WeightOperands, warn_emulated_on_cuda
from .current import scale_from_amax

__all__ = ["BlockQuantization", "TILE", "quantize_tiles"]

TILE = 128


def quantize_tiles(
    x: torch.Tensor, rows: int, power_2: bool, encoding: str = "e4m3", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [R, C] cast to FP8 values (as `dtype`: float32, or an FP8 dtype) with one scale per
    `rows` x 128 tile along C (rows=1: 1x128 tiles; rows=128: 128x128 blocks), and the scale_inv per
    tile [ceil(R/rows), ceil(C/128)]. The last tiles may be smaller: their scales come from their own
    elements (zero padding does not change an amax). x is read in its own dtype (the cast multiplies
    in float32) and copied only to pad it or to lay a transposed view out in rows."""
    r, c = x.shape
    pad = (0, -c % TILE, 0, -r % rows)
    padded = F.pad(x, pad) if any(pad) else x
    tiles = padded.contiguous().view(padded.shape[0] // rows, rows, padded.shape[1] // TILE, TILE)
    scale = scale_from_amax(_tile_amax(tiles).float(), fp8_max(encoding), power_2)
    q = cast_operand(tiles, scale[:, None, :, None], encoding, dtype)
    return q.view(padded.shape)[:r, :c], scale.reciprocal()


def _tile_amax(tiles: torch.Tensor) -> torch.Tensor:
    """max|x| per tile, NaN where a tile holds one. 1x128 tiles: the max and the min along the
    contiguous dimension, two reductions without a temporary (abs() would make one the size of x);
    128x128 blocks reduce faster over abs() than over two strided dimensions twice."""
    if tiles.shape[1] == 1:
        return torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg())
    return tiles.abs().amax(dim=(1, 3))


def _tiles(x: torch.Tensor, power_2: bool, transposed: bool = False, fp8: bool = False) -> Operand:
    """`x` (or its transpose) in 1x128 tiles along its last dimension, as an operand of `x`'s
    orientation; `fp8` keeps the values as 1-byte FP8 (what backward saves)."""
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    q, scale_inv = quantize_tiles(x.t() if transposed else x, 1, power_2, dtype=dtype)
    return Operand(q, scale_inv, (1, TILE), transposed)


def _fused_grad_tiles(g2d: torch.Tensor, power_2: bool, needs: tuple[bool, bool]) -> GradOperands:
    """`quantize_grad`'s operands from the fused kernel: both copies in one read of g2d, or the
    wgrad copy alone from g2d.t() (the torch path's `_tiles(g2d, power_2, transposed=True)`)."""
    if needs[0]:
        transposed_dtype = torch.float32 if needs[1] else None
        dgrad, wgrad = kernels.cast_tiles_1x128(g2d, power_2, transposed_dtype=transposed_dtype)
        return GradOperands(dgrad, wgrad)
    if not needs[1]:
        return GradOperands(None, None)
    stored, _ = kernels.cast_tiles_1x128(g2d.t(), power_2)
    return GradOperands(None, Operand(stored.values, stored.scale_inv, stored.block, True))


class BlockQuantization(Quantization):
    kind = "block"
    kernel = "block"
    block = TILE

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        """128x128 blocks, which serve w and w.T alike: one quantization for forward and dgrad."""
        if kernels.use_fused_kernels(weight):
            return WeightOperands.same(kernels.cast_blocks_128x128(weight, self.recipe.power_2_scale))
        q, scale_inv = quantize_tiles(
            weight.detach(), TILE, self.recipe.power_2_scale, dtype=torch.float8_e4m3fn
        )
        return WeightOperands.same(Operand(q, scale_inv, (TILE, TILE)))

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        """Along in_features for the forward; along the tokens, 1-byte, for the weight gradient."""
        warn_emulated_on_cuda(x2d, "Float8BlockScaling", self.kernel)
        power_2 = self.recipe.power_2_scale
        if kernels.use_fused_kernels(x2d):
            fp8 = torch.float8_e4m3fn
            return InputOperands(*kernels.cast_tiles_1x128(x2d, power_2, transposed_dtype=fp8))
        return InputOperands(_tiles(x2d, power_2), _tiles(x2d, power_2, transposed=True, fp8=True))

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        """Along out_features for dgrad, along the tokens for wgrad."""
        power_2 = self.recipe.power_2_scale
        if kernels.use_fused_kernels(g2d):
            return _fused_grad_tiles(g2d, power_2, needs)
        dgrad = _tiles(g2d, power_2) if needs[0] else None
        wgrad = _tiles(g2d, power_2, transposed=True) if needs[1] else None
        return GradOperands(dgrad, wgrad)
