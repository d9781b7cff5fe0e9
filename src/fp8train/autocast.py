"""FP8 regions: `fp8_autocast`, the registry of active regions, and when reductions launch.

Forward amaxes of a region are launched when its outermost `fp8_autocast` exits; backward amaxes
when the region's last FP8 backward node has run (or, if some never run, when the backward pass
ends). Both are finished (waited on, then applied) where their values are first needed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .recipe import DelayedScaling
from .reduction import AmaxGroup, ReductionStats

__all__ = [
    "fp8_autocast",
    "autocast",
    "synchronize",
    "reduction_stats",
    "reset_reduction_stats",
    "async_amax_reduction",
    "REGISTRY",
]

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"


def async_amax_reduction() -> bool:
    """Read NVTE_ASYNC_AMAX_REDUCTION: unset or '1' is asynchronous, '0' blocking."""
    value = os.environ.get(ENV_ASYNC)
    if value is None or value.strip() == "1":
        return True
    if value.strip() == "0":
        return False
    raise ValueError(f"{ENV_ASYNC}={value!r} is not valid: use 1 (asynchronous, the default) or 0 (blocking)")


@dataclass(frozen=True)
class RegionSettings:
    enabled: bool
    calibrating: bool
    recipe: DelayedScaling
    group: object  # torch.distributed ProcessGroup or None for the world


class Region:
    """One outermost fp8_autocast entry: what it touched and what its backward still owes."""

    def __init__(self, async_op: bool) -> None:
        self.async_op = async_op
        self.snapshots: dict[AmaxGroup, tuple[torch.Tensor, torch.Tensor]] = {}  # frozen (scale, scale_inv)
        self.bwd_groups: dict[AmaxGroup, None] = {}
        self.backward_nodes = 0  # FP8 nodes whose backward has not run yet
        self.backward_recorded = False  # bwd amaxes recorded but not launched
        self.backward_task: Optional[int] = None  # graph task that will launch leftovers at its end
        self.calls: dict[int, collections.deque] = {}  # module id -> forward plans, for recompute
        self.backward_done = False
        self.keys: dict[tuple, None] = {}  # (recipe, group) of every FP8 or calibrating entry
        self.index = -1  # which training region of this process (set when its forward launches)

    def scales(self, group: AmaxGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) this region uses for `group`: finished once, then frozen (a copy)."""
        snap = self.snapshots.get(group)
        if snap is None or snap[0].numel() != group.storage.num_roles:
            group.finish()
            snap = (group.storage.scale.clone(), group.storage.scale_inv.clone())
            self.snapshots[group] = snap
        return snap

    def launch_backward(self) -> None:
        if not self.backward_recorded:
            return
        self.backward_recorded = False
        for group in self.bwd_groups:
            if group.recorded_columns:
                group.launch(self.async_op, self.index)

    def note_backward(self, group: AmaxGroup) -> None:
        """A backward node of this region recorded into `group`; make sure the amaxes get launched."""
        self.bwd_groups[group] = None
        self.backward_recorded = True
        task = torch._C._current_graph_task_id()
        if self.backward_task != task:  # if some nodes never run, launch at the end of this pass
            self.backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def backward_node_done(self) -> None:
        if self.backward_nodes > 0:
            self.backward_nodes -= 1
            if self.backward_nodes == 0:
                self.finish_backward()

    def finish_backward(self) -> None:
        self.launch_backward()
        self.backward_done = True
        self.calls.clear()


class _Registry:
    """The one process-wide state: the stack of active regions and the amax groups they created."""

    def __init__(self) -> None:
        self.stack: list[RegionSettings] = []
        self.region: Optional[Region] = None
        self.groups: dict[tuple, tuple[AmaxGroup, AmaxGroup]] = {}
        self.stats = ReductionStats()
        self.live_regions: weakref.WeakSet[Region] = weakref.WeakSet()
        self.training_regions = 0  # outermost regions that launched forward reductions
        self.recompute = None  # the fp8train.checkpoint call being recomputed (recompute.CallRecord)
        self.checkpoints: list = []  # fp8train.checkpoint calls whose forward is running: they note plans

    def amax_groups(self, recipe: DelayedScaling, group) -> tuple[AmaxGroup, AmaxGroup]:
        key = (recipe, group)
        pair = self.groups.get(key)
        if pair is None:
            pair = (AmaxGroup("fwd", recipe, group, self.stats), AmaxGroup("bwd", recipe, group, self.stats))
            self.groups[key] = pair
        return pair

    def synchronize(self) -> None:
        for fwd, bwd in self.groups.values():
            fwd.finish()
            bwd.finish()


REGISTRY = _Registry()


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[DelayedScaling] = None,
    fp8_group=None,
) -> Iterator[None]:
    """Run FP8 modules inside in FP8 (or record amaxes only, with `calibrating`)."""
    if fp8_recipe is not None and not isinstance(fp8_recipe, DelayedScaling):
        raise ValueError(f"fp8_recipe must be a fp8train.DelayedScaling, got {type(fp8_recipe).__name__}")
    settings = RegionSettings(bool(enabled), bool(calibrating), fp8_recipe or DelayedScaling(), fp8_group)
    # A region re-entered while recomputing a checkpointed forward replays, it does not record.
    outermost = not REGISTRY.stack and REGISTRY.recompute is None and torch._C._current_graph_task_id() == -1
    if outermost:
        region = Region(async_amax_reduction())
        REGISTRY.region = region
        REGISTRY.live_regions.add(region)
    REGISTRY.stack.append(settings)
    if REGISTRY.region is not None and (settings.enabled or settings.calibrating):
        REGISTRY.region.keys[(settings.recipe, settings.group)] = None
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        REGISTRY.stack.pop()
        if outermost:
            _end_forward(REGISTRY.region, failed)
            REGISTRY.region = None


def _end_forward(region: Region, failed: bool) -> None:
    """Launch the forward reductions of a region that has just exited.

    Whether a rank launches must not depend on which modules ran on that rank, or ranks would pair
    different steps' collectives: after a training region (grad enabled, or amaxes recorded) the
    group of every fp8_autocast entered in it launches, recorded or not, and a region that raised
    launches an empty snapshot. What differs between ranks then fails the header check as a
    LayoutMismatchError; the header also carries the region's index, so ranks that ran different
    numbers of training regions fail it too instead of pairing different steps.
    """
    groups = [REGISTRY.groups[key][0] for key in region.keys if key in REGISTRY.groups]
    groups = [group for group in groups if group.storage is not None]
    if failed:
        for group in groups:
            group.discard_recording()
    if torch.is_grad_enabled() or any(group.recorded_columns for group in groups):
        region.index = REGISTRY.training_regions
        REGISTRY.training_regions += 1
        for group in groups:
            group.launch(region.async_op, region.index)


def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Optional[DelayedScaling] = None,
    amax_reduction_group=None,
):
    """`fp8_autocast` under TransformerEngine's newer argument names."""
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group)


def synchronize() -> None:
    """Complete every in-flight amax reduction and apply it. Issues no collective."""
    REGISTRY.synchronize()


def reduction_stats(complete: bool = True) -> dict:
    """Per-process reduction counters: launched, bytes_reduced, exposed_wait_s, hidden_s, updates,
    nonfinite_amax_events.

    By default in-flight reductions are completed first (no collective is issued), so the counters
    include the last step's update; `complete=False` reads them without waiting.
    """
    if complete:
        REGISTRY.synchronize()
    return REGISTRY.stats.as_dict()


def reset_reduction_stats() -> None:
    REGISTRY.stats.__init__()
