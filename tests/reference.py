"""Independent reference implementations for the tests, written from docs/design.md, section 1.

Deliberately naive: one column at a time, plain Python lists, float32 rounding done explicitly, so
that a vectorisation or storage bug in the library cannot hide behind the same bug here.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Optional, Sequence

import torch

from fp8train import DelayedScaling

FLOAT32_MAX = torch.finfo(torch.float32).max
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (inf on overflow, subnormals kept)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def f32_div(a: float, b: float) -> float:
    """IEEE float32 division of two float32 values (double division then one rounding is exact)."""
    return f32(a / b)


class RefScaling:
    """Delayed-scaling state of N roles: history[c][0] is the most recent completed step of column c.
    Starts from zero histories and unit scales, or from a given state (`history` H x N, `scale` N)."""

    def __init__(
        self,
        num_roles: int,
        history_len: int,
        history: Optional[Sequence[Sequence[float]]] = None,
        scale: Optional[Sequence[float]] = None,
    ) -> None:
        self.history = [[0.0] * history_len for _ in range(num_roles)]
        if history is not None:
            self.history = [[f32(row[c]) for row in history] for c in range(num_roles)]
        self.scale = [1.0] * num_roles if scale is None else [f32(v) for v in scale]
        self.scale_inv = [f32_div(1.0, v) for v in self.scale]

    def update(self, last: Sequence[float], recipe: DelayedScaling, fp8_max: float) -> list[Optional[float]]:
        """Apply one step whose (reduced) amaxes are `last`, column by column; returns, per column,
        the amax its new scale came from (None where the scale was kept)."""
        assert len(last) == len(self.scale)
        used: list[Optional[float]] = [None] * len(last)
        for c, value in enumerate(last):
            value = math.inf if math.isnan(value) else f32(value)  # the reduction delivers NaN as inf
            if value == 0.0:  # the role did not run (or used a cached weight): no roll, no new scale
                continue
            self.history[c] = [value] + self.history[c][:-1]
            amax = self._amax(self.history[c], recipe)
            if math.isfinite(amax) and amax > 0.0:
                new = self._scale(amax, self.scale[c], fp8_max, recipe)
                if new is not None:
                    self.scale[c], used[c] = new, amax
            self.scale_inv[c] = f32_div(1.0, self.scale[c])
        return used

    @staticmethod
    def _amax(column: list[float], recipe: DelayedScaling) -> float:
        algo = recipe.amax_compute_algo
        if algo == "max":
            return max(column)
        if algo == "most_recent":
            return column[0]
        return f32(float(algo(torch.tensor(column, dtype=torch.float32).unsqueeze(1)).reshape(-1)[0]))

    @staticmethod
    def _scale(amax: float, old: float, fp8_max: float, recipe: DelayedScaling) -> Optional[float]:
        """The new scale, or None to keep the old one (a NaN, zero or negative result)."""
        if recipe.scaling_factor_compute_algo is None:
            new = f32(f32_div(fp8_max, amax) / 2.0**recipe.margin)
        else:
            out = recipe.scaling_factor_compute_algo(
                torch.tensor([amax], dtype=torch.float32),
                torch.tensor([old], dtype=torch.float32),
                fp8_max,
                recipe,
            )
            new = f32(float(out.reshape(-1)[0]))
        if math.isnan(new) or new <= 0.0:
            return None
        return min(new, FLOAT32_MAX)

    def history_tensor(self) -> torch.Tensor:
        """H x N float32, the layout of `fp8_meta[...].amax_history`."""
        return torch.tensor(self.history, dtype=torch.float32).t().contiguous()

    def scale_tensor(self) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32)

    def scale_inv_tensor(self) -> torch.Tensor:
        return torch.tensor(self.scale_inv, dtype=torch.float32)


def amax_of(x: torch.Tensor) -> float:
    """max|x| of a float tensor as a Python float (exact for float32 inputs)."""
    return float(x.detach().abs().max())


def quantize_ref(x: torch.Tensor, scale: float, dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    """The FP8 values of x * scale after saturation, returned in float64 for exact arithmetic."""
    scaled = x.detach().double() * scale
    return scaled.clamp(-fp8_max, fp8_max).float().to(dtype).double()


def quant_error_bound(x: torch.Tensor, scale: float, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Elementwise bound on |dequant(quant(x)) - x| for a non-saturating cast to an FP8 format.

    Round to nearest gives a relative error <= 2**-(m+1) for normals and an absolute error <= half the
    subnormal spacing 2**(min_exponent - m - 1) below the normal range, both in scaled units.
    """
    rel = 2.0 ** -(mantissa_bits + 1)
    absolute = 2.0 ** (min_exponent - mantissa_bits - 1) / scale
    return x.detach().double().abs() * rel + absolute


# ---- microscaling (docs/design.md, section 13): one block at a time, Python floats -------------------


def _grid(exponent_bits: int, mantissa_bits: int, max_code: int) -> list[float]:
    """The non-negative values of a small float format, by code (0 .. max_code), decoded by hand:
    subnormals m * 2**(1 - bias - mantissa_bits), normals (1 + m / 2**mantissa_bits) * 2**(e - bias)."""
    bias = 2 ** (exponent_bits - 1) - 1
    values = []
    for code in range(max_code + 1):
        e, m = code >> mantissa_bits, code & (2**mantissa_bits - 1)
        if e == 0:
            values.append(m * 2.0 ** (1 - bias - mantissa_bits))
        else:
            values.append((1 + m / 2**mantissa_bits) * 2.0 ** (e - bias))
    return values


E4M3_GRID = _grid(4, 3, 126)  # 0x7F is NaN
E5M2_GRID = _grid(5, 2, 123)  # 0x7C is inf
E2M1_GRID = _grid(2, 1, 7)


def f32_fast(x: float) -> float:
    """`f32` through the C cast (struct), for the per-element microscaling references: the same
    correctly rounded float32 (subnormals kept), inf where it rounds beyond the float32 maximum."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def round_to_grid(x: float, grid: list[float]) -> float:
    """x (|x| <= grid max) to the nearest value of `grid` (increasing by code), ties to the even code;
    sign kept (-0.0 too); NaN stays NaN."""
    if math.isnan(x):
        return x
    a = abs(x)
    hi = min(bisect.bisect_left(grid, a), len(grid) - 1)
    lo = max(hi - 1, 0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a  # exact in doubles wherever a is near a midpoint
    best = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi
    return math.copysign(grid[best], x)


def mx_block_ref(block: Sequence[float], fmax: float, grid: list[float]) -> tuple[int, list[float]]:
    """(E8M0 byte, values) of one MX block: byte = ceil(log2(f32(amax / fmax))) + 127 from the exact
    binary exponent (math.frexp), clamped to [0, 254]; NaN 255, inf 254; values rounded from
    x * 2**(127 - byte) (times 1 for byte 0) after saturation."""
    values = [f32_fast(v) for v in block]
    if any(math.isnan(v) for v in values):
        return 255, [math.nan] * len(values)
    amax = max(abs(v) for v in values)
    descale = f32_fast(amax / fmax)
    if math.isinf(descale):
        byte = 254
    elif descale == 0.0:
        byte = 0
    else:
        mantissa, exponent = math.frexp(descale)  # descale = mantissa * 2**exponent, mantissa in [0.5, 1)
        byte = min(max((exponent - 1 if mantissa == 0.5 else exponent) + 127, 0), 254)
    multiplier = 1.0 if byte == 0 else 2.0 ** (127 - byte)
    out = []
    for v in values:
        scaled = f32_fast(v * multiplier)
        out.append(round_to_grid(min(max(scaled, -fmax), fmax), grid))
    return byte, out


def nvfp4_tensor_scale_ref(amax: float) -> float:
    if math.isnan(amax):
        return math.nan
    if amax == 0.0:
        return 1.0
    s = f32_fast(E4M3_MAX * 6.0 / amax)  # f32 operands: one rounding of the double quotient is exact
    return 1.0 if s == 0.0 else min(s, FLOAT32_MAX)


def nvfp4_block_ref(block: Sequence[float], s_enc: float) -> tuple[float, list[float]]:
    """(E4M3 block scale, E2M1 values) of one NVFP4 block, each float32 operation rounded explicitly
    (f = f32_fast): S_dec = e4m3(min(f(f(amax * S_enc) / 6), 448)); enc = min(f(1 / f(S_dec / S_enc)),
    FLT_MAX), FLT_MAX for S_dec = 0; value = e2m1(clamp(f(x * enc), -6, 6)), 0 in a NaN block."""
    values = [f32_fast(v) for v in block]
    amax = math.nan if any(math.isnan(v) for v in values) else max(abs(v) for v in values)
    pre = f32_fast(f32_fast(amax * s_enc) / 6.0)
    s_dec = round_to_grid(min(pre, E4M3_MAX), E4M3_GRID) if not math.isnan(pre) else math.nan
    if math.isnan(s_dec) or math.isnan(s_enc):
        return math.nan, [0.0] * len(values)
    quotient = f32_fast(s_dec / s_enc)
    enc = FLOAT32_MAX if quotient == 0.0 else min(f32_fast(1.0 / quotient), FLOAT32_MAX)
    out = []
    for v in values:
        scaled = f32_fast(v * enc)
        out.append(round_to_grid(min(max(scaled, -6.0), 6.0), E2M1_GRID))
    return s_dec, out
