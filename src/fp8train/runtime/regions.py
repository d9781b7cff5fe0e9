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
  (`Region.scales_for`), the first FP8 backward node of a pass (calls.py), a launch, and every reader
  of FP8 state (views.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..torch_internals import in_backward, in_pipeline_shape_inference
from ..amax.settings import settings as knobs
from .state import STATE, BackwardPass, Region, RegionSettings

__all__ = ["enter_region", "exit_region", "current_backward_pass"]


def current_backward_pass() -> BackwardPass:
    return STATE.backward.current()


def enter_region(settings: RegionSettings, fp8_group=None) -> Optional[Region]:
    """Push `settings`; return the new Region when this entry is outermost (None otherwise).

    `fp8_group`: the amax group's process group (None: the world). Under delayed scaling in an active
    region, its amax group is looked up here, once, and kept in the settings pushed (`amax_group`)."""
    regions = STATE.regions
    replaying = STATE.recompute.replaying is not None or in_backward()
    if settings.active and not regions.stack and in_pipeline_shape_inference():
        settings = replace(settings, enabled=False, calibrating=False)  # shapes only: high precision
    region = None
    if not regions.stack and not replaying:
        region = Region(regions.entered + 1, knobs.asynchronous())
    if settings.active and settings.quantization.reduces_amax:
        # a group this rank is not in raises now (a replay's group was checked by its original entry)
        settings = replace(settings, amax_group=STATE.groups.of(settings.recipe, fp8_group))
    # nothing above may have left state behind: it can raise (a bad env value, a foreign group)
    regions.push(settings, region)
    return region


def exit_region(region: Optional[Region], failed: bool) -> None:
    """Pop a region; when it is the outermost, launch the forward reductions it owes.

    A region that raised launches what it owes with its amaxes discarded, so a rank that caught an
    exception its peers did not have fails their header check instead of pairing other steps.
    """
    STATE.regions.pop(region)
    if region is None:
        return
    for group in region.trained:
        if failed:
            group.fwd.discard_recording()
        group.note_exit(region)
        if group.recipe.per_step:  # kept for the step boundary (steps.py)
            group.fwd.accumulate()
            STATE.step.note_group(group)
        else:
            group.fwd.launch(region.async_op, region.index_of(group))
