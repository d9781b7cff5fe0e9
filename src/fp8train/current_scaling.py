"""Scales taken from the tensor being cast, just before the cast: per tensor (`Float8CurrentScaling`)
or per 1x128 tile and 128x128 block (`Float8BlockScaling`). docs/design.md, section 9.

No history and no reduction: every rank computes the scale of what it casts. Block scaling's GEMM is
emulated: operands are dequantized tile by tile (exact with power-of-2 scales) and multiplied in
fp32; the same code runs on GPUs (torch's block-scaled `_scaled_mm` is not used yet).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .cast import amax, cast_operand
from .recipe import fp8_max
from .second_order import linear_grads

__all__ = [
    "TILE", "scale_from_amax", "current_scales", "quantize_tiles", "dequantize_tiles",
    "quantize_weight_blocks", "block_linear",
]  # fmt: skip

TILE = 128
FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax: torch.Tensor, fp8_max_value: float, power_2: bool = False) -> torch.Tensor:
    """TransformerEngine's rule: fp8_max / amax, capped at the float32 maximum, and 1 where amax is
    0, inf or NaN; with `power_2`, rounded down to a power of 2 (exactly, through the exponent)."""
    ok = torch.isfinite(amax) & (amax > 0)
    # a true division (python_number / tensor would multiply by a rounded reciprocal)
    quotient = torch.full_like(amax, fp8_max_value).div_(torch.where(ok, amax, 1.0))
    scale = torch.where(ok, quotient, 1.0).clamp(max=FLOAT32_MAX)
    if power_2:
        _, exponent = torch.frexp(scale)  # scale = m * 2**exponent, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def current_scales(x: torch.Tensor, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of `x` as a whole, float32 scalars."""
    scale = scale_from_amax(amax(x), fp8_max(encoding))
    return scale, scale.reciprocal()


def quantize_tiles(
    x: torch.Tensor, rows: int, power_2: bool, encoding: str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [R, C] cast to FP8 values (float32) with one scale per `rows` x 128 tile along C (rows=1:
    1x128 tiles; rows=128: 128x128 blocks), and the scale_inv per tile [ceil(R/rows), ceil(C/128)].
    The last tiles may be smaller: their scales come from their own elements (zero padding does not
    change an amax)."""
    r, c = x.shape
    padded = F.pad(x.float(), (0, -c % TILE, 0, -r % rows))
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // TILE, TILE)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), fp8_max(encoding), power_2)
    q = cast_operand(tiles, scale[:, None, :, None], encoding, torch.float32)
    return q.view(padded.shape)[:r, :c], scale.reciprocal()


def dequantize_tiles(q: torch.Tensor, scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    r, c = q.shape
    per_element = scale_inv.repeat_interleave(rows, 0)[:r].repeat_interleave(TILE, 1)[:, :c]
    return q * per_element


def quantize_weight_blocks(weight: torch.Tensor, power_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's 128x128-block FP8 values (1 byte each) and scale_inv per block; the same blocks
    serve w and w.T, so one quantization serves the forward and the input gradient."""
    q, scale_inv = quantize_tiles(weight.detach(), TILE, power_2)
    return q.to(torch.float8_e4m3fn), scale_inv  # FP8 values: exact in float8


class _BlockLinear(torch.autograd.Function):
    """y = x @ w.T + b with block-scaled FP8 operands in every GEMM, forward and backward: each GEMM
    quantizes its operands along its own reduction dimension. Backward keeps 1-byte operands: the
    weight's blocks and the input quantized along the tokens (the weight gradient's reduction)."""

    @staticmethod
    def forward(ctx, x, weight, bias, qweight, w_scale_inv, power_2):
        x2d = x.reshape(-1, x.shape[-1])
        w = dequantize_tiles(qweight.float(), w_scale_inv, TILE)
        qx, x_inv = quantize_tiles(x2d, 1, power_2)  # 1x128 tiles along in_features
        y = dequantize_tiles(qx, x_inv, 1) @ w.t()
        if bias is not None:
            y = y + bias.float()
        qxt, xt_inv = quantize_tiles(x2d.t(), 1, power_2)  # for the weight gradient: along the tokens
        # the weight itself only for a double backward (create_graph): a reference, no copy
        ctx.save_for_backward(qweight, w_scale_inv, qxt.to(torch.float8_e4m3fn), xt_inv, weight)
        ctx.power_2, ctx.has_bias, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = (
            power_2, bias is not None, x.shape, x.dtype, weight.dtype
        )  # fmt: skip
        # not a view of y: in-place ops on the output (torch.relu_, a TP all-reduce) must work
        return torch.ops.aten._unsafe_view(y.to(x.dtype), (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):
        qweight, w_scale_inv, qxt, xt_inv, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_b = g.sum(0).to(ctx.w_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = grad_w = g_for_x = g_for_w = x_deq = None
        with torch.no_grad():
            w = dequantize_tiles(qweight.float(), w_scale_inv, TILE)
            if ctx.needs_input_grad[0]:  # reduction over out_features: 1x128 tiles along g's rows
                qg, g_inv = quantize_tiles(g, 1, ctx.power_2)
                g_for_x = dequantize_tiles(qg, g_inv, 1)
                grad_x = (g_for_x @ w).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:  # reduction over tokens: tiles along the token dimension
                qgt, gt_inv = quantize_tiles(g.t(), 1, ctx.power_2)
                g_for_w = dequantize_tiles(qgt, gt_inv, 1).t()
                x_deq = dequantize_tiles(qxt.float(), xt_inv, 1).t()
                grad_w = (g_for_w.t() @ x_deq).to(ctx.w_dtype)
        if torch.is_grad_enabled():  # create_graph: differentiable, same values (second_order.py)
            grad_x, grad_w = linear_grads(
                grad_x, grad_w, g, g_for_x, weight, w, g_for_w, x_deq, ctx.needs_input_grad[0]
            )
        return grad_x, grad_w, grad_b, None, None, None


def block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    power_2: bool,
    quantized_weight: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """`quantized_weight`: the weight's (blocks, scale_inv) from `quantize_weight_blocks`, cached
    across microbatches (is_first_microbatch); quantized here when None."""
    if x.is_cuda:  # shown once per process by Python's default warning filter
        warnings.warn(
            "fp8train.Float8BlockScaling on CUDA runs an emulated GEMM (block-dequantized operands, fp32 "
            "matmul): the numerics of block scaling without its speed. Use DelayedScaling or "
            "Float8CurrentScaling for FP8 tensor-core GEMMs (torch._scaled_mm).",
            stacklevel=2,
        )
    qweight, w_scale_inv = quantized_weight or quantize_weight_blocks(weight, power_2)
    return _BlockLinear.apply(x, weight, bias, qweight, w_scale_inv, power_2)
