"""The bytes of FP8 gradient communication: rows of float32 values as FP8 values with one E8M0 scale
per chunk, and back. docs/design.md, section 15.

A row of n values is cut into ceil(n / chunk) chunks (the last one partial); each chunk is the MXFP8
rule with a block of `chunk` elements: scale = amax / fp8_max rounded up to a power of two
(`microscaling.e8m0_scale`), values = fp8(x * 2**-scale). A row's bytes are its n FP8 values, then its
chunk scales: [n + ceil(n / chunk)] uint8, so one row travels as one message and its scales travel
with it (what the receiver needs, no separate collective).

Exactness: the multiplication by a power of two is exact (an underflow only touches values far below
the FP8 subnormals), and amax / 2**scale <= fp8_max except where float32 rounded amax / fp8_max down
(at most 2**-24 relative, then saturated): the only rounding is the FP8 one. Per element,
|decode(encode(x)) - x| <= half an FP8 ulp of |x| / 2**scale, times 2**scale (round to nearest), or
below one ulp (stochastic). Decoding (FP8 value times a power of two) is exact.

Non-finite: a chunk holding a NaN has scale 255 and decodes to NaN everywhere; a chunk holding an
infinity (no NaN) has scale 254, its infinities saturate to +-fp8_max and decode to +-inf again (by
overflow), its finite values flush to 0. A scale of 0 (amax <= fp8_max * 2**-127) multiplies by
2**127, keeping such tiny chunks (MXFP8's rule multiplies by 1 there, for TransformerEngine's bits).

Pure functions on tensors, any device.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics.formats import fp8_dtype, fp8_max
from ..numerics.microscaling import e8m0_scale, e8m0_to_float

__all__ = [
    "ENCODINGS", "chunks_per_row", "checked_chunk_size", "encode", "decode", "stochastic_fp8_round",
    "RoundingGenerators",
]  # fmt: skip

# encoding: (mantissa bits, exponent of the smallest normal)
ENCODINGS = {"e4m3": (3, -6), "e5m2": (2, -14)}
_NAN_SCALE = 255


def chunks_per_row(n: int, chunk: int) -> int:
    return -(-n // chunk)


def checked_chunk_size(chunk_size: object) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer (values per scale), got {chunk_size!r}")
    return chunk_size


class RoundingGenerators:
    """Stochastic rounding's generators (None everywhere when it is off): one per device, rank and
    trip of a reduction (each trip draws in one fixed order on one thread, so draws made on
    different threads never interleave), seeded from `seed`, the rank and the trip."""

    def __init__(self, enabled: bool, seed: int) -> None:
        self.enabled = bool(enabled)
        self.seed = int(seed)
        self._by_key: dict[tuple, torch.Generator] = {}

    def get(self, device: torch.device, rank: int, trip: int = 0) -> Optional[torch.Generator]:
        if not self.enabled:
            return None
        key = (device, rank, trip)
        if key not in self._by_key:
            self._by_key[key] = torch.Generator(device=device)
            self._by_key[key].manual_seed((self.seed * 1_000_003 + rank) * 2 + trip)
        return self._by_key[key]


def stochastic_fp8_round(
    magnitude: torch.Tensor, encoding: str, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """`magnitude` (float32, in [0, fp8_max]) rounded stochastically to the FP8 grid, in float32: the
    rule of NVFP4's E2M1 rounding (`microscaling.e2m1_round`) on the FP8 grid. Between neighbours
    lo < hi it rounds up when u < (m - lo) / (hi - lo), u = torch.rand (from `generator`). The step
    hi - lo is a power of two (the ulp of m's binade, at least the subnormal spacing), so lo, m - lo
    and the quotient are exact: P(up) is the exact fraction on torch.rand's grid (2**-24), unbiased up
    to 2**-24 of a step. Values on the grid never move; NaN stays NaN."""
    mantissa_bits, min_exponent = ENCODINGS[encoding]
    binade = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)
    step = binade.clamp(min=2.0**min_exponent).mul_(2.0**-mantissa_bits)
    low = torch.floor(magnitude / step).mul_(step)
    u = torch.rand(magnitude.shape, generator=generator, device=magnitude.device)
    return torch.where(u < (magnitude - low) / step, low + step, low)


def encode(
    rows: torch.Tensor, chunk: int, encoding: str, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """[R, n] float32 as [R, n + K] uint8: each row's FP8 values, then its K = ceil(n / chunk) E8M0
    chunk scales. Round to nearest even, or stochastic with `generator` (`stochastic_fp8_round`)."""
    r, n = rows.shape
    whole = n // chunk * chunk  # the whole chunks, then a partial one
    x = rows.float()
    amax = x[:, :whole].view(r, -1, chunk).abs().amax(dim=-1)
    if whole < n:
        amax = torch.cat([amax, x[:, whole:].abs().amax(dim=-1, keepdim=True)], dim=1)
    out = torch.empty((r, n + amax.shape[1]), dtype=torch.uint8, device=rows.device)
    scales = out[:, n:]
    scales.copy_(e8m0_scale(amax, encoding))  # NaN -> 255, inf -> 254
    # 2**(127 - scale), exact (built from the bits, as e8m0_to_float does); NaN for a NaN chunk
    multiplier = e8m0_to_float((254 - scales.to(torch.int32)).clamp_(min=0).to(torch.uint8))
    multiplier = torch.where(scales == _NAN_SCALE, float("nan"), multiplier)
    scaled = torch.empty_like(x)
    torch.mul(x[:, :whole].view(r, -1, chunk), multiplier[:, : whole // chunk].unsqueeze(-1),
              out=scaled[:, :whole].view(r, -1, chunk))  # fmt: skip
    if whole < n:
        torch.mul(x[:, whole:], multiplier[:, -1:], out=scaled[:, whole:])
    limit = fp8_max(encoding)
    scaled.clamp_(-limit, limit)
    if generator is not None:
        scaled = stochastic_fp8_round(scaled.abs(), encoding, generator).copysign_(scaled)
    out[:, :n].view(fp8_dtype(encoding)).copy_(scaled)
    return out


def decode(data: torch.Tensor, n: int, chunk: int, encoding: str) -> torch.Tensor:
    """`encode`'s [R, n + K] bytes as [R, n] float32 (exact: FP8 values times powers of two; +-inf
    where a saturated infinity's chunk overflows back, NaN across a NaN chunk)."""
    decoded = data[:, :n].view(fp8_dtype(encoding)).float()
    scales = e8m0_to_float(data[:, n:])  # [R, K]
    whole = n // chunk * chunk  # the whole chunks, then a partial one; scaled in place
    decoded[:, :whole].view(data.shape[0], -1, chunk).mul_(scales[:, : whole // chunk].unsqueeze(-1))
    if whole < n:
        decoded[:, whole:].mul_(scales[:, -1:])
    return decoded
