"""Inverses of the library's numerics, used only as test oracles: dequantizers, E2M1 unpacking, the
inverse random Hadamard transform, the unswizzle of block scales, the dequantized block tiles.

The library never goes back from a quantized operand (it multiplies operands; a GEMM's emulation
dequantizes through `Operand.dequantize` and `microscaled_mm`), so these live beside the tests, not in
`fp8train.numerics`. Each is written from the format's definition with torch's plain operations and the
library's public constants; exactness is argued where the tests rely on it.
"""

from __future__ import annotations

import torch

from fp8train.numerics.microscaling import (
    E2M1_VALUES,
    MX_BLOCK,
    NVFP4_BLOCK,
    RHT_SIGNS,
    SWIZZLE_TILE,
    e8m0_to_float,
    float32_matmul,
    hadamard_matrix,
)
from fp8train.numerics.operand import Operand

__all__ = [
    "mx_dequantize",
    "nvfp4_dequantize",
    "unpack_e2m1",
    "inverse_random_hadamard_transform",
    "unswizzle_scales",
    "dequantize_tiles",
]

_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))


def _expand(per_block: torch.Tensor, shape: torch.Size, dim: int, block: int, two_d: bool) -> torch.Tensor:
    """A per-block tensor repeated to every element of a tensor of `shape` (partial blocks cut)."""
    if two_d:
        return per_block.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]
    moved = per_block.movedim(dim, -1).repeat_interleave(block, -1)[..., : shape[dim]]
    return moved.movedim(-1, dim)


def mx_dequantize(
    values: torch.Tensor, scales: torch.Tensor, dim: int, block: int = MX_BLOCK, two_d: bool = False
) -> torch.Tensor:
    """values * 2**(scale - 127) in float32: exact (an FP8 value times a power of two within float32's
    range, subnormals included), except that it overflows to +-inf beyond float32's range (the
    saturated infinities of a scale-254 block); NaN where the scale is 255."""
    return values.float() * _expand(e8m0_to_float(scales), values.shape, dim, block, two_d)


def nvfp4_dequantize(
    values: torch.Tensor,
    block_scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    dim: int,
    two_d: bool = False,
) -> torch.Tensor:
    """(values * block_scale) / S_enc in float32. The product of an E2M1 and an E4M3 value is exact
    (at most 2 + 4 significant bits, within float32's normal range), so the result is the correctly
    rounded value of the exact quotient; NaN where the block scale is NaN."""
    per_element = _expand(block_scales.float(), values.shape, dim, NVFP4_BLOCK, two_d)
    return (values.float() * per_element) / tensor_scale.float()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The float32 E2M1 values of `pack_e2m1`'s bytes (the last dimension doubles): element 2i from the
    low nibble, 2i+1 from the high one; a code is sign << 3 | index into E2M1_VALUES."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return _E2M1_TABLE.to(packed.device)[codes.long()]


def inverse_random_hadamard_transform(
    x: torch.Tensor, signs: tuple[int, ...] = RHT_SIGNS, dim: int = -1
) -> torch.Tensor:
    """The inverse of `random_hadamard_transform`: y = x @ M.T per block of len(signs) along `dim`
    (M = hadamard_matrix(signs) is orthogonal)."""
    matrix = hadamard_matrix(signs, x.device).t()
    n = matrix.shape[0]
    moved = x.float().movedim(dim, -1)
    out = float32_matmul(moved.unflatten(-1, (moved.shape[-1] // n, n)), matrix)
    return out.flatten(-2).movedim(-1, dim)


def unswizzle_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `swizzle_scales`: per-row block scales [rows, cols] from cuBLAS's blocked layout."""
    tr, tc = SWIZZLE_TILE
    row_tiles, col_tiles = -(-rows // tr), -(-cols // tc)
    tiles = blocked.reshape(row_tiles, col_tiles, 32, 4, tc).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * tr, col_tiles * tc)[:rows, :cols]


def dequantize_tiles(q: torch.Tensor, scale_inv: torch.Tensor, rows: int, tile: int = 128) -> torch.Tensor:
    """`quantize_tiles`'s values times their tile's scale_inv (rows x `tile` tiles), in float32."""
    return Operand(q, scale_inv, (rows, tile)).dequantize()
