"""Delayed scaling's state, behind this one face (docs/design.md, sections 3 and 3.1).

What `amax/` keeps is delayed scaling's: its amax groups (both directions, their storage, the wire
and channel of each process group, the reductions), the step boundary of per-step groups, the
`fp8_meta` views of each module's columns and the membership checks. Its recipe owns it through the
runtime's hooks (`runtime.RecipeRuntime`): `DelayedRuntime`, the base of `DelayedQuantization`, answers
them (a region's amax group, a call's plan with frozen scales, a GEMM's scales and recorded amaxes,
a backward's gradient scale, what FSDP2 casts a shard with), and each `AmaxGroup` launches its
reductions when a region that trained it exits and when a backward pass that recorded into it ends.
The runtime (regions, calls, plans, replays, handles, compiled ops) is `fp8train.runtime`.

Nothing outside `amax/` imports past this file (tests/test_layers.py). Its names:

- `DelayedRuntime`: the hooks (quantization/delayed.py);
- `ScalingMeta`, `decode_extra_state`, `roles`: a module's `fp8_meta` and its checkpoint form, the
  role layout (modules/base.py, telemetry);
- `steps`: the step boundary (`end_step`, `end_step_on`, `ending_step`, `parameters_loaded`);
- `fp8_gathers`: FSDP2's FP8 gathers (the region, the weight scales, whether a gather serves a call);
- `membership`: who may share an amax group (`check_stage_group`, pipeline; `expert_group_error`,
  expert_parallel);
- readers: `views` (fp8train.inspection), `HostMirror` (telemetry);
- `settings`: the knobs (async switch and its variable `settings.ENV_ASYNC`, initial wire size,
  verdict lag); `update_scaling`: the fused update (its benchmark).
"""

from . import membership, roles, steps, views
from .gathers import fp8_gathers
from .hooks import DelayedRuntime
from .meta import ScalingMeta, decode_extra_state
from .settings import settings
from .stats import HostMirror
from .storage import update_scaling

__all__ = [
    "DelayedRuntime", "ScalingMeta", "decode_extra_state", "roles", "steps", "fp8_gathers", "membership",
    "views", "HostMirror", "settings", "update_scaling",
]  # fmt: skip
