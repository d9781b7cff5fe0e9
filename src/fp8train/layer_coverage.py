"""Is FP8 actually on? Which linear layers run in FP8 and why not, and what a step ran in FP8.

`coverage(model)` looks at the model as it stands: every linear layer (`torch.nn.Linear`,
transformers' `Conv1D`, fp8train's FP8 modules, one entry per GEMM) with whether it runs in FP8 and
why not (its shape is off the multiple of 16 FP8 GEMMs need or off the whole blocks its recipe
needs, `module_filter_fn` kept it, a high-precision switch holds it: debug_switches.py), whether it is
frozen (no weight-gradient GEMM), whether its operands are padded to the recipe's blocks (block
scaling's 128) and the GEMM path it takes on its device (`gemm_path`: as gemm.py chooses it).

`StepCoverage(model)` counts what each step ran, from shapes (host ints: no device is waited for):
linear FLOPs in FP8 and in high precision, GEMMs per path, and, under FSDP2, the bytes of linear
weights gathered in FP8 and in high precision. Forward hooks do the counting, so it counts eager
calls (a compiled graph runs its hooks while it is traced, not at each call: nothing is counted).
"""

from __future__ import annotations

import collections
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .debug_switches import SWITCHES
from .fsdp import GatheredWeight
from .modules.base import FP8Module
from .modules.grouped_gemm import GROUPED_KERNELS, grouped_kernel_choice
from .numerics import gemm
from .quantization import RECIPES, check_recipe, record_of_kind
from .quantization.base import Quantization
from .recipe import DelayedScaling, Recipe
from .runtime import current_call
from .shape_rule import GEMM_MULTIPLE, why_off
from .torch_internals import managed_by_fsdp2
from .user_warnings import warn_user

__all__ = [
    "LayerCoverage", "ModelCoverage", "coverage", "StepCoverage", "log_summary", "LOGGER",
    "fp8_compatible", "is_hf_conv1d", "KEPT_BY_FILTER", "shape_fits", "model_coverage", "log_coverage",
]  # fmt: skip

LOGGER = logging.getLogger("fp8train")
BLOCK_PATH = "block_dequantized"  # gemm.matmul: block-scaled operands dequantized, fp32 matmul


# ---- which layers convert_to_fp8 converts (convert.py applies these rules, coverage explains them) ----
# FP8 GEMMs (torch._scaled_mm, cuBLASLt) need both dimensions of the weight to be multiples of 16, on
# every device (shape_rule.py: the FP8 modules follow the same rule at run time)
# layers a module_filter_fn kept in high precision (reported as "filter"); written by convert.py only
KEPT_BY_FILTER: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def fp8_compatible(in_features: int, out_features: int, recipe: Optional[Recipe] = None) -> bool:
    """Whether an FP8 GEMM can take a weight of this shape: multiples of 16, and whole blocks of
    `recipe` where it has blocks that every GEMM dimension must fill (MXFP8: 32, NVFP4: 16)."""
    whole_blocks = 1 if recipe is None else RECIPES[type(check_recipe(recipe, "recipe"))].whole_blocks
    return shape_fits(in_features, out_features, whole_blocks)


def shape_fits(in_features: int, out_features: int, whole_blocks: int = 1) -> bool:
    """`fp8_compatible` for a recipe already checked: multiples of 16 and of `whole_blocks` (its
    `Quantization.whole_blocks`)."""
    multiple = math.lcm(GEMM_MULTIPLE, whole_blocks)
    return in_features % multiple == 0 and out_features % multiple == 0


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


@dataclass(frozen=True)
class LayerCoverage:
    """One GEMM of a linear layer: whether it runs in FP8, and why not."""

    name: str  # the layer's name in the model (with "/fc1" etc. for a module of several GEMMs)
    layer: str  # its class
    in_features: int
    out_features: int
    fp8: bool
    reason: str  # "fp8", or why not: "shape", "off block", "filter", "switched", "not converted"
    frozen: bool  # its weight trains not: no weight-gradient GEMM
    path: Optional[str]  # the GEMM path an FP8 call takes (a token count that is a multiple of 16)
    padded: bool = False  # off the recipe's block: its operands are padded to whole blocks
    asked: bool = False  # in high precision at the user's request: a module_filter_fn kept it, a switch

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs per token (2 per multiply-add)."""
        return 2 * self.in_features * self.out_features


@dataclass(frozen=True)
class ModelCoverage:
    layers: tuple[LayerCoverage, ...]
    recipe_kind: Optional[str]  # the kind whose block and path were used ("delayed" if none is known)

    @property
    def fp8_share(self) -> float:
        """The share of linear forward FLOPs (per token) that runs in FP8."""
        total = sum(layer.flops_per_token for layer in self.layers)
        fp8 = sum(layer.flops_per_token for layer in self.layers if layer.fp8)
        return fp8 / total if total else 0.0

    def counts(self) -> dict[str, int]:
        """GEMMs per reason ("fp8", "shape", "filter", ...), and "frozen" for frozen ones."""
        out = collections.Counter(layer.reason for layer in self.layers)
        out["frozen"] = sum(layer.frozen for layer in self.layers)
        return dict(out)

    def summary(self) -> str:
        """One line: how many linear GEMMs run in FP8, their FLOP share, the others' reasons, paths."""
        counts = self.counts()
        fp8 = counts.pop("fp8", 0)
        frozen = counts.pop("frozen")
        others = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        paths = collections.Counter(layer.path for layer in self.layers if layer.fp8)
        via = ", ".join(f"{n} {p}" for p, n in sorted(paths.items()))
        return (
            f"fp8train: {fp8}/{len(self.layers)} linear GEMMs in FP8 ({100 * self.fp8_share:.1f}% of linear "
            f"FLOPs; recipe {self.recipe_kind})" + (f"; high precision: {others}" if others else "")
            + (f"; frozen: {frozen}" if frozen else "") + (f"; paths: {via}" if via else "")
        )  # fmt: skip

    def table(self) -> str:
        """Every GEMM on a line: name, shape, FP8 or why not, path."""
        rows = [("layer", "shape", "fp8", "why", "path")]
        for layer in self.layers:
            notes = (
                [layer.reason] + (["frozen"] if layer.frozen else []) + (["padded"] if layer.padded else [])
            )
            shape = f"{layer.in_features}x{layer.out_features}"
            rows.append((layer.name, shape, "yes" if layer.fp8 else "no", ",".join(notes), layer.path or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def as_dict(self) -> dict:
        """A JSON-able record (telemetry writes it as a "coverage" record)."""
        return {
            "kind": "coverage",
            "recipe": self.recipe_kind,
            "fp8_share": self.fp8_share,
            "counts": self.counts(),
            "layers": [
                {"name": x.name, "in": x.in_features, "out": x.out_features, "fp8": x.fp8, "reason": x.reason,
                 "frozen": x.frozen, "path": x.path, "padded": x.padded}
                for x in self.layers
            ],
        }  # fmt: skip


def gemm_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, int, int]]:
    """(GEMM name, weight, in_features, out_features) of each GEMM of a linear layer; [] for others."""
    if isinstance(module, FP8Module) and hasattr(module, "gemm_weights"):  # grouped: one matrix per GEMM
        return [
            (name, w, w.shape[1], w.shape[0]) for name, w in zip(module.gemm_names, module.gemm_weights())
        ]
    if isinstance(module, FP8Module):
        weights = [
            getattr(module, f"{name}_weight" if name else "weight", None) for name in module.gemm_names
        ]
        if any(w is None for w in weights):  # a module of its own naming: its matrices, in order
            weights = [p for p in module.parameters(recurse=False) if p.dim() == 2]
            if len(weights) != len(module.gemm_names):
                return []
        transposed = type(module).__name__ == "Conv1D"  # stored (in, out)
        return [
            (name, w, *(w.shape if transposed else (w.shape[1], w.shape[0])))
            for name, w in zip(module.gemm_names, weights)
        ]
    if isinstance(module, torch.nn.Linear):
        return [("", module.weight, module.in_features, module.out_features)]
    if is_hf_conv1d(module):
        return [("", module.weight, *module.weight.shape)]
    return []


def gemm_path(kernel: str, device: torch.device, tokens: int, in_features: int, out_features: int) -> str:
    """The path an FP8 GEMM of this shape takes on `device` under a recipe whose torch._scaled_mm
    kernel is `kernel` (its `Quantization.kernel`), as gemm.py chooses it: a per-tensor path
    (`gemm.PATHS`), "scaled_mm:<kernel>" for a block-scaled kernel of torch._scaled_mm
    (`gemm.kernel_choice`), else the block-dequantized emulation."""
    if kernel == "tensorwise":
        return gemm.choose_path(device, tokens, in_features, out_features)
    fits = in_features % GEMM_MULTIPLE == 0 and out_features % GEMM_MULTIPLE == 0
    return f"scaled_mm:{kernel}" if fits and gemm.kernel_choice(kernel, device)[0] else BLOCK_PATH


GROUPED_PATH = "scaled_grouped_mm"


def grouped_gemm_path(
    module: torch.nn.Module, kernel: str, device: torch.device, k: int, n: int
) -> Optional[str]:
    """GROUPED_PATH where the GEMMs of a grouped module (GroupedLinear, experts) of this shape take
    torch._scaled_grouped_mm on `device` under a recipe whose kernel is `kernel` (per-tensor recipes, and
    MXFP8 on compute capability 10.x; features in whole 16s, a layer computing in bf16:
    modules/grouped_gemm.py), else None."""
    if (
        not hasattr(module, "gemm_weights")
        or kernel not in GROUPED_KERNELS
        or k % 16
        or n % 16
        or not k
        or not n
    ):
        return None
    return GROUPED_PATH if grouped_kernel_choice(device, kernel)[0] else None


def whole_blocks(kind: str) -> int:
    """The block every GEMM dimension must fill under a recipe of `kind` (1: none); the recipe refuses
    other shapes, and convert_to_fp8 given the recipe keeps them in high precision."""
    return record_of_kind(kind).whole_blocks


def _record(model: torch.nn.Module, recipe) -> type[Quantization]:
    """The record of the recipe `model` trains with: `recipe` (checked here, the door), else a
    prepared model's, else the kind its modules trained with, else delayed scaling's."""
    if recipe is not None:
        return RECIPES[type(check_recipe(recipe, "recipe"))]
    prepared = getattr(model.__dict__.get("forward"), "quantization", None)  # a prepared model's
    if prepared is not None:
        return type(prepared)
    kinds = {m.recipe_kind for m in model.modules() if isinstance(m, FP8Module)} - {None}
    return record_of_kind(kinds.pop()) if len(kinds) == 1 else RECIPES[DelayedScaling]


def coverage(model: torch.nn.Module, recipe=None) -> ModelCoverage:
    """Every linear GEMM of `model`: FP8 or not, and why (see the module docstring). `recipe`: the
    recipe it trains with (default: a prepared model's, else the one its modules trained with, else
    delayed scaling); it decides the block and the path."""
    return model_coverage(model, _record(model, recipe))


def model_coverage(model: torch.nn.Module, record: type[Quantization]) -> ModelCoverage:
    """`coverage` under a recipe already checked: `record` is its `Quantization` (class or object)."""
    kind, block, whole = record.kind, record.block, record.whole_blocks
    layers = []
    for fqn, module in model.named_modules():
        for gemm_name, weight, k, n in gemm_weights(module):
            name = f"{fqn}/{gemm_name}" if gemm_name else (fqn or type(module).__name__)
            frozen = not weight.requires_grad
            off_block = bool(k % whole or n % whole)
            if not isinstance(module, FP8Module) and not fp8_compatible(k, n):
                reason = "shape"  # convert_to_fp8 left it high precision (an FP8 module emulates it)
            elif off_block:  # an FP8 module of this shape is refused by the recipe at its first call
                reason = "off block"
            elif not isinstance(module, FP8Module):
                reason = "filter" if module in KEPT_BY_FILTER else "not converted"
            else:
                reason = "switched" if SWITCHES.high_precision_now(module) else "fp8"
            fp8 = reason == "fp8"
            padded = fp8 and block is not None and bool(k % block or n % block)
            path = None
            if fp8:
                grouped = grouped_gemm_path(module, record.kernel, weight.device, k, n)
                path = grouped or gemm_path(record.kernel, weight.device, 16, k, n)
            asked = reason in ("filter", "switched") or module in KEPT_BY_FILTER
            layers.append(
                LayerCoverage(name, type(module).__name__, k, n, fp8, reason, frozen, path, padded, asked)
            )
    return ModelCoverage(tuple(layers), kind)


def log_summary(model: torch.nn.Module, recipe=None) -> ModelCoverage:
    """Log `coverage(model).summary()` (logger "fp8train", level INFO), and warn once (one UserWarning
    naming each layer and why) about the linear layers in high precision that the user did not ask for
    (not kept by a module_filter_fn or a switch); say so when nothing runs in FP8. Returns the coverage."""
    return log_coverage(model, _record(model, recipe))


def log_coverage(model: torch.nn.Module, record: type[Quantization]) -> ModelCoverage:
    """`log_summary` under a recipe already checked: `record` is its `Quantization` (class or object)."""
    report = model_coverage(model, record)
    LOGGER.info(report.summary())
    unasked = [layer for layer in report.layers if not layer.fp8 and not layer.asked]
    nothing = bool(report.layers) and not any(layer.fp8 for layer in report.layers)
    if unasked or nothing:
        shown = "; ".join(f"{layer.name} ({_why_not(layer, report.recipe_kind)})" for layer in unasked[:8])
        more = f"; and {len(unasked) - 8} more" if len(unasked) > 8 else ""
        parts = [f"{report.summary()}: nothing trains in FP8"] if nothing else []
        if unasked:
            parts.append(
                f"fp8train: linear layers in high precision that no module_filter_fn asked for: {shown}"
                f"{more}. A module_filter_fn that returns False for a layer keeps it in high precision "
                "without this warning"
            )
        parts.append("fp8train.coverage(model).table() lists every layer")
        warn_user(". ".join(parts))
    return report


def _why_not(layer: LayerCoverage, kind: Optional[str]) -> str:
    """Why a layer runs in high precision, in words."""
    if layer.reason == "shape":
        return why_off(layer.out_features, layer.in_features)
    if layer.reason == "off block":
        whole = whole_blocks(kind or "delayed")
        return (
            f"{layer.in_features}x{layer.out_features} (in x out) is not whole {whole}-element blocks of "
            f"the {kind} recipe"
        )
    if layer.reason == "not converted":
        return (
            f"a {layer.layer}, which convert_to_fp8 does not convert (it converts torch.nn.Linear itself "
            "and transformers' Conv1D)"
        )
    return layer.reason


def _rows_per_gemm(module: torch.nn.Module, args: tuple, tokens: int, gemms: int) -> Optional[list[int]]:
    """The rows each GEMM of a call multiplied: all of the input's for a linear layer, each group's own
    for grouped GEMMs (GroupedLinear, experts: `gemm_tokens` of the call's positional arguments); None
    where those arguments were given by keyword (a forward hook sees positional ones only)."""
    if not hasattr(module, "gemm_tokens"):
        return [tokens] * gemms
    try:
        return module.gemm_tokens(*args)
    except TypeError:  # the group sizes were passed by keyword: not counted
        return None


class StepCoverage:
    """What the linear layers of `model` ran since the last `take()`, counted from shapes on the host.

    Per step: FLOPs (2 per multiply-add, forward and the backward GEMMs a training call owes) in FP8
    and in high precision, GEMMs per path ("high_precision" for those not in FP8), the bytes of linear
    weights FSDP2 gathered in FP8 and in high precision (per forward gather), and the FP8 modules that
    ran in high precision (a switch, or a call outside a region). Grouped GEMMs (GroupedLinear,
    experts) count each group's own rows, read from the call's positional arguments (a call that
    passes the group sizes by keyword is not counted)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._handles = []
        self._names: dict[int, str] = {}
        self._weights: dict[int, list] = {}  # module id -> its GEMMs' weights as its forward saw them
        for fqn, module in model.named_modules():
            if gemm_weights(module):
                self._names[id(module)] = fqn or type(module).__name__
                # FSDP2 gathers in its pre-hook (prepended) and frees in its post-hook: weights are read
                # in a pre-hook, the call's precision (its plan) in a post-hook
                self._handles.append(module.register_forward_pre_hook(self._before))
                self._handles.append(module.register_forward_hook(self._after))
        self._clear()

    def _clear(self) -> None:
        self.flops = {"fp8": 0, "high_precision": 0}
        self.gemms: collections.Counter[str] = collections.Counter()
        self.gathered_bytes = {"fp8": 0, "high_precision": 0}
        self.high_precision_layers: set[str] = set()

    def _before(self, module, args) -> None:
        if not torch.compiler.is_compiling():
            self._weights[id(module)] = gemm_weights(module)

    def _after(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        weights = self._weights.pop(id(module), None)
        if weights is None or not args or not isinstance(args[0], torch.Tensor) or not args[0].dim():
            return
        x = args[0]
        tokens = x.numel() // x.shape[-1]
        training = torch.is_grad_enabled()
        call = current_call(module) if isinstance(module, FP8Module) else None
        fp8 = call is not None and call.fp8
        if isinstance(module, FP8Module) and not fp8:
            self.high_precision_layers.add(self._names[id(module)])
        fsdp = managed_by_fsdp2(module)
        rows = _rows_per_gemm(module, args, tokens, len(weights))
        if rows is None:
            return
        for (_, weight, k, n), tokens in zip(weights, rows):
            gemms = 1 + (training and x.requires_grad) + (training and weight.requires_grad)
            self.flops["fp8" if fp8 else "high_precision"] += 2 * tokens * k * n * gemms
            path = "high_precision"
            if fp8:
                kernel = call.quantization.kernel
                grouped = grouped_gemm_path(module, kernel, weight.device, k, n)
                path = grouped if grouped and x.dtype == torch.bfloat16 else None
                path = path or gemm_path(kernel, weight.device, tokens, k, n)
            self.gemms[path] += gemms
            if isinstance(weight, GatheredWeight) and weight.fp8:
                self.gathered_bytes["fp8"] += weight.numel()
                if not fp8:  # gathered again in the parameter dtype (fp8_linear's _HighPrecision)
                    self.gathered_bytes["high_precision"] += weight.numel() * weight.element_size()
            elif isinstance(weight, GatheredWeight) or fsdp:
                self.gathered_bytes["high_precision"] += weight.numel() * weight.element_size()

    def take(self) -> dict:
        """The counts since the last take (JSON-able), and start counting afresh."""
        total = self.flops["fp8"] + self.flops["high_precision"]
        out = {
            "fp8_flop_share": self.flops["fp8"] / total if total else None,
            "flops": dict(self.flops),
            "gemms": dict(sorted(self.gemms.items())),
            "gathered_bytes": dict(self.gathered_bytes),
            "high_precision_layers": sorted(self.high_precision_layers),
        }
        self._clear()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
