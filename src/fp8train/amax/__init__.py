"""Delayed scaling's amax protocol, behind this one face (docs/design.md, section 3).

Nothing outside `amax/` imports past this file (tests/test_layers.py). What the rest of the package
asks of the protocol:

- regions: `enter_region` / `exit_region` with a `RegionSettings` (autocast.py, prepare.py);
- calls: `begin_call(module, gemm_index)` gives the `Call` each FP8 GEMM hands down (fp8_linear,
  the recipes); `current_call` reads a module's latest call (coverage, tensor statistics);
  `recomputation_context_fn` replays calls in fp8train.checkpoint;
- modules: `register_module` / `module_of` (handles), `ScalingMeta` (fp8_meta) and its checkpoint
  form, the role layout (`roles`);
- the step boundary: `end_step`, `end_step_on`, `ending_step`, `parameters_loaded`;
- the innermost region's settings: `current_settings` (grouped GEMMs, torchtitan);
- FSDP2's FP8 gathers: `fp8_gathers` (the region, the weight scales, whether a gather serves a call);
- readers: `views` (fp8train.inspection), `HostMirror` (telemetry), `check_stage_group` (pipeline),
  `expert_group_error` (expert_parallel);
- `settings`: the knobs (async switch, initial wire size, verdict lag); `update_scaling`: the fused
  update (its benchmark).
"""

from typing import Optional

import torch

from . import roles, views
from ..runtime.calls import Call, begin_call, current_call
from .gathers import fp8_gathers
from .membership import check_stage_group, expert_group_error
from .meta import ScalingMeta, decode_extra_state
from ..runtime.plans import recomputation_context_fn
from ..runtime.regions import enter_region, exit_region
from .settings import ENV_ASYNC, settings
from ..runtime.state import STATE, Region, RegionSettings
from .stats import HostMirror
from .steps import end_step, end_step_on, ending_step, parameters_loaded
from .storage import update_scaling

__all__ = [
    "RegionSettings", "Region", "enter_region", "exit_region",
    "Call", "begin_call", "current_call", "recomputation_context_fn",
    "register_module", "module_of", "ScalingMeta", "decode_extra_state", "roles",
    "end_step", "end_step_on", "ending_step", "parameters_loaded",
    "current_settings", "fp8_gathers",
    "views", "HostMirror", "check_stage_group", "expert_group_error",
    "settings", "ENV_ASYNC", "update_scaling",
]  # fmt: skip


def register_module(module: torch.nn.Module) -> torch.Tensor:
    """A new handle for `module` (an FP8Module): how the protocol's custom ops name it."""
    return STATE.handles.register(module)


def module_of(handle: torch.Tensor) -> torch.nn.Module:
    return STATE.handles.module(handle)


def current_settings() -> Optional[RegionSettings]:
    """The innermost active region's settings (None outside every region)."""
    return STATE.regions.settings
