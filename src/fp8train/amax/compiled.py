"""What each FP8 call asks of the protocol, eagerly and as custom ops that torch.compile graphs call at
run time (docs/design.md, section 6).

A compiled graph holds the FP8 math (casts, GEMMs) as ordinary ops that inductor fuses. What a call
asks of the protocol is Python state: make the call's plan, record amaxes, hand out the region's
frozen scales; in backward, wait for earlier reductions, record, arrange the end-of-pass launch;
refuse a recipe kind the module did not train with. Those run here, as custom ops registered as
ordered side effects (so a compiled graph neither drops nor reorders them); eager code calls the same
functions directly.
"""

from typing import Any, NamedTuple, Optional

import torch

from ..debug_switches import SWITCHES
from ..torch_internals import keep_out_of_cuda_graphs, register_ordered_effects, round_divisions_as_eager
from .calls import BWD_ROLES, FWD_ROLES, plan_forward
from .regions import current_backward_pass
from .state import REGISTRY

__all__ = ["CallPrecision", "call_precision", "forward_scales", "backward_scales", "check_recipe_kind"]

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 0  # role of each tensor within its GEMM's columns


class CallPrecision(NamedTuple):
    fp8: bool  # the GEMM runs in FP8
    record: bool  # its amaxes are recorded (training, or calibrating)
    quantization: Any = None  # the recipe's, when the call runs in FP8 or records


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


def call_precision(module, gemm_index: int) -> CallPrecision:
    """How GEMM `gemm_index` of `module`'s current forward call runs.

    Eager, the call's plan is made here (at its first GEMM). Under torch.compile the answer comes from
    the region settings and grad mode, which dynamo guards, and the plan is made at run time by the
    forward_scales op: the same rules, since a compiled graph is never a recomputation.
    """
    if torch.compiler.is_compiling():
        settings = REGISTRY.settings
        if settings is None or not settings.active:
            return CallPrecision(False, False)
        record = settings.quantization.reduces_amax and (settings.calibrating or torch.is_grad_enabled())
        return CallPrecision(settings.enabled, record, settings.quantization)
    if gemm_index == 0:
        # a bisecting switch (debug_switches.py) holds it in high precision: no plan, also in a replay
        held = SWITCHES.high_precision_now(module)
        REGISTRY.set_plan(module, None if held else plan_forward(module, torch.is_grad_enabled()))
    plan = REGISTRY.plan_of(module)
    if plan is None:
        return CallPrecision(False, False)
    return CallPrecision(plan.fp8, plan.records_into is not None, plan.quantization)


def _forward_scales(
    module,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
    training=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Record this GEMM's amaxes; return its scales [[x, w], [x_inv, w_inv]] and its region's token.

    The scales are the region's frozen ones (a copy); the token (a CPU int64 scalar) names the
    region to the backward of a training call, -1 otherwise. With `training` given (the op under
    torch.compile), the call's plan is made here; otherwise `call_precision` made it."""
    if training is not None and gemm_index == 0:
        plan = plan_forward(module, training)
        REGISTRY.set_plan(module, plan)
        if plan is not None and plan.region is not None:
            plan.region.compiled_calls = True
    refuse_cuda_graph_capture(like)
    plan = REGISTRY.plan_of(module)
    base = plan.fwd_offset + FWD_ROLES * gemm_index
    if plan.records_into is not None:
        if x_amax is not None:
            plan.records_into.record(base + INPUT, x_amax)
        if w_amax is not None:
            plan.records_into.record(base + WEIGHT, w_amax)
    scales = torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]])
    token = torch.tensor(plan.serial)
    token._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
    return scales, token


def _backward_scales(module, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Record this backward GEMM's grad_output amax; return [scale, scale_inv] for it.

    Waits for earlier steps' backward reductions first (wait before read), and makes sure the pass
    launches the group's backward reduction when it ends."""
    refuse_cuda_graph_capture(g_amax)
    meta = module.fp8_meta["scaling_bwd"]
    direction = meta.direction
    direction.finish()
    direction.check()
    column = meta.offset + BWD_ROLES * gemm_index + GRAD_OUTPUT
    direction.record(column, g_amax)
    current_backward_pass().note(direction.group, REGISTRY.region_by_serial(int(token)))
    return torch.stack([direction.storage.scale[column], direction.storage.scale_inv[column]])


# ---- the custom ops ---------------------------------------------------------------------------------
# Each op names its module by handle (registry.py): a host tensor, an input of the graph.
@torch.library.custom_op("fp8train::forward_scales", mutates_args=())
def _forward_scales_op(
    handle: torch.Tensor,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_scales(REGISTRY.module(handle), gemm_index, x_amax, w_amax, like, training)


@_forward_scales_op.register_fake
def _(handle, gemm_index, x_amax, w_amax, like, training):
    return like.new_empty((2, 2), dtype=torch.float32), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("fp8train::backward_scales", mutates_args=())
def _backward_scales_op(
    handle: torch.Tensor, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    return _backward_scales(REGISTRY.module(handle), gemm_index, g_amax, token)


@_backward_scales_op.register_fake
def _(handle, gemm_index, g_amax, token):
    return g_amax.new_empty((2,), dtype=torch.float32)


@torch.library.custom_op("fp8train::check_recipe_kind", mutates_args=())
def _check_recipe_kind_op(handle: torch.Tensor, kind: str) -> None:
    REGISTRY.module(handle).claim_recipe_kind(kind)


@_check_recipe_kind_op.register_fake
def _(handle, kind):
    return None


PROTOCOL_OPS = (
    torch.ops.fp8train.forward_scales,
    torch.ops.fp8train.backward_scales,
    torch.ops.fp8train.check_recipe_kind,
)
ORDERED_EFFECTS = register_ordered_effects(op.default for op in PROTOCOL_OPS)
# mode="reduce-overhead": the graph's CUDA graphs hold the compute between these ops, never the ops
KEPT_OUT_OF_CUDA_GRAPHS = keep_out_of_cuda_graphs(op.default.name() for op in PROTOCOL_OPS)
# compiled scales are eager's: fp8_max / amax and 1 / scale correctly rounded on GPUs too
DIVISIONS_ROUNDED_AS_EAGER = round_divisions_as_eager()


# ---- what FP8 GEMM calls use: the op while torch.compile traces, the function otherwise -------------------
def forward_scales(
    module,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():  # the graph runs without grad: whether the call trains is passed
        training = torch.is_grad_enabled()
        return _forward_scales_op(module.fp8_handle, gemm_index, x_amax, w_amax, like, training)
    return _forward_scales(module, gemm_index, x_amax, w_amax, like)


def backward_scales(
    module_handle: torch.Tensor, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _backward_scales_op(module_handle, gemm_index, g_amax, token)
    return _backward_scales(REGISTRY.module(module_handle), gemm_index, g_amax, token)


def check_recipe_kind(module, kind: str) -> None:
    """A training call of `module` under a recipe of `kind`: refused if the module trained (or was
    loaded) with another kind. Under torch.compile the check runs in the graph, at run time, so that its
    error reaches the caller as it is (raised while tracing, dynamo would hide it)."""
    if torch.compiler.is_compiling():
        _check_recipe_kind_op(module.fp8_handle, kind)
    else:
        module.claim_recipe_kind(kind)
