"""Why did it diverge? Statistics of the tensors FP8 GEMMs quantize, as device tensors (no host wait).

Per GEMM role ("input", "weight", "grad_output") of the sampled layers, on the steps it is armed for:
- ``zero_share``: the share of the tensor's elements that are not zero but quantize to zero;
- ``subnormal_share``: the share that quantize to a subnormal of the format (E4M3: |q| < 2^-6, E5M2:
  2^-14, NVFP4's E2M1: 1);
- ``kurtosis``: E[(x - mean)^4] / var^2 over the tensor (3 for a Gaussian; heavy tails, outlier
  features, read higher): FP8 divergence is preceded by growing input kurtosis (arXiv:2505.20524);
- block-scaled recipes (block, MXFP8, NVFP4) also: ``scale_spread_log2``, log2 of the largest over
  the smallest block scale_inv (of blocks that are not all zero), and ``block_range_log2``, the most
  any block spans: log2(its amax / its smallest nonzero |x|);
- ``what_if_rel_error`` (with `what_if`): ||dequantize(quantize(t)) - t|| / ||t|| under another
  recipe's quantization, on the same tensor (the SNR panel's measure, tools/quant_error.py), next
  to ``rel_error`` under the run's recipe.
Delayed scaling quantizes with the step's frozen scales: input and weight from the call's plan; its
output gradient's scale is only final once backward reductions finish, so it gets no quantized
statistics (kurtosis only). `Telemetry(statistics=GemmStatistics(...))` copies them with its record.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Optional

import torch

from .layer_coverage import gemm_weights
from .modules.base import FP8Module
from .numerics.gemm import Operand
from .quantization import quantization_of
from .recipe import Recipe
from .runtime import Call, current_call

__all__ = [
    "kurtosis", "underflow_shares", "block_scale_stats", "relative_error", "GemmStatistics",
    "KURTOSIS_WARNING",
]  # fmt: skip

# Telemetry warns (once per role) when a GEMM input's kurtosis exceeds this. Measured (docs/telemetry.md,
# "Coverage and tensor statistics"): healthy demo runs stay far below it.
KURTOSIS_WARNING = 50.0


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """E[(x - mean)^4] / var^2 (population moments, fp32); 0 for a constant tensor."""
    x = x.float().flatten()
    d = x - x.mean()
    var = d.pow(2).mean()
    return torch.where(var > 0, d.pow(4).mean() / var.clamp_min(1e-30).pow(2), torch.zeros_like(var))


def _smallest_normal(kind: str, encoding: str) -> float:
    if kind == "nvfp4":
        return 1.0  # E2M1: 1 is its smallest normal, 0.5 its one subnormal
    return torch.finfo(torch.float8_e4m3fn if encoding == "e4m3" else torch.float8_e5m2).smallest_normal


def underflow_shares(x: torch.Tensor, operand: Operand, smallest_normal: float) -> torch.Tensor:
    """[zero share, subnormal share] of `x` quantized as `operand` (see the module docstring)."""
    deq = operand.dequantize()
    r, c = x.shape
    values = operand.values.float()
    values = (values.t() if operand.transposed else values)[:r, :c]
    zero = (deq == 0) & (x != 0)
    subnormal = (values != 0) & (values.abs() < smallest_normal)
    n = max(x.numel(), 1)
    return torch.stack([zero.sum() / n, subnormal.sum() / n]).float()


def block_scale_stats(x: torch.Tensor, operand: Operand) -> torch.Tensor:
    """[scale_spread_log2, block_range_log2] of a block-scaled operand of `x` (its forward operand)."""
    inv = operand.scale_inv.float().flatten()  # masked, not indexed: a boolean index waits for the GPU
    smallest = torch.where(inv > 0, inv, torch.full_like(inv, float("inf"))).amin()
    spread = torch.where(
        smallest < float("inf"), torch.log2(inv.amax() / smallest), torch.zeros_like(smallest)
    )
    rows, cols = operand.block
    a = x.float().abs()
    r, c = a.shape
    padded = torch.nn.functional.pad(a, (0, -c % cols, 0, -r % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).transpose(1, 2)
    blocks = blocks.reshape(blocks.shape[0], blocks.shape[1], -1)
    big = blocks.amax(-1)
    small = torch.where(blocks > 0, blocks, torch.full_like(blocks, float("inf"))).amin(-1)
    nonzero = big > 0
    ranges = torch.where(nonzero, torch.log2(big / small.clamp_min(1e-45)), torch.zeros_like(big))
    return torch.stack([spread, ranges.max() if ranges.numel() else torch.zeros((), device=x.device)])


def relative_error(operand: Operand, x: torch.Tensor) -> torch.Tensor:
    """||dequantize(operand) - x|| / ||x|| as a device scalar (0 for a zero tensor)."""
    x = x.float()
    norm = x.norm()
    err = (operand.dequantize() - x).norm()
    return torch.where(norm > 0, err / norm.clamp_min(1e-30), err)


def _operands(quantization, x: torch.Tensor, role: str, scales: Optional[torch.Tensor]) -> Optional[Operand]:
    """`x` quantized as the run quantizes `role` (input, weight: the forward GEMM's; grad: dgrad's)."""
    call = Call.outside_module(quantization, scales)
    fork = [x.device.index or 0] if x.is_cuda else []
    with torch.random.fork_rng(devices=fork):  # stochastic rounding must not move the training's draws
        if role == "input":
            return quantization.quantize_input(x, call).forward
        if role == "weight":
            return quantization.quantize_weight(x, call).forward
        if quantization.reduces_amax:
            return None
        return quantization.quantize_grad(x, call, (True, False)).dgrad


class GemmStatistics:
    """Hooks on the FP8 linear layers of `model` whose names match `layers` (fnmatch patterns; default
    every one) that measure the statistics of the module docstring on one step in `every`, as device
    tensors; `what_if`: another recipe to quantize the same tensors with."""

    def __init__(
        self,
        model: torch.nn.Module,
        every: int = 1,
        layers: str = "*",
        what_if: Optional[Recipe] = None,
        kurtosis_warning: float = KURTOSIS_WARNING,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.kurtosis_warning = kurtosis_warning
        self._warned: set[str] = set()
        self.what_if = None if what_if is None else quantization_of(what_if)
        self.armed = True  # the first step is measured
        self.names: list[str] = []  # "<layer>/<role>/<statistic>", in the order of `values`
        self.values: list[torch.Tensor] = []
        self._handles = []
        self._norm_outputs: dict[int, torch.Tensor] = {}  # a LayerNormLinear's GEMM input: its norm's output
        for fqn, module in model.named_modules():
            if isinstance(module, FP8Module) and len(gemm_weights(module)) == 1:
                if any(fnmatch.fnmatchcase(fqn, p.strip()) for p in layers.split(",")):
                    norm = getattr(module, "norm", None)
                    if isinstance(norm, torch.nn.Module):
                        self._handles.append(norm.register_forward_hook(self._keep_norm_output(module)))
                    self._handles.append(module.register_forward_hook(self._measure(fqn or "model")))

    def arm_for(self, step: Optional[int]) -> None:
        """Measure the next step if it is `step` and one in `every` (None: do not measure it); Telemetry
        calls it at each step for the next one, which it logs or not."""
        self.armed = step is not None and step % self.every == 0

    def take(self) -> tuple[list[str], Optional[torch.Tensor]]:
        """The names and values measured since the last take (values: one device tensor)."""
        names, values = self.names, self.values
        self.names, self.values = [], []
        return names, (torch.cat([v.reshape(-1).float() for v in values]) if values else None)

    def _add(self, prefix: str, stats: dict[str, torch.Tensor]) -> None:
        for key, value in stats.items():
            self.names.append(f"{prefix}/{key}")
            self.values.append(value.to(self.values[0].device) if self.values else value)

    def _keep_norm_output(self, module: torch.nn.Module):
        def hook(norm, args, output) -> None:
            if self.armed and not torch.compiler.is_compiling():
                self._norm_outputs[id(module)] = output

        return hook

    def _measure(self, name: str):
        def hook(module, args, output) -> None:
            if torch.compiler.is_compiling():
                return
            x = self._norm_outputs.pop(id(module), None)
            if not self.armed or not args:
                return
            call = current_call(module)
            if call is None or not call.fp8:
                return
            x = args[0] if x is None else x  # what the GEMM multiplies
            x = x.detach().reshape(-1, x.shape[-1])
            _, weight, _, _ = gemm_weights(module)[0]
            w = weight.detach().t() if type(module).__name__ == "Conv1D" else weight.detach()
            with torch.no_grad():
                scales = call.quantization.frozen_scales(call.plan, call.gemm_index)
                self._role(name, "input", x, call.quantization, scales)
                self._role(name, "weight", w, call.quantization, scales)
            if output.requires_grad:
                quantization = call.quantization
                output.register_hook(
                    lambda g: self._role(
                        name, "grad_output", g.detach().reshape(-1, g.shape[-1]), quantization
                    )
                )

        return hook

    def _role(self, name: str, role: str, t: torch.Tensor, quantization, scales=None) -> None:
        with torch.no_grad():
            stats = {"kurtosis": kurtosis(t)}
            operand = _operands(quantization, t, role, scales)
            if operand is not None:
                fmt = getattr(quantization.recipe, "fp8_format", None)  # NVFP4: E2M1 for every role
                encoding = "e4m3" if fmt is None else (fmt.bwd if role == "grad_output" else fmt.fwd)
                zero, sub = underflow_shares(
                    t, operand, _smallest_normal(quantization.kind, encoding)
                ).unbind()
                stats.update(zero_share=zero, subnormal_share=sub, rel_error=relative_error(operand, t))
                if operand.block is not None:
                    spread, span = block_scale_stats(t, operand).unbind()
                    stats.update(scale_spread_log2=spread, block_range_log2=span)
            whole = self.what_if.whole_blocks if self.what_if is not None else 1
            if self.what_if is not None and not (t.shape[0] % whole or t.shape[1] % whole):  # else refused
                other = _operands(self.what_if, t, role, None)
                if other is not None:
                    stats["what_if_rel_error"] = relative_error(other, t)
            self._add(f"{name}/{role}", stats)

    def check(self, measured: dict) -> None:
        """Warn once per GEMM input whose kurtosis in `measured` (a record's "statistics", host values)
        exceeds `kurtosis_warning`."""
        for role, stats in measured.items():
            value = stats.get("kurtosis")
            high = isinstance(value, float) and value > self.kurtosis_warning
            if role.endswith("/input") and high and role not in self._warned:
                self._warned.add(role)
                warnings.warn(
                    f"fp8train telemetry: the kurtosis of {role} is {value:.1f} "
                    f"(> {self.kurtosis_warning:g}): heavy-tailed activations (outlier features) precede "
                    "FP8 divergence; see docs/guide.md, 'Debugging a divergence'",
                    stacklevel=2,
                )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
