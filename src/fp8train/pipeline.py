"""FP8 stages of `torch.distributed.pipelining` (docs/design.md, section 14).

Each stage's amax group must stay inside the stage (its data- and tensor-parallel ranks): stages run
different modules at different times. `prepare_stage` checks that when the stage is built, on every
rank and before any communication, so a misconfigured group is an error on every rank instead of one
stage raising in its first forward while the next waits for its activations. Then it makes every
call of the stage's module one FP8 region (`fp8_regions`), which is one region per microbatch
whichever schedule runs it; per-step reduction (`DelayedScaling(amax_reduction="step")`) needs
`fp8train.end_step()` after `schedule.step(...)`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .autocast import autocast
from .tensor_parallel import check_stage_group

__all__ = ["check_stage", "prepare_stage", "fp8_regions"]


def check_stage(stage, amax_reduction_group=None) -> None:
    """Raise (on every rank alike) if `amax_reduction_group` (None: the world) holds ranks of other
    stages of `stage`'s pipeline (a torch.distributed.pipelining PipelineStage)."""
    group = dist.group.WORLD if amax_reduction_group is None else amax_reduction_group
    check_stage_group(f"pipeline stage {stage.stage_index}", group, True, stage.group)


def fp8_regions(
    module: torch.nn.Module,
    recipe=None,
    amax_reduction_group=None,
    enabled: bool = True,
    calibrating: bool = False,
) -> torch.nn.Module:
    """Make every call of `module` one FP8 region (`fp8train.autocast(enabled, calibrating, recipe,
    amax_reduction_group)` around its forward), in place: a schedule calls the stage's module once per
    microbatch, so that is one region per microbatch. Returns `module`; a second call replaces the
    first one's settings instead of nesting regions."""
    forward = getattr(module.forward, "__wrapped_by_fp8train__", module.forward)

    @functools.wraps(forward)
    def fp8_forward(*args, **kwargs):
        with autocast(enabled, calibrating, recipe, amax_reduction_group):
            return forward(*args, **kwargs)

    fp8_forward.__wrapped_by_fp8train__ = forward
    module.forward = fp8_forward
    return module


def prepare_stage(stage, recipe=None, amax_reduction_group=None, **kwargs):
    """`check_stage`, then `fp8_regions(stage.submod, recipe, amax_reduction_group, **kwargs)`: the
    stage trains in FP8, one region per microbatch, its amaxes reduced over `amax_reduction_group`
    (None: the world, which `check_stage` refuses when there is more than one stage). Returns
    `stage`."""
    check_stage(stage, amax_reduction_group)
    fp8_regions(stage.submod, recipe, amax_reduction_group, **kwargs)
    return stage
