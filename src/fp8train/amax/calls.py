"""The plan of each FP8 call: its precision, delayed scaling's frozen scales and where its amaxes go,
and what its backward owes its region (docs/design.md, sections 3 and 5).

A call's plan is made at its module's first GEMM (ops.py) and kept by the registry for the rest of
the call. Training calls note their plan in their region, so that an activation recomputation in
backward replays it: same scales, no amax recorded.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..torch_internals import (
    ddp_join_that_does_not_throw,
    in_backward,
    inside_reentrant_checkpoint,
    pipeline_group_of_caller,
)
from .membership import check_amax_group, check_stage_group
from .reduction import Direction
from .regions import Region, RegionSettings, current_backward_pass
from .state import REGISTRY
from .steps import check_step_open

__all__ = ["Plan", "plan_forward", "note_training_output", "FWD_ROLES", "BWD_ROLES"]

FWD_ROLES = 3  # input, weight, output per GEMM
BWD_ROLES = 2  # grad_output, grad_input per GEMM


@dataclass
class Plan:
    """How one forward call of an FP8 module runs, and what its backward owes the protocol."""

    fp8: bool
    quantization: Any  # the recipe's Quantization (quantization/), opaque to the protocol
    region: Optional[Region] = None  # an FP8 training call: the region whose backward it owes
    serial: int = -1  # that region's serial, also in a replay (which holds no reference to it)
    # delayed scaling only (quantization.reduces_amax):
    scale: Optional[torch.Tensor] = None  # forward scales of the module's group (a frozen snapshot)
    scale_inv: Optional[torch.Tensor] = None
    fwd_offset: int = 0  # the module's first column in the group's forward and backward storage
    bwd_offset: int = 0
    records_into: Optional[Direction] = None  # forward amaxes go here (None: record nothing)


def plan_forward(module, training: bool) -> Optional[Plan]:
    """How `module` (an FP8Module) runs this forward call; None: in high precision, recording nothing.

    `training`: grad is enabled for the call (given, not read: a compiled graph runs without grad)."""
    if REGISTRY.recompute is not None or in_backward():
        plan = _recompute_plan(module)
        if plan is not None:
            for call in REGISTRY.checkpoints:  # a checkpoint nested in the one being recomputed
                call.add(id(module), plan)
        return plan
    settings = REGISTRY.settings
    if settings is None or not settings.active:
        return None
    region = REGISTRY.region
    quantization = settings.quantization
    if settings.enabled and training:
        module.claim_recipe_kind(quantization.kind)
    if settings.enabled and not training and region.grad_at_entry:
        _refuse_reentrant_checkpoint()
    if quantization.reduces_amax:
        plan = _delayed_plan(module, settings, region, training)
    elif settings.enabled:
        plan = Plan(True, quantization)
    else:
        return None  # calibrating records amaxes for delayed scaling only
    if settings.enabled and training:
        plan.region, plan.serial = region, region.serial
    if training:  # noted for recomputation; the replay holds no region reference and records nothing
        region.backward_done = False  # (again, when a backward ran inside the region)
        replay = replace(plan, records_into=None, region=None)
        region.calls.setdefault(id(module), collections.deque()).append(replay)
        for call in REGISTRY.checkpoints:
            call.add(id(module), replay)
    return plan


def _delayed_plan(module, settings: RegionSettings, region: Region, training: bool) -> Plan:
    """Delayed scaling: the module joins its amax group when it first records; the region's frozen
    scales; amaxes recorded when training or calibrating."""
    group = REGISTRY.amax_group(settings.recipe, settings.group)
    record = settings.calibrating or training
    fwd_meta, bwd_meta = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
    if record:
        if group not in region.trained and group.fwd.channel is not None:
            _refuse_ddp_join()
        if fwd_meta.direction is None:
            reduces = group.fwd.channel is not None
            check_amax_group(module, group.process_group, reduces)
            pipeline_group = pipeline_group_of_caller()
            if pipeline_group is not False:  # inside a torch.distributed.pipelining stage
                check_stage_group(module.signature, group.process_group, reduces, pipeline_group)
            device = next(module.parameters()).device
            fwd_meta.join(group.fwd, module.signature, device)
            bwd_meta.join(group.bwd, module.signature, device)
        elif fwd_meta.direction is not group.fwd:
            raise RuntimeError(
                f"{module.signature} trains under one recipe and amax group; it was first trained "
                f"with {fwd_meta.direction.recipe} and is now run with {settings.recipe} (or another "
                "group). Use the same fp8_recipe and fp8_group for every training region of a module"
            )
        region.trained.setdefault(group, -1)  # only once the module is a member: it can launch
        if group.recipe.per_step and training:
            check_step_open(module)
    if fwd_meta.direction is None:  # not trained yet (evaluation): its own scales, on its device
        (scale, scale_inv), offset = fwd_meta.own_scales(next(module.parameters()).device), 0
    else:
        scale, scale_inv = region.scales_for(fwd_meta.direction)
        offset = fwd_meta.offset
    return Plan(
        fp8=settings.enabled,
        quantization=settings.quantization,
        scale=scale,
        scale_inv=scale_inv,
        fwd_offset=offset,
        bwd_offset=bwd_meta.offset,
        records_into=group.fwd if record else None,
    )


def _recompute_plan(module) -> Optional[Plan]:
    """The plan of the original forward call, replayed: same scales, no amax, no registration."""
    call = REGISTRY.recompute
    if call is not None:  # fp8train.checkpoint noted this call's plans and restored its settings
        settings = REGISTRY.settings
        if settings is None or not settings.active:
            return None  # the original call ran in high precision
        plan = call.next(id(module))
        if plan is None:
            raise RuntimeError(
                f"{module.signature} runs more often in the recomputed forward than in the original "
                "one; a function passed to fp8train.checkpoint must call the same FP8 modules each time"
            )
        return plan
    # torch.utils.checkpoint(use_reentrant=False): the one region whose backward still owes a call
    candidates = [r for r in REGISTRY.live_regions() if r.owes_backward() and r.calls.get(id(module))]
    if not candidates:
        return None  # no FP8 training call pending: the original forward was high precision
    first = candidates[0].calls[id(module)][0]
    stateless = not first.quantization.reduces_amax and all(
        p.quantization.recipe == first.quantization.recipe for r in candidates for p in r.calls[id(module)]
    )  # a recipe that scales each tensor from itself: any pending call of it replays alike
    plans = candidates[0].calls[id(module)] if len(candidates) == 1 or stateless else ()
    # backward recomputes later calls first: taking the oldest plan is right only if all are alike
    if plans and all(p.fp8 == plans[0].fp8 and p.scale is plans[0].scale for p in plans):
        return plans.popleft()
    raise RuntimeError(
        f"{module.signature} is being recomputed during backward, but fp8train cannot tell which "
        f"FP8 forward it repeats ({len(candidates)} candidate regions, or calls of it that ran "
        "differently in one region). Wrap the recomputed code in "
        "fp8train.checkpoint(fn, *args), or use torch.utils.checkpoint with use_reentrant=False "
        "and one region per backward pass; a region's backward must run in one backward pass"
    )


def _refuse_reentrant_checkpoint() -> None:
    """Raise inside torch.utils.checkpoint(use_reentrant=True) in a training region.

    Its forward runs without grad, so the FP8 call records nothing and owes no backward, and its
    recomputation in backward cannot be told apart from another call of the same module. Called for
    FP8 calls without grad in a region entered with grad (evaluation inside a training region, or
    this), so evaluation under no_grad outside the region pays nothing.
    """
    if inside_reentrant_checkpoint():
        raise RuntimeError(
            "torch.utils.checkpoint(..., use_reentrant=True) over FP8 modules in a training region: "
            "use_reentrant=True is not supported (its forward runs without autograd, so its FP8 "
            "calls cannot be matched to their recomputation). Use fp8train.checkpoint(fn, *args) or "
            "torch.utils.checkpoint(fn, *args, use_reentrant=False)"
        )


def _refuse_ddp_join() -> None:
    """Raise inside DistributedDataParallel's join() (uneven inputs) unless it throws on early termination.

    A rank that ran out of data shadows DDP's collectives, not the amax all-reduces, so the others'
    amax collectives would pair with DDP's (gloo kills the process on the size mismatch; NCCL hangs).
    Called at the first FP8 call of each region: every rank raises in its first step inside join(),
    before any rank can have joined.
    """
    if ddp_join_that_does_not_throw():
        raise RuntimeError(
            "DistributedDataParallel.join() (uneven inputs) cannot be used with a multi-rank FP8 "
            "amax reduction: a rank that ran out of data would shadow DDP's collectives but not "
            "fp8train's amax all-reduce, and the other ranks would hang or abort. Use "
            "join(throw_on_early_termination=True) (every rank stops when one runs out of data), "
            "give every rank the same number of batches (e.g. DistributedSampler(drop_last=True)), "
            "or DelayedScaling(reduce_amax=False)"
        )


def note_training_output(plan: Optional[Plan], output: torch.Tensor) -> None:
    """An FP8 training call's output: its region owes a backward while this graph lives. Recipes that
    record nothing in backward get a hook on the node that marks their region's backward as run (for
    plain torch.utils.checkpoint's recomputations to find the regions still pending)."""
    if plan is None or plan.region is None or output.grad_fn is None:
        return
    region = plan.region
    region.outputs.append(weakref.ref(output.grad_fn))
    if not plan.quantization.reduces_amax:
        output.grad_fn.register_hook(lambda *_: current_backward_pass().note(None, region))
