"""Swap a model's linear layers for FP8 ones in place, keeping its parameters.

`convert_to_fp8` replaces every `torch.nn.Linear` (and Hugging Face `transformers`' `Conv1D`, the
GPT-2 family's linear layer, whose weight is stored transposed as in x out, and its fused MoE experts,
`modules/grouped_experts.py`) by an FP8 module that
holds the very same Parameter objects. So an optimizer built before the conversion still updates
the model, tied weights stay tied, parameter names and shapes do not change (a checkpoint of the
unconverted model loads with `strict=False`: only the FP8 `_extra_state` entries are new), and
outside an FP8 region the converted model computes exactly what the original did.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .debug_switches import apply_environment
from .fsdp import wrap_for_fsdp
from .layer_coverage import (
    KEPT_BY_FILTER,
    fp8_compatible,
    is_hf_conv1d,
    log_coverage,
    log_summary,
    shape_fits,
)
from .modules.base import FP8Module
from .modules.fp8_linear import fp8_linear
from .modules.grouped_experts import FusedExperts, is_hf_fused_experts
from .modules.linear import Linear
from .quantization import quantization_of
from .quantization.base import Quantization
from .recipe import Recipe
from .torch_internals import children_by_name

__all__ = ["convert_to_fp8", "convert_checked", "Conv1D", "fp8_compatible"]

FilterFn = Callable[[torch.nn.Module, str], bool]


class Conv1D(FP8Module):
    """FP8 version of `transformers`' Conv1D: y = x @ weight + bias with weight stored (in, out)."""

    def __init__(self, weight: torch.nn.Parameter, bias: Optional[torch.nn.Parameter]) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape
        self.nf = self.out_features  # the attribute name transformers' code reads
        self.weight = weight
        self.bias = bias

    def reset_parameters(self) -> None:
        """transformers' Conv1D initialisation: weight ~ N(0, 0.02), bias 0."""
        torch.nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)
        self.forget_cached_weights()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        # weight.t() is a view: gradients flow back into the same (in, out) Parameter.
        return fp8_linear(self, x, self.weight.t(), self.bias, 0, is_first_microbatch)

    def extra_repr(self) -> str:
        return f"nf={self.out_features}, nx={self.in_features}"


def _swap(module: torch.nn.Module, fsdp_fp8_all_gather: bool, whole_blocks: int) -> Optional[FP8Module]:
    """The FP8 replacement of `module`, or None if it is not a layer this function converts."""
    if type(module) is torch.nn.Linear:
        if not shape_fits(module.in_features, module.out_features, whole_blocks):
            return None
        new = Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
    elif is_hf_conv1d(module):
        if not shape_fits(*module.weight.shape, whole_blocks):
            return None
        new = Conv1D(module.weight, module.bias)
    elif is_hf_fused_experts(module):  # transformers' fused MoE experts (3-D weights): one GEMM per expert
        if not shape_fits(*module.down_proj.shape[1:], whole_blocks):
            return None
        new = FusedExperts(module)
        if fsdp_fp8_all_gather:  # each expert gathered in FP8 with its GEMM's scale (fsdp.py)
            wrap_for_fsdp(new.gate_up_proj, 0)
            wrap_for_fsdp(new.down_proj, new.num_experts)
        new.train(module.training)
        return new
    else:
        return None
    if fsdp_fp8_all_gather:
        wrap_for_fsdp(new.weight, 0)
    new.train(module.training)
    return new


def convert_to_fp8(
    model: torch.nn.Module,
    module_filter_fn: Optional[FilterFn] = None,
    recipe: Optional[Recipe] = None,
    fsdp_fp8_all_gather: bool = False,
    log: bool = True,
) -> torch.nn.Module:
    """Replace the `torch.nn.Linear` (and transformers' `Conv1D`) layers of `model` by FP8 modules, in place.

    Args:
        model: the model (any `torch.nn.Module`; a bare `torch.nn.Linear` too).
        module_filter_fn: `module_filter_fn(module, fqn) -> bool`, called once for every linear layer
            (`fqn`: its fully qualified name in `model`, "" for `model` itself); False keeps the layer
            in high precision at your request (the output head, say: `first_and_last_linear_filter`).
            torchao's name for the same argument of `convert_to_float8_training`.
        recipe: the recipe the model trains with (default: none checked). It is only checked here and
            decides which shapes convert (whole blocks of MXFP8's 32); FP8 state is created under the
            recipe of the first training `fp8_autocast` region, so pass that same recipe there.
        fsdp_fp8_all_gather: FSDP2 (`fully_shard`) gathers the converted weights in FP8 (docs/guide.md,
            "FSDP2 with FP8 all-gather"); the Parameter objects stay the same.
        log: log `fp8train.coverage(model).summary()` (logger "fp8train", level INFO) and warn once
            (a UserWarning naming the layers and why) about linear layers left in high precision that
            you did not ask for: a weight dimension off 16 (FP8 GEMMs need multiples of 16 on every
            device: shape_rule.py), off the recipe's whole blocks, or a subclass of `torch.nn.Linear`
            (not converted). Layers your `module_filter_fn` keeps are not warned about.

    A layer is converted when `module_filter_fn` returns True (or there is none), both weight
    dimensions are multiples of 16, and of `recipe`'s block where it has one that every GEMM
    dimension must fill (MXFP8: 32). The converted modules hold the very same Parameter objects.
    `FP8TRAIN_HIGH_PRECISION` switches are applied (debug_switches.py).

    Returns:
        `model`, converted in place; a `model` that is itself a Linear cannot be replaced in place and
        is returned converted.

    Raises:
        ValueError: `module_filter_fn` is not callable, or `recipe` is not a recipe.
    """
    quantization = None if recipe is None else quantization_of(recipe)
    return convert_checked(model, module_filter_fn, quantization, fsdp_fp8_all_gather, log)


def convert_checked(
    model: torch.nn.Module,
    module_filter_fn: Optional[FilterFn],
    quantization: Optional[Quantization],
    fsdp_fp8_all_gather: bool,
    log: bool,
) -> torch.nn.Module:
    """`convert_to_fp8` of a recipe checked already (`prepare`'s): `quantization` is its record
    (`quantization_of(recipe)`), None for no recipe."""
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise ValueError("module_filter_fn must be a callable (module, fqn) -> bool")

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        kept = module_filter_fn is None or bool(module_filter_fn(module, fqn))
        if not kept:
            KEPT_BY_FILTER.add(module)
        return kept

    def converted(module: torch.nn.Module, fqn: str) -> torch.nn.Module:
        """The module's FP8 replacement, or the module itself (not a linear layer, kept by the filter
        (asked first: a layer it keeps is kept at the user's request, whatever its shape), or of a shape
        FP8 GEMMs cannot take)."""
        convertible = type(module) is torch.nn.Linear or is_hf_conv1d(module) or is_hf_fused_experts(module)
        if not convertible or not keep(module, fqn):
            return module
        new = _swap(module, fsdp_fp8_all_gather, 1 if quantization is None else quantization.whole_blocks)
        return module if new is None else new

    if type(model) is torch.nn.Linear or is_hf_conv1d(model):
        return _converted(converted(model, ""), quantization, log)
    swapped: dict[int, torch.nn.Module] = {}  # a layer shared by several parents stays one module
    for fqn, parent in list(model.named_modules(remove_duplicate=False)):
        if isinstance(parent, FP8Module):
            continue
        for name, child in children_by_name(parent):
            if child is None:
                continue
            if id(child) not in swapped:
                swapped[id(child)] = converted(child, f"{fqn}.{name}" if fqn else name)
            setattr(parent, name, swapped[id(child)])
    return _converted(model, quantization, log)


def _converted(model: torch.nn.Module, quantization: Optional[Quantization], log: bool) -> torch.nn.Module:
    """A converted model: the switches of FP8TRAIN_HIGH_PRECISION applied, its coverage logged once."""
    apply_environment(model)
    if log:
        if quantization is None:
            log_summary(model)
        else:
            log_coverage(model, type(quantization))
    return model
