"""One FP8 GEMM call, `Call`: made by `begin_call` at the GEMM and handed down, and the custom ops
through which torch.compile graphs reach the runtime at run time (docs/design.md, sections 3.1, 5
and 6).

A Call goes to the recipe's quantization (`call_scales`, the `quantize_*` methods), which keeps its
own state (delayed scaling: amax/hooks.py) and reaches the runtime through the Call: its plan (made at
the module's first GEMM by the recipe, plans.py), the token that names its region to its backward,
the output whose backward the region owes (`note_output`). A compiled graph holds the FP8 math
(casts, GEMMs) as ordinary ops that inductor fuses; what a recipe's state does is Python, so its
steps run as custom ops registered as ordered side effects (a compiled graph neither drops nor
reorders them), which name the module by its handle and make the plan at run time
(`forward_scales_op`, and each recipe's own: `add_protocol_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..debug_switches import SWITCHES
from ..torch_internals import (
    constant_for_compile,
    keep_out_of_cuda_graphs,
    register_ordered_effects,
    round_divisions_as_eager,
    round_precision_casts_as_eager,
)
from .plans import plan_forward
from .state import STATE, ForwardPlan, RuntimeModule

if TYPE_CHECKING:
    from .state import RecipeRuntime

__all__ = [
    "Call", "begin_call", "current_call", "forward_scales_op", "add_protocol_ops", "inductor_configured",
]  # fmt: skip


@dataclass(eq=False)
class Call:
    """One GEMM call of an FP8 module (not the module's forward call: state.ForwardPlan; not a
    checkpoint call: plans.CheckpointRecord): how it runs, and what its quantization needs besides
    the tensors.

    Eagerly one Call is made per GEMM (`begin_call`) and completed in place (`for_gemm`), and one for
    its backward (`without_tensors`, completed in place by `with_saved`): the lean path (docs/design.md,
    section 6). In a compiled graph each step makes a new one, field by field (dynamo traces no
    mutation of it; dataclasses.replace is not traceable in every torch).
    """

    fp8: bool  # the GEMM runs in FP8
    record: bool  # its amaxes are recorded (training, or calibrating)
    quantization: Optional[RecipeRuntime] = None  # the recipe's Quantization, when in FP8 or recording
    module_handle: Optional[torch.Tensor] = None  # names the module to the custom ops (state.py)
    gemm_index: int = 0
    operand_dtype: Optional[torch.dtype] = None  # per-tensor operands: FP8 (hardware GEMM), bf16 or fp32
    scales: Optional[torch.Tensor] = None  # a recipe with state: [[x, w], [x_inv, w_inv]] of this GEMM
    token: Optional[torch.Tensor] = None  # a recipe with state: names the call's region to its backward
    plan: Optional[ForwardPlan] = None  # eager: its module call's plan (compiled graphs make it at run time)
    gemm_path: Optional[str] = None  # gemm.PATHS: how its GEMMs multiply (the emulation's output rounding)
    weight_amax_in_cast: bool = False  # eager: the weight's cast (`quantize_weight`) takes its amax
    # eager, a recipe with state: ((x, x_inv), (w, w_inv)), the casts' views of `scales` (None: select
    # them), as its plan gives them (`ForwardPlan.given`)
    pairs: Optional[tuple] = None
    amax_in_cast: bool = False  # eager training calls in FP8: the forward casts take their amaxes

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
        if torch.compiler.is_compiling():  # a graph's call: a new one, no views
            return Call(
                self.fp8, self.record, self.quantization, self.module_handle, self.gemm_index,
                operand_dtype, scales, token, None, gemm_path, weight_amax_in_cast,
            )  # fmt: skip
        plan, pairs = self.plan, None
        given = None if plan is None else plan.given
        if given is not None and given[0] is scales:  # the scales as given: their casts' views
            pairs = given[1]
        self.operand_dtype, self.scales, self.token, self.gemm_path = operand_dtype, scales, token, gemm_path
        self.weight_amax_in_cast, self.pairs = weight_amax_in_cast, pairs
        self.amax_in_cast = self.record and self.fp8
        return self

    def without_tensors(self) -> Call:
        """What backward keeps on its context (the tensors travel through save_for_backward; the plan,
        which holds the region, is not kept: backward names the region by the token)."""
        return Call(
            self.fp8, self.record, self.quantization, None, self.gemm_index, self.operand_dtype,
            None, None, None, self.gemm_path,
        )  # fmt: skip

    def with_saved(self, module_handle: torch.Tensor, token: Optional[torch.Tensor]) -> Call:
        """The backward's call: this one (`without_tensors`'s) with the saved tensors; eagerly in place
        (each backward of the node sets the same tensors again)."""
        if torch.compiler.is_compiling():
            return Call(
                self.fp8, self.record, self.quantization, module_handle, self.gemm_index, self.operand_dtype,
                None, token, None, self.gemm_path,
            )  # fmt: skip
        self.module_handle, self.token = module_handle, token
        return self

    # ---- what the call asks of the runtime ------------------------------------------------------------
    def check_recipe_kind(self) -> None:
        """Under torch.compile, a training call's check that its module trains under one recipe kind
        runs in the graph, at run time, so that its error reaches the caller as it is (raised while
        tracing, dynamo would hide it). Eager calls are checked in their plan."""
        _check_recipe_kind_op(self.module_handle, self.quantization.kind)

    def note_output(self, output: torch.Tensor) -> None:
        """The GEMM's output (eager): its region owes a backward while the output's graph lives (the
        recipe is told: `RecipeRuntime.output_noted`)."""
        plan = self.plan
        if plan is not None and plan.region is not None and output.grad_fn is not None:
            plan.quantization.output_noted(plan, output)


def begin_call(module: RuntimeModule, gemm_index: int) -> Call:
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
        record = settings.quantization.records(settings, torch.is_grad_enabled())
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
    return Call(plan.fp8, plan.record, plan.quantization, handle, gemm_index, plan=plan)


def current_call(module: RuntimeModule, gemm_index: int = 0) -> Optional[Call]:
    """GEMM `gemm_index` of `module`'s latest eager forward call (readers, after the call); None when
    it ran in high precision or has not run."""
    plan = STATE.calls.of(module)
    return None if plan is None else _planned_call(plan, module.fp8_handle, gemm_index)


def _planned_call(plan: Optional[ForwardPlan], handle: torch.Tensor, gemm_index: int) -> Call:
    if plan is None:  # high precision, recording nothing
        return Call(False, False, None, handle, gemm_index)
    return Call(plan.fp8, plan.record, plan.quantization, handle, gemm_index, plan=plan)


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
    plan = STATE.calls.of(module)
    return plan.quantization.gemm_scales(plan, gemm_index, x_amax, w_amax, like, fresh=True)


@_forward_scales_op.register_fake
def _(handle, gemm_index, x_amax, w_amax, like, training):
    return like.new_empty((2, 2), dtype=torch.float32), torch.empty((), dtype=torch.int64)


def forward_scales_op(
    call: Call, x_amax: Optional[torch.Tensor], w_amax: Optional[torch.Tensor], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In a compiled graph: the op that makes `call`'s module call's plan at run time (its first GEMM)
    and gives the GEMM's scales and token, recording its amaxes (`RecipeRuntime.gemm_scales`). The
    graph runs without grad: whether the call trains is passed."""
    training = torch.is_grad_enabled()
    return _forward_scales_op(call.module_handle, call.gemm_index, x_amax, w_amax, like, training)


@torch.library.custom_op("fp8train::check_recipe_kind", mutates_args=())
def _check_recipe_kind_op(handle: torch.Tensor, kind: str) -> None:
    STATE.handles.module(handle).claim_recipe_kind(kind)


@_check_recipe_kind_op.register_fake
def _(handle, kind):
    return None


PROTOCOL_OPS = [torch.ops.fp8train.forward_scales, torch.ops.fp8train.check_recipe_kind]
ORDERED_EFFECTS = register_ordered_effects(op.default for op in PROTOCOL_OPS)


def add_protocol_ops(*ops) -> bool:
    """A recipe's own custom ops (delayed scaling: its backward scales, amax/hooks.py): ordered side
    effects, kept out of CUDA graphs as the runtime's are (`inductor_configured`)."""
    PROTOCOL_OPS.extend(ops)
    return register_ordered_effects(op.default for op in ops)


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
