"""FP8 regions and backward passes: when every amax group launches (docs/design.md, section 3).

- An amax group's forward amaxes are launched when the outermost `fp8_autocast` exits, for a region
  in which the group recorded amaxes for training (an FP8 call with grad enabled, or a calibrating
  one), in the order in which the groups first trained in it. A region in which a group trained
  nothing (evaluation without grad, no call at all) launches nothing for it and does not count, so
  one rank may evaluate, or evaluate more batches, alone.
- Each amax group numbers its own training regions; the number travels in every header.
- Backward amaxes are launched when the backward pass that recorded them ends: the same point on
  every rank, whatever else issued collectives during the pass.
- `Direction.finish` (reduction.py) is the only wait. It runs at the first FP8 call of a region
  (`Region.scales_for`), the first FP8 backward node of a pass (ops.py), a launch, and every reader
  of FP8 state (inspection.py).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..torch_internals import in_backward, in_pipeline_shape_inference
from .reduction import AmaxGroup, Direction
from .settings import settings as knobs
from .state import REGISTRY

__all__ = [
    "RegionSettings",
    "Region",
    "BackwardPass",
    "enter_region",
    "exit_region",
]


@dataclass(frozen=True)
class RegionSettings:
    """One fp8_autocast entry's arguments, with its recipe's quantization."""

    enabled: bool
    calibrating: bool
    recipe: object  # one of recipe.RECIPES
    quantization: Any  # the recipe's Quantization (quantization/), opaque to the protocol
    group: object  # the amax group's torch.distributed ProcessGroup, or None for the world

    @property
    def active(self) -> bool:
        """FP8 casts or amax recording happen in this region."""
        return self.enabled or self.calibrating


class Region:
    """One outermost fp8_autocast entry: the amax groups it trained, and its forward calls."""

    def __init__(self, serial: int, async_op: bool) -> None:
        self.serial = serial
        self.async_op = async_op
        self.grad_at_entry = torch.is_grad_enabled()
        self.trained: dict[AmaxGroup, int] = {}  # groups in the order they first trained -> index
        self.snapshots: dict[Direction, tuple[torch.Tensor, torch.Tensor]] = {}  # frozen (scale, scale_inv)
        self.calls: dict[int, collections.deque] = {}  # module id -> forward plans, for recomputation
        self.outputs: list[weakref.ref] = []  # autograd nodes of its FP8 training calls' outputs
        self.compiled_calls = False  # training calls from a compiled graph, whose outputs are not seen
        self.backward_done = False

    def owes_backward(self) -> bool:
        """Its backward has not run and its graph is alive (a dropped graph owes nothing)."""
        if self.backward_done:
            return False
        # no node: no call produced a graph (frozen layers), unless a compiled graph made the calls
        return self.compiled_calls or any(node() is not None for node in self.outputs)

    def index_of(self, group: AmaxGroup) -> int:
        """This region's index among `group`'s training regions (taken by its first launch)."""
        if self.trained[group] < 0:
            self.trained[group] = group.next_region_index()
        return self.trained[group]

    def scales_for(self, direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) this region uses for `direction`: finished once, then frozen (a copy)."""
        snap = self.snapshots.get(direction)
        if snap is None or snap[0].numel() != direction.storage.num_roles:
            direction.finish()
            direction.check()
            snap = (direction.storage.scale.clone(), direction.storage.scale_inv.clone())
            self.snapshots[direction] = snap
        return snap


class BackwardPass:
    """What one backward pass (an autograd graph task) recorded: launched when the pass ends.

    Each group's reduction carries the index of the region whose backward recorded into it first in
    the pass, so a rank that ran a backward its peers did not (or in another order) fails the check.
    """

    def __init__(self) -> None:
        self.groups: dict[AmaxGroup, Region] = {}  # group -> the first region that recorded into it
        self.regions: dict[Region, None] = {}

    def note(self, group: Optional[AmaxGroup], region: Optional[Region]) -> None:
        if region is None:  # its region was collected: it cannot be named, the group's latest stands in
            region = group.latest_region
        if group is not None:  # None: a recipe that reduces nothing
            self.groups.setdefault(group, region)
        self.regions[region] = None

    def end(self) -> None:
        for group, region in self.groups.items():
            if group.recipe.per_step:  # kept for the step boundary (steps.py)
                group.bwd.accumulate()
                REGISTRY.note_step_group(group)
            elif group.bwd.recorded_columns:
                group.bwd.launch(region.async_op, region.index_of(group))
        for region in self.regions:
            region.backward_done = True
            region.calls.clear()


def current_backward_pass() -> BackwardPass:
    return REGISTRY.backward_pass(BackwardPass)


def enter_region(settings: RegionSettings) -> Optional[Region]:
    """Push `settings`; return the new Region when this entry is outermost (None otherwise)."""
    replaying = REGISTRY.recompute is not None or in_backward()
    if settings.active and not REGISTRY.stack and in_pipeline_shape_inference():
        settings = replace(settings, enabled=False, calibrating=False)  # shapes only: high precision
    region = None
    if not REGISTRY.stack and not replaying:
        region = Region(REGISTRY.regions_entered + 1, knobs.asynchronous())
    if settings.active and settings.quantization.reduces_amax and not replaying:
        REGISTRY.amax_group(settings.recipe, settings.group)  # a group this rank is not in: raise now
    # nothing above may have left state behind: it can raise (a bad env value, a foreign group)
    REGISTRY.push(settings, region)
    return region


def exit_region(region: Optional[Region], failed: bool) -> None:
    """Pop a region; when it is the outermost, launch the forward reductions it owes.

    A region that raised launches what it owes with its amaxes discarded, so a rank that caught an
    exception its peers did not have fails their header check instead of pairing other steps.
    """
    REGISTRY.pop(region)
    if region is None:
        return
    for group in region.trained:
        if failed:
            group.fwd.discard_recording()
        group.latest_region = region
        if group.recipe.per_step:  # kept for the step boundary (steps.py)
            group.fwd.accumulate()
            REGISTRY.note_step_group(group)
        else:
            group.fwd.launch(region.async_op, region.index_of(group))
