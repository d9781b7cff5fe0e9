"""Delayed scaling's state between calls (docs/design.md, sections 3 and 3.1): its amax groups (with
the channel of each process group and the reduction counters) and the step boundary, attached to the
runtime's one state (`STATE.attach`: reset with it, no second registry); a region's frozen scales; and
the plan of a delayed-scaling module call, which extends the runtime's `ForwardPlan`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..runtime import STATE, ForwardPlan
from .channel import Channel
from .membership import reduces_across_ranks, world_if_default
from .reduction import AmaxGroup, Direction, StepBoundary
from .stats import ReductionStats

if TYPE_CHECKING:
    from ..runtime import Region

__all__ = ["AMAX", "AmaxGroups", "FrozenScales", "DelayedPlan", "frozen_scales"]


class FrozenScales:
    """A direction's scales frozen for a region (a copy): [scale; scale_inv] as one 2 x N tensor, made
    in one op, and what every GEMM of the region reads from it, made once for all of them at the
    region's first GEMM (the lean path, docs/design.md, section 6): each GEMM's [[x, w], [x_inv, w_inv]]
    block and each column's scale and scale_inv, as views (three unbinds for the region, where each
    GEMM would slice its block and each cast select its scales)."""

    __slots__ = ("stacked", "scale", "scale_inv", "_views")

    def __init__(self, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.stacked = torch.stack([scale, scale_inv])
        self.scale, self.scale_inv = self.stacked.unbind()
        self._views: Optional[tuple[tuple, tuple, tuple]] = None

    def gemm(self, base: int) -> tuple[torch.Tensor, tuple]:
        """The block [[x, w], [x_inv, w_inv]] of the GEMM whose input's column is `base` (its weight's
        is base + 1), and its casts' ((x, x_inv), (w, w_inv)), as views of the frozen copy."""
        views = self._views
        if views is None:  # block b is stacked[:, b : b + 2], a window of the unfolded copy
            blocks = self.stacked.unfold(1, 2, 1).unbind(1)
            views = self._views = (blocks, self.scale.unbind(), self.scale_inv.unbind())
        blocks, scales, inverses = views
        return blocks[base], ((scales[base], inverses[base]), (scales[base + 1], inverses[base + 1]))


def frozen_scales(region: Region, direction: Direction) -> FrozenScales:
    """The scales `region` uses for `direction`: finished once, then frozen (a copy), kept by the
    direction for its latest region (regions run one at a time; a recomputation replays its plan's)."""
    snap = direction.frozen
    storage = direction.storage
    if snap is None or snap[0] != region.serial or snap[1].scale.shape[0] != storage.scale.shape[0]:
        direction.finish()
        direction.check()
        snap = direction.frozen = (region.serial, FrozenScales(storage.scale, storage.scale_inv))
    return snap[1]


@dataclass
class DelayedPlan(ForwardPlan):
    """A delayed-scaling module call's plan: the runtime's, with the region's frozen scales of the
    module's group and where its amaxes go."""

    scale: Optional[torch.Tensor] = None  # forward scales of the module's group (a frozen snapshot)
    scale_inv: Optional[torch.Tensor] = None
    offset: int = 0  # the module's first column in its group's forward storage
    records_into: Optional[Direction] = None  # forward amaxes go here (None: record nothing)
    frozen: Optional[FrozenScales] = None  # the region's frozen scales, when scale and scale_inv are its
    # `given` (ForwardPlan's): (block, its casts' pairs or None, its (input, weight) columns), for the
    # call's `for_gemm` and `amax_slot`

    def replay(self) -> DelayedPlan:
        """The plan as a recomputation replays it: same scales, no amax recorded, no region held."""
        return DelayedPlan(
            self.fp8, self.quantization, serial=self.serial, scale=self.scale, scale_inv=self.scale_inv,
            offset=self.offset, frozen=self.frozen,
        )  # fmt: skip

    def same_as(self, other: ForwardPlan) -> bool:
        return isinstance(other, DelayedPlan) and self.fp8 == other.fp8 and self.scale is other.scale


class AmaxGroups:
    """The amax groups, the channel of each process group, and their reduction counters; and the
    step boundary of the per-step groups. A part of the runtime's state (`STATE.attach`), reset with it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = StepBoundary()
        self.groups: dict[tuple, AmaxGroup] = {}
        self._last: Optional[tuple] = None  # (recipe, process group, its group): `of`'s last answer
        self.channels: dict[object, Channel] = {}
        self.stats = ReductionStats()

    def of(self, recipe, process_group) -> AmaxGroup:
        """The amax group of `recipe` (a DelayedScaling) on `process_group` (None: the world). The last
        answer is kept for the same two objects (every FP8 call of a region asks it)."""
        process_group = world_if_default(process_group)
        last = self._last
        if last is not None and last[0] is recipe and last[1] is process_group:
            return last[2]
        group = self._of(recipe, process_group)
        self._last = (recipe, process_group, group)
        return group

    def _of(self, recipe, process_group) -> AmaxGroup:
        # recipes equal as the header sees them (callables by their code) share a group
        key = (recipe.key(), recipe.reduce_amax, process_group)
        group = self.groups.get(key)
        if group is None:
            channel = None
            if reduces_across_ranks(recipe, process_group):
                channel = self.channels.setdefault(process_group, Channel())
            group = self.groups[key] = AmaxGroup(recipe, process_group, channel, self.stats, self.step)
        return group

    def synchronize(self) -> None:
        """Complete every in-flight amax reduction and apply it, then raise any mismatch. No collective."""
        for group in self.groups.values():
            group.fwd.finish()
            group.bwd.finish()
        for channel in self.channels.values():
            channel.check(block=True)


AMAX = STATE.attach(AmaxGroups())  # delayed scaling's part of the one state
