"""Casts to FP8: the amax of a tensor, and its scaled, saturated, FP8-rounded values.

Two forms of the same values. `quantize` gives real FP8 tensors (for `torch._scaled_mm`).
`cast_operand` gives the operand a GEMM consumes: real FP8 for the hardware path, else the FP8
values held exactly in bf16 or fp32. On CPUs the conversions to and from FP8 dtypes are scalar code,
several times slower than float arithmetic, so there the values are rounded in float32 arithmetic
(`_round_to_fp8_grid`); CUDA converts in one kernel each way.

Few passes (docs/design.md, section 6): the product x * scale is the one float32 temporary, made in
one pass from x as it is (bf16 included); saturation and rounding work on it in place, and the last
pass writes the output. On the CPU, in eager mode, a large tensor is cast in pieces of about
`PIECE_ELEMENTS` per thread, so the temporaries are small and reused by the allocator, where
full-size ones would be fresh pages, faulted in on every cast. Under torch.compile
inductor fuses the whole cast into one kernel; eagerly, large CPU casts run as that one kernel too
(compiled here once per variant, `cast_with_amax`, the seam every per-tensor cast goes through).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch

from ..torch_internals import PLAIN_TENSOR_TYPES, DirectlyCalled, dispatch_mode_active
from .formats import fp8_dtype, fp8_max

__all__ = [
    "amax", "quantize", "cast_operand", "cast_with_amax", "PIECE_ELEMENTS", "FUSED_MIN_ELEMENTS",
    "CompiledKernels", "COMPILED_KERNELS",
]  # fmt: skip

# mantissa bits and smallest normal exponent of each encoding
_FORMATS = {"e4m3": (3, -6), "e5m2": (2, -14)}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PIECE_ELEMENTS = 1 << 20  # per thread, of a CPU cast in pieces: float32 temporaries of 4 MiB; each
# op is a parallel region, so fewer, larger pieces on an oversubscribed CPU


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a float32 scalar in one pass; NaN propagates, an empty tensor gives 0."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    x = x.detach()
    return _amax_by_aminmax(x) if x.device.type == "cpu" else _amax_by_norm(x)


def _amax_by_aminmax(x: torch.Tensor) -> torch.Tensor:
    """The CPU's: one vectorized pass (its vector_norm(inf) is scalar code, ~20x slower)."""
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low).to(torch.float32)


def _amax_by_norm(x: torch.Tensor) -> torch.Tensor:
    """One kernel, where aminmax is followed by three tiny ones; NaN propagates (torch's max
    reductions propagate NaN on every device)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def cast_with_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    encoding: str,
    dtype: torch.dtype,
    *,
    transposed: bool,
    amax_out: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The per-tensor cast every recipe with one scale per tensor goes through: (values, values_t).
    `cast_operand`'s values (saturate(x * scale) rounded to FP8, as `dtype`, x's layout), cast with the
    scale in force; with `transposed` (2-D x) also the values' transposed copy, contiguous (where a
    later GEMM wants the other layout), else None. Given `amax_out` (a float32 0-dim tensor on x's
    device, not x's storage), max|x| is MAXed into it (NaN propagates), read in the same pass where
    the kernel allows: delayed scaling passes the amax's recording slot, so a cast records its amax
    for a later step with one read of x and no call of its own. The fused device kernels
    (`kernels.cast_with_amax`) take the same arguments. Eager CPU casts of large tensors run as one
    compiled kernel (below); others as torch kernels (`cast_operand`, and `amax` one pass more)."""
    if x.numel() >= FUSED_MIN_ELEMENTS and _fused_applies(x, scale) and (amax_out is None or amax_out.is_cpu):
        out = _fused_cast(x, scale, encoding, dtype, transposed, amax_out)
        if out is not None:
            return out
    values = cast_operand(x, scale, encoding, dtype)
    if amax_out is not None:
        torch.maximum(amax_out, amax(x), out=amax_out)
    return values, (values.t().contiguous() if transposed else None)


def quantize(x: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """saturate(x * scale) as an FP8 tensor."""
    return cast_operand(x, scale, encoding, fp8_dtype(encoding))


def cast_operand(x: torch.Tensor, scale: torch.Tensor, encoding: str, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) rounded to FP8, as `dtype`: an FP8 dtype, or bfloat16/float32 holding FP8
    values exactly (every FP8 value is a bf16 value). Scales are positive: the sign is x's. Not
    differentiable (x is read detached). The output has x's layout."""
    x = x.detach()
    out = torch.empty_like(x, dtype=dtype)
    for x_piece, scale_piece, out_piece in _pieces(x, scale, out):
        _cast_into(out_piece, x_piece, scale_piece, encoding)
    return out


def _cast_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, encoding: str) -> None:
    """out = the cast of x: 3 passes to an FP8 dtype; to bf16 or fp32, 4 through FP8 on CUDA (eager),
    else 7 into fp32 and 8 into bf16 (the product rounded in place, its sign restored, copied: the
    CPU would make copysign(out=bf16) the same two passes, through a hidden float32 temporary)."""
    product = _saturated_product(x, scale, encoding, out if out.dtype == torch.float32 else None)
    if out.dtype in _FP8_DTYPES:
        out.copy_(product)
    elif _rounds_by_conversion(out.device):
        out.copy_(product.to(fp8_dtype(encoding)))
    else:
        _round_to_fp8_grid(product, encoding).copysign_(x)  # -0.0 back
        if product is not out:
            out.copy_(product)


def _rounds_by_conversion(device: torch.device) -> bool:
    """Whether bf16/fp32 operands are rounded by converting to FP8 and back (CUDA: one kernel each
    way, the definition of the values) rather than by float32 arithmetic (CPUs convert FP8 in scalar
    code). Not under torch.compile: inductor fuses the arithmetic into the cast's one kernel, and
    Triton has no E4M3 conversion before SM89, where the emulated GEMM runs."""
    return device.type == "cuda" and not torch.compiler.is_compiling()


def _saturated_product(
    x: torch.Tensor, scale: torch.Tensor, encoding: str, out: torch.Tensor | None
) -> torch.Tensor:
    """saturate(x * scale) in float32, in `out` if given. One rounding: a bf16 or fp16 x is read as
    it is and multiplied in float32 (exact upcast), because a scale with x's number of dimensions
    takes part in type promotion (a 0-dim one would not, and the product would round to bf16).
    Clamping after the product makes overflow identical for every FP8 dtype."""
    if x.dtype in (torch.bfloat16, torch.float16) and scale.device == x.device:
        scale = scale.reshape((1,) * x.dim()) if scale.dim() == 0 else scale
    else:  # a no-op for float32; float64 rounds to float32 first; a host scale stays a 0-dim scalar
        x = x.to(torch.float32)
    product = torch.mul(x, scale) if out is None else torch.mul(x, scale, out=out)
    limit = fp8_max(encoding)
    return product.clamp_(-limit, limit)


def _round_to_fp8_grid(t: torch.Tensor, encoding: str) -> torch.Tensor:
    """`t` (float32, in [-fp8_max, fp8_max]; overwritten) rounded to the nearest FP8 value, ties to
    even, except that a value rounding to zero gives +0.0 (the caller restores the sign).

    Equal to the FP8 cast: let 2**e be the binade of |t| (at least the smallest normal) and
    k = 1.5 * 2**(e + 23 - m), m the mantissa bits. k + t lies in [2**(e+23-m), 2**(e+24-m)), the
    binade whose float32 spacing is the FP8 spacing at e, for either sign of t (|t| < 2**(e+1) is far
    below k / 2). k is on that grid and k / spacing = 1.5 * 2**23 is even, so the addition rounds t
    exactly as the FP8 cast rounds it, ties to even included, and subtracting k is exact (Sterbenz).
    `add_(binade, alpha)` forms k = alpha * 2**e exactly (1.5 times a power of two), so fused or
    not the addition is one rounding. NaN stays NaN (its k is inf). Checked against the FP8 cast on
    every FP8 value, every tie and its neighbours and a wide sample, of both signs
    (tests/recipes/test_cast_gemm.py); once on every negative float32 pattern up to 2 * fp8_max, E4M3 and
    E5M2 (scripts/check_cast_exhaustively.py; the positive ones compute what the unsigned form of the trick
    did, which was checked on all 2**32 patterns)."""
    mantissa_bits, min_exponent = _FORMATS[encoding]
    binade = (t.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**e of |t| (inf for NaN)
    binade.clamp_(min=2.0**min_exponent)
    alpha = 1.5 * 2.0 ** (23 - mantissa_bits)  # k = alpha * binade
    return t.add_(binade, alpha=alpha).sub_(binade, alpha=alpha)


def _pieces(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor):
    """(x, scale, out) in pieces along dim 0 of about PIECE_ELEMENTS per thread: on the CPU, eagerly,
    for contiguous tensors larger than that; else whole. A scale that varies along dim 0 (block
    scales) is cut alike; the pieces are views, so `out` is written in place."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or x.dim() == 0:
        return [(x, scale, out)]
    n, piece = x.numel(), PIECE_ELEMENTS * torch.get_num_threads()
    if n <= piece or not (x.is_contiguous() and out.is_contiguous()):
        return [(x, scale, out)]
    rows = max(1, piece * x.shape[0] // n)
    cut = scale.dim() == x.dim() and scale.shape[0] > 1
    return [
        (x[i : i + rows], scale[i : i + rows] if cut else scale, out[i : i + rows])
        for i in range(0, x.shape[0], rows)
    ]


# ---- the cast as one compiled kernel ------------------------------------------------------------
# The per-tensor cast as one compiled kernel, for eager calls on the CPU (docs/design.md, section 6).
#
# Eagerly, torch runs the cast above as separate kernels, each a pass over the operand (and the amax
# one more). Here the same arithmetic (`_saturated_product`, `_round_to_fp8_grid`) is traced by
# torch.compile, and inductor fuses it into one loop that reads x once, writes the values (and their
# transposed copy where asked) and takes max|x| on the way. The values are the same bits: every
# operation rounds as the eager one does (a product, a clamp, an exact addition and subtraction;
# tests/recipes/test_cast_gemm.py checks it on every FP8 value, tie and neighbour, zeros, saturation);
# a NaN stays NaN, though not always with its sign and payload bits (as under torch.compile).
#
# It is registered as the custom op `fp8train::fused_cast`: a dispatch-mode counter sees one op (a
# compiled kernel would be invisible to it, and dynamo does not compile under such a mode), whose
# body calls the compiled kernel with no mode in the way.
#
# Used where it pays (`_fused_applies`): eager calls (under torch.compile inductor fuses the graph's
# casts itself), CPU tensors of at least `FUSED_MIN_ELEMENTS` (a compilation takes seconds, once per
# variant and process; smaller tensors take the eager kernels), contiguous, in float32, bf16 or fp16,
# with one scale on x's device. `COMPILED_KERNELS` (the one registry of the compiled kernels, below)
# says whether they run: `FP8TRAIN_FUSED_CAST` (read at import: 1 by default, 0 off) sets it; a
# compilation that fails (no C++ compiler) turns them off for the process, with one warning. On GPUs,
# `cast_with_amax` is where fused device kernels plug in.

ENV_FUSED_CAST = "FP8TRAIN_FUSED_CAST"


def _enabled_by_env() -> bool:
    value = os.environ.get(ENV_FUSED_CAST, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(
            f"{ENV_FUSED_CAST}={value!r} is not valid: 1 (the default) casts large CPU operands in one "
            "compiled kernel, 0 in torch's eager kernels"
        )
    return value == "1"


class CompiledKernels:
    """The one registry of fp8train's compiled eager kernels (this file's cast, gemm_output.py's GEMM
    output): whether they run, each kernel compiled once per variant, and why they stopped.

    - `enabled`: `FP8TRAIN_FUSED_CAST` at import (benchmarks turn it off to measure the torch ops);
    - `failure`: why a compiled kernel failed (None while none has): from then on every compiled kernel
      is off for the process and callers compute the same values with torch's eager kernels;
    - `running`: `enabled` and no failure, the one flag the hot path reads (an attribute, no call).

    Only its methods change it; tests replace the registry object to test a failure."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.failure: Optional[str] = None
        self.running = enabled
        # (kernel, its variant) -> the compiled kernel (hot paths look it up here, then `variant`)
        self.compiled: dict[tuple, Callable] = {}

    def set_enabled(self, enabled: bool) -> None:
        """Turn the compiled kernels on or off (benchmarks: the torch-op casts beside them)."""
        self.enabled = enabled
        self.running = enabled and self.failure is None

    def variant(self, kernel: Callable, key: tuple) -> Callable:
        """`kernel` compiled for one variant `key` (the constants its graph depends on: dtypes,
        encoding; the values of its arguments after the tensors, bound as their defaults), each its
        own code object: dynamo keeps 8 graphs per code object (then runs it eagerly), and a process
        may cast in more variants than that. Shapes are dynamic. Called with the tensors only, the
        compiled graph directly after the first call (`torch_internals.DirectlyCalled`: no dynamo
        overhead, which made calls of small tensors cost more than the torch kernels)."""
        compiled = self.compiled.get((kernel, key))
        if compiled is not None:
            return compiled
        name = kernel.__name__ + "_" + "_".join(str(k).replace("torch.", "") for k in key)
        code = kernel.__code__.replace(co_name=name, co_qualname=name)
        fn = type(kernel)(code, kernel.__globals__, name, tuple(key))
        # emulate_precision_casts: a rounding to bf16 inside the kernel is kept (inductor would
        # otherwise compute through it in fp32)
        # benchmark_harness off: inductor would write a benchmark main into the module, reading
        # sys.argv as strings (a script's sys.argv may hold other objects)
        options = {"emulate_precision_casts": True, "benchmark_harness": False}
        compiled = DirectlyCalled(fn, options)
        self.compiled[kernel, key] = compiled
        return compiled

    def variants(self) -> list[str]:
        """The names of the variants compiled so far (one code object each)."""
        return [kernel.__name__ + str(key) for kernel, key in self.compiled]

    def run(self, run: Callable, *args):
        """`run(*args)` (a compiled kernel's call); None if it fails (no C++ compiler, an inductor bug):
        then every compiled kernel of fp8train is off for the process, with one warning, and the caller
        computes the same values with torch's eager kernels."""
        try:
            return run(*args)
        except Exception as err:
            self.failed(f"{type(err).__name__}: {err}")
            return None

    def failed(self, why: str, stacklevel: int = 4) -> None:
        """A compiled kernel failed (`why`): all are off from now on; the first failure warns (at the
        caller `stacklevel` frames up)."""
        if self.failure is None:
            self.failure = why
            warnings.warn(
                f"fp8train's compiled kernels failed ({why[:300]}); casts and GEMM outputs run as torch's "
                f"eager kernels from now on (slower, the same values). Set {ENV_FUSED_CAST}=0 to skip the "
                "attempt",
                stacklevel=stacklevel + 1,
            )
        self.running = False


COMPILED_KERNELS = CompiledKernels(_enabled_by_env())
FUSED_MIN_ELEMENTS = 1 << 12  # below: the eager kernels (no compilation for small tensors)
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_applies(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the cast of `x` (of FUSED_MIN_ELEMENTS elements or more: the caller checks) by `scale`
    runs as the compiled kernel (the cheapest tests first: attributes, not calls)."""
    return (
        COMPILED_KERNELS.running
        and x.__class__ in PLAIN_TENSOR_TYPES  # (a subclass, e.g. FSDP2's gathered weight: its own ops)
        and x.is_cpu
        and x.dtype in _FUSED_DTYPES
        and scale.is_cpu  # (x's device)
        and (scale.ndim == 0 or scale.numel() == 1)  # (0-dim, the recipes' views: no call)
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
    )


def _values(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, encoding: str,
            transposed: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """What the compiled kernels compute: `cast_operand`'s values, with `transposed` their transposed
    copy (a flat tuple)."""
    product = _saturated_product(x, scale.reshape(()), encoding, None)
    if dtype in _FP8_DTYPES:
        values = product.to(dtype)
    else:
        values = _round_to_fp8_grid(product, encoding).copysign_(x).to(dtype)
    return (values, values.t().contiguous()) if transposed else (values,)


def _kernel(x: torch.Tensor, scale: torch.Tensor, x_dtype: torch.dtype, dtype: torch.dtype, encoding: str,
            transposed: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The compiled cast without an amax: `_values`. The arguments after the tensors are the variant's
    (`CompiledKernels.variant`): x_dtype, x's dtype, gives each its graph."""
    return _values(x, scale, dtype, encoding, transposed)


def _recording_kernel(x: torch.Tensor, scale: torch.Tensor, amax_out: torch.Tensor, x_dtype: torch.dtype,
                      dtype: torch.dtype, encoding: str,
                      transposed: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The compiled cast that also MAXes max|x| into `amax_out` (written in the graph: inductor's
    reduction in the same loop as the cast, and one store into amax_out's own element, so the direct
    call writes it too, `torch_internals.DirectlyCalled`; amax_out is a recording slot, which autograd
    never records)."""
    amax_out.copy_(torch.maximum(amax_out, x.abs().amax().to(torch.float32)))
    return _values(x, scale, dtype, encoding, transposed)


def _run_fused(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_out: Optional[torch.Tensor],
    encoding: str,
    dtype: torch.dtype,
    transposed: bool,
) -> list[torch.Tensor]:
    """The op's body (and `_fused_cast`'s, inline): the compiled kernel's values, with `transposed`
    their transposed copy (new tensors, in that order); max|x| MAXed into `amax_out` if given."""
    key = (x.dtype, dtype, encoding, transposed)
    fn = _kernel if amax_out is None else _recording_kernel
    kernel = COMPILED_KERNELS.compiled.get((fn, key)) or COMPILED_KERNELS.variant(fn, key)
    return list(kernel(x, scale) if amax_out is None else kernel(x, scale, amax_out))


_fused_cast_op = torch.library.custom_op("fp8train::fused_cast", _run_fused, mutates_args=("amax_out",))


@_fused_cast_op.register_fake
def _(x, scale, amax_out, encoding, dtype, transposed):
    values = torch.empty_like(x, dtype=dtype)
    return [values, values.t().contiguous()] if transposed else [values]


def _fused_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    encoding: str,
    dtype: torch.dtype,
    transposed: bool,
    amax_out: Optional[torch.Tensor],
) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """`cast_with_amax` by the compiled kernel; None if it cannot compile here (then never again in
    this process: the caller casts eagerly, and `amax_out` is as it was)."""
    # the op where a dispatch mode would see it (and dynamo would not compile), else its body: the
    # op's own dispatch costs about as much as the kernel of a 64K-element cast
    try:  # (COMPILED_KERNELS.run, inline: the hot path)
        if dispatch_mode_active():  # (without grad: the op has no autograd formula; no `detach` that
            with torch.no_grad():  # the eager call does not make either)
                out = _fused_cast_op(x, scale, amax_out, encoding, dtype, transposed)
        else:
            key = (x.dtype, dtype, encoding, transposed)  # (`_run_fused`, inline)
            if amax_out is None:
                try:
                    kernel = COMPILED_KERNELS.compiled[_kernel, key]
                except KeyError:
                    kernel = COMPILED_KERNELS.variant(_kernel, key)
                out = kernel.call(x, scale)  # (`DirectlyCalled.call`: the hot path's)
            else:
                try:
                    kernel = COMPILED_KERNELS.compiled[_recording_kernel, key]
                except KeyError:
                    kernel = COMPILED_KERNELS.variant(_recording_kernel, key)
                out = kernel.call(x, scale, amax_out)
    except Exception as err:
        COMPILED_KERNELS.failed(f"{type(err).__name__}: {err}", stacklevel=3)
        return None
    return out[0], (out[1] if transposed else None)
