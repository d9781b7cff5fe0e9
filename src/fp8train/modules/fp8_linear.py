"""The FP8 linear function every module calls: the operands its recipe's quantization gives for the
weight and input sources the call picks (sources.py), multiplied (docs/design.md, sections 9 and 9.3),
with the `Call` the protocol makes for the GEMM handed down (amax/)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import fsdp, saved, second_order
from ..fsdp import GatheredWeight
from ..numerics.gemm import Operand, choose_path, kernel_choice, matmul, operand_dtype
from ..quantization.base import AMAX_IN_CAST, WeightOperands
from ..runtime import Call, begin_call
from ..shape_rule import weight_fits, why_off
from ..tensor_parallel import TensorParallel, TokenCollective, check_equal_shards, reduce_scatter_tokens
from ..torch_internals import unsafe_view
from ..user_warnings import warn_user
from .sources import LOCAL, InputSource, input_source, weight_source

__all__ = ["fp8_linear", "parallel_linear"]


class _LinearFn(torch.autograd.Function):
    """y = x @ weight.T + bias in FP8: x's operands made here by its input source, the weight's given
    (made by its weight source: sources.py), the gradient quantized in backward, all by
    `call.quantization`. `given`: what the call hands over besides the tensors that get gradients, in
    one argument (each argument of `Function.apply` costs a look at it): (w_ops, call, inputs, noted,
    save_fp8); `noted`: the forward used an FSDP2 FP8 gather that its backward settles; `save_fp8`:
    whether backward keeps emulated operands as FP8 bytes (`saved.saves_fp8_bytes`, decided with the
    GEMM path: `_gemm_path`), otherwise they are kept as the GEMMs take them, without a call."""

    @staticmethod
    def forward(ctx, x, weight, bias, given: tuple[WeightOperands, Call, InputSource, bool, bool]):
        w_ops, call, inputs, noted, save_fp8 = given
        x2d = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])  # (2-D: no view to make)
        x_ops = inputs.operands(x2d, call)
        shape = x.shape
        if inputs.fp8_group is not None:  # sequence parallel: every rank's tokens, gathered in FP8
            shape = (x_ops.forward.values.shape[0] // x2d.shape[0] * x.shape[0], *x.shape[1:])
        y = matmul(x_ops.forward, w_ops.forward.t(), _output_dtype(x), bias, path=call.gemm_path)
        if save_fp8:
            formats = call.quantization.e2m1_values, call.quantization.e8m0_scales
            (x_saved, x_form), (w_saved, w_form) = (
                saved.pack(x_ops.wgrad, *formats),
                saved.pack(w_ops.dgrad, *formats),
            )
            ctx.forms = x_form, w_form
        else:  # kept as they are (`saved.unpack` has nothing to do)
            x_saved, w_saved, ctx.forms = x_ops.wgrad, w_ops.dgrad, None
        # the weight itself only for a double backward (create_graph): a reference, not a copy
        kept = (*x_saved.tensors(), *w_saved.tensors(), weight, call.module_handle, call.token)
        ctx.save_for_backward(*kept)
        ctx.layouts = x_saved.layout, w_saved.layout
        ctx.call, ctx.sp_group = call.without_tensors(), inputs.fp8_group  # its tensors: saved above
        ctx.noted = noted  # a forward of FSDP2's FP8 gather: its backward settles what it owes
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # y as it is for 2-D x (the GEMM's own product); else not a view of y: FSDP2 warns on (and
        # in-place ops would bypass hooks of) a view output
        return y if len(shape) == 2 else unsafe_view(y, (*shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):
        *operands, weight, module_handle, token = ctx.saved_tensors
        x_wgrad = Operand.rebuild(operands[:3], ctx.layouts[0])
        w_dgrad = Operand.rebuild(operands[3:], ctx.layouts[1])
        forms = ctx.forms
        if forms is not None:  # kept as FP8 bytes: the GEMMs' values again
            x_wgrad, w_dgrad = saved.unpack(x_wgrad, forms[0]), saved.unpack(w_dgrad, forms[1])
        call = ctx.call.with_saved(module_handle, token)
        create_graph = torch.is_grad_enabled()
        if create_graph and (
            ctx.sp_group is not None or isinstance(weight, GatheredWeight) or x_wgrad.rotated
        ):
            second_order.refuse_create_graph(
                "a sequence-parallel, FSDP2-FP8-gathered or Hadamard-transformed layer's gradients"
            )
        needs = ctx.needs_input_grad[:2]
        g2d = grad_y if grad_y.ndim == 2 else grad_y.reshape(-1, grad_y.shape[-1])
        needs_bias = ctx.b_dtype is not None and ctx.needs_input_grad[2]
        grad_bias = g2d.sum(0) if needs_bias else None
        if needs_bias and grad_bias.dtype != ctx.b_dtype:  # (a bias in another dtype than y's)
            grad_bias = grad_bias.to(ctx.b_dtype)
        if create_graph:
            with torch.no_grad():
                g_ops, grad_x, grad_w = _LinearFn.gemms(ctx, call, g2d, needs, x_wgrad, w_dgrad)
        else:  # (grad mode is off already: a backward that builds no graph)
            g_ops, grad_x, grad_w = _LinearFn.gemms(ctx, call, g2d, needs, x_wgrad, w_dgrad)
        if create_graph:  # differentiable, with the same values (second_order.py)
            grad_x, grad_w = second_order.linear_grads(
                grad_x, grad_w, g2d,
                g_ops.dgrad.dequantize() if needs[0] else None, weight, w_dgrad.dequantize(),
                g_ops.wgrad.dequantize() if needs[1] else None, x_wgrad.dequantize(), needs[0],
            )  # fmt: skip
        return grad_x, grad_w, grad_bias, None

    @staticmethod
    def gemms(ctx, call: Call, g2d: torch.Tensor, needs: tuple, x_wgrad: Operand, w_dgrad: Operand):
        """Backward's quantized gradient and its GEMMs (grad mode off): (g_ops, grad_x, grad_w)."""
        grad_x = grad_w = None
        g_ops = call.quantization.quantize_grad(g2d, call, needs)
        if ctx.noted and not torch.compiler.is_compiling():
            fsdp.gathered_backward_ran(call.module_handle, call.gemm_index, ctx)  # owed nothing now
        if needs[0]:
            grad_x = matmul(g_ops.dgrad, w_dgrad, ctx.x_dtype, role="dgrad", path=call.gemm_path)
            if ctx.sp_group is not None:  # each rank's tokens: summed over the group
                grad_x = reduce_scatter_tokens(grad_x, ctx.sp_group)
            if grad_x.shape != ctx.x_shape:  # (x was not 2-D)
                grad_x = grad_x.reshape(ctx.x_shape)
        if needs[1]:
            grad_w = matmul(g_ops.wgrad.t(), x_wgrad, ctx.w_dtype, role="wgrad", path=call.gemm_path)
        return g_ops, grad_x, grad_w


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """x's dtype, or torch.autocast's where it is on for x's device (as TransformerEngine's modules):
    the activations after an FP8 GEMM then are what they would be after an autocast GEMM."""
    # (CPU and CUDA tensors by attribute: `x.device` makes a device object)
    device = "cpu" if x.is_cpu else "cuda" if x.is_cuda else x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _gemm_path(
    x: torch.Tensor, ranks: int, weight: torch.Tensor, call: Call
) -> tuple[str, torch.dtype, bool, bool]:
    """The GEMM path (gemm.PATHS) and its operand dtype (`gemm.operand_dtype`): FP8 for torch._scaled_mm
    when every GEMM dimension fits it, else bf16 or fp32 holding FP8 values; whether the weight's
    shape fits torch._scaled_mm (`shape_rule.weight_fits`); and whether backward keeps the operands
    as FP8 bytes (`saved.saves_fp8_bytes`, FP8TRAIN_SAVE_FP8). Decided once per region and shape for a
    training call (`Region.gemm_paths`: the settings are read at the first call), for `x` (its rows
    times `ranks`, the ranks whose tokens the GEMM multiplies, are the GEMM's tokens).

    The backward GEMMs have the same three dimensions, so they take the same path."""
    region = None if call.plan is None else call.plan.region
    key = (weight.device, x.shape[:-1], ranks, *weight.shape)  # (the tokens without counting them)
    if region is not None and key in region.gemm_paths:
        return region.gemm_paths[key]
    out_features, in_features = weight.shape
    path = choose_path(weight.device, x.numel() // x.shape[-1] * ranks, in_features, out_features)
    decided = (
        path,
        operand_dtype(path, weight.device),
        weight_fits(out_features, in_features),
        saved.saves_fp8_bytes(),
    )
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
    grouped=None,
) -> Optional[torch.Tensor]:
    """y = x @ weight.T + bias, in FP8 when the region (or a replayed plan) says so. With `sp_group`
    (sequence parallelism: the TP group) x is this rank's block of tokens, all-gathered first.
    `stored_weight`: the weight's operands as stored (a frozen FP8 `weight`, StoredFP8Linear), used
    as they are in FP8 and dequantized outside it. `grouped`: the GroupedGEMMs of a grouped call
    (grouped_gemm.py); where it takes the call, the GEMM's operands go to it and None is returned.

    The call picks its weight source and input source once (sources.py); one path runs for all."""
    call = begin_call(module, gemm_index)
    weight, source = weight_source(module, weight, call, gemm_index, is_first_microbatch, stored_weight)
    if not source.fp8:  # in high precision
        weight = source.linear_weight(weight, x, call)
        return F.linear(x if sp_group is None else TokenCollective.apply(x, sp_group, True), weight, bias)
    x, inputs = (x, LOCAL) if sp_group is None else input_source(x, sp_group, call.quantization)
    compiling = torch.compiler.is_compiling()
    if compiling and torch.is_grad_enabled():  # eager calls checked in their plan
        call.check_recipe_kind()
    scales, token = call.quantization.call_scales(call, x, source.weight_amax)
    if source.cast_scales is not None:  # the weight scale the weight is cast with instead
        scales = torch.stack([scales[:, 0], source.cast_scales.to(scales.device)], dim=1)
    path, dtype, fits, save_fp8 = _gemm_path(x, inputs.ranks, weight, call)
    if not fits:  # the same FP8 numerics on every device (shape_rule.py)
        _warn_if_emulated_for_shape(module, weight, call)
    native = grouped is not None and stored_weight is None and grouped.takes(call, _output_dtype(x))
    if native:  # one GEMM of a grouped call (grouped_gemm.py): its operands in FP8
        path, dtype = grouped.operand_path()
    call = call.for_gemm(dtype, scales, token, path, source.weight_amax is AMAX_IN_CAST)
    w_ops = source.operands(weight, call)
    if source.kept:  # for the step's next microbatches, with the scales it was cast with
        cast_scales = None if scales is None else scales[:, 1]
        module.cache_weight(gemm_index, call.quantization.kind, w_ops, source.gather is not None, cast_scales)
    if native:
        grouped.add(weight, bias, w_ops, call)
        return None
    y = _LinearFn.apply(x, weight, bias, (w_ops, call, inputs, source.gather is not None, save_fp8))
    if not compiling:  # compiled graphs' outputs: the region counts their calls
        call.note_output(y)
    if source.gather is not None:
        fsdp.note_gathered_forward(module, gemm_index, source.gather, y)
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
    if tp.group is None:  # not tensor parallel (most modules): no collective to place
        return fp8_linear(module, x, weight, bias, gemm_index, is_first_microbatch)
    if tp.sp_group() is not None and not module.shards_checked:  # the first SP gather of the module
        check_equal_shards(x, tp.group, module.signature)
        module.shards_checked = True
    if tp.mode == "row":
        y = tp.exit(fp8_linear(module, x, weight, None, gemm_index, is_first_microbatch))
        return y if bias is None else y + bias
    return fp8_linear(module, tp.enter(x), weight, bias, gemm_index, is_first_microbatch, tp.sp_group())
