"""The FP8 linear op (autograd): casts, GEMMs, amax recording and backward bookkeeping."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import protocol
from ..cast import amax, quantize
from ..gemm import gemm, operand
from ..protocol import Plan
from .base import BWD_ROLES, FWD_ROLES, FP8Module

__all__ = ["fp8_linear"]

INPUT, WEIGHT = 0, 1
GRAD_OUTPUT = 0


def _cast_weight(
    module: FP8Module, weight: torch.Tensor, plan: Plan, gemm_index: int, is_first_microbatch: Optional[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight and its scale_inv; cached across microbatches when asked to."""
    cached = module._weight_cache.get(gemm_index)
    if is_first_microbatch is False and cached is not None:
        return cached
    column = plan.fwd_offset + FWD_ROLES * gemm_index + WEIGHT
    if plan.records_into is not None:
        plan.records_into.record(column, amax(weight))
    encoding = "e4m3"
    cast = (operand(quantize(weight.detach(), plan.scale[column], encoding)), plan.scale_inv[column])
    if is_first_microbatch is not None:
        module._weight_cache[gemm_index] = cast
    return cast


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qweight, weight_scale_inv, plan: Plan, gemm_index: int):
        column = plan.fwd_offset + FWD_ROLES * gemm_index + INPUT
        if plan.records_into is not None:
            plan.records_into.record(column, amax(x))
        x2d = x.reshape(-1, x.shape[-1])
        qx = operand(quantize(x2d, plan.scale[column], "e4m3"))
        x_scale_inv = plan.scale_inv[column]
        y = gemm(qx, x_scale_inv, qweight.t(), weight_scale_inv, x.dtype, bias)
        ctx.save_for_backward(qx, x_scale_inv, qweight, weight_scale_inv)
        ctx.plan, ctx.gemm_index, ctx.has_bias = plan, gemm_index, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        plan = ctx.plan
        qx, x_scale_inv, qweight, weight_scale_inv = ctx.saved_tensors
        g2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_bias = g2d.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        column = plan.bwd_offset + BWD_ROLES * ctx.gemm_index + GRAD_OUTPUT
        g_scale, g_scale_inv = protocol.backward_scale(plan, column)  # waits for earlier steps first
        protocol.record_backward(plan, column, amax(g2d))
        qg = operand(quantize(g2d, g_scale, plan.backward.bwd.encoding))
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm(qg, g_scale_inv, qweight, weight_scale_inv, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = gemm(qg.t(), g_scale_inv, qx, x_scale_inv, ctx.w_dtype)
        return grad_x, grad_w, grad_bias, None, None, None, None


def fp8_linear(
    module: FP8Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    plan: Optional[Plan],
    gemm_index: int = 0,
    is_first_microbatch: Optional[bool] = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias, in FP8 when `plan` says so, else in high precision."""
    if plan is None or not plan.fp8:
        if plan is not None and plan.records_into is not None:  # calibrating: amaxes only
            base = plan.fwd_offset + FWD_ROLES * gemm_index
            plan.records_into.record(base + INPUT, amax(x.detach()))
            plan.records_into.record(base + WEIGHT, amax(weight.detach()))
        return F.linear(x, weight, bias)
    qweight, weight_scale_inv = _cast_weight(module, weight, plan, gemm_index, is_first_microbatch)
    return _FP8LinearFn.apply(x, weight, bias, qweight, weight_scale_inv, plan, gemm_index)
