"""Fused FP8 casts in Triton: per-tensor (delayed and current scaling) and block scaling (1x128 tiles,
128x128 blocks). Each kernel reads the high-precision tensor once and writes, in the same pass, what
the GEMMs of that operand need: the FP8 values, their transposed copy, the scales and (delayed
scaling) the amax of the tensor (docs/design.md, section 6, "Fused quantization kernels").

The values equal cast.py's `cast_operand` and quantization/block_scaling.py's `quantize_tiles` bit for bit:
the float32 product x * scale (x read in its own dtype, upcast exactly), clamped to +-fp8_max (inf
saturates, NaN stays), rounded to FP8 with ties to even by kernels/rounding.py's arithmetic, and
written as FP8 bytes, or as the bf16/fp32 bits of the same values. Scales computed in a kernel
follow quantization/current.py's `scale_from_amax`.

Importing this module imports triton, and decides for its whole life whether its kernels are
compiled or interpreted (TRITON_INTERPRET=1 at import: kernels run on CPU tensors, for the tests).
The face is kernels/__init__.py.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .rounding import abs_bits, bf16_bits, fp8_byte, max_along, round_to_fp8, saturate, scale_from_amax

__all__ = [
    "INTERPRETED",
    "TILE",
    "cast_with_amax",
    "tensor_amax",
    "amax_then_cast",
    "cast_tiles",
    "CurrentCast",
]

TILE = 128  # block scaling's tile along the reduction dimension (quantization/block_scaling.py's TILE)

# mantissa bits, exponent of the smallest normal, largest finite value
_ENCODINGS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}
# how an output dtype is written: 0 float32 values, 1 bf16 bits (int16), 2 FP8 bytes (uint8)
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 2}
_STORE_VIEWS = {0: torch.float32, 1: torch.int16, 2: torch.uint8}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NO_OUTPUT = 3  # OUT_KIND of the amax-only launch

# per-tensor tiles (rows, columns) of one program; tests pass smaller ones for masked edges
DEFAULT_TILE = (64, 128)


@triton.jit
def _fp8_values(x, scale, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, FP8_MAX: tl.constexpr):
    """saturate(x * scale) rounded to FP8, as float32 (x float32)."""
    return round_to_fp8(saturate(x * scale, FP8_MAX), MANTISSA_BITS, MIN_EXPONENT)


@triton.jit
def _store(
    ptr, values, mask, OUT_KIND: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr
):
    """Store FP8 values (float32) as OUT_KIND: float32, bf16 bits or FP8 bytes."""
    if OUT_KIND == 0:
        tl.store(ptr, values, mask=mask)
    elif OUT_KIND == 1:
        tl.store(ptr, bf16_bits(values).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, fp8_byte(values, MANTISSA_BITS, MIN_EXPONENT).to(tl.uint8), mask=mask)


@triton.jit
def _offsets(axis: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """The indices of this program's block along grid `axis`, 64-bit where INT64."""
    if INT64:
        return tl.program_id(axis).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return tl.program_id(axis) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _row_offsets(rows, S, stride_a, stride_b, SPLIT_ROWS: tl.constexpr):
    if SPLIT_ROWS:
        return (rows // S) * stride_a + (rows % S) * stride_b
    return rows * stride_b


@triton.jit
def _tensor_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
    M, N, S, sx_a, sx_b, sx_c, so_a, so_b, so_c,
    MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, FP8_MAX: tl.constexpr,
    OUT_KIND: tl.constexpr, TRANSPOSED: tl.constexpr, RECORD_AMAX: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr, SPLIT_ROWS: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N tile of x seen as M rows of N: row r at r * sx_b, or with SPLIT_ROWS (a
    3-D tensor whose leading dimensions do not merge) at (r // S, r % S) of its strides. The cast
    with the scale in force (or the one its amax gives), the transposed copy [N, M] (contiguous),
    and the tile's max|x| atomically maxed into amax_ptr (int32 bits). Offsets are 32-bit unless
    INT64 (a division or a 64-bit product per element would make the kernel compute-bound)."""
    rows = _offsets(0, BLOCK_M, INT64)
    cols = _offsets(1, BLOCK_N, INT64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x_rows = _row_offsets(rows, S, sx_a, sx_b, SPLIT_ROWS)
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
    if RECORD_AMAX:
        tl.atomic_max(amax_ptr, max_along(max_along(abs_bits(x), 1), 0))
    if OUT_KIND != 3:
        if SCALE_FROM_AMAX:
            scale = scale_from_amax(tl.load(amax_ptr).to(tl.float32, bitcast=True), FP8_MAX, False)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(scale_ptr, scale)
                tl.store(scale_inv_ptr, tl.math.div_rn(scale * 0.0 + 1.0, scale))
        else:
            scale = tl.load(scale_ptr)
        values = _fp8_values(x, scale, MANTISSA_BITS, MIN_EXPONENT, FP8_MAX)
        out_rows = _row_offsets(rows, S, so_a, so_b, SPLIT_ROWS)
        _store(out_ptr + out_rows[:, None] + cols[None, :] * so_c, values, mask, OUT_KIND, MANTISSA_BITS,
               MIN_EXPONENT)  # fmt: skip
        if TRANSPOSED:
            t_ptr = out_t_ptr + cols[None, :] * M + rows[:, None]
            _store(t_ptr, values, mask, OUT_KIND, MANTISSA_BITS, MIN_EXPONENT)


@triton.jit
def _tiles_kernel(
    x_ptr, out_ptr, scale_inv_ptr, out_t_ptr, scale_inv_t_ptr,
    M, N, sx0, sx1, SCALE_COLS, SCALE_T_COLS,
    MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, FP8_MAX: tl.constexpr, POWER_2: tl.constexpr,
    OUT_KIND: tl.constexpr, OUT_T_KIND: tl.constexpr, ROWS: tl.constexpr, TRANSPOSED: tl.constexpr,
    INT64: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x TILE_N tile of x [M, N]: ROWS=1, a scale per row (1xTILE_N tiles); ROWS=BLOCK_M,
    one scale for the tile (128x128 blocks); values [M, N] and scale_inv [ceil(M/ROWS), ceil(N/TILE_N)].
    TRANSPOSED: also x.t() in 1xBLOCK_M tiles along M, a scale per column: values_t [N, M] and
    scale_inv_t [N, ceil(M/BLOCK_M)]. Masked elements read 0, which changes no amax."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = _offsets(0, BLOCK_M, INT64)
    cols = _offsets(1, TILE_N, INT64)
    row_in = rows < M
    col_in = cols < N
    mask = row_in[:, None] & col_in[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx0 + cols[None, :] * sx1, mask=mask, other=0.0).to(tl.float32)
    magnitude = abs_bits(x)
    if ROWS == 1:
        scale = scale_from_amax(max_along(magnitude, 1).to(tl.float32, bitcast=True), FP8_MAX, POWER_2)
        values = _fp8_values(x, scale[:, None], MANTISSA_BITS, MIN_EXPONENT, FP8_MAX)
        tl.store(
            scale_inv_ptr + rows * SCALE_COLS + pid_n, tl.math.div_rn(scale * 0.0 + 1.0, scale), mask=row_in
        )
    else:
        amax = max_along(max_along(magnitude, 1), 0).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, FP8_MAX, POWER_2)
        values = _fp8_values(x, scale, MANTISSA_BITS, MIN_EXPONENT, FP8_MAX)
        tl.store(scale_inv_ptr + pid_m * SCALE_COLS + pid_n, tl.math.div_rn(scale * 0.0 + 1.0, scale))
    _store(out_ptr + rows[:, None] * N + cols[None, :], values, mask, OUT_KIND, MANTISSA_BITS, MIN_EXPONENT)
    if TRANSPOSED:
        scale_t = scale_from_amax(max_along(magnitude, 0).to(tl.float32, bitcast=True), FP8_MAX, POWER_2)
        values_t = _fp8_values(x, scale_t[None, :], MANTISSA_BITS, MIN_EXPONENT, FP8_MAX)
        _store(out_t_ptr + cols[None, :] * M + rows[:, None], values_t, mask, OUT_T_KIND, MANTISSA_BITS,
               MIN_EXPONENT)  # fmt: skip
        tl.store(scale_inv_t_ptr + cols * SCALE_T_COLS + pid_m, tl.math.div_rn(scale_t * 0.0 + 1.0, scale_t),
                 mask=col_in)  # fmt: skip


INTERPRETED = isinstance(_tensor_kernel, InterpretedFunction)


class CurrentCast(NamedTuple):
    """Current scaling's cast of a tensor: its values (and transposed copy), its amax, its scale and
    the scale_inv that dequantizes the values (quantization/current.py's `current_scales`)."""

    values: torch.Tensor
    values_t: Optional[torch.Tensor]
    amax: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, tuple[int, int, int]]:
    """x as M rows of N: (x at most 3-D, M, N, S, strides (a, b, c)), row r at (r // S, r % S), or at
    r * b where a == S * b (the leading dimensions merge: `_merges`)."""
    if x.dim() > 3:
        x = x.flatten(0, -3)  # a view where the leading dimensions merge, else a copy
    shape = (1,) * (3 - x.dim()) + tuple(x.shape)
    strides = (0,) * (3 - x.dim()) + tuple(x.stride())
    return x, shape[0] * shape[1], shape[2], shape[1], strides


def _merges(s: int, strides: tuple[int, int, int], a_size: int) -> bool:
    return a_size <= 1 or strides[0] == s * strides[1]


def _needs_int64(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether an element offset of any of these tensors can reach 2**31."""
    for t in tensors:
        if t is not None and (
            t.numel() >= 2**31 or sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31
        ):
            return True
    return False


def _out_view(out: torch.Tensor) -> torch.Tensor:
    return out.view(_STORE_VIEWS[_OUT_KINDS[out.dtype]])


def _check_dtype(dtype: torch.dtype, encoding: str) -> int:
    if encoding not in _ENCODINGS:
        raise ValueError(f"FP8 encodings are {tuple(_ENCODINGS)}; got {encoding!r}")
    if dtype not in _OUT_KINDS:
        raise ValueError(f"fused FP8 casts write float32, bfloat16 or an FP8 dtype, not {dtype}")
    if _OUT_KINDS[dtype] == 2 and dtype != _FP8_DTYPES[encoding]:
        raise ValueError(f"{encoding} values are written as {_FP8_DTYPES[encoding]}, not {dtype}")
    return _OUT_KINDS[dtype]


def _check_amax_out(amax_out: torch.Tensor, x: torch.Tensor) -> None:
    if amax_out.dtype != torch.float32 or amax_out.dim() != 0 or amax_out.device != x.device:
        raise ValueError(
            f"amax_out must be a float32 0-dim tensor on {x.device} (the amax is maxed into it); got "
            f"{amax_out.dtype} of shape {tuple(amax_out.shape)} on {amax_out.device}"
        )


def _launch_tensor(
    x, out, out_t, scale, amax, scale_inv, encoding, out_kind, record, from_amax, tile
) -> None:
    x3, m, n, s, (sa, sb, sc) = _rows_of(x)
    split = not _merges(s, (sa, sb, sc), m // max(s, 1))
    if out is not None:
        _, _, _, _, (oa, ob, oc) = _rows_of(out)
        split = split or not _merges(s, (oa, ob, oc), m // max(s, 1))
    else:
        oa = ob = oc = 0
    mantissa_bits, min_exponent, limit = _ENCODINGS[encoding]
    block_m, block_n = tile or DEFAULT_TILE
    dummy = amax if amax is not None else scale
    _tensor_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x3,
        _out_view(out) if out is not None else dummy,
        _out_view(out_t) if out_t is not None else dummy,
        scale if scale is not None else dummy,
        amax.view(torch.int32) if amax is not None else dummy,
        scale_inv if scale_inv is not None else dummy,
        m, n, s, sa, sb, sc, oa, ob, oc,
        MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, FP8_MAX=limit,
        OUT_KIND=out_kind, TRANSPOSED=out_t is not None, RECORD_AMAX=record, SCALE_FROM_AMAX=from_amax,
        SPLIT_ROWS=split, INT64=_needs_int64(x3, out, out_t), BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip


def _outputs(x: torch.Tensor, dtype: torch.dtype, transposed: bool):
    """The values (x's layout where x is at most 3-D, as cast_operand's; else contiguous) and the
    transposed copy [N, M] of x seen as M rows of N."""
    if transposed and x.dim() < 2:
        raise ValueError(f"a transposed copy needs a 2-D or 3-D tensor; got shape {tuple(x.shape)}")
    out = (
        torch.empty_like(x, dtype=dtype)
        if x.dim() <= 3
        else torch.empty(x.shape, dtype=dtype, device=x.device)
    )
    out_t = None
    if transposed:
        out_t = torch.empty((x.shape[-1], x.numel() // max(x.shape[-1], 1)), dtype=dtype, device=x.device)
    return out, out_t


def cast_with_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    encoding: str,
    dtype: torch.dtype,
    *,
    transposed: bool,
    amax_out: Optional[torch.Tensor],
    tile: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`cast.cast_with_amax` (the torch path's seam: its arguments and results, bit for bit) in one
    read of x, one launch: the transposed copy [N, M] of x seen as M = numel / N rows of its last
    dimension N (x 2-D or 3-D); max|x| maxed into `amax_out` (a float32 0-dim tensor on x's device,
    not overwritten). `tile`: (rows, columns) per program."""
    out_kind = _check_dtype(dtype, encoding)
    if amax_out is not None:
        _check_amax_out(amax_out, x)
    x = x.detach()
    out, out_t = _outputs(x, dtype, transposed)
    if x.numel() == 0:
        return out, out_t
    scale = scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
    _launch_tensor(
        x, out, out_t, scale, amax_out, None, encoding, out_kind, amax_out is not None, False, tile
    )
    return out, out_t


def tensor_amax(x: torch.Tensor, amax_out: torch.Tensor, tile: Optional[tuple[int, int]] = None) -> None:
    """max|x| maxed into `amax_out` (float32 scalar) in one read of x."""
    x = x.detach()
    if x.numel():
        _launch_tensor(x, None, None, None, amax_out, None, "e4m3", NO_OUTPUT, True, False, tile)


def amax_then_cast(
    x: torch.Tensor,
    encoding: str,
    dtype: torch.dtype,
    *,
    transposed: bool,
    tile: Optional[tuple[int, int]] = None,
) -> CurrentCast:
    """Current scaling: CurrentCast(values, values_t, amax, scale, scale_inv), bit for bit the amax of x
    and `current_scales(x, encoding)` with the cast by that scale: the amax (one read), then the cast
    with the scale it gives, computed in the cast kernel (a second read): two launches, nothing else."""
    out_kind = _check_dtype(dtype, encoding)
    x = x.detach()
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = torch.ones((), dtype=torch.float32, device=x.device)
    scale_inv = torch.ones((), dtype=torch.float32, device=x.device)
    out, out_t = _outputs(x, dtype, transposed)
    if x.numel():
        tensor_amax(x, amax, tile)
        _launch_tensor(x, out, out_t, scale, amax, scale_inv, encoding, out_kind, False, True, tile)
    return CurrentCast(out, out_t, amax, scale, scale_inv)


def cast_tiles(
    x: torch.Tensor,
    rows: int,
    encoding: str,
    dtype: torch.dtype,
    power_2: bool,
    *,
    transposed_dtype: Optional[torch.dtype] = None,
    block_m: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """quantize_tiles(x, rows, power_2, encoding, dtype) for a 2-D x in one read: (values [M, N],
    scale_inv [ceil(M/rows), ceil(N/128)]), and with `transposed_dtype` also quantize_tiles(x.t(), 1,
    ...) as that dtype in the same pass: (values_t [N, M], scale_inv_t [N, ceil(M/128)]).
    rows: 1 (1x128 tiles) or 128 (128x128 blocks, which serve x and x.t() alike: no transposed copy).
    `block_m`: rows per program for 1x128 tiles without a transposed copy."""
    if x.dim() != 2:
        raise ValueError(f"block scaling casts 2-D tensors; got shape {tuple(x.shape)}")
    if rows not in (1, TILE):
        raise ValueError(f"block scaling's tiles are 1x{TILE} or {TILE}x{TILE}; got {rows} rows")
    if rows == TILE and transposed_dtype is not None:
        raise ValueError(f"{TILE}x{TILE} blocks serve x and x.t() alike: no transposed copy is made")
    out_kind = _check_dtype(dtype, encoding)
    out_t_kind = _check_dtype(transposed_dtype, encoding) if transposed_dtype is not None else 0
    x = x.detach()
    m, n = x.shape
    device = x.device
    values = torch.empty((m, n), dtype=dtype, device=device)
    scale_inv = torch.empty((triton.cdiv(m, rows), triton.cdiv(n, TILE)), dtype=torch.float32, device=device)
    values_t = scale_inv_t = None
    if transposed_dtype is not None:
        values_t = torch.empty((n, m), dtype=transposed_dtype, device=device)
        scale_inv_t = torch.empty((n, triton.cdiv(m, TILE)), dtype=torch.float32, device=device)
    if x.numel() == 0:
        return values, scale_inv, values_t, scale_inv_t
    block_rows = TILE if rows == TILE or transposed_dtype is not None else (block_m or 32)
    mantissa_bits, min_exponent, limit = _ENCODINGS[encoding]
    _tiles_kernel[(triton.cdiv(m, block_rows), triton.cdiv(n, TILE))](
        x, _out_view(values), scale_inv,
        _out_view(values_t) if values_t is not None else scale_inv,
        scale_inv_t if scale_inv_t is not None else scale_inv,
        m, n, x.stride(0), x.stride(1), scale_inv.shape[1], triton.cdiv(m, TILE),
        MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, FP8_MAX=limit, POWER_2=power_2,
        OUT_KIND=out_kind, OUT_T_KIND=out_t_kind, ROWS=rows, TRANSPOSED=transposed_dtype is not None,
        INT64=_needs_int64(x, values), BLOCK_M=block_rows, TILE_N=TILE,
        num_warps=8 if block_rows * TILE >= 128 * 128 else 4,  # 64 elements per thread, as per tensor
    )  # fmt: skip
    return values, scale_inv, values_t, scale_inv_t
