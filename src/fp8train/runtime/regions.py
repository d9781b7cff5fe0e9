"""FP8 regions: `fp8_autocast`'s entry and exit, and the backward pass that runs (docs/design.md,
sections 3 and 3.1).

- An entry pushes its settings; the outermost entry makes a `Region` (numbered in the order of entry).
  The recipe's state for an active entry is looked up once, here (`RecipeRuntime.region_state`:
  delayed scaling's amax group, whose membership errors are raised now), and kept in the settings.
- The outermost exit tells every recipe state that trained in the region (`RecipeState.exited`:
  delayed scaling launches its forward amax reduction), in the order in which they first trained.
- A backward pass tells the states its GEMMs recorded into when it ends (`BackwardPass.end`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..torch_internals import in_backward, in_pipeline_shape_inference
from .state import STATE, BackwardPass, Region, RegionSettings

__all__ = ["enter_region", "exit_region", "current_backward_pass"]


def current_backward_pass() -> BackwardPass:
    return STATE.backward.current()


def enter_region(settings: RegionSettings, fp8_group=None) -> Optional[Region]:
    """Push `settings`; return the new Region when this entry is outermost (None otherwise).

    `fp8_group`: the process group of the recipe's state (delayed scaling: the amax group's; None:
    the world), looked up once for an active entry and kept in the settings pushed (`state`)."""
    regions = STATE.regions
    replaying = STATE.recompute.replaying is not None or in_backward()
    if settings.active and not regions.stack and in_pipeline_shape_inference():
        settings = replace(settings, enabled=False, calibrating=False)  # shapes only: high precision
    region = None
    if not regions.stack and not replaying:
        region = Region(regions.entered + 1)
    if not replaying and settings.quantization is not None:
        settings.quantization.region_entered()
    if settings.active:
        # a state this rank may not take raises now (a replay's was checked by its original entry)
        outer = region if region is not None else regions.region
        state = settings.quantization.region_state(settings, outer, fp8_group)
        if state is not None:
            settings = replace(settings, state=state)
    # nothing above may have left state behind: it can raise (a bad env value, a foreign group)
    regions.push(settings, region)
    return region


def exit_region(region: Optional[Region], failed: bool) -> None:
    """Pop a region; when it is the outermost, tell each recipe state that trained in it (in the order
    they first trained), which launches what the region owes (`failed`: it raised)."""
    STATE.regions.pop(region)
    if region is None:
        return
    for state in region.trained:
        state.exited(region, failed)
