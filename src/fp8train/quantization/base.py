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
uses (or, on torch._scaled_mm's path with the fused kernels, the second one its cast's transposed
copy, stored transposed: the layout that GEMM takes); a block-scaled recipe quantizes each use along
its own GEMM's reduction dimension.
"""

from __future__ import annotations

import functools
import warnings
from typing import ClassVar, NamedTuple, Optional

import torch

from ..numerics.gemm import Operand, kernel_choice
from ..runtime import Call, RecipeRuntime
from ..torch_internals import constant_for_compile

__all__ = [
    "Quantization",
    "WeightOperands",
    "InputOperands",
    "GradOperands",
    "check_whole_blocks",
    "AMAX_IN_CAST",
]

# `weight_amax` of an eager FP8 call whose weight `quantize_weight` casts: the cast takes its amax
AMAX_IN_CAST = object()


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


class Quantization(RecipeRuntime):
    """How one recipe quantizes a linear layer's operands, and the record of every fact the library
    knows of its kind. Subclasses: one per recipe family, each in its own file, registered with its
    recipe's dataclass (`quantization.register_recipe`, which checks that the record is complete); every
    table of recipe kinds (GEMM kernel, coverage blocks, `fp8train info`) is read from the registry.

    Class attributes say how the recipe meets the rest of the library:
    - `kind`: its name in checkpoints (a module trains under one kind) and in the weight cache; one
      registered recipe per kind;
    - `kernel`: the torch._scaled_mm kernel its GEMMs take where the device runs it
      (torch_internals.SCALED_MM_KERNELS: "tensorwise" for one scale per tensor, "block", "mxfp8",
      "nvfp4"), else its emulation (`gemm.kernel_choice`, `fp8train info`);
    - `block`: the block its scales cover along a GEMM's reduction dimension, to which operands off it
      are padded (`coverage` says "padded"); None when its scales cover whole tensors;
    - `reduces_amax`: its scales come from amax histories shared by an amax group (delayed scaling,
      whose state answers the runtime's hooks: `amax.DelayedRuntime`; a stateless recipe keeps the
      hooks' defaults, `runtime.RecipeRuntime`);
    - `casts_before_gather`: a tensor's scale is known before the tensor is whole, so sequence-parallel
      inputs and FSDP2 weights are cast on each rank and gathered as FP8 bytes; otherwise they are
      gathered in high precision and quantized whole;
    - `whole_blocks`: the block every GEMM dimension must fill (`check_whole_blocks`; convert_to_fp8
      keeps layers whose features are off it in high precision).
    - `e2m1_values`: its operands hold E2M1 values (in float8_e4m3fn), which backward may keep packed
      two to a byte (saved.py); `e8m0_scales`: its block scales are E8M0 values (MX), which backward
      may keep as their bytes.
    """

    kind: ClassVar[str]
    kernel: ClassVar[str]
    block: ClassVar[Optional[int]] = None
    reduces_amax: ClassVar[bool] = False
    casts_before_gather: ClassVar[bool] = False
    whole_blocks: ClassVar[int] = 1  # tokens, in and out features must be multiples of it (MX, NVFP4)
    e2m1_values: ClassVar[bool] = False
    e8m0_scales: ClassVar[bool] = False

    def __init__(self, recipe) -> None:
        self.recipe = recipe

    @property
    def grad_encoding(self) -> str:
        return self.recipe.fp8_format.bwd

    def call_scales(self, call: Call, x: torch.Tensor, weight_amax):
        """(scales, token) of a GEMM call: recorded amaxes (when `call.record`) and frozen scales for
        delayed scaling; (None, None) for recipes that scale each tensor from itself. `weight_amax()`
        gives the weight's amax, or is None when the weight is not cast (a cached FP8 weight), or is
        AMAX_IN_CAST (eager FP8 calls) when `quantize_weight` casts it and may take its amax there."""
        return None, None

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        raise NotImplementedError

    def reuse_weight(self, cached: WeightOperands, call: Call) -> WeightOperands:
        """A weight already quantized, for this call: for an earlier microbatch (is_first_microbatch=False),
        or on its shards before FSDP2's gather (delayed scaling: FP8 values with this call's scale)."""
        return cached

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        raise NotImplementedError

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        """The output gradient's operands for dgrad and wgrad (`needs`: which of them are needed)."""
        raise NotImplementedError


# The device type on which the block-scaled recipes say that their GEMM is emulated: where a user may
# expect tensor-core speed (the tests set "cpu" to take this branch).
EMULATION_NOTED_ON = "cuda"


def check_whole_blocks(tensor: torch.Tensor, names: tuple[str, str], block: int, recipe_name: str) -> None:
    """Refuse a GEMM operand whose dimensions are not whole blocks: MXFP8 (32) and NVFP4 (16) quantize
    along each GEMM's reduction dimension, and tokens, in_features and out_features are each one of
    them. TransformerEngine refuses such shapes and cuBLAS's block-scaled GEMMs cannot take them, so
    fp8train does not pad them silently either."""
    off = [f"{name} = {size}" for name, size in zip(names, tensor.shape) if size % block]
    if off:
        raise ValueError(
            f"fp8train.{recipe_name} quantizes in blocks of {block} along each GEMM's reduction dimension, "
            f"so tokens, in_features and out_features must be multiples of {block}; got {', '.join(off)}. "
            f"Pad the batch (tokens) to a multiple of {block}, or keep this layer in high precision "
            "(convert_to_fp8 and prepare skip layers whose dimensions are not whole blocks of their recipe)"
        )


def warn_emulated_on_cuda(x: torch.Tensor, recipe_name: str, kernel: str) -> None:
    """Block-scaled recipes run an emulated GEMM where the GPU has no native kernel for them (the
    `kernel`'s capability or its probe, `gemm.kernel_choice`): say so on CUDA, once per recipe."""
    if x.device.type == EMULATION_NOTED_ON:
        _note_emulated(recipe_name, kernel, x.device)


@constant_for_compile
def _note_emulated(recipe_name: str, kernel: str, device: torch.device) -> bool:
    """Eager code calls it; torch.compile runs it while tracing and leaves it out of the graph (the
    mark), where `warnings.warn` cannot be traced (a graph break per layer, an error with
    fullgraph=True). Its result, always True, is the constant the graph would see."""
    if not kernel_choice(kernel, device)[0]:
        _warn_emulated(recipe_name)
    return True


@functools.cache  # once per process: a compilation resets Python's record of warnings already shown
def _warn_emulated(recipe_name: str) -> None:
    warnings.warn(
        f"fp8train.{recipe_name} on this GPU runs an emulated GEMM (block-dequantized operands, fp32 "
        "matmul): the numerics of the recipe without its speed, because torch._scaled_mm's kernel for it "
        "does not run here (`fp8train info` says why). Use DelayedScaling or Float8CurrentScaling for "
        "FP8 tensor-core GEMMs on this GPU.",
        stacklevel=1,  # here: no caller's line would mean more (torch.compile calls it from its tracer)
    )
