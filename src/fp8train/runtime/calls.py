"""One FP8 GEMM call, `Call`: made once by `begin_call` at the GEMM and handed down, and the steps it
asks of the protocol, eagerly or as custom ops that torch.compile graphs call at run time
(docs/design.md, sections 5 and 6).

A Call goes to the recipe's quantization (`call_scales`, the `quantize_*` methods), which reaches the
protocol through the Call's methods only: record this GEMM's amaxes and take the region's frozen
scales (`forward_scales`), take the gradient's scale in backward (`backward_scales`), note the output
whose backward the region owes (`note_output`). Eagerly a Call carries its module call's plan
(plans.py), made at the module's first GEMM. A compiled graph holds the FP8 math (casts, GEMMs) as
ordinary ops that inductor fuses; what the protocol does is Python state, so the same steps run as
custom ops registered as ordered side effects (a compiled graph neither drops nor reorders them),
which name the module by its handle and make the plan at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..debug_switches import SWITCHES
from ..torch_internals import (
    constant_for_compile,
    keep_out_of_cuda_graphs,
    register_ordered_effects,
    round_divisions_as_eager,
    round_precision_casts_as_eager,
)
from .plans import note_training_output, plan_forward
from ..amax.roles import GRAD_OUTPUT, INPUT, WEIGHT, backward_column, forward_column
from .state import STATE, ForwardPlan, _host_scalar

__all__ = ["Call", "begin_call", "current_call"]


@dataclass(frozen=True)
class Call:
    """One GEMM call of an FP8 module (not the module's forward call: state.ForwardPlan; not a
    checkpoint call: plans.CheckpointRecord): how it runs, and what its quantization needs besides
    the tensors.

    Built field by field where it changes (`for_gemm`, `without_tensors`, `with_saved`):
    dataclasses.replace is not traceable by dynamo in every torch.
    """

    fp8: bool  # the GEMM runs in FP8
    record: bool  # its amaxes are recorded (training, or calibrating)
    quantization: Any = None  # the recipe's Quantization, when the call runs in FP8 or records
    module_handle: Optional[torch.Tensor] = None  # names the module to the custom ops (state.py)
    gemm_index: int = 0
    operand_dtype: Optional[torch.dtype] = None  # per-tensor operands: FP8 (hardware GEMM), bf16 or fp32
    scales: Optional[torch.Tensor] = None  # delayed scaling: [[x, w], [x_inv, w_inv]] of this GEMM
    token: Optional[torch.Tensor] = None  # delayed scaling: names the call's region to its backward
    plan: Optional[ForwardPlan] = None  # eager: its module call's plan (compiled graphs make it at run time)
    gemm_path: Optional[str] = None  # gemm.PATHS: how its GEMMs multiply (the emulation's output rounding)
    weight_amax_in_cast: bool = False  # eager: the weight's cast (`quantize_weight`) takes its amax
    # eager delayed scaling: ((x, x_inv), (w, w_inv)), the casts' views of `scales` (None: select them)
    pairs: Optional[tuple] = None
    amax_in_cast: bool = False  # eager training calls in FP8: the forward casts take their amaxes
    # eager delayed scaling: (x, w) amax slots of the recording direction (`Direction.column_views`)
    # where the forward casts write their amaxes for `record_amax`; None: new tensors
    amax_slots: Optional[tuple] = None

    @staticmethod
    def outside_module(quantization, scales: Optional[torch.Tensor] = None) -> Call:
        """A call that quantizes a tensor as `quantization` would in FP8, outside any module's call
        (readers: quantization error, tensor statistics): float32 operands, nothing recorded."""
        return Call(True, False, quantization, None, 0, torch.float32, scales)

    def for_gemm(
        self,
        operand_dtype: torch.dtype,
        scales: Optional[torch.Tensor],
        token,
        gemm_path: Optional[str] = None,
        weight_amax_in_cast: bool = False,
    ) -> Call:
        """This call with its GEMM's operand dtype and path, the scales and token `forward_scales` gave,
        and whether the weight's cast takes the weight's amax."""
        plan, pairs, slots = self.plan, None, None
        given = None if plan is None else plan.given
        if given is not None and given[0] is scales:  # the scales as given: their views and slots
            pairs = given[1]  # (None where the plan has no frozen views)
            if given[3] is not None:
                slots = given[3][given[2][0]], given[3][given[2][1]]
        amax_in_cast = self.record and self.fp8 and not torch.compiler.is_compiling()
        return Call(
            self.fp8, self.record, self.quantization, self.module_handle, self.gemm_index,
            operand_dtype, scales, token, plan, gemm_path, weight_amax_in_cast, pairs, amax_in_cast, slots,
        )  # fmt: skip

    def without_tensors(self) -> Call:
        """What backward keeps on its context (the tensors travel through save_for_backward; the plan,
        which holds the region, is not kept: backward names the region by the token)."""
        return Call(
            self.fp8, self.record, self.quantization, None, self.gemm_index, self.operand_dtype,
            None, None, None, self.gemm_path,
        )  # fmt: skip

    def with_saved(self, module_handle: torch.Tensor, token: Optional[torch.Tensor]) -> Call:
        """The backward's call: this one's fields with the saved tensors."""
        return Call(
            self.fp8, self.record, self.quantization, module_handle, self.gemm_index, self.operand_dtype,
            None, token, None, self.gemm_path,
        )  # fmt: skip

    # ---- what the call asks of the protocol ----------------------------------------------------------
    def forward_scales(
        self, x_amax: Optional[torch.Tensor], w_amax: Optional[torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this GEMM's amaxes; its scales [[x, w], [x_inv, w_inv]] and its region's token."""
        if torch.compiler.is_compiling():  # the graph runs without grad: whether the call trains is passed
            training = torch.is_grad_enabled()
            return _forward_scales_op(self.module_handle, self.gemm_index, x_amax, w_amax, like, training)
        return _forward_scales(self.plan, self.gemm_index, x_amax, w_amax, like)

    def backward_scales(self, g_amax: Optional[torch.Tensor]) -> torch.Tensor:
        """Record this backward GEMM's grad_output amax; [scale, scale_inv] for it. Eagerly `g_amax` may
        be None: the gradient's cast takes it and `record_grad_amax` records it after the cast."""
        if torch.compiler.is_compiling():
            return _backward_scales_op(self.module_handle, self.gemm_index, g_amax, self.token)
        return _backward_scales(STATE.handles.module(self.module_handle), self.gemm_index, g_amax, self.token)

    def backward_scale_pair(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """Eager, for a gradient cast that takes its own amax: (scale, scale_inv) of this GEMM's
        grad_output, `backward_scales(None)`'s values, as views of the group's storage
        (`Direction.column_views`) where that makes a copy; the amax slot its cast writes; and where
        the amax is recorded, for `record_grad_amax` after the cast."""
        return _backward_scales(
            STATE.handles.module(self.module_handle), self.gemm_index, None, self.token, pair=True
        )

    def record_amax(self, role: int, amax: torch.Tensor) -> None:
        """Eager: record the amax of forward `role` (roles.py: INPUT, WEIGHT) that its cast took (delayed
        scaling's scales are frozen before the call, so the cast needs no amax first: one read)."""
        plan = self.plan
        if plan.records_into is not None:
            given = plan.given  # the GEMM's columns, where `forward_scales` found them
            if given is not None and given[0] is self.scales:
                plan.records_into.record(given[2][role], amax)
            else:
                plan.records_into.record(forward_column(plan.offset, self.gemm_index, role), amax)

    def record_grad_amax(self, g_amax: torch.Tensor, into: Optional[tuple] = None) -> None:
        """Eager: record the grad_output amax its cast took (after `backward_scales(None)`; `into`: where,
        as `backward_scale_pair` said)."""
        if into is None:
            meta = STATE.handles.module(self.module_handle).fp8_meta["scaling_bwd"]
            into = meta.direction, backward_column(meta.offset, self.gemm_index, GRAD_OUTPUT)
        into[0].record(into[1], g_amax)

    def check_recipe_kind(self) -> None:
        """Under torch.compile, a training call's check that its module trains under one recipe kind
        runs in the graph, at run time, so that its error reaches the caller as it is (raised while
        tracing, dynamo would hide it). Eager calls are checked in their plan."""
        _check_recipe_kind_op(self.module_handle, self.quantization.kind)

    def note_output(self, output: torch.Tensor) -> None:
        """The GEMM's output (eager): its region owes a backward while the output's graph lives."""
        note_training_output(self.plan, output)

    def frozen_scales(self) -> Optional[torch.Tensor]:
        """[[x, w], [x_inv, w_inv]] this GEMM casts with under delayed scaling, recording nothing
        (readers: tensor statistics); None for other recipes and for compiled calls."""
        if self.plan is None or self.plan.scale is None:
            return None
        return _gemm_scales(self.plan, self.gemm_index)


def begin_call(module, gemm_index: int) -> Call:
    """GEMM `gemm_index` of `module`'s current forward call (an FP8Module).

    Eager, the module call's plan is made at its first GEMM (and is its current call until the next
    one). Under torch.compile the answer comes from the region settings and grad mode, which dynamo
    guards, and the plan is made at run time by the forward_scales op: the same rules, since a
    compiled graph is never a recomputation.
    """
    handle = module.fp8_handle
    if torch.compiler.is_compiling():
        inductor_configured()
        settings = STATE.regions.settings
        if settings is None or not settings.active:
            return Call(False, False, None, handle, gemm_index)
        record = settings.quantization.reduces_amax and (settings.calibrating or torch.is_grad_enabled())
        return Call(settings.enabled, record, settings.quantization, handle, gemm_index)
    if gemm_index == 0:
        # a bisecting switch (debug_switches.py) holds it in high precision: no plan, also in a replay
        held = SWITCHES.high_precision_now(module)
        plan = None if held else plan_forward(module, torch.is_grad_enabled())
        STATE.calls.begin(module, plan)
    else:  # a later GEMM of the module's call (LayerNormMLP's fc2)
        plan = STATE.calls.of(module)
    if plan is None:  # high precision, recording nothing (`_planned_call`, inline)
        return Call(False, False, None, handle, gemm_index)
    return Call(plan.fp8, plan.records_into is not None, plan.quantization, handle, gemm_index, plan=plan)


def current_call(module, gemm_index: int = 0) -> Optional[Call]:
    """GEMM `gemm_index` of `module`'s latest eager forward call (readers, after the call); None when
    it ran in high precision or has not run."""
    plan = STATE.calls.of(module)
    return None if plan is None else _planned_call(plan, module.fp8_handle, gemm_index)


def _planned_call(plan: Optional[ForwardPlan], handle: torch.Tensor, gemm_index: int) -> Call:
    if plan is None:  # high precision, recording nothing
        return Call(False, False, None, handle, gemm_index)
    return Call(plan.fp8, plan.records_into is not None, plan.quantization, handle, gemm_index, plan=plan)


# ---- the steps, eagerly -----------------------------------------------------------------------------------
def capturing_cuda_graph(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_cuda_graph_capture(like: torch.Tensor) -> None:
    """A CUDA graph replays kernels, not Python: captured, the protocol's work would be skipped at
    every replay (plans, amax recording, frozen scales read once, no end-of-backward launch)."""
    if capturing_cuda_graph(like.device):
        raise RuntimeError(
            "an FP8 call of fp8train is being captured into a CUDA graph (torch.cuda.graph, or "
            "torch.compile(mode='reduce-overhead') on a torch whose inductor has no "
            "custom_should_partition_ops); the amax protocol runs Python at every call, which a replay "
            "would skip. Capture only code outside FP8 modules, compile with mode='default' or "
            "'max-autotune-no-cudagraphs', or use a torch whose inductor keeps fp8train's ops out of "
            "its CUDA graphs (docs/design.md, section 6)"
        )


def _gemm_scales(plan: ForwardPlan, gemm_index: int) -> torch.Tensor:
    base = forward_column(plan.offset, gemm_index, INPUT)
    if plan.frozen is not None:
        return plan.frozen.gemm(base)[0]
    return torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]])


def _forward_scales(
    plan: ForwardPlan,
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
    if capturing_cuda_graph(like.device):
        refuse_cuda_graph_capture(like)
    base = forward_column(plan.offset, gemm_index, INPUT)
    columns = (base, forward_column(plan.offset, gemm_index, WEIGHT))
    slots = None
    if plan.records_into is not None:
        if x_amax is not None:
            plan.records_into.record(base, x_amax)
        if w_amax is not None:
            plan.records_into.record(columns[WEIGHT], w_amax)
        if not fresh:  # where the eager casts write their amaxes
            slots = plan.records_into.column_views()[2]
    # the region's token, made once (a replay holds no region: its own)
    token = plan.region.token if plan.region is not None and not fresh else _host_scalar(plan.serial)
    if plan.frozen is None or fresh:
        block, pairs = torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]]), None
    else:
        block, pairs = plan.frozen.gemm(base)
    plan.given = block, pairs, columns, slots  # for the call's `for_gemm` and `record_amax`
    return block, token


def _backward_scales(
    module, gemm_index: int, g_amax: Optional[torch.Tensor], token: torch.Tensor, pair: bool = False
):
    """Record this backward GEMM's grad_output amax (unless None: recorded after the cast); return
    [scale, scale_inv] for it (a copy), or with `pair` (eager, cast at once) the two as views.

    Waits for earlier steps' backward reductions first (wait before read), and makes sure the pass
    launches the group's backward reduction when it ends."""
    meta = module.fp8_meta["scaling_bwd"]
    direction = meta.direction
    like = direction.storage.scale if g_amax is None else g_amax
    if capturing_cuda_graph(like.device):
        refuse_cuda_graph_capture(like)
    if direction.pending:  # (finish and check, called only where they have work)
        direction.finish()
    if direction.channel is not None:
        direction.check()
    column = backward_column(meta.offset, gemm_index, GRAD_OUTPUT)
    if g_amax is not None:
        direction.record(column, g_amax)
    backward, region = STATE.backward.current(), STATE.regions.by_serial(int(token))
    if direction.group not in backward.groups or region not in backward.regions:  # noted once a pass
        backward.note(direction.group, region)
    if pair:
        scales, inverses, slots = direction.column_views()
        return scales[column], inverses[column], slots[column], (direction, column)
    return torch.stack([direction.storage.scale[column], direction.storage.scale_inv[column]])


# ---- the custom ops ----------------------------------------------------------------------------------------
# Each op names its module by handle (state.py): a host tensor, an input of the graph.
@torch.library.custom_op("fp8train::forward_scales", mutates_args=())
def _forward_scales_op(
    handle: torch.Tensor,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    module = STATE.handles.module(handle)
    if gemm_index == 0:  # the module call's plan, made at run time
        STATE.calls.begin(module, plan_forward(module, training, compiled=True))
    return _forward_scales(STATE.calls.of(module), gemm_index, x_amax, w_amax, like, fresh=True)


@_forward_scales_op.register_fake
def _(handle, gemm_index, x_amax, w_amax, like, training):
    return like.new_empty((2, 2), dtype=torch.float32), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("fp8train::backward_scales", mutates_args=())
def _backward_scales_op(
    handle: torch.Tensor, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    return _backward_scales(STATE.handles.module(handle), gemm_index, g_amax, token)


@_backward_scales_op.register_fake
def _(handle, gemm_index, g_amax, token):
    return g_amax.new_empty((2,), dtype=torch.float32)


@torch.library.custom_op("fp8train::check_recipe_kind", mutates_args=())
def _check_recipe_kind_op(handle: torch.Tensor, kind: str) -> None:
    STATE.handles.module(handle).claim_recipe_kind(kind)


@_check_recipe_kind_op.register_fake
def _(handle, kind):
    return None


PROTOCOL_OPS = (
    torch.ops.fp8train.forward_scales,
    torch.ops.fp8train.backward_scales,
    torch.ops.fp8train.check_recipe_kind,
)
ORDERED_EFFECTS = register_ordered_effects(op.default for op in PROTOCOL_OPS)


@constant_for_compile  # dynamo runs it for real while tracing, before inductor compiles the graph
def inductor_configured() -> bool:
    """Inductor's settings for FP8 graphs, applied when a graph with FP8 calls is traced (not at import:
    importing inductor's config imports torch._dynamo, which would double `import fp8train`'s time).
    mode="reduce-overhead": the graph's CUDA graphs hold the compute between the protocol's ops, never
    the ops; compiled scales are eager's (fp8_max / amax and 1 / scale correctly rounded on GPUs too);
    the emulated bf16 GEMM's output is rounded to bf16 where eager rounds it, fused or not.
    Idempotent. Whether all three settings are in force."""
    kept = keep_out_of_cuda_graphs(op.default.name() for op in PROTOCOL_OPS)
    divisions = round_divisions_as_eager()
    casts = round_precision_casts_as_eager()
    return kept and divisions and casts
