"""`fp8_meta["scaling_fwd"|"scaling_bwd"]`: a module's delayed-scaling state (amax histories, scales,
scale_inv), its own before the module first trains and views of its amax group's storage after; and
that state in checkpoints (docs/design.md, sections 2 and 5)."""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from .reduction import Direction
from .state import frozen_scales

if TYPE_CHECKING:
    from ..runtime import Region

__all__ = ["ScalingMeta", "decode_extra_state"]

# A per-step group's amaxes of the open step are rank-local until the boundary reduces them, and
# reducing them for a save would be a collective, which rank 0 saving alone cannot issue: such a
# checkpoint records the rank that saved it and its group's ranks, and resumes on that rank of that
# group only (each rank saving and loading its own file); loaded by another rank or into another
# group it is refused, instead of resuming with the saving rank's amaxes as the group's.
PARTIAL_STEP_SAVED = (
    "fp8train: this FP8 state is saved in the middle of an optimizer step of a multi-rank "
    "DelayedScaling(amax_reduction='step') group; it holds this rank's amaxes of the step only: it "
    "resumes on this rank of this group (each rank loading the file it saved), and is refused "
    "elsewhere. Save at a step boundary (after fp8train.end_step() or the optimizer step) to get a "
    "checkpoint that any rank can load"
)
PARTIAL_STEP_REFUSED = (
    "checkpoint saved in the middle of an optimizer step under DelayedScaling(amax_reduction='step') "
    "by {saver} of a {ranks}-rank amax group{where_loaded}: it holds that rank's amaxes of the step so "
    "far, not the group's (they are reduced only at the step boundary), so resuming from it elsewhere "
    "would silently give the step other scales than the uninterrupted run. Each rank may resume from "
    "the mid-step state it saved itself, in the same group; otherwise resume from a checkpoint saved "
    "at a step boundary (after fp8train.end_step() or the optimizer step: rank 0 alone may save then)"
)


def _global_rank() -> Optional[int]:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _group_ranks(direction: Optional[Direction]) -> Optional[list[int]]:
    """The global ranks of `direction`'s amax group; None for a group of one rank (no channel)."""
    channel = None if direction is None else direction.channel
    return None if channel is None else list(dist.get_process_group_ranks(direction.group.process_group))


def _refused(ranks, saved_by, group, where_loaded: str) -> ValueError:
    saver = "one rank" if saved_by is None else f"global rank {saved_by}"
    if group is not None:
        saver += f" (group ranks {group})"
    return ValueError(PARTIAL_STEP_REFUSED.format(saver=saver, ranks=ranks, where_loaded=where_loaded))


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
        self.own_step_amax: Optional[torch.Tensor] = None  # likewise: a per-step checkpoint saved mid-step
        self.own_step_group: Optional[list[int]] = None  # the global ranks of the group that saved it
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

    def scales_in(self, region: Region, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(scale, scale_inv, offset): the scales `module` (this direction's) casts with in `region`,
        and its first column in them. A module that has not trained yet uses its own (on its
        parameters' device; joining its group keeps them); a member uses its group's, frozen for the
        region."""
        if self.direction is None:
            return *self.own_scales(next(module.parameters()).device), 0
        frozen = frozen_scales(region, self.direction)
        return frozen.scale, frozen.scale_inv, self.offset

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

    def _settled(self, name: str) -> torch.Tensor:
        self.direction.settle()
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
        saved_group = self.own_step_group
        if self.own_step_amax is not None and direction.recipe.per_step and saved_group is not None:
            group = _group_ranks(direction)
            if group != saved_group:  # refused before the module joins
                loaded = f", loaded into the amax group of ranks {group or [_global_rank()]}"
                error = _refused(len(saved_group), _global_rank(), saved_group, loaded)
                raise ValueError(f"{signature}: {error}")
        history = self.own_history
        if history is None:
            history = torch.zeros(direction.recipe.amax_history_len, self.num_roles)
        self.offset = direction.register(
            signature, history.to(device), self.own_scale.to(device), self.own_scale_inv.to(device)
        )
        self.direction = direction
        self.own_history = None
        self.own_step_group = None
        if self.own_step_amax is not None and direction.recipe.per_step:
            direction.restore_accumulated(self.offset, self.own_step_amax.to(device))
        self.own_step_amax = None

    def state(self) -> dict:
        """This direction's state, for a checkpoint: a host point (mismatches seen so far are raised)."""
        if self.direction is not None:
            self.direction.settle(host_point=True)
        state = {
            "amax_history": self.amax_history.detach().clone().cpu(),
            "scale": self.scale.detach().clone().cpu(),
            "scale_inv": self.scale_inv.detach().clone().cpu(),
        }
        step_amax = self._step_amax()
        if step_amax is not None:  # per-step reduction, saved mid-step: the step's amaxes so far
            state["step_amax"] = step_amax.cpu()
            channel = self.direction.channel if self.direction is not None else None
            if channel is not None:  # this rank's amaxes only: the others' are reduced at the boundary
                state["step_amax_ranks"] = dist.get_world_size(self.direction.group.process_group)
                state["step_amax_saved_by"] = dist.get_rank()  # global ranks: what a restart keeps
                state["step_amax_group"] = _group_ranks(self.direction)
                if bool(step_amax.any()):
                    warnings.warn(PARTIAL_STEP_SAVED, stacklevel=4)
        return state

    def _step_amax(self) -> Optional[torch.Tensor]:
        if self.direction is None:
            return self.own_step_amax
        if not self.direction.recipe.per_step:
            return None
        self.direction.accumulate()
        return self._columns(self.direction.storage.accumulated).clone()

    def _own_partial(self, state: dict, ranks, where: str) -> list[int]:
        """The group (global ranks) of a mid-step partial of a multi-rank group, if this rank saved
        it (and, for a module in its group already, into this group); else the refusal."""
        saved_by, group = state.get("step_amax_saved_by"), state.get("step_amax_group")
        rank = _global_rank()
        if not isinstance(saved_by, int) or not isinstance(group, list) or rank != saved_by:
            loaded = "" if not isinstance(saved_by, int) else f", loaded by global rank {rank}"
            raise ValueError(f"{where}: {_refused(ranks, saved_by, group, loaded)}")
        if self.direction is not None and _group_ranks(self.direction) != group:
            loaded = f", loaded into the amax group of ranks {_group_ranks(self.direction) or [rank]}"
            raise ValueError(f"{where}: {_refused(ranks, saved_by, group, loaded)}")
        return group

    def load(self, state: dict, where: str) -> None:
        history, scale, scale_inv = _checked_state(state, where)
        n = self.num_roles
        if scale.shape != (n,) or scale_inv.shape != (n,) or history.dim() != 2 or history.shape[1] != n:
            raise ValueError(
                f"{where}: checkpoint FP8 state has scale {tuple(scale.shape)} and amax_history "
                f"{tuple(history.shape)}, but this module has {n} roles (expected scale ({n},) and "
                f"amax_history (H, {n})); the checkpoint belongs to a different model"
            )
        step_amax = state.get("step_amax")
        if step_amax is not None and (
            step_amax.shape != (n,) or bool((torch.isnan(step_amax) | (step_amax < 0)).any())
        ):
            raise ValueError(
                f"{where}: checkpoint step_amax is not {n} amaxes >= 0; the checkpoint file is corrupted"
            )
        ranks = state.get("step_amax_ranks", 1)
        saved_group = None
        if step_amax is not None and (not isinstance(ranks, int) or ranks > 1) and bool(step_amax.any()):
            saved_group = self._own_partial(state, ranks, where)
        if history.shape[0] == 0:  # saved before the module ever trained: no history yet
            history = None if self.direction is None else torch.zeros_like(self._settled("history"))
        if self.direction is None:
            self.own_history = None if history is None else history.clone().float()
            self.own_scale = scale.clone().float()
            self.own_scale_inv = scale_inv.clone().float()
            self.own_step_amax = None if step_amax is None else step_amax.clone().float()
            self.own_step_group = saved_group  # checked when the module joins its group
            self._own_on_device.clear()
            return
        if history.shape[0] != self.direction.recipe.amax_history_len:
            raise ValueError(
                f"{where}: checkpoint amax history length {history.shape[0]} differs from this run's "
                f"amax_history_len={self.direction.recipe.amax_history_len}; use the recipe the checkpoint "
                "was trained with"
            )
        self.direction.settle()
        storage = self.direction.storage
        self._columns(storage.history).copy_(history)
        self._columns(storage.scale).copy_(scale)
        self._columns(storage.scale_inv).copy_(scale_inv)
        storage.refresh_digest()
        if step_amax is not None:
            self.direction.restore_accumulated(self.offset, step_amax)


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
    `get_extra_state`, the same bytes as a 1-D uint8 tensor (`extra_state_as_tensor`: formats that
    store tensors only, such as safetensors), or the dict that version 1 checkpoints hold."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        state = bytes(state.cpu().tolist())  # no numpy: the core needs torch only
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
