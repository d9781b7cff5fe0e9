"""What every FP8 module shares: its delayed-scaling state (`fp8_meta`), the recipe kind it trains
with, cached FP8 weights, and its state in checkpoints and copies."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Optional

import torch

from ..amax import ScalingMeta, decode_extra_state, roles, steps
from ..fsdp import plain_weight
from ..quantization.base import WeightOperands
from ..runtime import register_module
from .sources import CachedWeight

__all__ = ["FP8Module"]


class FP8Module(torch.nn.Module):
    """Base of modules with FP8 GEMMs: their delayed-scaling state (`fp8_meta`, saved as the module's
    `_extra_state`), the recipe kind they train with, and FP8 weights kept across microbatches.

    A subclass sets `num_gemms` (and `gemm_names`), holds each GEMM's weight as `weight` (or
    `<gemm name>_weight`) and calls `fp8train.modules.fp8_linear.fp8_linear` in its forward; its
    constructor takes no argument here. `isinstance(m, fp8train.FP8Module)` tells FP8 layers apart."""

    num_gemms = 1
    gemm_names: tuple[str, ...] = ("",)  # one per GEMM: how telemetry names its roles
    # True: `get_extra_state` gives its bytes as a 1-D uint8 tensor, for checkpoint formats that store
    # tensors only (safetensors: Hugging Face's save_pretrained); set on the instance (prepare does it
    # for transformers models). Either form loads into any module.
    extra_state_as_tensor = False

    def __init__(self) -> None:
        super().__init__()
        self.init_fp8_state()

    def init_fp8_state(self) -> None:
        """The FP8 attributes of a fresh module: what `__init__` sets after `torch.nn.Module.__init__`,
        for classes that combine FP8Module with another module class whose `__init__` runs instead
        (fp8train.integrations.torchtitan)."""
        self.fp8_meta = {
            "scaling_fwd": ScalingMeta(roles.FWD_ROLES * self.num_gemms),
            "scaling_bwd": ScalingMeta(roles.BWD_ROLES * self.num_gemms),
        }
        self.recipe_kind: Optional[str] = None  # the kind of recipe it trains with ("delayed", ...), once set
        self.fp8_handle = register_module(self)  # how the protocol's custom ops name it
        self.shards_checked = False  # sequence parallelism: token shards checked equal across TP ranks
        self.fsdp_gathers: dict = {}  # fsdp.py's bookkeeping of FP8 weight gathers, per GEMM
        # (GEMM index, recipe kind) -> the weight's FP8 operands kept across microbatches (as the weight
        # source of the next microbatches' calls), and the [scale, scale_inv] they were cast with
        # (delayed scaling): what rebuilds them after a load
        self._weight_cache: dict[tuple[int, str], CachedWeight] = {}
        self._weight_cast_scales: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def signature(self) -> str:
        """The module's type and parameter shapes: how layouts and messages name it."""
        shapes = ",".join("x".join(map(str, p.shape)) for p in self.parameters(recurse=False))
        return f"{type(self).__name__}({shapes})"

    def claim_recipe_kind(self, kind: str) -> None:
        """A training call under a recipe of `kind`: a module trains under one kind, because its FP8
        state (and a checkpoint of it) belongs to that kind."""
        if self.recipe_kind is None:
            self.recipe_kind = kind
        elif self.recipe_kind != kind:
            raise RuntimeError(
                f"{self.signature} was trained with {self.recipe_kind} scaling (by this run, or in the "
                f"checkpoint it was loaded from) and is now trained with {kind} scaling. Keep the recipe "
                "of the run (or of the checkpoint), or start from a model that has not trained"
            )

    # ---- FP8 weights kept across microbatches (is_first_microbatch) -------------------------------------
    def cached_weight(self, gemm_index: int, kind: str) -> Optional[CachedWeight]:
        """The FP8 operands of GEMM `gemm_index`'s weight kept under a recipe of `kind` ("delayed", ...)
        by the step's first microbatch (`is_first_microbatch=True`), as the next calls' weight source
        (sources.py; `.cached`: the operands), or None."""
        return self._weight_cache.get((gemm_index, kind))

    def cache_weight(
        self,
        gemm_index: int,
        kind: str,
        operands: WeightOperands,
        copy: bool = False,
        cast_scales: Optional[torch.Tensor] = None,
    ) -> None:
        """Keep `operands`, GEMM `gemm_index`'s weight cast under a recipe of `kind`, for the next
        microbatches; `copy`: their 1-byte values may be a buffer that someone else refills (FSDP2's
        gather), so keep a copy of them. `cast_scales`: [scale, scale_inv] they were cast with
        (delayed scaling), saved with the module's state."""
        if copy and operands.forward.values.dtype.itemsize == 1:
            forward = operands.forward
            operands = WeightOperands.same(replace(forward, values=forward.values.clone()))
        self._weight_cache[(gemm_index, kind)] = CachedWeight(operands, None)
        if cast_scales is not None:
            # its own copy: the caller's is a view of its region's frozen scales
            self._weight_cast_scales[(gemm_index, kind)] = cast_scales.clone()

    def weight_cast_scales(self, gemm_index: int, kind: str) -> Optional[torch.Tensor]:
        """[scale, scale_inv] the cached weight of GEMM `gemm_index` (recipe `kind`) was cast with, also
        after a load dropped it; None if none was cached."""
        return self._weight_cast_scales.get((gemm_index, kind))

    def forget_cached_weights(self) -> None:
        """Drop the FP8 weights kept across microbatches (after a change of the weights themselves)."""
        self._weight_cache.clear()
        self._weight_cast_scales.clear()

    # ---- copies and devices ---------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """What a copy (deepcopy, pickle, torch.save of the module, an EMA model) keeps: parameters and
        FP8 state; not FSDP2 gather bookkeeping or cached FP8 weights, which belong to this module's own
        calls (the protocol keeps the current call's plan, so nothing of it is copied)."""
        state = dict(self.__dict__)
        state.update(fsdp_gathers={}, _weight_cache={}, _weight_cast_scales={})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.fp8_handle = register_module(self)  # a copy is a module of its own

    def _apply(self, fn, recurse: bool = True):
        """`to()`, `cuda()`, `to_empty()`: FP8 state that joined an amax group on another device
        leaves it (the module owns its state again and joins a group of its new device when it next
        trains); state not joined yet is host memory and needs nothing."""
        devices = {p.device for p in self.parameters(recurse=False)}
        module = super()._apply(fn, recurse)
        if {p.device for p in self.parameters(recurse=False)} != devices:
            for meta in self.fp8_meta.values():
                meta.leave()
            self.forget_cached_weights()
        return module

    # ---- checkpoints ----------------------------------------------------------------------------------
    def get_extra_state(self):
        """FP8 state as serialized bytes (see `decode_extra_state`), or those bytes as a uint8 tensor
        (`extra_state_as_tensor`).

        Checkpoint formats store bytes whole and restore them by replacement, whatever the history
        length: torch.distributed.checkpoint loads tensors in place, so a fresh module (no history
        yet) could not receive a trained module's (H x N) history if it were a tensor.
        """
        state = {"version": 2, "recipe": self.recipe_kind}
        for key in ("scaling_fwd", "scaling_bwd"):
            state[key] = self.fp8_meta[key].state()
        if self._weight_cast_scales:  # a step with is_first_microbatch resumes with the same FP8 weight
            state["weight_cast_scales"] = {
                f"{gemm}:{kind}": scales.detach().cpu()
                for (gemm, kind), scales in self._weight_cast_scales.items()
            }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        if self.extra_state_as_tensor:
            return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return buffer.getvalue()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # weights wrapped for FSDP2 FP8 all-gather are saved as plain tensors
            for name, _ in self.named_parameters(recurse=False):
                destination[prefix + name] = plain_weight(destination[prefix + name])

    def set_extra_state(self, state) -> None:
        where = self.signature
        state = decode_extra_state(state, where)
        for key in ("scaling_fwd", "scaling_bwd"):
            self.fp8_meta[key].load(state[key], f"{where} {key}")
        if state.get("recipe") is not None:  # checked against the run's recipe at its first training call
            self.recipe_kind = state["recipe"]
        self.forget_cached_weights()
        steps.parameters_loaded(self)  # torch loads a module's parameters before its extra state
        self._weight_cast_scales.update(_cast_scales(state.get("weight_cast_scales", {}), where))


def _cast_scales(saved: dict, where: str) -> dict[tuple[int, str], torch.Tensor]:
    """The [scale, scale_inv] of each cached FP8 weight, as `get_extra_state` saved them."""
    out = {}
    for key, scales in saved.items():
        if not (isinstance(scales, torch.Tensor) and scales.shape == (2,) and bool((scales > 0).all())):
            raise ValueError(f"{where}: checkpoint weight_cast_scales are not 2 scales > 0; it is corrupted")
        gemm, kind = key.split(":")
        out[(int(gemm), kind)] = scales.float()
    return out
