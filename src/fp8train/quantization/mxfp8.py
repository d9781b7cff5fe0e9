"""MXFP8 (`MXFP8BlockScaling`, the OCP MX format; TransformerEngine's recipe): blocks of 32 consecutive
values along each GEMM's reduction dimension, E4M3 values (E5M2 gradients with HYBRID), one E8M0
(power-of-two) scale per block rounded up from the block's amax (microscaling.py; docs/design.md,
sections 9 and 13).

Every use of a tensor is quantized from the high-precision tensor along its own GEMM's reduction
dimension: a row-wise (1x32) copy for one GEMM and a column-wise (32x1) copy for the other, or one
32x32-block copy of a weight for both with `enable_2d_quantization`. Tokens, in_features and
out_features must be multiples of 32 (`check_whole_blocks`). The GEMM is torch's MX `_scaled_mm` on
SM100+ (block_scaled_mm.py), else emulated: operands dequantized block by block (exact: powers of two)
and multiplied in fp32.

Where `kernels.use_fused_kernels` says so (CUDA with Triton) the fused kernels quantize, bit for bit as
microscaling.py: `mx_quantize_both` makes a tensor's two copies in one read, `mx_quantize` one copy
or the 32x32 weight blocks.
"""

from __future__ import annotations

import torch

from ..numerics import kernels
from ..numerics.gemm import Operand
from ..numerics.microscaling import MX_BLOCK, e8m0_to_float, mx_quantize
from ..runtime import Call
from .base import (
    GradOperands,
    InputOperands,
    Quantization,
    WeightOperands,
    check_whole_blocks,
    warn_emulated_on_cuda,
)

__all__ = ["MXFP8Quantization"]


def _operand(values: torch.Tensor, scales: torch.Tensor, dim: int, two_d: bool = False) -> Operand:
    block = (MX_BLOCK, MX_BLOCK) if two_d else ((1, MX_BLOCK) if dim == 1 else (MX_BLOCK, 1))
    return Operand(values, e8m0_to_float(scales), block)


def _mx(x: torch.Tensor, dim: int, encoding: str, two_d: bool = False) -> Operand:
    """`x` in MX blocks along `dim` (0: 32x1, 1: 1x32) or 32x32 squares, as an operand of x's shape."""
    quantize = kernels.microscaling().mx_quantize if kernels.use_fused_kernels(x) else mx_quantize
    return _operand(*quantize(x, dim, MX_BLOCK, encoding, two_d), dim, two_d)


def _mx_both(x2d: torch.Tensor, encoding: str) -> tuple[Operand, Operand]:
    """`x2d` in 1x32 blocks (along dim 1) and in 32x1 blocks (along dim 0): one read with the kernels."""
    if kernels.use_fused_kernels(x2d):
        rows, columns = kernels.microscaling().mx_quantize_both(x2d, encoding, MX_BLOCK)
        return _operand(*rows, 1), _operand(*columns, 0)
    return _mx(x2d, 1, encoding), _mx(x2d, 0, encoding)


class MXFP8Quantization(Quantization):
    kind = "mxfp8"
    kernel = "mxfp8"
    block = MX_BLOCK
    whole_blocks = MX_BLOCK
    e8m0_scales = True

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        check_whole_blocks(weight, ("out_features", "in_features"), self.whole_blocks, "MXFP8BlockScaling")
        if self.recipe.enable_2d_quantization:
            return WeightOperands.same(_mx(weight, 0, "e4m3", two_d=True))
        return WeightOperands(*_mx_both(weight, "e4m3"))  # along in; along out

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        warn_emulated_on_cuda(x2d, "MXFP8BlockScaling", self.kernel)
        check_whole_blocks(x2d, ("tokens", "in_features"), self.whole_blocks, "MXFP8BlockScaling")
        return InputOperands(*_mx_both(x2d, "e4m3"))  # along in; along the tokens

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        encoding = self.grad_encoding
        if all(needs):
            return GradOperands(*_mx_both(g2d, encoding))  # along out; along the tokens
        dgrad = _mx(g2d, 1, encoding) if needs[0] else None  # along out
        wgrad = _mx(g2d, 0, encoding) if needs[1] else None  # along the tokens
        return GradOperands(dgrad, wgrad)
