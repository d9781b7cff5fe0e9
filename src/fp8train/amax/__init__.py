"""Delayed scaling's amax protocol, behind this one face (docs/design.md, section 3).

Nothing outside `amax/` imports past this file (tests/test_layers.py): the modules call it per
region, per call and per step; readers (`inspection`, telemetry) see its state through views.
"""

from .calls import BWD_ROLES, FWD_ROLES, note_training_output
from .compiled import backward_scales, call_precision, check_recipe_kind, forward_scales
from .membership import check_stage_group
from .meta import ScalingMeta, decode_extra_state
from .reduction import AmaxGroup, Direction
from .regions import Region, RegionSettings, enter_region, exit_region
from .settings import ENV_ASYNC, settings
from .state import KEPT_REGIONS, REGISTRY
from .stats import HostMirror
from .steps import end_step, end_step_on, ending_step, parameters_loaded
from .storage import ScalingStorage, update_scaling

__all__ = [
    "BWD_ROLES",
    "FWD_ROLES",
    "note_training_output",
    "call_precision",
    "check_recipe_kind",
    "backward_scales",
    "forward_scales",
    "check_stage_group",
    "ScalingMeta",
    "decode_extra_state",
    "ENV_ASYNC",
    "Region",
    "RegionSettings",
    "settings",
    "enter_region",
    "exit_region",
    "KEPT_REGIONS",
    "REGISTRY",
    "HostMirror",
    "end_step",
    "end_step_on",
    "ending_step",
    "parameters_loaded",
    "ScalingStorage",
    "update_scaling",
    "AmaxGroup",
    "Direction",
]
