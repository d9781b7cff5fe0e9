"""What delayed and current scaling share: one scale per tensor, operands for the per-tensor GEMM
(torch._scaled_mm on GPUs that have it, else the exact emulation in bf16 or fp32)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..numerics import kernels
from ..numerics.cast import cast_with_amax
from ..numerics.formats import fp8_dtype
from ..numerics.gemm import Operand
from ..runtime import Call
from .base import GradOperands, Quantization, WeightOperands

__all__ = ["TensorQuantization"]


class TensorQuantization(Quantization):
    """A recipe with one scale per tensor: each tensor's one operand serves both of its GEMMs."""

    kernel = "tensorwise"

    @staticmethod
    def cast(
        x: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        encoding: str,
        dtype: torch.dtype,
        amax_out: Optional[torch.Tensor] = None,
    ) -> Operand:
        """x's operand (`cast.cast_with_amax`, or its fused kernel where `kernels.use_fused_kernels`:
        the same bits; its amax into `amax_out` when given, in the same read)."""
        # (on the CPU with the default setting, the answer is known without asking: no call)
        if (x.is_cuda or kernels.ENV_FUSED_KERNELS in os.environ) and kernels.use_fused_kernels(x):
            if amax_out is not None:
                amax_out.zero_()  # the kernel maxes into it
            values, _ = kernels.cast_with_amax(x, scale, encoding, dtype, transposed=False, amax_out=amax_out)
        else:
            values, _ = cast_with_amax(x, scale, encoding, dtype, transposed=False, amax_out=amax_out)
        return Operand(values, scale_inv)

    def reuse_weight(self, cached: WeightOperands, call: Call) -> WeightOperands:
        # FP8 values convert exactly between the operand dtypes of the GEMM paths
        operand = cached.forward
        return WeightOperands.same(Operand(operand.values.to(call.operand_dtype), operand.scale_inv))

    def grad_operands(
        self,
        g2d: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        call: Call,
        amax_out: Optional[torch.Tensor] = None,
    ) -> GradOperands:
        """The gradient cast once for both backward GEMMs: FP8 in the gradient encoding's dtype for
        the hardware GEMM, else in the emulation's operand dtype (its amax into `amax_out` if given)."""
        encoding = self.grad_encoding
        dtype = fp8_dtype(encoding) if call.operand_dtype.itemsize == 1 else call.operand_dtype
        operand = self.cast(g2d, scale, scale_inv, encoding, dtype, amax_out)
        return GradOperands(operand, operand)
