"""The emulated bf16 path's output in one pass: the fp32 product rounded to bf16, scaled in fp32, in
the output dtype, as one compiled kernel for large eager CPU outputs (docs/design.md,
section 6). Eagerly that is two or three passes (a bf16 copy, the scaling, a conversion); the kernel
computes the same operations, each rounding as torch's eager kernel does, so the same bits
(tests/recipes/test_lean_path.py). Used where `cast.py`'s compiled cast is (`fused_output_applies`),
registered alike as the custom op `fp8train::scaled_output` where a dispatch mode would see it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..torch_internals import dispatch_mode_active
from . import cast

__all__ = ["fused_output_applies", "scaled_output"]


def fused_output_applies(y: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether `scaled_output` runs as the compiled kernel for this (large: the caller checks) output."""
    return (
        cast.COMPILED_KERNELS.running
        and y.device.type == "cpu"
        and scale.device == y.device
        and bias is None  # with a bias, inductor's kernel rounds bias + y * scale once (a fused
        # multiply-add) where torch's addcmul rounds twice: not the same bits
        and not torch.compiler.is_compiling()
    )


def _output_kernel(y: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
    """`gemm`'s eager epilogue of the bf16 path without a bias: round to bf16, then scale in fp32."""
    return torch.mul(y.to(torch.bfloat16), scale).to(out_dtype)


def _run(y: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    key = (_output_kernel, (y.dtype, out_dtype))
    try:
        kernel = cast.COMPILED_KERNELS.compiled[key]
    except KeyError:
        kernel = cast.COMPILED_KERNELS.variant(*key)
    return kernel(y, scale, out_dtype)


_scaled_output_op = torch.library.custom_op("fp8train::scaled_output", _run, mutates_args=())


@_scaled_output_op.register_fake
def _(y, scale, out_dtype):
    return torch.empty_like(y, dtype=out_dtype)


def scaled_output(y: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """y (the fp32 product of FP8 values) rounded to bf16, times `scale` (1 element, fp32), as
    `out_dtype`: one pass; None where the compiled kernel cannot run here (`cast.COMPILED_KERNELS.run`:
    the caller computes it eagerly)."""
    try:  # (cast.COMPILED_KERNELS.run, inline: the hot path)
        if dispatch_mode_active():
            return _scaled_output_op(y, scale, out_dtype)
        key = (_output_kernel, (y.dtype, out_dtype))  # (`_run`, inline)
        try:
            kernel = cast.COMPILED_KERNELS.compiled[key]
        except KeyError:
            kernel = cast.COMPILED_KERNELS.variant(*key)
        return kernel(y, scale, out_dtype)
    except Exception as err:
        cast.COMPILED_KERNELS.failed(f"{type(err).__name__}: {err}", stacklevel=3)
        return None
