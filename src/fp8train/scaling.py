"""Contiguous FP8 scaling state and the fused delayed-scaling update.

Every tensor role of every module in a group is one column of the same storage, and modules hold
views into it. One update (a fixed number of tensor ops) serves any number of modules, and because
the storage is the real one, the history a module sees is the rolled one.
"""

from __future__ import annotations

from typing import Optional

import torch

from .recipe import DelayedScaling

__all__ = ["ScalingStorage", "update_scaling"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


class ScalingStorage:
    """amax_history (H x N), scale (N), scale_inv (N) and the recording slot (N) of one direction."""

    def __init__(self, history_len: int, device: torch.device) -> None:
        self.history = torch.zeros(history_len, 0, device=device)
        self.scale = torch.ones(0, device=device)
        self.scale_inv = torch.ones(0, device=device)
        self.recording = torch.zeros(0, device=device)

    @property
    def num_roles(self) -> int:
        return self.scale.numel()

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def append(self, history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor) -> int:
        """Add columns holding the given state; return the offset of the first new column."""
        offset = self.num_roles
        dev = self.device
        self.history = torch.cat([self.history, history.to(dev, torch.float32)], dim=1)
        self.scale = torch.cat([self.scale, scale.to(dev, torch.float32)])
        self.scale_inv = torch.cat([self.scale_inv, scale_inv.to(dev, torch.float32)])
        self.recording = torch.cat([self.recording, torch.zeros_like(scale, device=dev, dtype=torch.float32)])
        return offset


def update_scaling(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    last: torch.Tensor,
    recipe: DelayedScaling,
    fp8_max: float,
    ok: Optional[torch.Tensor] = None,
) -> None:
    """Roll `last` into `history` and recompute `scale`/`scale_inv`, in place, for all columns at once.

    A column whose `last` is 0 (the role did not run) neither rolls nor changes scale. A column whose
    amax is not finite and positive keeps its old scale; an infinite scale is clamped to float32 max.
    `ok` (a device bool) false changes nothing: the reduction failed its check, decided on the device.
    """
    rolled = last > 0
    if ok is not None:
        rolled &= ok
    shifted = torch.cat([last.unsqueeze(0), history[:-1]])
    torch.where(rolled, shifted, history, out=history)

    algo = recipe.amax_compute_algo
    if algo == "max":
        amax = history.amax(dim=0)
    elif algo == "most_recent":
        amax = history[0]
    else:
        amax = algo(history)

    if recipe.scaling_factor_compute_algo is None:
        # torch computes `scalar / tensor` as reciprocal(tensor) * scalar (two roundings): divide two
        # tensors instead so the scale is the correctly rounded fp8_max / amax.
        new_scale = torch.full_like(amax, fp8_max).div_(amax).div_(2.0**recipe.margin)
    else:
        new_scale = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
    new_scale = torch.nan_to_num(new_scale, nan=0.0, posinf=_FLOAT32_MAX)
    usable = rolled & torch.isfinite(amax) & (amax > 0) & (new_scale > 0)
    scale.copy_(torch.where(usable, new_scale, scale))
    torch.reciprocal(scale, out=scale_inv)
