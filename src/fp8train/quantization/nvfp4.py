"""NVFP4 (`NVFP4BlockScaling`, TransformerEngine's recipe): E2M1 values in blocks of 16 along each
GEMM's reduction dimension with an E4M3 scale per block and one FP32 scale per tensor
(microscaling.py; docs/design.md, sections 9 and 13).

As TransformerEngine's recipe: weights in 16x16 blocks (one copy serves w and w.T), a 16-point random
Hadamard transform with one fixed sign vector on both operands of the weight-gradient GEMM (which
spreads outliers over a block; the product is unchanged because the transform is orthogonal), and
stochastic rounding of gradients only. Each quantized tensor takes its per-tensor scale from its own
amax, where it is whole: sequence-parallel inputs and FSDP2 weights are gathered in high precision
first, so no amax needs reducing. Tokens, in_features and out_features must be multiples of 16
(`check_whole_blocks`). The GEMM is torch's NVFP4 `_scaled_mm` on SM100+ (block_scaled_mm.py: values
packed two per byte, the product divided by both S_enc), else emulated: (E2M1 x E4M3) / S_enc per
element, exact products, then an fp32 matmul; values are kept as float8_e4m3fn (every E2M1 value is
one).

Where `kernels.use_fused_kernels` says so (CUDA with Triton) the fused kernels quantize, bit for bit as
microscaling.py (the Hadamard transform's sums included: both add them in the same butterfly order):
`nvfp4_quantize_both_rotated` (or `nvfp4_quantize_both` without the RHT) makes an input's or a
gradient's two copies from one amax read and one quantizing read, `nvfp4_quantize` the 16x16 weight
blocks, `nvfp4_quantize_rotated` a rotated copy alone.
"""

from __future__ import annotations

import torch

from ..numerics import kernels
from ..numerics.gemm import Operand
from ..numerics.microscaling import NVFP4_BLOCK, RHT_SIGNS, nvfp4_quantize, random_hadamard_transform
from ..runtime import Call
from .base import (
    GradOperands,
    InputOperands,
    Quantization,
    WeightOperands,
    check_whole_blocks,
    warn_emulated_on_cuda,
)

__all__ = ["NVFP4Quantization"]


def _operand(values, block_scales, tensor_scale, dim: int, two_d: bool = False, rotated: bool = False):
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if two_d else ((1, NVFP4_BLOCK) if dim == 1 else (NVFP4_BLOCK, 1))
    fp8_values = values.to(torch.float8_e4m3fn)  # exact: every E2M1 value is an E4M3 value
    return Operand(fp8_values, block_scales.float(), block, tensor_scale=tensor_scale, rotated=rotated)


def _nvfp4(x: torch.Tensor, dim: int, two_d: bool = False, stochastic: bool = False, rotate: bool = False):
    """`x` in NVFP4 blocks along `dim` (0: 16x1, 1: 1x16) or 16x16 squares, as an operand of x's shape;
    `rotate`: the random Hadamard transform along `dim` first (only where that dimension is a whole
    number of 16-blocks, as TransformerEngine requires; otherwise the operand is not rotated)."""
    rotate = rotate and x.shape[dim] % NVFP4_BLOCK == 0
    if kernels.use_fused_kernels(x):
        fused, fp8 = kernels.microscaling(), torch.float8_e4m3fn
        if rotate:
            quantized = fused.nvfp4_quantize_rotated(
                x, dim, RHT_SIGNS, stochastic=stochastic, values_dtype=fp8
            )
        else:
            quantized = fused.nvfp4_quantize(x, dim, two_d=two_d, stochastic=stochastic, values_dtype=fp8)
        return _operand(*quantized, dim, two_d, rotate)
    if rotate:
        x = random_hadamard_transform(x.float(), RHT_SIGNS, dim)
    return _operand(*nvfp4_quantize(x, dim, two_d=two_d, stochastic=stochastic), dim, two_d, rotate)


def _nvfp4_both(x2d: torch.Tensor, stochastic: bool = False, rotate: bool = False):
    """(`_nvfp4(x2d, 1, ...)`, `_nvfp4(x2d, 0, ..., rotate=rotate)`) in that order (stochastic draws
    included): with the kernels, from one amax read and one quantizing read of x2d."""
    rotate = rotate and x2d.shape[0] % NVFP4_BLOCK == 0
    if not kernels.use_fused_kernels(x2d):
        return _nvfp4(x2d, 1, stochastic=stochastic), _nvfp4(x2d, 0, stochastic=stochastic, rotate=rotate)
    fused, fp8 = kernels.microscaling(), torch.float8_e4m3fn
    if rotate:
        rows, columns = fused.nvfp4_quantize_both_rotated(
            x2d, RHT_SIGNS, stochastic=stochastic, values_dtype=fp8
        )
    else:
        rows, columns = fused.nvfp4_quantize_both(x2d, stochastic=stochastic, values_dtype=fp8)
    return _operand(*rows, 1), _operand(*columns, 0, rotated=rotate)


class NVFP4Quantization(Quantization):
    kind = "nvfp4"
    kernel = "nvfp4"
    block = NVFP4_BLOCK
    whole_blocks = NVFP4_BLOCK
    e2m1_values = True

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        check_whole_blocks(weight, ("out_features", "in_features"), self.whole_blocks, "NVFP4BlockScaling")
        if not self.recipe.disable_2d_quantization:
            return WeightOperands.same(_nvfp4(weight, 0, two_d=True))
        return WeightOperands(*_nvfp4_both(weight))  # along in; along out

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        warn_emulated_on_cuda(x2d, "NVFP4BlockScaling", self.kernel)
        check_whole_blocks(x2d, ("tokens", "in_features"), self.whole_blocks, "NVFP4BlockScaling")
        rotate = not self.recipe.disable_rht
        return InputOperands(*_nvfp4_both(x2d, rotate=rotate))  # along in; along the tokens

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        stochastic, rotate = not self.recipe.disable_stochastic_rounding, not self.recipe.disable_rht
        if all(needs):
            return GradOperands(*_nvfp4_both(g2d, stochastic, rotate))  # along out; along the tokens
        dgrad = _nvfp4(g2d, 1, stochastic=stochastic) if needs[0] else None
        wgrad = _nvfp4(g2d, 0, stochastic=stochastic, rotate=rotate) if needs[1] else None
        return GradOperands(dgrad, wgrad)
