"""Contiguous FP8 scaling state and the fused delayed-scaling update (docs/design.md, section 2).

Every tensor role of every module in a group is one column of the same storage, and modules hold
views into it. One update (a fixed number of tensor ops) serves any number of modules, and because
the storage is the real one, the history a module sees is the rolled one.

Each column also keeps a digest of its history (integer arithmetic modulo a prime below 2**24, so
exact and identical on every device), which the update keeps current in O(N): the reduction header
carries a digest of every rank's state, and ranks whose histories differ fail its check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..numerics.formats import FLOAT32_MAX

if TYPE_CHECKING:
    from ..recipe import DelayedScaling

__all__ = ["DIGEST_PRIME", "ScalingStorage", "bits_mod_p", "history_digest", "update_scaling"]

DIGEST_PRIME = 16_777_213  # the largest prime below 2**24: a digest is exact in float32
_ROW_BASE = 1_000_003  # the digest weighs history row h by _ROW_BASE**h (mod DIGEST_PRIME)


def bits_mod_p(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit pattern of each element, as an int64 modulo DIGEST_PRIME."""
    return (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) % DIGEST_PRIME


def history_digest(history: torch.Tensor) -> torch.Tensor:
    """Per column, sum over rows h of _ROW_BASE**h * bits(history[h]), modulo DIGEST_PRIME (int64)."""
    powers = [pow(_ROW_BASE, h, DIGEST_PRIME) for h in range(history.shape[0])]
    weights = torch.tensor(powers, dtype=torch.int64, device=history.device).unsqueeze(1)
    return ((weights * bits_mod_p(history)) % DIGEST_PRIME).sum(0) % DIGEST_PRIME


def _roll_digest(
    digest: torch.Tensor, history: torch.Tensor, last: torch.Tensor, rolled: torch.Tensor
) -> None:
    """Bring `digest` to the history after the rolled columns drop their oldest row and take `last`.

    Call before `history` rolls (its last row is the one that leaves)."""
    top = pow(_ROW_BASE, history.shape[0] - 1, DIGEST_PRIME)
    # (% is the floor remainder: one after the subtraction is the two of the formula; |terms| < 2**48)
    rest = (digest - bits_mod_p(history[-1]) * top) % DIGEST_PRIME
    rolled_digest = (bits_mod_p(last) + _ROW_BASE * rest) % DIGEST_PRIME
    torch.where(rolled, rolled_digest, digest, out=digest)


class ScalingStorage:
    """amax_history (H x N), scale (N), scale_inv (N), the recording slot (N), the step's accumulated
    amaxes (N, per-step reduction) and the history digest
    (N, int64) of one direction."""

    def __init__(self, history_len: int, device: torch.device) -> None:
        self.history = torch.zeros(history_len, 0, device=device)
        self.scale = torch.ones(0, device=device)
        self.scale_inv = torch.ones(0, device=device)
        self.recording = torch.zeros(0, device=device)
        self.accumulated = torch.zeros(0, device=device)  # per-step reduction: the step's amaxes so far
        self.digest = torch.zeros(0, dtype=torch.int64, device=device)

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
        history = history.to(dev, torch.float32)
        self.history = torch.cat([self.history, history], dim=1)
        self.scale = torch.cat([self.scale, scale.to(dev, torch.float32)])
        self.scale_inv = torch.cat([self.scale_inv, scale_inv.to(dev, torch.float32)])
        zeros = torch.zeros_like(scale, device=dev, dtype=torch.float32)
        self.recording = torch.cat([self.recording, zeros])
        self.accumulated = torch.cat([self.accumulated, zeros])
        self.digest = torch.cat([self.digest, history_digest(history)])
        return offset

    def refresh_digest(self) -> None:
        """Recompute the history digest from scratch: after the history was written from outside."""
        self.digest = history_digest(self.history)


def update_scaling(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    last: torch.Tensor,
    recipe: DelayedScaling,
    fp8_max: float,
    ok: Optional[torch.Tensor] = None,
    digest: Optional[torch.Tensor] = None,
) -> None:
    """Roll `last` into `history` and recompute `scale`/`scale_inv`, in place, for all columns at once.

    A column whose `last` is 0 (the role did not run) neither rolls nor changes scale. A column whose
    amax is not finite and positive keeps its old scale; an infinite scale is clamped to float32 max.
    `ok` (a device bool) false changes nothing: the reduction failed its check, decided on the device.
    `digest` (the columns' history digests) is kept current.
    """
    rolled = last > 0
    if ok is not None:
        rolled &= ok
    if digest is not None:
        _roll_digest(digest, history, last, rolled)
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
        # tensors instead so the scale is the correctly rounded fp8_max / amax (/ 1.0, margin 0, is
        # the identity: skipped).
        new_scale = torch.full_like(amax, fp8_max).div_(amax)
        if recipe.margin:
            new_scale.div_(2.0**recipe.margin)
        new_scale = torch.nan_to_num(new_scale, nan=0.0, posinf=FLOAT32_MAX)
        # an infinite amax gives the scale 0 (and a NaN one is not > 0): isfinite(amax) adds nothing
        usable = rolled & (amax > 0) & (new_scale > 0)
    else:
        new_scale = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
        new_scale = torch.nan_to_num(new_scale, nan=0.0, posinf=FLOAT32_MAX)
        usable = rolled & torch.isfinite(amax) & (amax > 0) & (new_scale > 0)
    torch.where(usable, new_scale, scale, out=scale)
    torch.reciprocal(scale, out=scale_inv)
