"""Triton helpers that round float32 values to FP8 and encode them, by float and integer arithmetic
that is exact on a GPU and in Triton's interpreter alike (docs/design.md, section 6, "Fused
quantization kernels").

Triton's own float32-to-FP8 conversion is not used: in triton 3.9's interpreter it is not
round-to-nearest-even (ties go away from zero, a mantissa carry is lost, subnormals truncate: triton
issue 8322), and before SM89 the GPU has no E4M3 conversion at all. Here the value is rounded by
cast.py's addition trick with the constant built from integer bits, and the FP8 byte is then read off
the float32 bits of the rounded (exactly representable) value. Every helper takes the encoding as two
constexprs: MANTISSA_BITS (E4M3: 3, E5M2: 2) and MIN_EXPONENT, the exponent of the smallest normal
(E4M3: -6, E5M2: -14).

Importing this module imports triton: only kernels/triton_cast.py does, lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...torch_internals import triton_max_combine

MAX_COMBINE = triton_max_combine()  # tl.max's own combine function (torch_internals says why)

__all__ = ["round_to_fp8", "fp8_byte", "bf16_bits", "abs_bits", "max_along", "saturate", "scale_from_amax"]

FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def round_to_fp8(t, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """`t` (float32, in [-fp8_max, fp8_max], or NaN) rounded to the nearest FP8 value, ties to even;
    a value rounding to zero keeps t's sign (the FP8 cast's -0.0); NaN stays NaN.

    cast.py's `_round_to_fp8_grid`: with 2**e the binade of |t| (at least the smallest normal) and
    k = 1.5 * 2**(e + 23 - m), t + k lies in the float32 binade whose spacing is the FP8 spacing at
    e, so the float32 addition rounds t as the FP8 cast does (ties to even: k is an even multiple of
    that spacing), and (t + k) - k is exact (Sterbenz). k is built from integer bits (exponent field
    e + 23 - m + 127, mantissa 0.5), so nothing but the two additions rounds: a compiler that
    contracts them into FMAs with k's formation gets the same values, as k is exact."""
    bits = t.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    exponent = tl.minimum(tl.maximum(exponent, (MIN_EXPONENT + 127) << 23), (16 + 127) << 23)  # NaN: bounded
    k = (exponent + ((23 - MANTISSA_BITS) << 23) + 0x400000).to(tl.float32, bitcast=True)
    rounded = (t + k) - k
    # (t + k) - k is +0.0 where t rounds to zero: t's sign bit back (-0.0); other values keep theirs
    rounded_bits = rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)
    return tl.where(t != t, t, rounded_bits.to(tl.float32, bitcast=True))


@triton.jit
def fp8_byte(r, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """The FP8 byte (int32 in [0, 255]) of `r`, a float32 holding an FP8 value exactly, or NaN
    (0x7F with r's sign bit, as torch's conversion gives), by integer arithmetic only. Normal values:
    the float32 exponent rebiased and the top mantissa bits. Subnormals (and zeros): the significand
    1.f of r, 24 bits, shifted to units of the smallest subnormal 2**(MIN_EXPONENT - m), a shift of
    23 - m + MIN_EXPONENT - e for r's exponent e (23 for the smallest subnormal; 31 and more, clamped
    to 31, gives 0 for a zero)."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # the exponent rebiased from 127 to the FP8 bias, 1 - MIN_EXPONENT
    normal = (magnitude >> (23 - MANTISSA_BITS)) - ((126 + MIN_EXPONENT) << MANTISSA_BITS)
    exponent = (magnitude >> 23) - 127
    shift = tl.minimum(tl.maximum(23 - MANTISSA_BITS + MIN_EXPONENT - exponent, 0), 31)
    subnormal = ((magnitude & 0x7FFFFF) | 0x800000) >> shift
    byte = tl.where(magnitude >= ((MIN_EXPONENT + 127) << 23), normal, subnormal)
    byte = tl.where(r != r, 0x7F, byte)
    return byte | sign


@triton.jit
def bf16_bits(r):
    """The bfloat16 bits (int32, the low 16 bits significant) of `r`, a float32 holding an FP8 value
    exactly (its low 16 bits are zero): the high half of its bits, NaN's included."""
    return r.to(tl.int32, bitcast=True) >> 16


@triton.jit
def abs_bits(x):
    """|x| as int32 bits (x float32): for non-negative floats the integer order is the float order, and
    NaN (any payload) is above inf, so an integer max of these is max|x| with NaN propagating,
    on every device (float max reductions may drop NaN)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def max_along(bits, axis: tl.constexpr):
    """The integer max of `bits` along `axis` (of abs_bits: max|x|, NaN propagating): tl.max's own
    reduction, `tl.reduce` with tl.max's own combine function (`MAX_COMBINE`). Not
    tl.max itself: a function of triton's standard library, decorated when triton is first imported,
    it runs interpreted only where TRITON_INTERPRET=1 was set before that, while these helpers follow
    the setting when the kernels are imported; the interpreter reduces with numpy for this combine
    function and element by element for any other."""
    return tl.reduce(bits, axis, MAX_COMBINE)


@triton.jit
def saturate(product, FP8_MAX: tl.constexpr):
    """clamp(product, -FP8_MAX, FP8_MAX) with NaN kept (comparisons with NaN are false), as torch's
    clamp does: inf saturates."""
    product = tl.where(product > FP8_MAX, FP8_MAX, product)
    return tl.where(product < -FP8_MAX, -FP8_MAX, product)


@triton.jit
def scale_from_amax(amax, FP8_MAX: tl.constexpr, POWER_2: tl.constexpr):
    """quantization/current.py's `scale_from_amax` (TransformerEngine's rule), bit for bit: FP8_MAX /
    amax by a correctly rounded division (Triton's `/` on a GPU is approximate), capped at the float32
    maximum, 1 where amax is 0, inf or NaN; with POWER_2 rounded down to a power of 2 by keeping the
    exponent field (scales are normal: FP8_MAX / float32 max is above 2**-126)."""
    ok = (amax > 0.0) & (amax <= FLOAT32_MAX)  # false for NaN
    divisor = tl.where(ok, amax, 1.0)
    quotient = tl.math.div_rn(divisor * 0.0 + FP8_MAX, divisor)  # a float32 FP8_MAX of divisor's shape
    scale = tl.where(ok, quotient, 1.0)
    scale = tl.where(scale > FLOAT32_MAX, FLOAT32_MAX, scale)
    if POWER_2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale
