"""Independent reference implementations for the tests, written from docs/design.md, section 1.

Deliberately naive: one column at a time, plain Python lists, float32 rounding done explicitly, so
that a vectorisation or storage bug in the library cannot hide behind the same bug here.
"""

from __future__ import annotations

import math
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
