"""Delayed scaling: each step's scales come from the amax history of earlier steps, which an amax
group shares and MAX-reduces across its ranks (docs/design.md, sections 1-3).

Its calls go through the protocol: a call's plan freezes its region's scales (plans.py), its amaxes
are recorded and its backward asks for the gradient's scale (ops.py). The scale of every tensor is
known before the tensor is cast, so sequence-parallel inputs and FSDP2 weights travel as FP8.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import ops
from ..cast import amax
from ..formats import Format
from .base import GemmCall, GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization

__all__ = ["DelayedScaling", "DelayedQuantization"]

AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each step's scale comes from the amax history of earlier steps.

    Callables are applied once to the whole contiguous storage of a group (one column per tensor
    role), so they must work column-wise: ``amax_compute_algo(history[H, N]) -> amax[N]`` and
    ``scaling_factor_compute_algo(amax[N], scale[N], fp8_max, recipe) -> scale[N]``.

    `amax_reduction`: "region" (TransformerEngine's behaviour: every FP8 region's amaxes are reduced
    and rolled into the history when it ends, and its backward's when that ends) or "step": the
    amaxes of all regions of an optimizer step are MAX-accumulated locally and reduced once per
    direction at the step boundary (`fp8train.end_step()`), so scales are constant within a step
    (docs/design.md, section 14).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[ScaleAlgo] = None
    reduce_amax: bool = True
    amax_reduction: str = "region"

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an integer >= 0, got {self.margin!r}")
        if not isinstance(self.fp8_format, Format) or self.fp8_format is Format.E5M2:
            raise ValueError(
                f"DelayedScaling.fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format!r} "
                "(pure E5M2 has too little precision for forward activations and weights)"
            )
        h = self.amax_history_len
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an integer >= 1, got {h!r}")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable "
                f"(amax_history) -> amax, got {algo!r}"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(
                "DelayedScaling.scaling_factor_compute_algo must be None or a callable "
                f"(amax, scale, fp8_max, recipe) -> scale, got {sf!r}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling.reduce_amax must be True or False, got {self.reduce_amax!r}")
        if self.amax_reduction not in ("region", "step"):
            raise ValueError(
                f"DelayedScaling.amax_reduction must be 'region' (per FP8 region) or 'step' (once per "
                f"optimizer step, at fp8train.end_step()), got {self.amax_reduction!r}"
            )

    @property
    def per_step(self) -> bool:
        return self.amax_reduction == "step"

    def key(self) -> str:
        """The fields every rank of an amax group must agree on, as text that is the same in every
        process (the reduction header's fingerprint; equal keys share an amax group)."""

        def name(algo) -> str:
            return repr(algo) if algo is None or isinstance(algo, str) else _callable_key(algo)

        return (
            f"margin={self.margin}, fp8_format={self.fp8_format.name}, "
            f"amax_history_len={self.amax_history_len}, amax_compute_algo={name(self.amax_compute_algo)}, "
            f"scaling_factor_compute_algo={name(self.scaling_factor_compute_algo)}"
            + (", amax_reduction=step" if self.per_step else "")
        )


def _callable_key(fn) -> str:
    """Text that is the same in every process for the same callable, and differs for different ones.

    Functions (lambdas and closures included) are known by their code, constants and the values they
    close over; `functools.partial` by its function and arguments; other callables by their type.
    Memory addresses, which differ between processes, are left out."""
    if isinstance(fn, functools.partial):
        return f"partial({_callable_key(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    closure = [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]
    details = repr((code.co_consts, code.co_names, getattr(fn, "__defaults__", None), closure))
    details = re.sub(r"0x[0-9a-fA-F]+", "0x", details)
    digest = hashlib.blake2b(code.co_code + details.encode(), digest_size=6).hexdigest()
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}#{digest}"


class DelayedQuantization(TensorQuantization):
    kind = "delayed"
    reduces_amax = True
    casts_before_gather = True

    def call_scales(self, module, gemm_index: int, x: torch.Tensor, weight_amax, record: bool):
        x_amax = amax(x) if record else None
        w_amax = weight_amax() if record and weight_amax is not None else None
        return ops.forward_scales(module, gemm_index, x_amax, w_amax, x.detach())

    def quantize_weight(self, weight: torch.Tensor, call: GemmCall) -> WeightOperands:
        scales = call.scales
        return WeightOperands.same(self.cast(weight, scales[0, 1], scales[1, 1], "e4m3", call.operand_dtype))

    def quantize_input(self, x2d: torch.Tensor, call: GemmCall) -> InputOperands:
        scales = call.scales
        operand = self.cast(x2d, scales[0, 0], scales[1, 0], "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d: torch.Tensor, call: GemmCall, needs: tuple[bool, bool]) -> GradOperands:
        scales = ops.backward_scales(call.module_handle, call.gemm_index, amax(g2d), call.token)
        return self.grad_operands(g2d, scales[0], scales[1], call)
