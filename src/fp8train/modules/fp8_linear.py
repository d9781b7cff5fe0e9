"""The FP8 linear op (autograd): casts and GEMMs, and what each call asks of the protocol (ops.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import ops, protocol, second_order
from ..cast import amax, cast_operand
from ..current_scaling import block_linear, current_scales, quantize_weight_blocks
from ..fsdp import GatheredWeight
from ..gemm import choose_path, gemm
from ..recipe import Float8BlockScaling, recipe_kind
from ..tensor_parallel import (
    TensorParallel,
    TokenCollective,
    check_equal_shards,
    gather_fp8_tokens,
    reduce_scatter_tokens,
)

__all__ = ["fp8_linear", "parallel_linear"]


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, qweight, w_scale_inv, x_scale, x_scale_inv, token, handle, gemm_index, bwd,
        gather_group,
    ):  # fmt: skip
        x2d = x.reshape(-1, x.shape[-1])
        qx = cast_operand(x2d, x_scale, "e4m3", qweight.dtype)
        shape = x.shape
        if gather_group is not None:  # sequence parallel: tokens gathered in FP8, after the cast
            qx = gather_fp8_tokens(qx, gather_group)
            shape = (qx.shape[0] // x2d.shape[0] * x.shape[0], *x.shape[1:])
        y = gemm(qx, x_scale_inv, qweight.t(), w_scale_inv, x.dtype, bias)
        # the weight itself only for a double backward (create_graph): a reference, no copy
        ctx.save_for_backward(qx, x_scale_inv, qweight, w_scale_inv, token, weight)
        ctx.handle, ctx.gemm_index, ctx.bwd_encoding = handle, gemm_index, bwd
        ctx.has_bias, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = bias is not None, x.shape, x.dtype, weight.dtype
        ctx.gather_group = gather_group
        # not a view of y: FSDP2 warns on (and in-place ops would bypass hooks of) a view output
        return torch.ops.aten._unsafe_view(y, (*shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):
        qx, x_scale_inv, qweight, w_scale_inv, token, weight = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        if create_graph and (ctx.gather_group is not None or isinstance(weight, GatheredWeight)):
            second_order.refuse_create_graph("a sequence-parallel or FSDP2-FP8-gathered layer's gradients")
        g2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_bias = g2d.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        with torch.no_grad():
            if ctx.handle is None:  # current scaling: the gradient's own scale
                g_scales = torch.stack(current_scales(g2d, ctx.bwd_encoding))
            else:
                g_scales = ops.backward_scales(ctx.handle, ctx.gemm_index, amax(g2d), token)
                if not torch.compiler.is_compiling():  # an FSDP2 gather this forward saved is owed nothing
                    protocol.gathered_backward_ran(ctx.handle, ctx.gemm_index, ctx)
            g_dtype = _FP8_GRAD_DTYPES[ctx.bwd_encoding] if qx.dtype.itemsize == 1 else qx.dtype
            qg = cast_operand(g2d, g_scales[0], ctx.bwd_encoding, g_dtype)
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:
                grad_x = gemm(qg, g_scales[1], qweight, w_scale_inv, ctx.x_dtype)
                if ctx.gather_group is not None:  # each rank's tokens: summed over the group
                    grad_x = reduce_scatter_tokens(grad_x, ctx.gather_group)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = gemm(qg.t(), g_scales[1], qx, x_scale_inv, ctx.w_dtype)
        if create_graph:
            g_deq = qg.float() * g_scales[1]
            grad_x, grad_w = second_order.linear_grads(
                grad_x, grad_w, g2d, g_deq, weight, qweight.float() * w_scale_inv, g_deq,
                qx.float() * x_scale_inv, ctx.needs_input_grad[0],
            )  # fmt: skip
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None, None, None


class _HighPrecision(torch.autograd.Function):
    """A weight FSDP2 gathered in FP8, gathered again in its parameter dtype; gradients pass through."""

    @staticmethod
    def forward(ctx, weight: GatheredWeight) -> torch.Tensor:
        return weight.high_precision()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


_OPERAND_DTYPES = {"scaled_mm": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
_FP8_GRAD_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _operand_dtype(tokens: int, weight: torch.Tensor) -> torch.dtype:
    """FP8 for torch._scaled_mm when every GEMM dimension fits it, else bf16 or fp32 holding FP8 values.

    The backward GEMMs have the same three dimensions, so they take the same path."""
    out_features, in_features = weight.shape
    return _OPERAND_DTYPES[choose_path(weight.device, tokens, in_features, out_features)]


def fp8_linear(
    module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gemm_index: int = 0,
    is_first_microbatch: Optional[bool] = None,
    gather_group=None,
) -> torch.Tensor:
    """y = x @ weight.T + bias, in FP8 when the region (or a replayed plan) says so. With
    `gather_group` (sequence parallelism) x is this rank's block of tokens, all-gathered first."""
    if isinstance(weight, GatheredWeight) and torch.compiler.is_compiling():
        raise RuntimeError(
            "torch.compile over FP8 modules built with fsdp_fp8_all_gather is not supported: the gathered "
            "FP8 weight's bookkeeping runs outside the graph. Compile without the option, or run eagerly"
        )
    precision = protocol.call_precision(module, gemm_index)
    if isinstance(weight, GatheredWeight) and weight.fp8:
        if not precision.fp8 or precision.recipe is not None or not protocol.is_current_gather(weight.gather):
            # gathered in FP8 for another region (FSDP2 kept it gathered), or needed in high precision
            weight = _HighPrecision.apply(weight)  # gathered again, in the parameter dtype
    if not precision.fp8 or weight.numel() == 0:  # an empty GEMM (Linear(0, n)): the bias, as torch gives
        if precision.record and weight.numel():  # calibrating: amaxes only
            ops.forward_scales(module, gemm_index, amax(x), amax(weight), x.detach())
        if gather_group is not None:
            x = TokenCollective.apply(x, gather_group, True)
        return F.linear(x, weight, bias)
    if precision.recipe is not None:
        return _scaled_from_tensors(
            module, x, weight, bias, gemm_index, is_first_microbatch, gather_group, precision
        )
    gathered = isinstance(weight, GatheredWeight) and weight.fp8  # FSDP2 gathered it in FP8 already
    cached = module._weight_cache.get((gemm_index, "delayed")) if is_first_microbatch is False else None
    x_amax = amax(x) if precision.record else None
    w_amax = None
    if precision.record and cached is None:  # a gathered weight's amax is its shard's: MAX over ranks
        w_amax = weight.shard_amax() if gathered else amax(weight)
    scales, token = ops.forward_scales(module, gemm_index, x_amax, w_amax, x.detach())
    tokens = x.numel() // x.shape[-1] * (1 if gather_group is None else dist.get_world_size(gather_group))
    dtype = _operand_dtype(tokens, weight)
    if cached is None:
        if gathered:  # cast on the shard before the gather, with this region's weight scale
            fp8_weight, w_scale_inv = weight.fp8_values()
            qweight = fp8_weight.to(dtype)  # FP8 values convert exactly
        else:
            qweight, w_scale_inv = cast_operand(weight.detach(), scales[0, 1], "e4m3", dtype), scales[1, 1]
        if is_first_microbatch is not None:  # kept across microbatches: not FSDP2's gather buffer
            aliases_buffer = gathered and qweight.dtype.itemsize == 1
            cache = (qweight.clone() if aliases_buffer else qweight, w_scale_inv)
            module._weight_cache[(gemm_index, "delayed")] = cache
    else:
        qweight, w_scale_inv = cached[0].to(dtype), cached[1]  # FP8 values convert exactly
    y = _FP8LinearFn.apply(
        x, weight, bias, qweight, w_scale_inv, scales[0, 0], scales[1, 0], token,
        module._fp8_handle, gemm_index, precision.bwd_encoding, gather_group,
    )  # fmt: skip
    protocol.note_training_output(module, y)
    if gathered:
        protocol.note_gathered_forward(module, gemm_index, weight.gather, y)
    return y


def parallel_linear(
    module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gemm_index: int,
    is_first_microbatch: Optional[bool],
    tp: TensorParallel,
) -> torch.Tensor:
    """`fp8_linear` with the tensor-parallel collectives around it; a row GEMM adds its (whole) bias
    once, after the sum over the group."""
    if tp.gather_group() is not None and not module._shards_checked:  # the first SP gather of the module
        check_equal_shards(x, tp.group, module._signature())
        module._shards_checked = True
    if tp.mode == "row":
        y = tp.exit(fp8_linear(module, x, weight, None, gemm_index, is_first_microbatch))
        return y if bias is None else y + bias
    return fp8_linear(module, tp.enter(x), weight, bias, gemm_index, is_first_microbatch, tp.gather_group())


def _scaled_from_tensors(module, x, weight, bias, gemm_index, is_first_microbatch, gather_group, precision):
    """Current and block scaling: each cast's scale from the tensor it casts, whole, so a
    sequence-parallel input is gathered in high precision first (and FSDP2 gathered the weight so)."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled():  # eager calls checked in their plan
        ops.check_recipe_kind(module, recipe_kind(precision.recipe))
    if gather_group is not None:
        x = TokenCollective.apply(x, gather_group, True)
    if isinstance(precision.recipe, Float8BlockScaling):
        power_2 = precision.recipe.power_2_scale
        cached = module._weight_cache.get((gemm_index, "block")) if is_first_microbatch is False else None
        if cached is None and is_first_microbatch is not None:
            cached = module._weight_cache[(gemm_index, "block")] = quantize_weight_blocks(weight, power_2)
        y = block_linear(x, weight, bias, power_2, cached)
        protocol.note_training_output(module, y)
        return y
    dtype = _operand_dtype(x.numel() // x.shape[-1], weight)
    cached = module._weight_cache.get((gemm_index, "current")) if is_first_microbatch is False else None
    if cached is None:
        w_scale, w_scale_inv = current_scales(weight.detach(), "e4m3")
        qweight = cast_operand(weight.detach(), w_scale, "e4m3", dtype)
        if is_first_microbatch is not None:
            module._weight_cache[(gemm_index, "current")] = (qweight, w_scale_inv)
    else:
        qweight, w_scale_inv = cached[0].to(dtype), cached[1]
    x_scale, x_scale_inv = current_scales(x.detach(), "e4m3")
    no_token = torch.full((), -1, dtype=torch.int64)
    y = _FP8LinearFn.apply(
        x, weight, bias, qweight, w_scale_inv, x_scale, x_scale_inv, no_token, None, gemm_index,
        precision.bwd_encoding, None,
    )  # fmt: skip
    protocol.note_training_output(module, y)
    return y
