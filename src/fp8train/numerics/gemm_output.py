"""The emulated bf16 path's output in one pass: the fp32 product rounded to bf16, scaled in fp32 by the
product of the operands' scales, the bias added, in the output dtype, as one compiled kernel for eager
CPU outputs of `cast.FUSED_MIN_ELEMENTS` or more (docs/design.md, section 6). Eagerly that is three to
five calls and two or three passes (the scales' product, a bf16 copy, the scaling, the bias, a
conversion); the kernel computes the same operations, each rounding as torch's eager kernel does, so
the same bits (tests/recipes/test_lean_path.py). Used where `cast.py`'s compiled cast is
(`fused_output_applies`), called as `cast.py`'s kernels are (`torch_internals.DirectlyCalled`), and
registered alike as the custom op `fp8train::scaled_output` where a dispatch mode would see it.

Where the caller owns the product (`gemm`: the fresh result of its torch.mm, held by nothing else) and
the output dtype is the product's (float32), the kernel writes the output into the product itself
(`overwrite`; never under a dispatch mode, which may hold the product: selective activation
checkpointing caches it and returns it at the recomputation): each element is read, then written, by the same
iteration of one pointwise loop (inductor's in-place buffer), so the bits are the out-of-place
kernel's, and the step allocates no second output-sized buffer. A new buffer of 4-16 MB costs more
than the pass that fills it (its pages are faulted in and zeroed by the OS: measured in
docs/benchmarks.md, "The lean eager path").
"""

from __future__ import annotations

from typing import Optional

import torch

from ..torch_internals import PLAIN_TENSOR_TYPES, dispatch_mode_active
from . import cast

__all__ = ["fused_output_applies", "scaled_output"]


def fused_output_applies(y: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether `scaled_output` runs as the compiled kernel for this (large: the caller checks) output;
    `scale` is one of its scales (they live on one device)."""
    return (  # (devices by attribute: `.device` makes a device object)
        cast.COMPILED_KERNELS.running
        and y.is_cpu
        and scale.is_cpu
        and (bias is None or (bias.__class__ in PLAIN_TENSOR_TYPES and bias.is_cpu and bias.is_contiguous()))
        and not torch.compiler.is_compiling()
    )  # (a bias of a subclass, e.g. a DTensor bias: torch's ops)


def _output_kernel(y: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                   y_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[torch.Tensor]:  # fmt: skip
    """`gemm`'s eager epilogue of the bf16 path without a bias: round to bf16, then scale in fp32 by
    the product of the scales (one rounding, as eager; as a 1-element tensor, which takes part in
    type promotion). A 1-tuple: `torch_internals.DirectlyCalled`'s form; y_dtype (y's) is the variant's."""
    scale = (a_scale_inv * b_scale_inv).reshape(1)
    return (torch.mul(y.to(torch.bfloat16), scale).to(out_dtype),)


def _biased_output_kernel(y: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                          bias: torch.Tensor, y_dtype: torch.dtype, out_dtype: torch.dtype,
                          bias_dtype: torch.dtype) -> tuple[torch.Tensor]:  # fmt: skip
    """With a bias: the scaled product, then the bias added (two roundings, as `gemm`'s eager
    `mul(...).add_(bias)`; inductor's C++ is compiled without floating-point contraction, so no fused
    multiply-add rounds them once). bias_dtype (the bias's) is the variant's."""
    scale = (a_scale_inv * b_scale_inv).reshape(1)
    return ((torch.mul(y.to(torch.bfloat16), scale) + bias).to(out_dtype),)


def _output_kernel_(y: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                    y_dtype: torch.dtype) -> tuple:  # fmt: skip
    """`_output_kernel` written into y (the output dtype is y's): nothing returned."""
    scale = (a_scale_inv * b_scale_inv).reshape(1)
    y.copy_(torch.mul(y.to(torch.bfloat16), scale))
    return ()


def _biased_output_kernel_(y: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                           bias: torch.Tensor, y_dtype: torch.dtype,
                           bias_dtype: torch.dtype) -> tuple:  # fmt: skip
    """`_biased_output_kernel` written into y (the output dtype is y's): nothing returned."""
    scale = (a_scale_inv * b_scale_inv).reshape(1)
    y.copy_(torch.mul(y.to(torch.bfloat16), scale) + bias)
    return ()


def _run(y: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
         out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    compiled = cast.COMPILED_KERNELS.compiled
    if bias is None:
        key = (y.dtype, out_dtype)
        kernel = compiled.get((_output_kernel, key)) or cast.COMPILED_KERNELS.variant(_output_kernel, key)
        return kernel(y, a_scale_inv, b_scale_inv)[0]
    key = (y.dtype, out_dtype, bias.dtype)
    kernel = compiled.get((_biased_output_kernel, key)) or cast.COMPILED_KERNELS.variant(
        _biased_output_kernel, key
    )
    return kernel(y, a_scale_inv, b_scale_inv, bias)[0]


_scaled_output_op = torch.library.custom_op("fp8train::scaled_output", _run, mutates_args=())


@_scaled_output_op.register_fake
def _(y, a_scale_inv, b_scale_inv, bias, out_dtype):
    return torch.empty_like(y, dtype=out_dtype)


def scaled_output(
    y: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    overwrite: bool = False,
) -> Optional[torch.Tensor]:
    """y (the fp32 product of FP8 values) rounded to bf16, times a_scale_inv * b_scale_inv (1
    element each, fp32), plus `bias` if given, as `out_dtype`: one pass, one call; None where the
    compiled kernel cannot run here (the caller computes it eagerly). With `overwrite` (the caller
    holds y's only reference: no view, no autograd record) and `out_dtype` y's dtype, the output is
    written into y and y returned (no new buffer); y is then unusable after a failure (None)."""
    try:  # (cast.COMPILED_KERNELS.run, inline: the hot path)
        if dispatch_mode_active():  # (out of place: the mode may hold y)
            return _scaled_output_op(y, a_scale_inv, b_scale_inv, bias, out_dtype)
        compiled = cast.COMPILED_KERNELS.compiled  # (`_run`, inline: the hot path)
        if overwrite and out_dtype == y.dtype:
            if bias is None:
                try:
                    kernel = compiled[_output_kernel_, (y.dtype,)]
                except KeyError:
                    kernel = cast.COMPILED_KERNELS.variant(_output_kernel_, (y.dtype,))
                kernel.call(y, a_scale_inv, b_scale_inv)
                return y
            try:
                kernel = compiled[_biased_output_kernel_, (y.dtype, bias.dtype)]
            except KeyError:
                kernel = cast.COMPILED_KERNELS.variant(_biased_output_kernel_, (y.dtype, bias.dtype))
            kernel.call(y, a_scale_inv, b_scale_inv, bias)
            return y
        if bias is None:
            try:
                kernel = compiled[_output_kernel, (y.dtype, out_dtype)]
            except KeyError:
                kernel = cast.COMPILED_KERNELS.variant(_output_kernel, (y.dtype, out_dtype))
            return kernel.call(y, a_scale_inv, b_scale_inv)[0]
        try:
            kernel = compiled[_biased_output_kernel, (y.dtype, out_dtype, bias.dtype)]
        except KeyError:
            kernel = cast.COMPILED_KERNELS.variant(_biased_output_kernel, (y.dtype, out_dtype, bias.dtype))
        return kernel.call(y, a_scale_inv, b_scale_inv, bias)[0]
    except Exception as err:
        cast.COMPILED_KERNELS.failed(f"{type(err).__name__}: {err}", stacklevel=3)
        return None
