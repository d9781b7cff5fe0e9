"""What a recipe is to a linear layer: how it quantizes the operands of the layer's three GEMMs.

One `Quantization` object per recipe (TransformerEngine keeps one state object per recipe, in the
same spirit). The linear autograd function (modules/fp8_linear.py) asks it for operands and
multiplies them (`gemm.matmul`); it has no branch on the recipe. docs/design.md, section 9.

The three GEMMs of y = x @ w.T, with x as (tokens x in), w as (out x in), g = dL/dy (tokens x out):

- forward:  y = x @ w.T       (reduction over in):     `InputOperands.forward`, `WeightOperands.forward`
- dgrad:    dx = g @ w        (reduction over out):    `GradOperands.dgrad`, `WeightOperands.dgrad`
- wgrad:    dw = g.T @ x      (reduction over tokens): `GradOperands.wgrad`, `InputOperands.wgrad`

Every operand is given in the orientation of its tensor (x, w or g); `Operand.t()` makes the views
the GEMMs need. A recipe whose scales cover whole tensors returns one operand for both of a tensor's
uses; a block-scaled recipe quantizes each use along its own GEMM's reduction dimension.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

import torch

from ..gemm import Operand

__all__ = ["Quantization", "GemmCall", "WeightOperands", "InputOperands", "GradOperands"]


class WeightOperands(NamedTuple):
    forward: Operand
    dgrad: Operand

    @staticmethod
    def same(operand: Operand) -> WeightOperands:
        return WeightOperands(operand, operand)


class InputOperands(NamedTuple):
    forward: Operand
    wgrad: Operand


class GradOperands(NamedTuple):
    dgrad: Optional[Operand]  # None: the input gradient is not needed
    wgrad: Optional[Operand]  # None: the weight gradient is not needed


@dataclass(frozen=True)
class GemmCall:
    """One FP8 GEMM call of a module: what its quantization needs besides the tensors."""

    quantization: Quantization
    module_handle: int  # names the module to the protocol's ops (ops.py)
    gemm_index: int
    operand_dtype: torch.dtype  # per-tensor operands: an FP8 dtype (hardware GEMM), or bf16/fp32
    scales: Optional[torch.Tensor] = None  # delayed scaling: [[x, w], [x_inv, w_inv]] of this GEMM
    token: Optional[torch.Tensor] = None  # delayed scaling: names the call's region to its backward

    def without_tensors(self) -> GemmCall:
        """What backward keeps on its context (the tensors travel through save_for_backward). Built
        field by field: dataclasses.replace is not traceable by dynamo in every torch."""
        return GemmCall(self.quantization, self.module_handle, self.gemm_index, self.operand_dtype)

    def with_token(self, token: Optional[torch.Tensor]) -> GemmCall:
        return GemmCall(
            self.quantization, self.module_handle, self.gemm_index, self.operand_dtype, None, token
        )


class Quantization:
    """How one recipe quantizes a linear layer's operands. Subclasses: one per recipe family, each in
    its own file, registered in recipe.py.

    Class attributes say how the recipe meets the rest of the library:
    - `kind`: its name in checkpoints (a module trains under one kind) and in the weight cache;
    - `reduces_amax`: its scales come from amax histories shared by an amax group (delayed scaling):
      calls have plans with frozen scales, amaxes are recorded and reduced (regions.py, plans.py);
    - `casts_before_gather`: a tensor's scale is known before the tensor is whole, so sequence-parallel
      inputs and FSDP2 weights are cast on each rank and gathered as FP8 bytes; otherwise they are
      gathered in high precision and quantized whole;
    - `e2m1_values`: its operands hold E2M1 values (in float8_e4m3fn), which backward may keep packed
      two to a byte (saved.py); `e8m0_scales`: its block scales are E8M0 values (MX), which backward
      may keep as their bytes.
    """

    kind: ClassVar[str]
    reduces_amax: ClassVar[bool] = False
    casts_before_gather: ClassVar[bool] = False
    e2m1_values: ClassVar[bool] = False
    e8m0_scales: ClassVar[bool] = False

    def __init__(self, recipe) -> None:
        self.recipe = recipe

    @property
    def grad_encoding(self) -> str:
        return self.recipe.fp8_format.bwd

    def call_scales(self, module, gemm_index: int, x: torch.Tensor, weight_amax, record: bool):
        """(scales, token) of a GEMM call: recorded amaxes and frozen scales for delayed scaling;
        (None, None) for recipes that scale each tensor from itself. `weight_amax()` gives the
        weight's amax, or is None when the weight is not cast (a cached FP8 weight)."""
        return None, None

    def quantize_weight(self, weight: torch.Tensor, call: GemmCall) -> WeightOperands:
        raise NotImplementedError

    def reuse_weight(self, cached: WeightOperands, call: GemmCall) -> WeightOperands:
        """A weight quantized for an earlier microbatch (is_first_microbatch=False), for this call."""
        return cached

    def quantize_input(self, x2d: torch.Tensor, call: GemmCall) -> InputOperands:
        raise NotImplementedError

    def quantize_grad(self, g2d: torch.Tensor, call: GemmCall, needs: tuple[bool, bool]) -> GradOperands:
        """The output gradient's operands for dgrad and wgrad (`needs`: which of them are needed)."""
        raise NotImplementedError


def warn_emulated_on_cuda(x: torch.Tensor, recipe_name: str) -> None:
    """Block-scaled recipes run an emulated GEMM on every device: say so once on CUDA, where a user
    may expect tensor-core speed (Python's default warning filter shows it once per place)."""
    if x.is_cuda:
        warnings.warn(
            f"fp8train.{recipe_name} on CUDA runs an emulated GEMM (block-dequantized operands, fp32 "
            "matmul): the numerics of the recipe without its speed. Use DelayedScaling or "
            "Float8CurrentScaling for FP8 tensor-core GEMMs (torch._scaled_mm).",
            stacklevel=5,
        )
