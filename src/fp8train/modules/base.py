"""What every FP8 module shares: its scaling metadata, the per-call plan, and extra state."""

from __future__ import annotations

import io
from typing import Optional

import torch

from .. import protocol
from ..fsdp import plain_weight
from ..protocol import BWD_ROLES, FWD_ROLES
from ..reduction import Direction

__all__ = ["FP8Module", "ScalingMeta", "decode_extra_state", "FWD_ROLES", "BWD_ROLES"]


class ScalingMeta:
    """`fp8_meta["scaling_fwd"|"scaling_bwd"]`: views of this module's columns in its amax group.

    Before the module first trains in a region it owns its state; afterwards the state lives in the
    group's contiguous storage. Reading an attribute first completes in-flight reductions; read it
    again after other modules join the group (the storage is reallocated then, old views go stale).
    """

    def __init__(self, num_roles: int) -> None:
        self.num_roles = num_roles
        self.direction: Optional[Direction] = None
        self.offset = 0
        self.own_history: Optional[torch.Tensor] = None  # set by load_state_dict before joining
        # host tensors, whatever device is in effect (a module built under torch.device("meta") too):
        # they are copied to the module's device when it joins its amax group
        self.own_scale = torch.ones(num_roles, device="cpu")
        self.own_scale_inv = torch.ones(num_roles, device="cpu")
        self._own_on_device: dict = {}  # device -> (own_scale, own_scale_inv) there: copied once

    def own_scales(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) of a module that has not trained yet, on `device` (cached: a copy from
        host memory each call would wait for the GPU)."""
        if device not in self._own_on_device:
            self._own_on_device[device] = (self.own_scale.to(device), self.own_scale_inv.to(device))
        return self._own_on_device[device]

    def _as_own(self) -> dict:
        """The attributes of this direction holding its current state as its own (a copy, not a view)."""
        return {
            "direction": None,
            "offset": 0,
            "own_history": self.amax_history.detach().clone(),
            "own_scale": self.scale.detach().clone(),
            "own_scale_inv": self.scale_inv.detach().clone(),
            "_own_on_device": {},
        }

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) owns its state: it must neither share nor drag along the group."""
        state = dict(self.__dict__)
        if self.direction is not None:
            state.update(self._as_own())
        return state

    def leave(self) -> None:
        """Own the current state again (the module moved to another device): it rejoins a group of
        that device when it next trains."""
        if self.direction is not None:
            self.__dict__.update(self._as_own())

    def _columns(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[..., self.offset : self.offset + self.num_roles]

    def _settled(self, name: str, host_point: bool = False) -> torch.Tensor:
        protocol.settle(self.direction, host_point)
        return self._columns(getattr(self.direction.storage, name))

    @property
    def amax_history(self) -> torch.Tensor:
        if self.direction is None:
            return self.own_history if self.own_history is not None else torch.zeros(0, self.num_roles)
        return self._settled("history")

    @property
    def scale(self) -> torch.Tensor:
        return self.own_scale if self.direction is None else self._settled("scale")

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.own_scale_inv if self.direction is None else self._settled("scale_inv")

    def join(self, direction: Direction, signature: str, device: torch.device) -> None:
        history = self.own_history
        if history is None:
            history = torch.zeros(direction.recipe.amax_history_len, self.num_roles)
        self.offset = direction.register(
            signature, history.to(device), self.own_scale.to(device), self.own_scale_inv.to(device)
        )
        self.direction = direction
        self.own_history = None

    def state(self) -> dict:
        """This direction's state, for a checkpoint: a host point (mismatches seen so far are raised)."""
        if self.direction is not None:
            protocol.settle(self.direction, host_point=True)
        return {
            "amax_history": self.amax_history.detach().clone().cpu(),
            "scale": self.scale.detach().clone().cpu(),
            "scale_inv": self.scale_inv.detach().clone().cpu(),
        }

    def load(self, state: dict, where: str) -> None:
        history, scale, scale_inv = _checked_state(state, where)
        n = self.num_roles
        if scale.shape != (n,) or scale_inv.shape != (n,) or history.dim() != 2 or history.shape[1] != n:
            raise ValueError(
                f"{where}: checkpoint FP8 state has scale {tuple(scale.shape)} and amax_history "
                f"{tuple(history.shape)}, but this module has {n} roles (expected scale ({n},) and "
                f"amax_history (H, {n})); the checkpoint belongs to a different model"
            )
        if history.shape[0] == 0:  # saved before the module ever trained: no history yet
            history = None if self.direction is None else torch.zeros_like(self._settled("history"))
        if self.direction is None:
            self.own_history = None if history is None else history.clone().float()
            self.own_scale = scale.clone().float()
            self.own_scale_inv = scale_inv.clone().float()
            self._own_on_device.clear()
            return
        if history.shape[0] != self.direction.recipe.amax_history_len:
            raise ValueError(
                f"{where}: checkpoint amax history length {history.shape[0]} differs from this run's "
                f"amax_history_len={self.direction.recipe.amax_history_len}; use the recipe the checkpoint "
                "was trained with"
            )
        protocol.settle(self.direction)
        storage = self.direction.storage
        self._columns(storage.history).copy_(history)
        self._columns(storage.scale).copy_(scale)
        self._columns(storage.scale_inv).copy_(scale_inv)
        storage.refresh_digest()


def _checked_state(state, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(amax_history, scale, scale_inv) of a saved direction, refusing values training never produces.

    torch.save stores no checksum, so a damaged file can load "fine": a negative, zero or non-finite
    scale, or a NaN/negative amax, would then silently poison every later step.
    """
    keys = ("amax_history", "scale", "scale_inv")
    if not isinstance(state, dict) or not all(isinstance(state.get(k), torch.Tensor) for k in keys):
        raise ValueError(
            f"{where}: checkpoint FP8 state must hold tensors {', '.join(keys)}; it is not fp8train's"
        )
    history, scale, scale_inv = (state[k] for k in keys)
    for name, t in (("scale", scale), ("scale_inv", scale_inv)):
        if not bool(torch.all(torch.isfinite(t) & (t > 0))):
            raise ValueError(
                f"{where}: checkpoint {name} {t.tolist()} has non-finite, zero or negative values, which "
                "training never produces; the checkpoint file is corrupted"
            )
    if bool(torch.any(torch.isnan(history) | (history < 0))):
        raise ValueError(
            f"{where}: checkpoint amax_history holds NaN or negative values, which training never "
            "produces; the checkpoint file is corrupted"
        )
    return history, scale, scale_inv


def decode_extra_state(state, where: str = "FP8 module") -> dict:
    """{"scaling_fwd": {...}, "scaling_bwd": {...}} from a module's extra state: the bytes written by
    `get_extra_state`, or the dict that version 1 checkpoints hold."""
    if isinstance(state, (bytes, bytearray)):
        try:
            state = torch.load(io.BytesIO(state), weights_only=True)
        except Exception:
            state = None
    if (
        not isinstance(state, dict)
        or state.get("version") not in (1, 2)
        or not {"scaling_fwd", "scaling_bwd"} <= set(state)
    ):
        raise ValueError(
            f"{where}: the checkpoint's FP8 extra state is not an fp8train state; "
            "load a checkpoint saved by fp8train's state_dict()"
        )
    return state


class FP8Module(torch.nn.Module):
    """Base of modules with FP8 GEMMs. Subclasses set `num_gemms` and call `fp8_linear` in forward."""

    num_gemms = 1
    gemm_names: tuple[str, ...] = ("",)  # one per GEMM: how telemetry names its roles

    def __init__(self) -> None:
        super().__init__()
        self.fp8_meta = {
            "scaling_fwd": ScalingMeta(FWD_ROLES * self.num_gemms),
            "scaling_bwd": ScalingMeta(BWD_ROLES * self.num_gemms),
        }
        # (GEMM index, recipe kind) -> the FP8 weight and its scale_inv, kept across microbatches
        self._weight_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._fp8_plan: Optional[protocol.Plan] = None  # the plan of the current forward call
        self._fp8_recipe_kind: Optional[str] = None  # "delayed", "current" or "block", once trained
        self._fp8_handle = protocol.register_module(self)  # how compiled graphs name this module
        self._shards_checked = False  # sequence parallelism: token shards checked equal across TP ranks

    def __getstate__(self) -> dict:
        """What a copy (deepcopy, pickle, torch.save of the module, an EMA model) keeps: parameters and
        FP8 state, not the last call's plan (its region, amax group and process group) nor FSDP2
        gather bookkeeping or cached FP8 weights, which belong to this module's own calls."""
        state = dict(self.__dict__)
        state.pop("_fsdp_gathers", None)
        state.update(_fp8_plan=None, _weight_cache={})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._fp8_handle = protocol.register_module(self)  # a copy is a module of its own

    def _apply(self, fn, recurse: bool = True):
        """`to()`, `cuda()`, `to_empty()`: FP8 state that joined an amax group on another device
        leaves it (the module owns its state again and joins a group of its new device when it next
        trains); state not joined yet is host memory and needs nothing."""
        devices = {p.device for p in self.parameters(recurse=False)}
        module = super()._apply(fn, recurse)
        if {p.device for p in self.parameters(recurse=False)} != devices:
            for meta in self.fp8_meta.values():
                meta.leave()
            self._weight_cache.clear()
        return module

    def _signature(self) -> str:
        shapes = ",".join("x".join(map(str, p.shape)) for p in self.parameters(recurse=False))
        return f"{type(self).__name__}({shapes})"

    # ---- checkpoints ----------------------------------------------------------------------------
    def get_extra_state(self) -> bytes:
        """FP8 state as serialized bytes (see `decode_extra_state`).

        Checkpoint formats store bytes whole and restore them by replacement, whatever the history
        length: torch.distributed.checkpoint loads tensors in place, so a fresh module (no history
        yet) could not receive a trained module's (H x N) history if it were a tensor.
        """
        state = {"version": 2, "recipe": self._fp8_recipe_kind}
        for key in ("scaling_fwd", "scaling_bwd"):
            state[key] = self.fp8_meta[key].state()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # weights wrapped for FSDP2 FP8 all-gather are saved as plain tensors
            for name, _ in self.named_parameters(recurse=False):
                destination[prefix + name] = plain_weight(destination[prefix + name])

    def set_extra_state(self, state) -> None:
        where = self._signature()
        state = decode_extra_state(state, where)
        for key in ("scaling_fwd", "scaling_bwd"):
            self.fp8_meta[key].load(state[key], f"{where} {key}")
        if state.get("recipe") is not None:  # checked against the run's recipe at its first training call
            self._fp8_recipe_kind = state["recipe"]
        self._weight_cache.clear()
