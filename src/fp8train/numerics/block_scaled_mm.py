"""The block-scaled `torch._scaled_mm` call (not block scaling's quantization: quantization/block_scaling.py;
not checkpoints' block-FP8 weights: quantization/stored_block_weights.py).

Block-scaled GEMMs on the hardware: the operands of block scaling, MXFP8 and NVFP4 in the layouts
`torch._scaled_mm`'s block-scaled kernels take (docs/design.md, sections 9 and 13).

A block-scaled `gemm.Operand` holds FP8 (or E2M1-valued) values with one scale per block of its
stored tensor. Every kernel wants both operands with their blocks along the reduction dimension K:
the first operand [M, K] row-major, the second [K, N] column-major (i.e. [N, K] row-major,
transposed), and the scales per row of those [rows, K] matrices:

- "block" (DeepSeek's 1x128 / 128x128, SM90 with cuBLASLt >= 12.9): fp32 scales, a 1x128 operand's
  [rows, K/128] stored outer-dim-major (strides (1, rows)) as the first operand and [K/128, N]
  row-major as the second; a 128x128 operand's [rows/128, K/128] row-major as the first and its
  transpose (column-major) as the second. Both operands 128x128 is not a kernel (never needed).
- "mxfp8" (SM100+): E8M0 scales per 32 values, per row, in cuBLAS's blocked layout
  (`microscaling.swizzle_scales`); a weight's 32x32 scales are repeated to its rows first.
- "nvfp4" (SM100+): E2M1 values packed two per byte (`float4_e2m1fn_x2`), E4M3 scales per 16 values
  in the blocked layout; the two per-tensor scales divide the fp32 output (the emulation divides
  each element).

Layouts and the call; which GEMM runs where is gemm.py's choice (`gemm.kernel_choice`, `fits`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..torch_internals import scaled_mm
from .microscaling import MX_BLOCK, NVFP4_BLOCK, pack_e2m1, swizzle_scales
from .operand import Operand

__all__ = [
    "BLOCK_FORMATS",
    "block_format",
    "fits",
    "KOperand",
    "k_major",
    "block_scaled_mm",
    "e8m0_bytes",
    "mx_blocked_scales",
    "kernel_adds_bias",
]

TILE = 128
# the size of a format's blocks along K, by the format's name
BLOCK_FORMATS = {"block": TILE, "mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK}


class KOperand(NamedTuple):
    """An operand as the kernels see it: values [rows, K], scales per `rows_per_scale` rows (1, or the
    side of a 2-D weight block) and per `block_k` values along K, and NVFP4's per-tensor scale."""

    values: torch.Tensor
    scales: torch.Tensor
    rows_per_scale: int
    block_k: int
    tensor_scale: Optional[torch.Tensor]


def k_major(op: Operand, first: bool) -> KOperand:
    """`op` (the first operand [M, K] or the second [K, N] of a GEMM) as values [rows, K] with its
    blocks along K: a view of what is stored (transposed where needed), nothing copied."""
    values, scales, block = op.values, op.scale_inv, op.block
    if op.transposed == first:  # stored [K, rows]
        values, scales, block = values.t(), scales.t(), block[::-1]
    return KOperand(values, scales, block[0], block[1], op.tensor_scale)


def block_format(a: Operand, b: Operand) -> Optional[str]:
    """The block-scaled kernel format of a @ b ("block", "mxfp8", "nvfp4"), or None where the
    operands' blocks name no kernel (the emulation takes those)."""
    if a.block is None or b.block is None:
        return None
    ka, kb = k_major(a, True), k_major(b, False)
    nvfp4 = ka.tensor_scale is not None and kb.tensor_scale is not None
    for name, size in BLOCK_FORMATS.items():
        if ka.block_k == kb.block_k == size and (name == "nvfp4") == nvfp4:
            shapes_ok = {ka.rows_per_scale, kb.rows_per_scale} <= {1, size}
            both_2d = ka.rows_per_scale == kb.rows_per_scale == size
            return name if shapes_ok and not (name == "block" and both_2d) else None
    return None


def fits(fmt: str, a: Operand, b: Operand, m: int, k: int, n: int) -> bool:
    """Whether the kernel of `fmt` takes this shape (torch: K and N multiples of 16, the packed FP4 K
    too). Block scaling asks for whole tiles (M, K, N multiples of 128), at least two along K (with
    one, torch reads [rows, 1] scales as row-wise scaling, another kernel) and, for a 128x128
    operand, K/128 a multiple of 4 (cuBLASLt's 16-byte aligned scale rows; then no layout pads them)."""
    if min(m, k, n) <= 0:
        return False
    if fmt == "block":
        two_d = TILE in (k_major(a, True).rows_per_scale, k_major(b, False).rows_per_scale)
        whole = all(d % TILE == 0 for d in (m, k, n)) and k >= 2 * TILE
        return whole and not (two_d and (k // TILE) % 4)
    if fmt == "mxfp8":
        return k % MX_BLOCK == 0 and m % 16 == 0 and n % 16 == 0
    return k % (2 * NVFP4_BLOCK) == 0 and m % 16 == 0 and n % 16 == 0


def e8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) of float32 powers of two (`microscaling.e8m0_to_float`'s values, NaN 255):
    the exponent field itself, exactly (2**-127, a float32 subnormal, has field 0, i.e. byte 0)."""
    return ((scales.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _per_row(op: KOperand) -> torch.Tensor:
    """The scales of a [rows, K] operand, one row per row of values (2-D blocks repeated)."""
    if op.rows_per_scale == 1:
        return op.scales
    return op.scales.repeat_interleave(op.rows_per_scale, 0)[: op.values.shape[0]]


def mx_blocked_scales(op: KOperand) -> torch.Tensor:
    """An MXFP8 operand's E8M0 scales (float8_e8m0fnu, flat) in cuBLAS's blocked layout, one row per row
    of its [rows, K] values: what torch._scaled_mm takes, and torch._scaled_grouped_mm per group."""
    return swizzle_scales(e8m0_bytes(_per_row(op))).view(torch.float8_e8m0fnu)


def kernel_adds_bias(out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> bool:
    """Whether the kernel adds the bias itself (its epilogue adds a bf16/fp16 bias of the output's dtype,
    in fp32 before the one rounding to the output: what `bias` added to an fp32 product gives)."""
    return bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype


def block_scaled_mm(
    fmt: str, a: Operand, b: Operand, out_dtype: torch.dtype, bias: Optional[torch.Tensor], fast_accum: bool
) -> torch.Tensor:
    """a @ b (+ bias) through torch._scaled_mm's `fmt` kernel (`block_format`, `fits` checked)."""
    ka, kb = k_major(a, True), k_major(b, False)
    if fmt == "block":
        mat1 = ka.values.to(torch.float8_e4m3fn).contiguous()  # FP8 values: exact
        mat2 = kb.values.to(torch.float8_e4m3fn).contiguous().t()
        scale_a = (
            ka.scales.float().contiguous()
            if ka.rows_per_scale == TILE
            else ka.scales.float().t().contiguous().t()
        )
        scale_b = (
            kb.scales.float().contiguous().t()
            if kb.rows_per_scale == TILE
            else kb.scales.float().t().contiguous()
        )
    elif fmt == "mxfp8":
        mat1, mat2 = ka.values.contiguous(), kb.values.contiguous().t()
        scale_a, scale_b = mx_blocked_scales(ka), mx_blocked_scales(kb)
    else:  # nvfp4: E2M1 values packed along K; no fast accumulation with FP4 (torch refuses it)
        mat1 = pack_e2m1(ka.values.float().contiguous()).view(torch.float4_e2m1fn_x2)
        mat2 = pack_e2m1(kb.values.float().contiguous()).view(torch.float4_e2m1fn_x2).t()
        scale_a = swizzle_scales(_per_row(ka).to(torch.float8_e4m3fn))  # E4M3 values: exact
        scale_b = swizzle_scales(_per_row(kb).to(torch.float8_e4m3fn))
        y = scaled_mm(mat1, mat2, scale_a, scale_b, torch.float32)
        y = y / ka.tensor_scale.float() / kb.tensor_scale.float()
        return (y if bias is None else y + bias.float()).to(out_dtype)
    if bias is None or kernel_adds_bias(out_dtype, bias):
        return scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype, bias, fast_accum)
    y = scaled_mm(mat1, mat2, scale_a, scale_b, torch.float32, None, fast_accum)  # one rounding, below
    return (y + bias.float()).to(out_dtype)
