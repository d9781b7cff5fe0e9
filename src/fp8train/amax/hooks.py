"""Delayed scaling's answers to the runtime's hooks (`runtime.RecipeRuntime`, runtime/state.py;
docs/design.md, sections 3 and 3.1), and the steps its GEMMs take: `DelayedRuntime`, the base of
`DelayedQuantization`.

- a region entry: its amax group, looked up once (`region_state`; membership errors now);
- a module call: its plan (`plan_call`, `delayed_plan`): the module joins its group when it first
  records, the region's frozen scales, where its amaxes go; compiled calls record when training or
  calibrating (`records`);
- a GEMM: record its amaxes and give the frozen scales (`forward_scales`, eagerly or as the runtime's
  op; `gemm_scales`), give the recording slots its casts MAX their amaxes into (`amax_slot`); in
  backward, the gradient's scale and slot (`backward_scales`, `backward_scale_pair`; compiled: this
  file's op);
- a region's exit and a backward pass's end: the amax group itself (`AmaxGroup.exited`,
  `AmaxGroup.backward_ended`, reduction.py); the step boundary is steps.py's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime import (
    STATE,
    Call,
    ForwardPlan,
    RecipeRuntime,
    Region,
    RegionSettings,
    add_protocol_ops,
    forward_scales_op,
    host_int,
    host_scalar,
)
from ..torch_internals import ddp_join_that_does_not_throw, pipeline_group_of_caller
from .membership import check_amax_group, check_stage_group
from .reduction import AmaxGroup
from .roles import GRAD_OUTPUT, INPUT, WEIGHT, backward_column, forward_column
from .settings import settings as knobs
from .state import AMAX, DelayedPlan, frozen_scales
from .steps import check_step_open

__all__ = ["DelayedRuntime", "delayed_plan", "capturing_cuda_graph"]


# ---- the module call's plan ------------------------------------------------------------------------------
def delayed_plan(module, settings: RegionSettings, region: Region, training: bool) -> DelayedPlan:
    """Delayed scaling: the module joins its amax group when it first records; the region's frozen
    scales; amaxes recorded when training or calibrating."""
    group = settings.state  # its amax group, looked up once at the region's entry (`region_state`)
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
        if group not in region.trained:
            region.note_trained(group)  # only once the module is a member: it can launch
        if training and group.recipe.amax_reduction == "step":  # (recipe.per_step, inline)
            check_step_open(module, AMAX.step)
    if fwd_meta.direction is None:  # not a member yet: its own scales (ScalingMeta.scales_in)
        scale, scale_inv, offset = fwd_meta.scales_in(region, module)
        frozen = None
    else:  # its group's, frozen for the region, with the views its GEMMs read
        frozen = frozen_scales(region, fwd_meta.direction)
        scale, scale_inv, offset = frozen.scale, frozen.scale_inv, fwd_meta.offset
    return DelayedPlan(
        fp8=settings.enabled,
        quantization=settings.quantization,
        record=record,
        scale=scale,
        scale_inv=scale_inv,
        offset=offset,
        records_into=group.fwd if record else None,
        frozen=frozen,
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


# ---- the GEMM's steps, eagerly ----------------------------------------------------------------------------
def capturing_cuda_graph(like: torch.Tensor) -> bool:
    """Whether the current stream of `like`'s device (a CUDA one) is capturing a CUDA graph."""
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def refuse_cuda_graph_capture(like: torch.Tensor) -> None:
    """A CUDA graph replays kernels, not Python: captured, the protocol's work would be skipped at
    every replay (plans, amax recording, frozen scales read once, no end-of-backward launch)."""
    if capturing_cuda_graph(like):
        raise RuntimeError(
            "an FP8 call of fp8train is being captured into a CUDA graph (torch.cuda.graph, or "
            "torch.compile(mode='reduce-overhead') on a torch whose inductor has no "
            "custom_should_partition_ops); the amax protocol runs Python at every call, which a replay "
            "would skip. Capture only code outside FP8 modules, compile with mode='default' or "
            "'max-autotune-no-cudagraphs', or use a torch whose inductor keeps fp8train's ops out of "
            "its CUDA graphs (docs/design.md, section 6)"
        )


def _gemm_scales(plan: DelayedPlan, gemm_index: int) -> torch.Tensor:
    base = forward_column(plan.offset, gemm_index, INPUT)
    if plan.frozen is not None:
        return plan.frozen.gemm(base)[0]
    return torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]])


def _forward_scales(
    plan: DelayedPlan,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
    fresh: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Record this GEMM's amaxes into the plan's direction; its scales (the region's frozen ones) and
    its region's token (a CPU int64 scalar: the region's serial for a training call's backward, -1
    otherwise). Eagerly the scales are a view of the region's frozen copy and the token the region's
    own; `fresh` (the custom op: its outputs must be new tensors, contiguous as its fake says) makes
    both anew."""
    if capturing_cuda_graph(like):
        refuse_cuda_graph_capture(like)
    base = forward_column(plan.offset, gemm_index, INPUT)
    columns = (base, base + WEIGHT)  # (the weight's column follows the input's: `forward_column`)
    if plan.records_into is not None:
        if x_amax is not None:
            plan.records_into.record(base, x_amax)
        if w_amax is not None:
            plan.records_into.record(columns[WEIGHT], w_amax)
    # the region's token, made once (a replay holds no region: its own)
    token = plan.region.token if plan.region is not None and not fresh else host_scalar(plan.serial)
    if plan.frozen is None or fresh:
        block, pairs = torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]]), None
    else:
        block, pairs = plan.frozen.gemm(base)
    plan.given = block, pairs, columns  # for the call's `for_gemm` and `amax_slot`
    return block, token


def _backward_scales(
    module, gemm_index: int, g_amax: Optional[torch.Tensor], token: torch.Tensor, pair: bool = False
):
    """Record this backward GEMM's grad_output amax (unless None: its cast records it); return
    [scale, scale_inv] for it (a copy), or with `pair` (eager, cast at once) the two as views and the
    amax's recording slot, which the cast MAXes its amax into.

    Waits for earlier steps' backward reductions first (wait before read), and makes sure the pass
    launches the group's backward reduction when it ends."""
    meta = module.fp8_meta["scaling_bwd"]
    direction = meta.direction
    like = direction.storage.scale if g_amax is None else g_amax
    if capturing_cuda_graph(like):
        refuse_cuda_graph_capture(like)
    if direction.pending:  # (finish and check, called only where they have work)
        direction.finish()
    if direction.channel is not None:
        direction.check()
    column = backward_column(meta.offset, gemm_index, GRAD_OUTPUT)
    if g_amax is not None:
        direction.record(column, g_amax)
    backward, region = STATE.backward.current(), STATE.regions.by_serial(host_int(token))
    if direction.group not in backward.groups or region not in backward.regions:  # noted once a pass
        backward.note(direction.group, region)
    if pair:
        return (*direction.scale_views(column), direction.recording_slot(column))
    return torch.stack([direction.storage.scale[column], direction.storage.scale_inv[column]])


class DelayedRuntime(RecipeRuntime):
    """Delayed scaling's hooks (its `Quantization` inherits them): amax groups, frozen scales, recorded
    amaxes, reductions launched at a region's exit and a backward pass's end."""

    def region_state(self, settings: RegionSettings, region: Optional[Region], fp8_group) -> AmaxGroup:
        # a group this rank is not in raises now; the region's reductions are asynchronous or not from
        # its first delayed entry on (NVTE_ASYNC_AMAX_REDUCTION: a bad value raises now, too)
        if region is not None and region.async_op is None:
            region.async_op = knobs.asynchronous()
        return AMAX.of(settings.recipe, fp8_group)

    # (module, settings, region, training) -> its DelayedPlan; the function itself (one call a plan)
    plan_call = staticmethod(delayed_plan)

    def records(self, settings: RegionSettings, training: bool) -> bool:
        return settings.calibrating or training

    def output_noted(self, plan: ForwardPlan, output: torch.Tensor) -> None:
        """Its region owes the output's backward; nothing more: the backward notes the pass itself
        (`backward_scales`)."""
        plan.region.note_output(output.grad_fn)

    def replays_alike(self, other: RecipeRuntime) -> bool:
        """Never: each call's scales are its region's, frozen."""
        return False

    def frozen_scales(self, plan: ForwardPlan, gemm_index: int) -> Optional[torch.Tensor]:
        if plan is None or plan.scale is None:
            return None
        return _gemm_scales(plan, gemm_index)

    # (plan, gemm_index, x_amax, w_amax, like, fresh=False) -> (scales, token): the function itself
    gemm_scales = staticmethod(_forward_scales)

    # ---- a GEMM's steps ------------------------------------------------------------------------------------
    def forward_scales(
        self, call: Call, x_amax: Optional[torch.Tensor], w_amax: Optional[torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this GEMM's amaxes; its scales [[x, w], [x_inv, w_inv]] and its region's token."""
        if torch.compiler.is_compiling():
            return forward_scales_op(call, x_amax, w_amax, like)
        return _forward_scales(call.plan, call.gemm_index, x_amax, w_amax, like)

    def backward_scales(self, call: Call, g_amax: Optional[torch.Tensor]) -> torch.Tensor:
        """Record this backward GEMM's grad_output amax; [scale, scale_inv] for it. Eagerly `g_amax` may
        be None: the gradient's cast takes it (`backward_scale_pair`)."""
        if torch.compiler.is_compiling():
            return _backward_scales_op(call.module_handle, call.gemm_index, g_amax, call.token)
        return _backward_scales(STATE.handles.module(call.module_handle), call.gemm_index, g_amax, call.token)

    def backward_scale_pair(self, call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eager, for a gradient cast that takes its own amax: (scale, scale_inv) of this GEMM's
        grad_output, `backward_scales(None)`'s values, as views of the group's storage
        (`Direction.scale_views`) where that makes a copy; and the recording slot of the gradient's
        amax, which the cast MAXes it into (`Direction.recording_slot`)."""
        module = STATE.handles.module(call.module_handle)
        return _backward_scales(module, call.gemm_index, None, call.token, pair=True)

    def amax_slot(self, call: Call, role: int) -> Optional[torch.Tensor]:
        """Eager: the recording slot of forward `role`'s amax (roles.py: INPUT, WEIGHT), which its cast
        MAXes the amax into (delayed scaling's scales are frozen before the call, so the cast needs no
        amax first: one read, and no call to record it); None where the call records nothing."""
        plan = call.plan
        direction = plan.records_into
        if direction is None:
            return None
        given = plan.given  # the GEMM's columns, where `forward_scales` found them
        if given is not None and given[0] is call.scales:
            return direction.recording_slot(given[2][role])
        return direction.recording_slot(forward_column(plan.offset, call.gemm_index, role))


# ---- the compiled backward op ------------------------------------------------------------------------------
@torch.library.custom_op("fp8train::backward_scales", mutates_args=())
def _backward_scales_op(
    handle: torch.Tensor, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    return _backward_scales(STATE.handles.module(handle), gemm_index, g_amax, token)


@_backward_scales_op.register_fake
def _(handle, gemm_index, g_amax, token):
    return g_amax.new_empty((2,), dtype=torch.float32)


ORDERED_EFFECTS = add_protocol_ops(torch.ops.fp8train.backward_scales)
