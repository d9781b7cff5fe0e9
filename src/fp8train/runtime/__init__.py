"""The FP8 runtime of every recipe, behind this one face (docs/design.md, sections 3 and 3.1). It
knows no recipe: what a recipe keeps (delayed scaling's amax groups, amax/) it reaches through the
hooks of the recipe's quantization (`RecipeRuntime`, state.py).

- regions: `enter_region` / `exit_region` with a `RegionSettings` (autocast.py, prepare.py), the
  innermost region's settings (`current_settings`), the live regions (`STATE.regions`);
- calls: `begin_call(module, gemm_index)` gives the `Call` each FP8 GEMM hands down; `current_call`
  reads a module's latest call (coverage, tensor statistics); a module call's `ForwardPlan`, made by
  its recipe; `recomputation_context_fn` replays calls in fp8train.checkpoint;
- modules: `register_module` / `module_of` (handles, how the compiled ops name a module);
- compiled ops: `forward_scales_op` (a recipe's scales in a graph), `add_protocol_ops` (a recipe's
  own ops), `inductor_configured`;
- the hooks: `RecipeRuntime` (a stateless recipe's defaults) and `RecipeState`;
- `STATE`: the one process-wide state, to which a recipe attaches its part (`STATE.attach`).
"""

from typing import Optional

import torch

from .calls import Call, add_protocol_ops, begin_call, current_call, forward_scales_op, inductor_configured
from .plans import recomputation_context_fn
from .regions import enter_region, exit_region
from .state import (
    KEPT_REGIONS,
    STATE,
    ForwardPlan,
    RecipeRuntime,
    RecipeState,
    Region,
    RegionSettings,
    host_int,
    host_scalar,
)

__all__ = [
    "RegionSettings", "Region", "enter_region", "exit_region", "current_settings",
    "Call", "begin_call", "current_call", "ForwardPlan", "recomputation_context_fn",
    "register_module", "module_of", "forward_scales_op", "add_protocol_ops", "inductor_configured",
    "RecipeRuntime", "RecipeState", "STATE", "KEPT_REGIONS", "host_scalar", "host_int",
]  # fmt: skip


def register_module(module: torch.nn.Module) -> torch.Tensor:
    """A new handle for `module` (an FP8Module): how the runtime's custom ops name it."""
    return STATE.handles.register(module)


def module_of(handle: torch.Tensor) -> torch.nn.Module:
    return STATE.handles.module(handle)


def current_settings() -> Optional[RegionSettings]:
    """The innermost active region's settings (None outside every region)."""
    return STATE.regions.settings
