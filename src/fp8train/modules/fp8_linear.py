"""The FP8 linear function every module calls: the operands its recipe's quantization gives, multiplied
(docs/design.md, section 9), with the `Call` the protocol makes for the GEMM handed down (amax/)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import fsdp, saved, second_order
from ..amax import Call, begin_call
from ..cast import amax
from ..fsdp import GatheredWeight
from ..gemm import Operand, choose_path, kernel_choice, matmul, operand_dtype
from ..quantization.base import AMAX_IN_CAST, WeightOperands
from ..shape_rule import weight_fits, why_off
from ..tensor_parallel import (
    TensorParallel,
    TokenCollective,
    check_equal_shards,
    gather_fp8_tokens,
    reduce_scatter_tokens,
)
from ..torch_internals import unsafe_view
from ..user_warnings import warn_user

__all__ = ["fp8_linear", "parallel_linear"]


class _LinearFn(torch.autograd.Function):
    """y = x @ weight.T + bias in FP8: x quantized here, the weight's operands given (cast, cached or
    gathered in FP8), the gradient quantized in backward, all by `call.quantization`."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_ops: WeightOperands, call: Call, sp_group):
        x2d = x.reshape(-1, x.shape[-1])
        x_ops = call.quantization.quantize_input(x2d, call)
        shape = x.shape
        if sp_group is not None:  # sequence parallel: this rank's tokens cast, then gathered in FP8
            local = x_ops.forward
            gathered = Operand(gather_fp8_tokens(local.values, sp_group), local.scale_inv)
            x_ops = x_ops._replace(forward=gathered, wgrad=gathered)
            shape = (gathered.values.shape[0] // x2d.shape[0] * x.shape[0], *x.shape[1:])
        y = matmul(x_ops.forward, w_ops.forward.t(), _output_dtype(x), bias, path=call.gemm_path)
        formats = call.quantization.e2m1_values, call.quantization.e8m0_scales
        (x_saved, x_form), (w_saved, w_form) = (
            saved.pack(x_ops.wgrad, *formats),
            saved.pack(w_ops.dgrad, *formats),
        )
        # the weight itself only for a double backward (create_graph): a reference, not a copy
        kept = (*x_saved.tensors(), *w_saved.tensors(), weight, call.module_handle, call.token)
        ctx.save_for_backward(*kept)
        ctx.layouts, ctx.forms = (x_saved.layout, w_saved.layout), (x_form, w_form)
        ctx.call, ctx.sp_group = call.without_tensors(), sp_group  # its tensors: saved above
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # not a view of y: FSDP2 warns on (and in-place ops would bypass hooks of) a view output
        return unsafe_view(y, (*shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):
        *operands, weight, module_handle, token = ctx.saved_tensors
        x_wgrad = saved.unpack(Operand.rebuild(operands[:3], ctx.layouts[0]), ctx.forms[0])
        w_dgrad = saved.unpack(Operand.rebuild(operands[3:], ctx.layouts[1]), ctx.forms[1])
        call = ctx.call.with_saved(module_handle, token)
        create_graph = torch.is_grad_enabled()
        if create_graph and (
            ctx.sp_group is not None or isinstance(weight, GatheredWeight) or x_wgrad.rotated
        ):
            second_order.refuse_create_graph(
                "a sequence-parallel, FSDP2-FP8-gathered or Hadamard-transformed layer's gradients"
            )
        needs = ctx.needs_input_grad[:2]
        g2d = grad_y.reshape(-1, grad_y.shape[-1])
        needs_bias = ctx.b_dtype is not None and ctx.needs_input_grad[2]
        grad_bias = g2d.sum(0).to(ctx.b_dtype) if needs_bias else None
        grad_x = grad_w = None
        with torch.no_grad():
            g_ops = call.quantization.quantize_grad(g2d, call, needs)
            if isinstance(weight, GatheredWeight) and not torch.compiler.is_compiling():
                fsdp.gathered_backward_ran(call.module_handle, call.gemm_index, ctx)  # owed nothing now
            if needs[0]:
                grad_x = matmul(g_ops.dgrad, w_dgrad, ctx.x_dtype, role="dgrad", path=call.gemm_path)
                if ctx.sp_group is not None:  # each rank's tokens: summed over the group
                    grad_x = reduce_scatter_tokens(grad_x, ctx.sp_group)
                grad_x = grad_x.reshape(ctx.x_shape)
            if needs[1]:
                grad_w = matmul(g_ops.wgrad.t(), x_wgrad, ctx.w_dtype, role="wgrad", path=call.gemm_path)
        if create_graph:  # differentiable, with the same values (second_order.py)
            grad_x, grad_w = second_order.linear_grads(
                grad_x, grad_w, g2d,
                g_ops.dgrad.dequantize() if needs[0] else None, weight, w_dgrad.dequantize(),
                g_ops.wgrad.dequantize() if needs[1] else None, x_wgrad.dequantize(), needs[0],
            )  # fmt: skip
        return grad_x, grad_w, grad_bias, None, None, None


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """x's dtype, or torch.autocast's where it is on for x's device (as TransformerEngine's modules):
    the activations after an FP8 GEMM then are what they would be after an autocast GEMM."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _HighPrecision(torch.autograd.Function):
    """A weight FSDP2 gathered in FP8, gathered again in its parameter dtype; gradients pass through."""

    @staticmethod
    def forward(ctx, weight: GatheredWeight) -> torch.Tensor:
        return weight.high_precision()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _gemm_path(tokens: int, weight: torch.Tensor, call: Call) -> tuple[str, torch.dtype]:
    """The GEMM path (gemm.PATHS) and its operand dtype (`gemm.operand_dtype`): FP8 for torch._scaled_mm
    when every GEMM dimension fits it, else bf16 or fp32 holding FP8 values. Decided once per region
    and shape for a training call (`Region.gemm_paths`: the settings are read at the first call).

    The backward GEMMs have the same three dimensions, so they take the same path."""
    region = None if call.plan is None else call.plan.region
    key = (weight.device, tokens, *weight.shape)
    if region is not None and key in region.gemm_paths:
        return region.gemm_paths[key]
    out_features, in_features = weight.shape
    path = choose_path(weight.device, tokens, in_features, out_features)
    decided = path, operand_dtype(path, weight.device)
    if region is not None:
        region.gemm_paths[key] = decided
    return decided


def _warn_if_emulated_for_shape(module, weight: torch.Tensor, call: Call) -> None:
    """One rule for a weight off 16, on every device (shape_rule.py): an FP8 module computes it in FP8
    through the exact emulation. Where the device would otherwise run the recipe's kernel (a GPU, or
    FP8TRAIN_GEMM=scaled_mm) that is a fallback, and the module says so once."""
    if getattr(module, "shape_warned", False) or torch.compiler.is_compiling():
        return
    kernel = call.quantization.kernel
    if not kernel_choice(kernel, weight.device)[0]:
        return  # the emulation is this device's path for every shape: nothing falls back
    module.shape_warned = True
    warn_user(
        f"fp8train: {module.signature} computes FP8 through the exact emulation on {weight.device}, not "
        f"torch._scaled_mm's {kernel} kernel: {why_off(*weight.shape)}. Pad it, or build it as a "
        "torch.nn.Linear to keep it in high precision (fp8train.convert_to_fp8 does); "
        "fp8train.coverage(model) shows each layer's path"
    )


def fp8_linear(
    module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gemm_index: int = 0,
    is_first_microbatch: Optional[bool] = None,
    sp_group=None,
    stored_weight: Optional[WeightOperands] = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias, in FP8 when the region (or a replayed plan) says so. With `sp_group`
    (sequence parallelism: the TP group) x is this rank's block of tokens, all-gathered first.
    `stored_weight`: the weight's operands as stored (a frozen FP8 `weight`, StoredFP8Linear), used
    as they are in FP8 and dequantized outside it."""
    if isinstance(weight, GatheredWeight) and torch.compiler.is_compiling():
        raise RuntimeError(
            "torch.compile over FP8 modules built with fsdp_fp8_all_gather is not supported: the gathered "
            "FP8 weight's bookkeeping runs outside the graph. Compile without the option, or run eagerly"
        )
    call = begin_call(module, gemm_index)
    quantization = call.quantization
    gathered = isinstance(weight, GatheredWeight) and weight.fp8  # FSDP2 gathered it in FP8 already
    if gathered and not (
        call.fp8 and quantization.casts_before_gather and fsdp.is_current_gather(weight.gather)
    ):
        # gathered in FP8 for another region (FSDP2 kept it gathered), or needed in high precision
        weight, gathered = _HighPrecision.apply(weight), False  # gathered again, in the parameter dtype
    if not call.fp8 or weight.numel() == 0:  # an empty GEMM (Linear(0, n)): the bias, as torch gives
        if stored_weight is not None:
            weight = stored_weight.forward.dequantize().to(x.dtype)
        elif call.record and weight.numel():  # calibrating: amaxes only
            quantization.call_scales(call, x, lambda: amax(weight))
        if sp_group is not None:
            x = TokenCollective.apply(x, sp_group, True)
        return F.linear(x, weight, bias)
    if not weight_fits(*weight.shape):  # the same FP8 numerics on every device (shape_rule.py)
        _warn_if_emulated_for_shape(module, weight, call)
    if sp_group is not None and not quantization.casts_before_gather:
        x, sp_group = TokenCollective.apply(x, sp_group, True), None  # cast where the tensor is whole
    if torch.compiler.is_compiling() and torch.is_grad_enabled():  # eager calls checked in their plan
        call.check_recipe_kind()
    stored = stored_weight is not None  # used as it is: never cast, cached or recorded
    cached = rebuild = None
    if is_first_microbatch is False and not stored:
        cached = module.cached_weight(gemm_index, quantization.kind)
        if cached is None:  # dropped by a load: cast again with the scale it was cast with
            rebuild = module.weight_cast_scales(gemm_index, quantization.kind)
            if rebuild is not None and gathered:
                raise RuntimeError(
                    f"{module.signature}: is_first_microbatch=False after a load, with fsdp_fp8_all_gather: "
                    "the FP8 weight of the step's first microbatch cannot be rebuilt from the gathered "
                    "shards. Resume the step with is_first_microbatch=True, or save at a step boundary"
                )
    reused = cached is not None or rebuild is not None  # the step's weight: no weight amax recorded
    if reused or stored:
        weight_amax = None
    elif gathered:
        weight_amax = weight.shard_amax
    elif torch.compiler.is_compiling():
        weight_amax = lambda: amax(weight)  # noqa: E731
    else:  # eager: quantize_weight casts it below and may take its amax in the same read
        weight_amax = AMAX_IN_CAST
    scales, token = quantization.call_scales(call, x, weight_amax)
    if rebuild is not None:  # the weight scale the step's first microbatch cast the weight with
        scales = torch.stack([scales[:, 0], rebuild.to(scales.device)], dim=1)
    tokens = x.numel() // x.shape[-1] * (1 if sp_group is None else dist.get_world_size(sp_group))
    path, dtype = _gemm_path(tokens, weight, call)
    call = call.for_gemm(dtype, scales, token, path, weight_amax is AMAX_IN_CAST)
    if stored:  # used as it is, whatever the recipe (a block operand: matmul dequantizes it)
        w_ops = stored_weight
    elif cached is not None:
        w_ops = quantization.reuse_weight(cached, call)
    elif gathered:  # cast on the shard before the gather, with this region's weight scale
        fp8_weight, w_scale_inv = weight.fp8_values()
        w_ops = WeightOperands.same(Operand(fp8_weight.to(call.operand_dtype), w_scale_inv))  # exact
    else:
        w_ops = quantization.quantize_weight(weight.detach(), call)
    if is_first_microbatch is not None and cached is None and not stored:  # kept across microbatches
        cast_scales = None if scales is None else scales[:, 1]
        module.cache_weight(gemm_index, quantization.kind, w_ops, copy=gathered, cast_scales=cast_scales)
    y = _LinearFn.apply(x, weight, bias, w_ops, call, sp_group)
    if not torch.compiler.is_compiling():  # compiled graphs' outputs: the region counts their calls
        call.note_output(y)
    if gathered:
        fsdp.note_gathered_forward(module, gemm_index, weight.gather, y)
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
    if tp.sp_group() is not None and not module.shards_checked:  # the first SP gather of the module
        check_equal_shards(x, tp.group, module.signature)
        module.shards_checked = True
    if tp.mode == "row":
        y = tp.exit(fp8_linear(module, x, weight, None, gemm_index, is_first_microbatch))
        return y if bias is None else y + bias
    return fp8_linear(module, tp.enter(x), weight, bias, gemm_index, is_first_microbatch, tp.sp_group())
