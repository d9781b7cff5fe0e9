"""The protocol's per-call work as custom ops, so that torch.compile graphs call it at run time.

A compiled graph holds the FP8 math (casts, GEMMs) as ordinary ops that inductor fuses. What each
call asks of the protocol (make the call's plan, record amaxes, hand out the region's frozen
scales; in backward: wait for earlier reductions, record, arrange the end-of-pass launch) is Python
state, run here as two custom ops. They are registered as ordered side effects, so a compiled graph
neither drops nor reorders them, and eager code calls the same functions directly.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import protocol

__all__ = ["forward_scales", "backward_scales", "check_recipe_kind"]


@torch.library.custom_op("fp8train::forward_scales", mutates_args=())
def _forward_scales_op(
    handle: int,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    module = protocol.REGISTRY.modules[handle]
    return protocol.forward_scales(module, gemm_index, x_amax, w_amax, training)


@_forward_scales_op.register_fake
def _(handle, gemm_index, x_amax, w_amax, like, training):
    return like.new_empty((2, 2), dtype=torch.float32), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("fp8train::backward_scales", mutates_args=())
def _backward_scales_op(
    handle: int, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    module = protocol.REGISTRY.modules[handle]
    return protocol.backward_scales(module, gemm_index, g_amax, token)


@_backward_scales_op.register_fake
def _(handle, gemm_index, g_amax, token):
    return g_amax.new_empty((2,), dtype=torch.float32)


@torch.library.custom_op("fp8train::check_recipe_kind", mutates_args=())
def _check_recipe_kind_op(handle: int, kind: str) -> None:
    protocol.check_recipe_kind(protocol.REGISTRY.modules[handle], kind)


@_check_recipe_kind_op.register_fake
def _(handle, kind):
    return None


def _register_ordered_effects() -> bool:
    """Mark the ops as side effects (private torch API, the one place this module relies on one)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:  # torch without it: compiled graphs could drop an op whose outputs go unused
        return False
    ops = (
        torch.ops.fp8train.forward_scales,
        torch.ops.fp8train.backward_scales,
        torch.ops.fp8train.check_recipe_kind,
    )
    for op in (o.default for o in ops):
        _register_effectful_op(op, _EffectType.ORDERED)
    return True


ORDERED_EFFECTS = _register_ordered_effects()


def forward_scales(
    module,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """protocol.forward_scales: through the custom op while torch.compile traces, directly otherwise."""
    if torch.compiler.is_compiling():  # the graph runs without grad: whether the call trains is passed
        training = torch.is_grad_enabled()
        return _forward_scales_op(module._fp8_handle, gemm_index, x_amax, w_amax, like, training)
    return protocol.forward_scales(module, gemm_index, x_amax, w_amax)


def check_recipe_kind(module, kind: str) -> None:
    """A training call of `module` under a recipe of `kind`: refused if the module trained (or was
    loaded) with another kind. Under torch.compile the check runs in the graph, at run time, so that its
    error reaches the caller as it is (raised while tracing, dynamo would hide it)."""
    if torch.compiler.is_compiling():
        _check_recipe_kind_op(module._fp8_handle, kind)
    else:
        protocol.check_recipe_kind(module, kind)


def backward_scales(
    module_handle: int, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    """protocol.backward_scales: through the custom op while torch.compile traces, directly otherwise."""
    if torch.compiler.is_compiling():
        return _backward_scales_op(module_handle, gemm_index, g_amax, token)
    return protocol.backward_scales(protocol.REGISTRY.modules[module_handle], gemm_index, g_amax, token)
