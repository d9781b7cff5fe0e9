"""FP8 stages of `torch.distributed.pipelining` (docs/design.md, section 14).

Each stage's amax group must stay inside the stage (its data- and tensor-parallel ranks): stages run
different modules at different times. `prepare_stage` checks that when the stage is built, on every
rank and before any communication, so a misconfigured group is an error on every rank instead of one
stage raising in its first forward while the next waits for its activations. Then it makes every
call of the stage's module one FP8 region (`fp8train.prepare`), which is one region per microbatch
whichever schedule runs it; per-step reduction (`DelayedScaling(amax_reduction="step")`) needs
`fp8train.end_step()` after `schedule.step(...)`.
"""

from __future__ import annotations

import torch.distributed as dist

from .amax import membership
from .debug_switches import SWITCHES

__all__ = ["check_stage", "prepare_stage"]


def check_stage(stage, amax_reduction_group=None) -> None:
    """Raise (on every rank alike) if `amax_reduction_group` (None: the world) holds ranks of other
    stages of `stage`'s pipeline (a torch.distributed.pipelining PipelineStage)."""
    group = dist.group.WORLD if amax_reduction_group is None else amax_reduction_group
    membership.check_stage_group(f"pipeline stage {stage.stage_index}", group, True, stage.group)


def prepare_stage(stage, recipe=None, amax_reduction_group=None, **kwargs):
    """`check_stage`, then `fp8train.prepare(stage.submod, recipe, amax_reduction_group, **kwargs)` in
    place: the stage trains in FP8, one region per microbatch. Returns `stage`."""
    from .prepare import prepare

    check_stage(stage, amax_reduction_group)
    with SWITCHES.converting_a_stage():  # FP8TRAIN_HIGH_PRECISION may name another stage's layers
        prepare(stage.submod, recipe=recipe, amax_reduction_group=amax_reduction_group, **kwargs)
    return stage
