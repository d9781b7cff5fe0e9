"""A recipe's quantization error on a model's real tensors, as training quantizes them.

For a few sampled GEMMs, a `TensorTap` keeps (on the steps it is armed for) the three tensors each
GEMM quantizes: its input (for a LayerNormLinear, the norm's output), its weight and its output
gradient. `quantization_errors` quantizes them with the recipe's own quantization object (the
operands of the forward GEMM for input and weight, of the input-gradient GEMM for the gradient) and
returns `||dequantize(quantize(t)) - t|| / ||t||` per role. Delayed scaling casts with the scales of
the step (`DelayedScales.read`, taken before its forward), the other recipes take theirs from the
tensors. Stochastic rounding (NVFP4's gradients) draws from a forked generator, so measuring does
not change the training that follows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from fp8train.modules import LayerNormLinear, Linear
from fp8train.numerics.gemm import Operand
from fp8train.quantization import quantization_of
from fp8train.quantization.delayed import DelayedQuantization
from fp8train.recipe import Recipe
from fp8train.runtime import Call

__all__ = [
    "ROLES", "Captured", "TensorTap", "DelayedScales", "sample_gemms", "quantization_errors",
    "relative_error", "mean_errors",
]  # fmt: skip

ROLES = ("input", "weight", "grad_output")


def sample_gemms(model: torch.nn.Module, per_end: int = 2) -> list[str]:
    """Names of the first and last `per_end` single-GEMM FP8 modules (Linear, LayerNormLinear) of
    `model`: the GEMMs whose three operands hooks can see from outside the module."""
    names = [n for n, m in model.named_modules() if isinstance(m, (Linear, LayerNormLinear))]
    chosen = names[:per_end] + names[-per_end:]
    return list(dict.fromkeys(chosen))  # in model order, once each


@dataclass
class Captured:
    """The tensors one GEMM quantized in one step (2-D, copies: the optimizer changes the weight)."""

    input: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    grad_output: Optional[torch.Tensor] = None


class TensorTap:
    """Hooks on the named modules that copy their GEMM's input, weight and output gradient, but only
    between `arm()` and `disarm()` (otherwise each hook returns at once)."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.names = list(names)
        self.modules = {n: model.get_submodule(n) for n in self.names}
        self.captured: dict[str, Captured] = {}
        self.armed = False
        self._handles = []
        for name, module in self.modules.items():
            if isinstance(module, LayerNormLinear):  # the GEMM's input is the norm's output
                self._handles.append(module.norm.register_forward_hook(self._keep_output_as_input(name)))
            else:
                self._handles.append(module.register_forward_pre_hook(self._keep_input(name)))
            self._handles.append(module.register_forward_hook(self._keep_weight_and_grad(name)))

    def arm(self) -> None:
        self.captured = {n: Captured() for n in self.names}
        self.armed = True

    def disarm(self) -> dict[str, Captured]:
        self.armed = False
        return self.captured

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep_input(self, name: str):
        def hook(module, args):
            if self.armed:
                self.captured[name].input = _rows(args[0])

        return hook

    def _keep_output_as_input(self, name: str):
        def hook(module, args, output):
            if self.armed:
                self.captured[name].input = _rows(output)

        return hook

    def _keep_weight_and_grad(self, name: str):
        def hook(module, args, output):
            if not self.armed:
                return
            self.captured[name].weight = module.weight.detach().clone()
            if output.requires_grad:

                def keep_grad(grad: torch.Tensor) -> None:
                    if self.armed:
                        self.captured[name].grad_output = _rows(grad)

                output.register_hook(keep_grad)

        return hook


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D copy (tokens x features), as the linear function flattens its operands."""
    return t.detach().reshape(-1, t.shape[-1]).clone()


@dataclass(frozen=True)
class DelayedScales:
    """The scales a delayed-scaling step casts one GEMM's input, weight and gradient with."""

    scale: torch.Tensor  # [input, weight, grad_output]
    scale_inv: torch.Tensor

    @staticmethod
    def read(module: torch.nn.Module) -> DelayedScales:
        """Read before the step's forward: reading `fp8_meta` completes in-flight reductions, so the
        stored scales are then the ones this step's forward and backward use (roles: forward 0
        input, 1 weight; backward 0 grad_output, of the module's first GEMM)."""
        fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
        scale = torch.stack([fwd.scale[0], fwd.scale[1], bwd.scale[0]]).clone()
        scale_inv = torch.stack([fwd.scale_inv[0], fwd.scale_inv[1], bwd.scale_inv[0]]).clone()
        return DelayedScales(scale, scale_inv)


def relative_error(operand: Operand, t: torch.Tensor) -> float:
    """||dequantize(operand) - t|| / ||t|| in fp32 (0 for a zero tensor quantized to zeros)."""
    t = t.float()
    err = float((operand.dequantize() - t).norm())
    norm = float(t.norm())
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def quantization_errors(
    recipe: Recipe, captured: Captured, delayed: Optional[DelayedScales] = None
) -> dict[str, float]:
    """Relative error per role of the recipe's operands: input and weight as the forward GEMM takes
    them, the output gradient as the input-gradient GEMM takes it. Delayed scaling needs `delayed`."""
    q = quantization_of(recipe)
    x, w, g = captured.input, captured.weight, captured.grad_output
    fork = [x.device.index or 0] if x.is_cuda else []
    with torch.random.fork_rng(devices=fork):  # stochastic rounding must not move the training's draws
        if isinstance(q, DelayedQuantization):
            if delayed is None:
                raise ValueError("delayed scaling casts with the step's scales: pass DelayedScales.read(...)")
            s, inv = delayed.scale.to(x.device), delayed.scale_inv.to(x.device)
            call = Call.outside_module(q, torch.stack([s[:2], inv[:2]]))
            grad = q.grad_operands(g, s[2], inv[2], call).dgrad if g is not None else None
        else:
            call = Call.outside_module(q)
            grad = q.quantize_grad(g, call, (True, False)).dgrad if g is not None else None
        operands = {
            "input": q.quantize_input(x, call).forward,
            "weight": q.quantize_weight(w, call).forward,
            "grad_output": grad,
        }
    tensors = {"input": x, "weight": w, "grad_output": g}
    return {role: relative_error(op, tensors[role]) for role, op in operands.items() if op is not None}


def mean_errors(records: list[dict]) -> Optional[dict[str, float]]:
    """Mean relative error per role over every measured step and sampled GEMM (None if none)."""
    values: dict[str, list[float]] = {}
    for rec in records:
        for per_role in rec["rel_error"].values():
            for role, v in per_role.items():
                values.setdefault(role, []).append(v)
    return {role: statistics.fmean(v) for role, v in values.items()} if values else None
