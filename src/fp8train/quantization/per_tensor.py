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

__all__ = ["TensorQuantization", "trains", "operand_pair"]


def trains(call: Optional[Call]) -> bool:
    """Whether `call` is a training call (its plan names its region's serial; a recomputation's replay
    too), whose backward GEMMs take its forward tensors in the other layout. False for inference and
    traced calls (no plan), and without a call."""
    return call is not None and call.plan is not None and call.plan.serial != -1


def operand_pair(
    values: torch.Tensor, values_t: Optional[torch.Tensor], scale_inv: torch.Tensor
) -> tuple[Operand, Operand]:
    """(the operand of `values`, the operand of the GEMM that takes the tensor in the other layout):
    the same one, or the kernel's transposed copy `values_t` stored as the tensor's transpose."""
    operand = Operand(values, scale_inv)
    return operand, (operand if values_t is None else Operand(values_t, scale_inv, transposed=True))


class TensorQuantization(Quantization):
    """A recipe with one scale per tensor: each tensor's one operand serves both of its GEMMs."""

    kernel = "tensorwise"
    # whether FP8TRAIN_FUSED_KERNELS is set, read at this object's first eager cast in a region (one
    # object per fp8_autocast entry, or one for all of a prepared model's regions: `region_entered`
    # sets it back to None); None: not yet.
    # Where it is unset, CPU tensors take the torch path without a call (`kernels.use_fused_kernels`)
    fused_kernels_named: Optional[bool] = None

    def region_entered(self) -> None:
        self.fused_kernels_named = None

    def cast(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        encoding: str,
        dtype: torch.dtype,
        amax_out: Optional[torch.Tensor] = None,
    ) -> Operand:
        """x's operand (`cast.cast_with_amax`, or its fused kernel where `kernels.use_fused_kernels`:
        the same bits; its amax copied into `amax_out` when given, taken in the same read)."""
        if amax_out is None:
            return self.cast_operands(x, scale, scale_inv, encoding, dtype)[0]
        x_amax = torch.zeros((), dtype=torch.float32, device=x.device)
        operand = self.cast_operands(x, scale, scale_inv, encoding, dtype, x_amax)[0]
        amax_out.copy_(x_amax)
        return operand

    def cast_operands(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        encoding: str,
        dtype: torch.dtype,
        amax_out: Optional[torch.Tensor] = None,
        call: Optional[Call] = None,
        wgrad: bool = False,
    ) -> tuple[Operand, Operand]:
        """(x's operand, the operand of the GEMM that takes x in the other layout); max|x| MAXed into
        `amax_out` (a float32 0-dim tensor on x's device) where given, in the same read. Where the fused
        kernel casts x to FP8 (torch._scaled_mm's path) for a GEMM that takes x so, the second is its
        transposed copy, written in the same pass and stored as x.t() (`Operand.transposed`): for the
        forward casts of a training `call` (`trains`), w for dgrad (column-major) and x for wgrad
        (column-major); for a gradient whose wgrad runs (`wgrad`), g.t() (row-major). gemm.py then
        copies nothing. Else `cast_with_amax`'s operand twice (the torch path: gemm.py copies)."""
        named = self.fused_kernels_named
        if named is None:  # (the region's first eager cast; a traced one leaves it: dynamo would guard
            # on the value it wrote, and compile again at the next block)
            named = kernels.ENV_FUSED_KERNELS in os.environ
            if not torch.compiler.is_compiling():
                self.fused_kernels_named = named
        # (on the CPU with the default setting, the answer is known without asking: no call)
        if (x.is_cuda or named) and kernels.use_fused_kernels(x):
            transposed = dtype.itemsize == 1 and (wgrad or trains(call))
            values, values_t = kernels.cast_with_amax(
                x, scale, encoding, dtype, transposed=transposed, amax_out=amax_out
            )
            return operand_pair(values, values_t, scale_inv)
        values, _ = cast_with_amax(x, scale, encoding, dtype, transposed=False, amax_out=amax_out)
        operand = Operand(values, scale_inv)
        return operand, operand

    def reuse_weight(self, cached: WeightOperands, call: Call) -> WeightOperands:
        # FP8 values convert exactly between the operand dtypes of the GEMM paths; in the same dtype
        # the cached operands serve as they are (with the dgrad's transposed copy, where cast)
        operand = cached.forward
        if operand.values.dtype == call.operand_dtype:
            return cached
        return WeightOperands.same(Operand(operand.values.to(call.operand_dtype), operand.scale_inv))

    def grad_operands(
        self,
        g2d: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        call: Call,
        wgrad: bool = True,
    ) -> GradOperands:
        """The gradient cast once for both backward GEMMs: FP8 in the gradient encoding's dtype for
        the hardware GEMM, else in the emulation's operand dtype. Where the wgrad GEMM runs (`wgrad`),
        the fused kernel writes its transposed copy for it in the same pass (`cast_operands`)."""
        return self.grad_cast(g2d, scale, scale_inv, call, None, wgrad)

    def grad_cast(
        self,
        g2d: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        call: Call,
        amax_out: Optional[torch.Tensor],
        wgrad: bool,
    ) -> GradOperands:
        """`grad_operands`'s operands; the gradient's amax MAXed into `amax_out` by the cast where given
        (a float32 0-dim tensor: delayed scaling's recording slot)."""
        encoding = self.grad_encoding
        dtype = fp8_dtype(encoding) if call.operand_dtype.itemsize == 1 else call.operand_dtype
        operands = self.cast_operands(g2d, scale, scale_inv, encoding, dtype, amax_out, None, wgrad)
        return GradOperands(*operands)
