"""fp8train.StoredFP8Linear: a linear layer whose weight is a stored block-FP8 operand (a published
FP8 checkpoint's `weight` and `weight_scale_inv`), frozen, with no high-precision copy.

Inside an FP8 region its forward multiplies the stored operand as it is (stored_block_weights.py: nothing is
requantized) with the input quantized by the region's recipe; backward gives the input gradient
through the same FP8 operand and no weight gradient. Outside a region it multiplies the dequantized
weight in the input's dtype (a temporary of one layer). docs/design.md, section 9.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics.gemm import Operand
from ..quantization.base import WeightOperands
from ..quantization.stored_block_weights import (
    DEFAULT_RECIPE,
    check_scale_values,
    check_stored_weight,
    dequantize_block_weight,
    quantize_block_weight,
    scales_to_float32,
    stored_operand,
)
from ..recipe import Float8BlockScaling
from ..torch_internals import ddp_ignore
from .base import FP8Module
from .fp8_linear import fp8_linear
from .linear import Linear

__all__ = ["StoredFP8Linear", "BlockFP8Linear", "StoredFP8Parameters", "exclude_stored_from_ddp"]


class StoredFP8Parameters:
    """Copies of a module holding stored FP8 parameters: pickle cannot rebuild a float8 tensor
    (torch's limitation), so its 1-byte float parameters travel as their bytes (a uint8 view) and
    are viewed back on arrival (pickle, deepcopy, torch.save of the module). Mixed in before
    torch.nn.Module (StoredFP8Linear, StoredFP8Experts)."""

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        parameters, as_bytes = dict(state["_parameters"]), {}
        for name, p in parameters.items():
            if p is not None and p.is_floating_point() and p.element_size() == 1:
                as_bytes[name] = (p.dtype, p.requires_grad)
                parameters[name] = p.detach().view(torch.uint8)
        state.update(_parameters=parameters, _fp8_parameters_as_bytes=as_bytes)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        parameters = dict(state["_parameters"])
        for name, (dtype, requires_grad) in state.pop("_fp8_parameters_as_bytes", {}).items():
            parameters[name] = torch.nn.Parameter(parameters[name].view(dtype), requires_grad=requires_grad)
        state["_parameters"] = parameters
        super().__setstate__(state)


class StoredFP8Linear(StoredFP8Parameters, FP8Module):
    """y = x @ W.T + bias with W = weight * weight_scale_inv (128x128 blocks), stored as loaded.

    `weight` (float8_e4m3fn [out, in]) and `weight_scale_inv` (one per block: float32, or E8M0 as
    float8_e8m0fnu or uint8 exponent bytes, converted to float32 here; every scale finite and
    positive, else a BlockFormatError naming the block) are frozen parameters, so state dicts,
    meta-device builds (`to_empty` then `load_state_dict`) and `requires_grad` work as for any
    layer; `bias` (high precision) is frozen too unless set trainable.
    `compute_dtype` is the high-precision dtype of the model around the layer (its output takes the
    input's dtype); PEFT gives adapters on the layer this dtype.
    `recipe` is the block recipe whose weight quantizer writes a new weight into the layer
    (`set_weight`: a merged adapter). `name`: what error messages call the weight (its name in the
    checkpoint).

    Raises:
        ValueError: `weight` is not float8_e4m3fn [out, in], or `weight_scale_inv` is not float32
            with one scale per 128x128 block of it (the message names `name`).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: torch.dtype = torch.float32,
        recipe: Float8BlockScaling = DEFAULT_RECIPE,
        name: str = "weight",
    ) -> None:
        super().__init__()
        check_stored_weight(name, weight, weight_scale_inv)
        weight_scale_inv = scales_to_float32(weight_scale_inv, f"{name}_scale_inv")
        check_scale_values(weight_scale_inv, f"{name}_scale_inv")
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(weight_scale_inv, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.compute_dtype = compute_dtype
        self.recipe = recipe

    @property
    def operand(self) -> Operand:
        """The stored weight as the GEMM operand (views of the parameters)."""
        return stored_operand(self.weight, self.weight_scale_inv)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies, in float32 (a new tensor)."""
        return dequantize_block_weight(self.weight, self.weight_scale_inv)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Store `weight` (high precision) quantized by the layer's recipe, in place of the stored one."""
        values, scale_inv = quantize_block_weight(weight, self.recipe)
        with torch.no_grad():
            self.weight.copy_(values)
            self.weight_scale_inv.copy_(scale_inv)
        self.forget_cached_weights()

    def to_linear(self, dtype: torch.dtype = torch.float32) -> BlockFP8Linear:
        """A `BlockFP8Linear` (an fp8train.Linear) whose master weight is the dequantized stored weight
        in `dtype`, trainable (full fine-tuning); the bias too. Its first block-scaled forward's
        operand: see docs/guide.md."""
        new = BlockFP8Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        new.weight = torch.nn.Parameter(self.dequantized().to(dtype))
        if self.bias is not None:
            new.bias = torch.nn.Parameter(self.bias.detach().to(dtype))
        new.train(self.training)
        return new

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """x @ W.T + bias for `x` (..., in_features): the stored FP8 weight used as it is inside an FP8
        region (no cast, nothing cached: `is_first_microbatch` is accepted for TransformerEngine's
        signature and changes nothing), the dequantized weight outside one. Returns (..., out_features)
        in `x`'s dtype."""
        stored = WeightOperands.same(self.operand)
        return fp8_linear(self, x, self.weight, self.bias, 0, stored_weight=stored)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias={self.bias is not None}, weight=float8_e4m3fn in 128x128 blocks"


class BlockFP8Linear(Linear):
    """An fp8train.Linear trained from a stored block-FP8 weight (`StoredFP8Linear.to_linear`): the
    same layer, whose type tells an export to write it back in the checkpoint's format. Its arguments
    are `fp8train.Linear`'s."""


def exclude_stored_from_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """Call on the module you wrap in DistributedDataParallel: its stored FP8 weights and scales
    (StoredFP8Linear, StoredFP8Experts) are left out of DDP's construction-time broadcast (gloo
    cannot send FP8 dtypes, and every rank loaded the same checkpoint) and, being frozen, were never
    reduced. Returns `model`."""
    names = [
        f"{name}.{param}" if name else param
        for name, module in model.named_modules()
        if isinstance(module, StoredFP8Parameters)
        for param, p in module.named_parameters(recurse=False)
        if (p.is_floating_point() and p.element_size() == 1) or param.endswith("scale_inv")
    ]
    ddp_ignore(model, names)
    return model
