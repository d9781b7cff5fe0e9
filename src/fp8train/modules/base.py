"""What every FP8 module shares: its scaling metadata, the per-call plan, and extra state."""

from __future__ import annotations

import collections
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..autocast import REGISTRY, Region
from ..reduction import AmaxGroup

__all__ = ["FP8Module", "ScalingMeta", "Plan", "in_backward"]

FWD_ROLES = 3  # input, weight, output per GEMM
BWD_ROLES = 2  # grad_output, grad_input per GEMM


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where a forward is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ScalingMeta:
    """`fp8_meta["scaling_fwd"|"scaling_bwd"]`: views of this module's columns in its amax group.

    Before the module first trains in a region it owns its state; afterwards the state lives in the
    group's contiguous storage. Reading an attribute first completes in-flight reductions; read it
    again after other modules join the group (the storage is reallocated then, old views go stale).
    """

    def __init__(self, num_roles: int) -> None:
        self.num_roles = num_roles
        self.group: Optional[AmaxGroup] = None
        self.offset = 0
        self.own_history: Optional[torch.Tensor] = None  # set by load_state_dict before registering
        self.own_scale = torch.ones(num_roles)
        self.own_scale_inv = torch.ones(num_roles)

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) owns its state: it must neither share nor drag along the group."""
        state = dict(self.__dict__)
        if self.group is not None:
            state.update(
                group=None,
                offset=0,
                own_history=self.amax_history.clone(),
                own_scale=self.scale.clone(),
                own_scale_inv=self.scale_inv.clone(),
            )
        return state

    def _columns(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[..., self.offset : self.offset + self.num_roles]

    @property
    def amax_history(self) -> torch.Tensor:
        if self.group is None:
            return self.own_history if self.own_history is not None else torch.zeros(0, self.num_roles)
        self.group.finish()
        return self._columns(self.group.storage.history)

    @property
    def scale(self) -> torch.Tensor:
        if self.group is None:
            return self.own_scale
        self.group.finish()
        return self._columns(self.group.storage.scale)

    @property
    def scale_inv(self) -> torch.Tensor:
        if self.group is None:
            return self.own_scale_inv
        self.group.finish()
        return self._columns(self.group.storage.scale_inv)

    def join(self, group: AmaxGroup, signature: str, device: torch.device, wire_roles: int) -> None:
        history = self.own_history
        if history is None:
            history = torch.zeros(group.recipe.amax_history_len, self.num_roles)
        self.offset = group.register(
            signature,
            history.to(device),
            self.own_scale.to(device),
            self.own_scale_inv.to(device),
            wire_roles,
        )
        self.group = group
        self.own_history = None

    def state(self) -> dict:
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
            history = (
                None if self.group is None else torch.zeros_like(self._columns(self.group.storage.history))
            )
        if self.group is None:
            self.own_history = None if history is None else history.clone().float()
            self.own_scale = scale.clone().float()
            self.own_scale_inv = scale_inv.clone().float()
            return
        if history.shape[0] != self.group.recipe.amax_history_len:
            raise ValueError(
                f"{where}: checkpoint amax history length {history.shape[0]} differs from this run's "
                f"amax_history_len={self.group.recipe.amax_history_len}; use the recipe the checkpoint "
                "was trained with"
            )
        self.group.finish()
        storage = self.group.storage
        self._columns(storage.history).copy_(history)
        self._columns(storage.scale).copy_(scale)
        self._columns(storage.scale_inv).copy_(scale_inv)


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


@dataclass
class Plan:
    """How one forward call of a module runs: precision, scales, and where amaxes go."""

    fp8: bool
    scale: torch.Tensor  # forward scales of the module's group (a frozen snapshot), indexed by column
    scale_inv: torch.Tensor
    fwd_offset: int
    bwd_offset: int
    record: Optional[AmaxGroup] = None  # forward amaxes go here (None: record nothing)
    bwd_group: Optional[AmaxGroup] = None  # backward scales and amaxes (None: no FP8 backward)
    region: Optional[Region] = None  # owes this call's backward


EAGER_REASON = (
    "fp8train FP8 modules run eagerly inside torch.compile (amax recording, scale snapshots and "
    "recomputation plans are Python-side state); compile without fullgraph=True"
)


def _eager(forward: Callable) -> Callable:
    """`forward`, kept out of torch.compile graphs: a compiled model graph-breaks around FP8 modules.

    torch._dynamo is only touched once the user has loaded it (importing it costs about a second).
    """
    disabled: list[Callable] = []

    def prepare() -> None:  # best outside a trace: fullgraph=True then reports EAGER_REASON
        if not disabled and "torch._dynamo" in sys.modules:
            disabled.append(torch.compiler.disable(forward, recursive=True, reason=EAGER_REASON))

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return forward(self, *args, **kwargs)
        if not disabled and torch.compiler.is_compiling():
            # Traced before any eager call: dynamo cannot trace the wrapping itself. Under fullgraph=True
            # this is the error the user sees; otherwise dynamo falls back to running this frame eagerly.
            raise RuntimeError(EAGER_REASON)
        prepare()
        return disabled[0](self, *args, **kwargs)

    prepare()

    return run


class FP8Module(torch.nn.Module):
    """Base of modules with FP8 GEMMs. Subclasses set `num_gemms` and call `_plan()` in forward."""

    num_gemms = 1

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.forward = _eager(cls.forward)

    def __init__(self) -> None:
        super().__init__()
        self.fp8_meta = {
            "scaling_fwd": ScalingMeta(FWD_ROLES * self.num_gemms),
            "scaling_bwd": ScalingMeta(BWD_ROLES * self.num_gemms),
        }
        self._untracked_fp8 = False  # its last FP8 forward ran without grad (eval, reentrant checkpoint)
        self._weight_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _signature(self) -> str:
        shapes = ",".join("x".join(map(str, p.shape)) for p in self.parameters(recurse=False))
        return f"{type(self).__name__}({shapes})"

    # ---- choosing how this call runs ----------------------------------------------------------
    def _plan(self) -> Optional[Plan]:
        if REGISTRY.recompute is not None or in_backward():
            plan = self._recompute_plan()
            if plan is not None:
                for call in REGISTRY.checkpoints:  # a checkpoint nested in the one being recomputed
                    call.add(id(self), plan)
            return plan
        training = torch.is_grad_enabled()
        settings = REGISTRY.stack[-1] if REGISTRY.stack else None
        if settings is None or not (settings.enabled or settings.calibrating):
            self._untracked_fp8 = self._untracked_fp8 and not training
            return None
        self._untracked_fp8 = settings.enabled and not training
        fwd_meta, bwd_meta = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        record = settings.calibrating or training
        fwd, bwd = REGISTRY.amax_groups(settings.recipe, settings.group)
        if fwd_meta.group is None and record:
            device = next(self.parameters()).device
            wire = FWD_ROLES * self.num_gemms  # both directions send as many values (see AmaxGroup)
            fwd_meta.join(fwd, self._signature(), device, wire)
            bwd_meta.join(bwd, self._signature(), device, wire)
        elif record and fwd_meta.group is not fwd:
            raise RuntimeError(
                f"{self._signature()} trains under one recipe and amax group; it was first trained with "
                f"{fwd_meta.group.recipe} and is now run with {settings.recipe} (or another group). Use "
                "the same fp8_recipe and fp8_group for every training region of a module"
            )
        region = REGISTRY.region
        if fwd_meta.group is None:  # not trained yet (eval): its own scales, on the module's device
            device = next(self.parameters()).device
            scale, scale_inv, offset = fwd_meta.own_scale.to(device), fwd_meta.own_scale_inv.to(device), 0
        else:
            scale, scale_inv = region.scales(fwd_meta.group)
            offset = fwd_meta.offset
        fp8 = settings.enabled
        plan = Plan(
            fp8=fp8,
            scale=scale,
            scale_inv=scale_inv,
            fwd_offset=offset,
            bwd_offset=bwd_meta.offset,
            record=fwd_meta.group if record else None,
            bwd_group=bwd_meta.group if (fp8 and training) else None,
            region=region if (fp8 and training) else None,
        )
        if training:
            replay = Plan(fp8, scale, scale_inv, offset, bwd_meta.offset)  # no reference to the region
            region.calls.setdefault(id(self), collections.deque()).append(replay)
            for call in REGISTRY.checkpoints:
                call.add(id(self), replay)
        return plan

    def _recompute_plan(self) -> Optional[Plan]:
        """The plan of the original forward call, replayed: same scales, no amax, no registration."""
        call = REGISTRY.recompute
        if call is not None:  # fp8train.checkpoint noted this call's plans and restored its settings
            settings = REGISTRY.stack[-1] if REGISTRY.stack else None
            if settings is None or not (settings.enabled or settings.calibrating):
                return None  # the original call ran in high precision
            plan = call.next(id(self))
            if plan is None:
                raise RuntimeError(
                    f"{self._signature()} runs more often in the recomputed forward than in the original "
                    "one; a function passed to fp8train.checkpoint must call the same FP8 modules each time"
                )
            return plan
        # torch.utils.checkpoint: the one region whose backward still owes a call of this module
        candidates = [r for r in list(REGISTRY.live_regions) if not r.backward_done and r.calls.get(id(self))]
        if not candidates and not self._untracked_fp8:
            return None  # no FP8 training call pending: the original forward was high precision
        if len(candidates) == 1:
            return candidates[0].calls[id(self)].popleft()
        raise RuntimeError(
            f"{self._signature()} is being recomputed during backward, but fp8train cannot tell which "
            f"FP8 forward it repeats ({len(candidates)} candidate regions). Wrap the recomputed code in "
            "fp8train.checkpoint(fn, *args), or use torch.utils.checkpoint with use_reentrant=False "
            "and one region per backward pass; use_reentrant=True is not supported, and a region's "
            "backward must run in one backward pass"
        )

    # ---- checkpoints ----------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {
            "version": 1,
            "scaling_fwd": self.fp8_meta["scaling_fwd"].state(),
            "scaling_bwd": self.fp8_meta["scaling_bwd"].state(),
        }

    def set_extra_state(self, state) -> None:
        where = self._signature()
        if not isinstance(state, dict) or state.get("version") != 1 or "scaling_fwd" not in state:
            raise ValueError(
                f"{where}: the checkpoint's FP8 extra state is not an fp8train (version 1) state; "
                "load a checkpoint saved by fp8train's state_dict()"
            )
        for key in ("scaling_fwd", "scaling_bwd"):
            self.fp8_meta[key].load(state[key], f"{where} {key}")
        self._weight_cache.clear()
