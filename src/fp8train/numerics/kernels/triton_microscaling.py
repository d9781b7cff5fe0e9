"""Fused one-pass Triton quantization kernels of the microscaling recipes (MXFP8, NVFP4): each kernel
reads the high-precision tensor once and writes the values, their scales and, where a layer needs both,
the row-wise and the column-wise copy (docs/design.md, section 13, "Fused kernels").

Every function here returns what its torch counterpart in `microscaling.py` returns, bit for bit
(tests/recipes/test_triton_microscaling.py checks it under Triton's interpreter on the CPU):

    mx_quantize(x, dim, block, encoding, two_d)            microscaling.mx_quantize
    mx_quantize_both(x2d, encoding)                        (mx_quantize(x, 1, ...), mx_quantize(x, 0, ...))
    nvfp4_quantize(x, dim, global_amax, two_d, stochastic, generator, values_dtype)
                                                           microscaling.nvfp4_quantize
    nvfp4_quantize_rotated(x, dim, signs, global_amax, stochastic, generator, values_dtype)
                                                           nvfp4_quantize(random_hadamard_transform(x, ...))
    nvfp4_quantize_both(x2d, global_amax, stochastic, generator, values_dtype)
                                                      (nvfp4_quantize(x, 1, ...), nvfp4_quantize(x, 0, ...))
    nvfp4_quantize_both_rotated(x2d, signs, stochastic, generator, values_dtype)
                                      (nvfp4_quantize(x, 1, ...), nvfp4_quantize_rotated(x, 0, signs, ...))
    nvfp4_amax(x, dim, signs)                              the per-tensor amax nvfp4_quantize starts from

Rounding is integer and float32 arithmetic that is exact both in the interpreter and on a GPU: no
Triton conversion to an FP8 type is used (the interpreter's is not round-to-nearest-even, triton issue
8322, and Triton has no E4M3 type before SM89). The FP8 bytes are assembled from the exactly rounded
float32 value's bits and stored as uint8, then viewed as the FP8 dtype. Divisions that must be correctly
rounded are taken in float64 and rounded once to float32 (Triton's float32 `/` is an approximate
division on NVIDIA GPUs; a float64 one is IEEE, and rounding an IEEE float64 quotient of two float32
numbers to float32 gives the correctly rounded float32 quotient: 53 >= 2 * 24 + 2). Triton's min, max
and max-reductions need not propagate NaN on a GPU: NaN is tracked explicitly (a flag per block) and
clamps are written as selects, which keep NaN as torch's clamp does. Every launch disables fp fusion
(`_OPTIONS`): no multiply-add is contracted, each float32 operation rounds once, as numpy does in the
interpreter. bf16 inputs are read as their bits and widened by a shift. The kernels use only Triton's
core builtins, their own @triton.jit helpers and those of kernels/rounding.py shared with
triton_cast.py (`round_to_fp8`, `fp8_byte`, `max_along`: tl.max's reduction without tl.max), so an
interpreted copy of this module runs in a process that imported triton without TRITON_INTERPRET (the
tests load one, with an interpreted copy of rounding.py in place while it imports).

Triton is optional for fp8train: this module imports it, so dispatch to it only where it imports (and
only for CUDA tensors; CPU tensors run here only in the interpreter).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ..microscaling import MX_BLOCK, NVFP4_BLOCK, RHT_SIGNS, nvfp4_tensor_scale
from .rounding import fp8_byte, max_along, round_to_fp8

__all__ = [
    "mx_quantize",
    "mx_quantize_both",
    "nvfp4_quantize",
    "nvfp4_quantize_rotated",
    "nvfp4_quantize_both",
    "nvfp4_quantize_both_rotated",
    "nvfp4_amax",
]

Amax = Union[torch.Tensor, float]

# (largest finite value, mantissa bits, smallest normal exponent) of each encoding
_FP8 = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Compile options of every launch: no fused multiply-adds, so that each float32 operation rounds once on
# the device as it does in the interpreter (numpy); the interpreter ignores the option.
_OPTIONS = {"enable_fp_fusion": False}
_SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as an int32 (a constexpr: jit code may read it)


# fmt: off
# ---- rounding helpers ----------------------------------------------------------------------------------


@triton.jit
def _binade(t, MIN_EXP: tl.constexpr):
    """2**e of |t| (float32), at least 2**MIN_EXP; inf for inf and NaN (exponent field all ones)."""
    b = (t.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(b < 2.0**MIN_EXP, 2.0**MIN_EXP, b)


@triton.jit
def _with_sign_of(r, t):
    """r (non-negative or +0.0) with t's sign bit: copysign for values rounded from t."""
    sign = t.to(tl.int32, bitcast=True) & _SIGN_BIT
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e2m1(t):
    """t (float32) rounded to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} with t's sign, saturating at
    +-6, ties to even; NaN stays NaN: `microscaling.e2m1_round` (nearest), k = 1.5 * 2**(e + 22) with
    2**e the binade of |t|, at least 1."""
    m = tl.abs(t)
    m = tl.where(m > 6.0, 6.0, m)  # a select keeps NaN
    k = _binade(m, 0) * (1.5 * 2.0**22)
    return _with_sign_of((m + k) - k, t)


@triton.jit
def _as_float32(x, IN_BF16: tl.constexpr):
    """Loaded input as float32: bf16 arrives as its int16 bits and is widened by a shift (exact, bf16
    subnormals included; Triton 3.9's interpreter converts bf16 subnormals wrongly); float32 and
    float16 by conversion (exact)."""
    if IN_BF16:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _correctly_rounded_div(a, b):
    """a / b of float32 tensors, correctly rounded to float32 (through one IEEE float64 division)."""
    return (a.to(tl.float64) / b.to(tl.float64)).to(tl.float32)


@triton.jit
def e8m0_byte(amax, LIMIT: tl.constexpr):
    """`microscaling.e8m0_scale`: the E8M0 byte (int32) of blocks with this amax (float32 >= 0, inf or
    NaN): fl32(amax / LIMIT) rounded up to a power of two, read off its bits; a subnormal quotient at
    most 2**-127 is byte 0; +inf 254; NaN 255."""
    q = (amax.to(tl.float64) / LIMIT).to(tl.float32)
    bits = q.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    byte = exponent + round_up.to(tl.int32)
    byte = tl.where(q == float("inf"), 254, byte)
    return tl.where(q != q, 255, byte)


@triton.jit
def mx_multiplier(byte):
    """`microscaling._mx_encode_multiplier`: 2**(127 - byte) as float32 (exact, built from bits;
    2**-127 is subnormal), 1 for byte 0, NaN for 255."""
    e = 127 - byte  # in [-128, 127]
    bits = tl.where(e >= -126, (e + 127) << 23, 0x400000)  # byte 254: 2**-127
    m = bits.to(tl.float32, bitcast=True)
    m = tl.where(byte == 0, 1.0, m)
    return tl.where(byte == 255, float("nan"), m)


@triton.jit
def _nan_to_flag(x):
    """(|x| with NaN as 0, 1 where x is NaN else 0): a block's amax and its NaN flag reduce with
    Triton's max, which need not propagate NaN on a GPU."""
    nan = x != x
    return tl.where(nan, 0.0, tl.abs(x)), nan.to(tl.int32)


@triton.jit
def _mx_codes(
    x, multiplier, LIMIT: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr
):
    """fp8(saturate(x * multiplier)) as FP8 bytes: the product of a power of two is exact (an
    underflow only touches values far below the FP8 subnormals); the clamp is a select (NaN kept)."""
    p = x * multiplier
    p = tl.where(p > LIMIT, LIMIT, tl.where(p < -LIMIT, -LIMIT, p))
    return fp8_byte(round_to_fp8(p, MANT, MIN_EXP), MANT, MIN_EXP)


# ---- MXFP8 kernels -------------------------------------------------------------------------------------


@triton.jit
def _mx_blocks_kernel(
    x_ptr, v_ptr, s_ptr, P, N, Q, sxp, sxn, sxq, svp, svn, svq, ssp, ssn, ssq, LIMIT: tl.constexpr,
    MANT: tl.constexpr, MIN_EXP: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
    BN: tl.constexpr, BQ: tl.constexpr, IN_BF16: tl.constexpr,
):
    """x viewed as [P, N, Q], blocks of B along N: one [BP, BN, BQ] tile per program (BN a multiple of
    B), zero-padded past the edges (a partial block is scaled from its own elements, as padding with
    zeros does). Writes the FP8 bytes and one E8M0 byte per block ([P, ceil(N/B), Q])."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)[:, None, None]
    n = tl.program_id(1) * BN + tl.arange(0, BN)[None, :, None]
    q = tl.program_id(2) * BQ + tl.arange(0, BQ)[None, None, :]
    inside = (p < P) & (n < N) & (q < Q)
    x = _as_float32(tl.load(x_ptr + p * sxp + n * sxn + q * sxq, mask=inside, other=0), IN_BF16)
    magnitude, nan = _nan_to_flag(tl.reshape(x, (BP, BN // B, B, BQ)))
    amax = tl.where(max_along(nan, 2) > 0, float("nan"), max_along(magnitude, 2))  # [BP, BN/B, BQ]
    byte = e8m0_byte(amax, LIMIT)
    multiplier = tl.reshape(
        tl.broadcast_to(mx_multiplier(byte)[:, :, None, :], (BP, BN // B, B, BQ)), (BP, BN, BQ)
    )
    codes = _mx_codes(x, multiplier, LIMIT, MANT, MIN_EXP)
    tl.store(v_ptr + p * svp + n * svn + q * svq, codes.to(tl.uint8), mask=inside)
    nb = tl.program_id(1) * (BN // B) + tl.arange(0, BN // B)[None, :, None]
    tl.store(s_ptr + p * ssp + nb * ssn + q * ssq, byte.to(tl.uint8), mask=(p < P) & (nb * B < N) & (q < Q))


@triton.jit
def _mx_matrix_kernel(
    x_ptr, vr_ptr, sr_ptr, vc_ptr, sc_ptr, R, C, sxr, sxc, svr_r, svr_c, ssr_r, ssr_c, svc_r, svc_c, ssc_r,
    ssc_c, LIMIT: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
    B: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, IN_BF16: tl.constexpr, ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr, TWO_D: tl.constexpr,
):
    """A 2-D x [R, C], one [BR, BC] tile per program (multiples of B), read once. ROWWISE: 1xB blocks
    (along C) into (vr, sr [R, ceil(C/B)]); COLUMNWISE: Bx1 blocks (along R) into (vc, sc
    [ceil(R/B), C]); TWO_D: BxB blocks into (vr, sr [ceil(R/B), ceil(C/B)])."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    inside = (r < R) & (c < C)
    x = _as_float32(tl.load(x_ptr + r * sxr + c * sxc, mask=inside, other=0), IN_BF16)
    if ROWWISE:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR, BC // B, B)))
        amax = tl.where(max_along(nan, 2) > 0, float("nan"), max_along(magnitude, 2))  # [BR, BC/B]
        byte = e8m0_byte(amax, LIMIT)
        multiplier = tl.reshape(tl.broadcast_to(mx_multiplier(byte)[:, :, None], (BR, BC // B, B)), (BR, BC))
        codes = _mx_codes(x, multiplier, LIMIT, MANT, MIN_EXP)
        tl.store(vr_ptr + r * svr_r + c * svr_c, codes.to(tl.uint8), mask=inside)
        cb = tl.program_id(1) * (BC // B) + tl.arange(0, BC // B)[None, :]
        tl.store(sr_ptr + r * ssr_r + cb * ssr_c, byte.to(tl.uint8), mask=(r < R) & (cb * B < C))
    if COLUMNWISE:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR // B, B, BC)))
        amax = tl.where(max_along(nan, 1) > 0, float("nan"), max_along(magnitude, 1))  # [BR/B, BC]
        byte = e8m0_byte(amax, LIMIT)
        multiplier = tl.reshape(tl.broadcast_to(mx_multiplier(byte)[:, None, :], (BR // B, B, BC)), (BR, BC))
        codes = _mx_codes(x, multiplier, LIMIT, MANT, MIN_EXP)
        tl.store(vc_ptr + r * svc_r + c * svc_c, codes.to(tl.uint8), mask=inside)
        rb = tl.program_id(0) * (BR // B) + tl.arange(0, BR // B)[:, None]
        tl.store(sc_ptr + rb * ssc_r + c * ssc_c, byte.to(tl.uint8), mask=(rb * B < R) & (c < C))
    if TWO_D:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR // B, B, BC // B, B)))
        any_nan = max_along(max_along(nan, 3), 1)
        amax = tl.where(any_nan > 0, float("nan"), max_along(max_along(magnitude, 3), 1))
        byte = e8m0_byte(amax, LIMIT)  # [BR/B, BC/B]
        multiplier = tl.broadcast_to(mx_multiplier(byte)[:, None, :, None], (BR // B, B, BC // B, B))
        codes = _mx_codes(x, tl.reshape(multiplier, (BR, BC)), LIMIT, MANT, MIN_EXP)
        tl.store(vr_ptr + r * svr_r + c * svr_c, codes.to(tl.uint8), mask=inside)
        rb = tl.program_id(0) * (BR // B) + tl.arange(0, BR // B)[:, None]
        cb = tl.program_id(1) * (BC // B) + tl.arange(0, BC // B)[None, :]
        tl.store(sr_ptr + rb * ssr_r + cb * ssr_c, byte.to(tl.uint8), mask=(rb * B < R) & (cb * B < C))


@triton.jit
def _fwht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGNS: tl.constexpr):
    """16 float32 tensors (the elements of 16-blocks) times M = diag(signs) H16 / 4 (H16 Sylvester;
    bit i of SIGNS set: sign i is -1): z_i = x_i * (+-1/4), each exact, then the fast Walsh-Hadamard
    butterflies, index bit 0 first: y_j = sum_i H_ij z_i added in a fixed pairwise order, each addition
    one float32 rounding (the same in the interpreter and on a GPU)."""
    z0 = x0 * (0.25 - 0.5 * ((SIGNS >> 0) & 1))
    z1 = x1 * (0.25 - 0.5 * ((SIGNS >> 1) & 1))
    z2 = x2 * (0.25 - 0.5 * ((SIGNS >> 2) & 1))
    z3 = x3 * (0.25 - 0.5 * ((SIGNS >> 3) & 1))
    z4 = x4 * (0.25 - 0.5 * ((SIGNS >> 4) & 1))
    z5 = x5 * (0.25 - 0.5 * ((SIGNS >> 5) & 1))
    z6 = x6 * (0.25 - 0.5 * ((SIGNS >> 6) & 1))
    z7 = x7 * (0.25 - 0.5 * ((SIGNS >> 7) & 1))
    z8 = x8 * (0.25 - 0.5 * ((SIGNS >> 8) & 1))
    z9 = x9 * (0.25 - 0.5 * ((SIGNS >> 9) & 1))
    z10 = x10 * (0.25 - 0.5 * ((SIGNS >> 10) & 1))
    z11 = x11 * (0.25 - 0.5 * ((SIGNS >> 11) & 1))
    z12 = x12 * (0.25 - 0.5 * ((SIGNS >> 12) & 1))
    z13 = x13 * (0.25 - 0.5 * ((SIGNS >> 13) & 1))
    z14 = x14 * (0.25 - 0.5 * ((SIGNS >> 14) & 1))
    z15 = x15 * (0.25 - 0.5 * ((SIGNS >> 15) & 1))
    s0_0, s0_1 = z0 + z1, z0 - z1
    s0_2, s0_3 = z2 + z3, z2 - z3
    s0_4, s0_5 = z4 + z5, z4 - z5
    s0_6, s0_7 = z6 + z7, z6 - z7
    s0_8, s0_9 = z8 + z9, z8 - z9
    s0_10, s0_11 = z10 + z11, z10 - z11
    s0_12, s0_13 = z12 + z13, z12 - z13
    s0_14, s0_15 = z14 + z15, z14 - z15
    s1_0, s1_2 = s0_0 + s0_2, s0_0 - s0_2
    s1_1, s1_3 = s0_1 + s0_3, s0_1 - s0_3
    s1_4, s1_6 = s0_4 + s0_6, s0_4 - s0_6
    s1_5, s1_7 = s0_5 + s0_7, s0_5 - s0_7
    s1_8, s1_10 = s0_8 + s0_10, s0_8 - s0_10
    s1_9, s1_11 = s0_9 + s0_11, s0_9 - s0_11
    s1_12, s1_14 = s0_12 + s0_14, s0_12 - s0_14
    s1_13, s1_15 = s0_13 + s0_15, s0_13 - s0_15
    s2_0, s2_4 = s1_0 + s1_4, s1_0 - s1_4
    s2_1, s2_5 = s1_1 + s1_5, s1_1 - s1_5
    s2_2, s2_6 = s1_2 + s1_6, s1_2 - s1_6
    s2_3, s2_7 = s1_3 + s1_7, s1_3 - s1_7
    s2_8, s2_12 = s1_8 + s1_12, s1_8 - s1_12
    s2_9, s2_13 = s1_9 + s1_13, s1_9 - s1_13
    s2_10, s2_14 = s1_10 + s1_14, s1_10 - s1_14
    s2_11, s2_15 = s1_11 + s1_15, s1_11 - s1_15
    s3_0, s3_8 = s2_0 + s2_8, s2_0 - s2_8
    s3_1, s3_9 = s2_1 + s2_9, s2_1 - s2_9
    s3_2, s3_10 = s2_2 + s2_10, s2_2 - s2_10
    s3_3, s3_11 = s2_3 + s2_11, s2_3 - s2_11
    s3_4, s3_12 = s2_4 + s2_12, s2_4 - s2_12
    s3_5, s3_13 = s2_5 + s2_13, s2_5 - s2_13
    s3_6, s3_14 = s2_6 + s2_14, s2_6 - s2_14
    s3_7, s3_15 = s2_7 + s2_15, s2_7 - s2_15
    # + 0.0: a sum that is exactly zero is +0.0, as from an accumulator that starts at +0.0 (the matmul's)
    return (
        s3_0 + 0.0, s3_1 + 0.0, s3_2 + 0.0, s3_3 + 0.0, s3_4 + 0.0, s3_5 + 0.0, s3_6 + 0.0, s3_7 + 0.0,
        s3_8 + 0.0, s3_9 + 0.0, s3_10 + 0.0, s3_11 + 0.0, s3_12 + 0.0, s3_13 + 0.0, s3_14 + 0.0, s3_15 + 0.0,
    )


# ---- NVFP4 kernels -------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_block_scales(amax, s_enc):
    """`microscaling.nvfp4_quantize`'s per-block scales from the block amax (float32 >= 0, inf or NaN)
    and S_enc, each step one float32 rounding: S_dec = e4m3(min((amax * S_enc) / 6, 448)) (the float32
    value of an E4M3 number, or NaN), enc = min(1 / (S_dec / S_enc), FLOAT32_MAX)."""
    product = amax * s_enc
    s = (product.to(tl.float64) / 6.0).to(tl.float32)
    s = tl.where(s > 448.0, 448.0, s)  # a select keeps NaN
    s_dec = round_to_fp8(s, 3, -6)
    q = (s_dec.to(tl.float64) / s_enc.to(tl.float64)).to(tl.float32)
    enc = (1.0 / tl.where(q == 0.0, 1.0, q).to(tl.float64)).to(tl.float32)
    enc = tl.where(q == 0.0, float("inf"), enc)  # 1 / 0, without dividing by zero
    enc = tl.where(enc > 3.4028234663852886e38, 3.4028234663852886e38, enc)  # NaN kept
    return s_dec, enc


@triton.jit
def _nvfp4_value(x, enc, u, STOCHASTIC: tl.constexpr):
    """e2m1(clamp(x * enc, -6, 6)), nearest even or (STOCHASTIC) up when u < the exact fraction of the
    step (`microscaling.e2m1_round`); NaN (a NaN block or tensor scale) becomes +0.0, the torch path's
    masked_fill. The clamp is a select: the product feeds no addition."""
    p = x * enc
    p = tl.where(p > 6.0, 6.0, tl.where(p < -6.0, -6.0, p))
    if STOCHASTIC:
        m = tl.abs(p)
        step = tl.where(m < 2.0, 0.5, tl.where(m < 4.0, 1.0, 2.0))
        inverse = tl.where(m < 2.0, 2.0, tl.where(m < 4.0, 1.0, 0.5))  # 1 / step, exact
        low = tl.floor(m * inverse) * step  # exact: powers of two
        up = u < (m - low) * inverse  # m - low exact (Sterbenz)
        r = _with_sign_of(tl.where(up, low + step, low), p)
    else:
        r = round_to_e2m1(p)
    return tl.where(r != r, 0.0, r)


@triton.jit
def _load_slice(base, n0, ELEMENT: tl.constexpr, N, sn, inside, IN_BF16: tl.constexpr):
    """Element ELEMENT of each 16-block along N (block starts n0, addresses base): a [BP, NBK, BQ] tile,
    0 past the edges (`inside`: the tile's (p, q) within the tensor)."""
    return _as_float32(tl.load(base + ELEMENT * sn, mask=inside & (n0 + ELEMENT < N), other=0), IN_BF16)


@triton.jit
def _store_value(
    v_base, u_base, x, enc, n0, ELEMENT: tl.constexpr, N, svn, sun, inside, STOCHASTIC: tl.constexpr,
    OUT_FP8: tl.constexpr,
):
    """Element ELEMENT of each 16-block: its NVFP4 value, stored as float32 or (OUT_FP8) an E4M3 byte."""
    inside = inside & (n0 + ELEMENT < N)
    u = 0.0
    if STOCHASTIC:
        u = tl.load(u_base + ELEMENT * sun, mask=inside, other=0.0)
    value = _nvfp4_value(x, enc, u, STOCHASTIC)
    if OUT_FP8:
        tl.store(v_base + ELEMENT * svn, fp8_byte(value, 3, -6).to(tl.uint8), mask=inside)
    else:
        tl.store(v_base + ELEMENT * svn, value, mask=inside)


@triton.jit
def _load16(base, n0, N, sn, inside, ROTATE: tl.constexpr, SIGNS: tl.constexpr, IN_BF16: tl.constexpr):
    """The 16 elements of the 16-blocks of a tile (see `_load_slice`), Hadamard-transformed if ROTATE."""
    x0 = _load_slice(base, n0, 0, N, sn, inside, IN_BF16)
    x1 = _load_slice(base, n0, 1, N, sn, inside, IN_BF16)
    x2 = _load_slice(base, n0, 2, N, sn, inside, IN_BF16)
    x3 = _load_slice(base, n0, 3, N, sn, inside, IN_BF16)
    x4 = _load_slice(base, n0, 4, N, sn, inside, IN_BF16)
    x5 = _load_slice(base, n0, 5, N, sn, inside, IN_BF16)
    x6 = _load_slice(base, n0, 6, N, sn, inside, IN_BF16)
    x7 = _load_slice(base, n0, 7, N, sn, inside, IN_BF16)
    x8 = _load_slice(base, n0, 8, N, sn, inside, IN_BF16)
    x9 = _load_slice(base, n0, 9, N, sn, inside, IN_BF16)
    x10 = _load_slice(base, n0, 10, N, sn, inside, IN_BF16)
    x11 = _load_slice(base, n0, 11, N, sn, inside, IN_BF16)
    x12 = _load_slice(base, n0, 12, N, sn, inside, IN_BF16)
    x13 = _load_slice(base, n0, 13, N, sn, inside, IN_BF16)
    x14 = _load_slice(base, n0, 14, N, sn, inside, IN_BF16)
    x15 = _load_slice(base, n0, 15, N, sn, inside, IN_BF16)
    if ROTATE:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _fwht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGNS
        )
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """max|x| over 16 tiles, elementwise, NaN if any is NaN (explicitly: Triton's maximum need not
    propagate NaN)."""
    m, nan = _nan_to_flag(x0)
    a, f = _nan_to_flag(x1)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x2)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x3)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x4)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x5)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x6)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x7)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x8)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x9)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x10)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x11)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x12)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x13)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x14)
    m, nan = tl.maximum(m, a), nan | f
    a, f = _nan_to_flag(x15)
    m, nan = tl.maximum(m, a), nan | f
    return tl.where(nan > 0, float("nan"), m)


@triton.jit
def _nvfp4_plain_kernel(
    x_ptr, v_ptr, s_ptr, u_ptr, s_enc_ptr, P, N, Q, sxp, sxn, sxq, svp, svn, svq, ssp, ssn, ssq, sup, sun,
    suq, STOCHASTIC: tl.constexpr, OUT_FP8: tl.constexpr, IN_BF16: tl.constexpr, BP: tl.constexpr,
    NBK: tl.constexpr, BQ: tl.constexpr,
):
    """x viewed as [P, N, Q], NVFP4 16-blocks along N, one [BP, 16 * NBK, BQ] tile per program,
    zero-padded past the edges. Writes the values (float32, or E4M3 bytes) and the E4M3 block scales
    ([P, ceil(N/16), Q], as bytes); STOCHASTIC reads its uniform draws from u ([P, N, Q] strides)."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)[:, None, None]
    n = tl.program_id(1) * NBK * 16 + tl.arange(0, NBK * 16)[None, :, None]
    q = tl.program_id(2) * BQ + tl.arange(0, BQ)[None, None, :]
    inside = (p < P) & (n < N) & (q < Q)
    x = _as_float32(tl.load(x_ptr + p * sxp + n * sxn + q * sxq, mask=inside, other=0), IN_BF16)
    magnitude, nan = _nan_to_flag(tl.reshape(x, (BP, NBK, 16, BQ)))
    amax = tl.where(max_along(nan, 2) > 0, float("nan"), max_along(magnitude, 2))  # [BP, NBK, BQ]
    s_dec, enc = _nvfp4_block_scales(amax, tl.load(s_enc_ptr))
    enc = tl.reshape(tl.broadcast_to(enc[:, :, None, :], (BP, NBK, 16, BQ)), (BP, NBK * 16, BQ))
    u = 0.0
    if STOCHASTIC:
        u = tl.load(u_ptr + p * sup + n * sun + q * suq, mask=inside, other=0.0)
    value = _nvfp4_value(x, enc, u, STOCHASTIC)
    if OUT_FP8:
        tl.store(v_ptr + p * svp + n * svn + q * svq, fp8_byte(value, 3, -6).to(tl.uint8), mask=inside)
    else:
        tl.store(v_ptr + p * svp + n * svn + q * svq, value, mask=inside)
    nb = tl.program_id(1) * NBK + tl.arange(0, NBK)[None, :, None]
    tl.store(
        s_ptr + p * ssp + nb * ssn + q * ssq,
        fp8_byte(s_dec, 3, -6).to(tl.uint8),
        mask=(p < P) & (nb * 16 < N) & (q < Q),
    )


@triton.jit
def _rowwise_slice(
    x, p, n, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n, ssr_q, sur_p,
    sur_n, sur_q, STOCHASTIC: tl.constexpr, OUT_FP8: tl.constexpr, BP: tl.constexpr, NBK: tl.constexpr,
    BQ: tl.constexpr,
):
    """The plain NVFP4 copy of one slice x [BP, NBK, BQ] (rows n of a [P, N, Q] tensor) in 16-blocks
    along Q: its values into vr and its block scales ([P, N, ceil(Q/16)]) into sr."""
    inside = (p < P) & (n < N) & (q < Q)
    magnitude, nan = _nan_to_flag(tl.reshape(x, (BP, NBK, BQ // 16, 16)))
    amax = tl.where(max_along(nan, 3) > 0, float("nan"), max_along(magnitude, 3))  # [BP, NBK, BQ/16]
    s_dec, enc = _nvfp4_block_scales(amax, s_enc_r)
    enc = tl.reshape(tl.broadcast_to(enc[:, :, :, None], (BP, NBK, BQ // 16, 16)), (BP, NBK, BQ))
    _nvfp4_write(
        vr_ptr + p * svr_p + n * svr_n + q * svr_q, ur_ptr + p * sur_p + n * sur_n + q * sur_q, x, enc,
        inside, STOCHASTIC, OUT_FP8,
    )
    qb = tl.program_id(2) * (BQ // 16) + tl.arange(0, BQ // 16)[None, None, :]
    tl.store(
        sr_ptr + p * ssr_p + n * ssr_n + qb * ssr_q,
        fp8_byte(s_dec, 3, -6).to(tl.uint8),
        mask=(p < P) & (n < N) & (qb * 16 < Q),
    )


@triton.jit
def _nvfp4_rotated_kernel(
    x_ptr, v_ptr, s_ptr, u_ptr, s_enc_ptr, P, N, Q, sxp, sxn, sxq, svp, svn, svq, ssp, ssn, ssq, sup, sun,
    suq, vr_ptr, sr_ptr, ur_ptr, s_enc_r_ptr, svr_p, svr_n, svr_q, ssr_p, ssr_n, ssr_q, sur_p, sur_n, sur_q,
    SIGNS: tl.constexpr, ROWWISE: tl.constexpr, STOCHASTIC: tl.constexpr, OUT_FP8: tl.constexpr,
    IN_BF16: tl.constexpr, BP: tl.constexpr, NBK: tl.constexpr, BQ: tl.constexpr,
):
    """`_nvfp4_plain_kernel` with the Hadamard transform of each 16-block along N first: one
    [BP, 16 * NBK, BQ] tile per program, read as 16 slices (element i of every block), which the
    butterflies combine elementwise (`_fwht16`). ROWWISE: from the same read, the plain copy of x in
    16-blocks along Q (BQ a multiple of 16) into (vr, sr, draws ur) under its own S_enc (s_enc_r)."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)[:, None, None]
    n0 = (tl.program_id(1) * NBK + tl.arange(0, NBK)[None, :, None]) * 16
    q = tl.program_id(2) * BQ + tl.arange(0, BQ)[None, None, :]
    inside = (p < P) & (q < Q)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _load16(
        x_ptr + p * sxp + n0 * sxn + q * sxq, n0, N, sxn, inside, False, SIGNS, IN_BF16
    )
    if ROWWISE:
        s_enc_r = tl.load(s_enc_r_ptr)
        _rowwise_slice(
            x0, p, n0 + 0, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x1, p, n0 + 1, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x2, p, n0 + 2, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x3, p, n0 + 3, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x4, p, n0 + 4, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x5, p, n0 + 5, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x6, p, n0 + 6, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x7, p, n0 + 7, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x8, p, n0 + 8, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x9, p, n0 + 9, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x10, p, n0 + 10, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x11, p, n0 + 11, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x12, p, n0 + 12, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x13, p, n0 + 13, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x14, p, n0 + 14, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
        _rowwise_slice(
            x15, p, n0 + 15, q, P, N, Q, vr_ptr, sr_ptr, ur_ptr, s_enc_r, svr_p, svr_n, svr_q, ssr_p, ssr_n,
            ssr_q, sur_p, sur_n, sur_q, STOCHASTIC, OUT_FP8, BP, NBK, BQ,
        )
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _fwht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGNS
    )
    amax = _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    s_dec, enc = _nvfp4_block_scales(amax, tl.load(s_enc_ptr))
    tl.store(
        s_ptr + p * ssp + (n0 // 16) * ssn + q * ssq,
        fp8_byte(s_dec, 3, -6).to(tl.uint8),
        mask=inside & (n0 < N),
    )
    v_base = v_ptr + p * svp + n0 * svn + q * svq
    u_base = u_ptr + p * sup + n0 * sun + q * suq
    _store_value(v_base, u_base, x0, enc, n0, 0, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x1, enc, n0, 1, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x2, enc, n0, 2, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x3, enc, n0, 3, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x4, enc, n0, 4, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x5, enc, n0, 5, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x6, enc, n0, 6, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x7, enc, n0, 7, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x8, enc, n0, 8, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x9, enc, n0, 9, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x10, enc, n0, 10, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x11, enc, n0, 11, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x12, enc, n0, 12, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x13, enc, n0, 13, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x14, enc, n0, 14, N, svn, sun, inside, STOCHASTIC, OUT_FP8)
    _store_value(v_base, u_base, x15, enc, n0, 15, N, svn, sun, inside, STOCHASTIC, OUT_FP8)


@triton.jit
def _tile_amax(magnitude, nan):
    """max over a 3-D tile of |x| (NaN as 0) and of its NaN flags: the tile's amax, NaN if any."""
    amax = max_along(max_along(max_along(magnitude, 2), 1), 0)
    any_nan = max_along(max_along(max_along(nan, 2), 1), 0)
    return tl.where(any_nan > 0, float("nan"), amax)


@triton.jit
def _amax_kernel(
    x_ptr, out_ptr, out_plain_ptr, P, N, Q, sxp, sxn, sxq, ROTATE: tl.constexpr, PLAIN_TOO: tl.constexpr,
    SIGNS: tl.constexpr, BP: tl.constexpr, NBK: tl.constexpr, BQ: tl.constexpr, IN_BF16: tl.constexpr,
):
    """One partial max|x| per program (NaN if its tile holds one) of x viewed as [P, N, Q], of the
    Hadamard-transformed tensor (16-blocks along N) if ROTATE, and with PLAIN_TOO that of x itself
    too (into out_plain), from the same read; the caller reduces the partials."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)[:, None, None]
    q = tl.program_id(2) * BQ + tl.arange(0, BQ)[None, None, :]
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    if ROTATE:
        n0 = (tl.program_id(1) * NBK + tl.arange(0, NBK)[None, :, None]) * 16
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _load16(
            x_ptr + p * sxp + n0 * sxn + q * sxq, n0, N, sxn, (p < P) & (q < Q), False, SIGNS, IN_BF16
        )
        if PLAIN_TOO:
            magnitude, nan = _nan_to_flag(
                _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
            )
            tl.store(out_plain_ptr + pid, _tile_amax(magnitude, nan))
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _fwht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGNS
        )
        magnitude, nan = _nan_to_flag(
            _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        )
    else:
        n = tl.program_id(1) * NBK * 16 + tl.arange(0, NBK * 16)[None, :, None]
        inside = (p < P) & (n < N) & (q < Q)
        magnitude, nan = _nan_to_flag(
            _as_float32(tl.load(x_ptr + p * sxp + n * sxn + q * sxq, mask=inside, other=0), IN_BF16)
        )
    tl.store(out_ptr + pid, _tile_amax(magnitude, nan))


@triton.jit
def _nvfp4_write(v_ptr, u_ptr, x, enc, inside, STOCHASTIC: tl.constexpr, OUT_FP8: tl.constexpr):
    """Values of a tile (x and its per-element enc) stored as float32 or (OUT_FP8) E4M3 bytes; the
    STOCHASTIC draws read from u_ptr (the same offsets' pointers into the draws)."""
    u = 0.0
    if STOCHASTIC:
        u = tl.load(u_ptr, mask=inside, other=0.0)
    value = _nvfp4_value(x, enc, u, STOCHASTIC)
    if OUT_FP8:
        tl.store(v_ptr, fp8_byte(value, 3, -6).to(tl.uint8), mask=inside)
    else:
        tl.store(v_ptr, value, mask=inside)


@triton.jit
def _nvfp4_matrix_kernel(
    x_ptr, vr_ptr, sr_ptr, ur_ptr, vc_ptr, sc_ptr, uc_ptr, s_enc_ptr, R, C, sxr, sxc, svr_r, svr_c, ssr_r,
    ssr_c, sur_r, sur_c, svc_r, svc_c, ssc_r, ssc_c, suc_r, suc_c, ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr, TWO_D: tl.constexpr, STOCHASTIC: tl.constexpr, OUT_FP8: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, IN_BF16: tl.constexpr,
):
    """A 2-D x [R, C] in NVFP4, one [BR, BC] tile per program (multiples of 16), read once, one
    per-tensor scale: ROWWISE 1x16 blocks (along C) into (vr, sr [R, ceil(C/16)], draws ur);
    COLUMNWISE 16x1 blocks (along R) into (vc, sc [ceil(R/16), C], draws uc); TWO_D 16x16 blocks into
    (vr, sr [ceil(R/16), ceil(C/16)], draws ur). Values float32 or E4M3 bytes, scales E4M3 bytes."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    inside = (r < R) & (c < C)
    x = _as_float32(tl.load(x_ptr + r * sxr + c * sxc, mask=inside, other=0), IN_BF16)
    s_enc = tl.load(s_enc_ptr)
    rb = tl.program_id(0) * (BR // 16) + tl.arange(0, BR // 16)[:, None]
    cb = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)[None, :]
    if ROWWISE:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR, BC // 16, 16)))
        amax = tl.where(max_along(nan, 2) > 0, float("nan"), max_along(magnitude, 2))  # [BR, BC/16]
        s_dec, enc = _nvfp4_block_scales(amax, s_enc)
        enc = tl.reshape(tl.broadcast_to(enc[:, :, None], (BR, BC // 16, 16)), (BR, BC))
        _nvfp4_write(
            vr_ptr + r * svr_r + c * svr_c, ur_ptr + r * sur_r + c * sur_c, x, enc, inside, STOCHASTIC,
            OUT_FP8,
        )
        tl.store(
            sr_ptr + r * ssr_r + cb * ssr_c,
            fp8_byte(s_dec, 3, -6).to(tl.uint8),
            mask=(r < R) & (cb * 16 < C),
        )
    if COLUMNWISE:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR // 16, 16, BC)))
        amax = tl.where(max_along(nan, 1) > 0, float("nan"), max_along(magnitude, 1))  # [BR/16, BC]
        s_dec, enc = _nvfp4_block_scales(amax, s_enc)
        enc = tl.reshape(tl.broadcast_to(enc[:, None, :], (BR // 16, 16, BC)), (BR, BC))
        _nvfp4_write(
            vc_ptr + r * svc_r + c * svc_c, uc_ptr + r * suc_r + c * suc_c, x, enc, inside, STOCHASTIC,
            OUT_FP8,
        )
        tl.store(
            sc_ptr + rb * ssc_r + c * ssc_c,
            fp8_byte(s_dec, 3, -6).to(tl.uint8),
            mask=(rb * 16 < R) & (c < C),
        )
    if TWO_D:
        magnitude, nan = _nan_to_flag(tl.reshape(x, (BR // 16, 16, BC // 16, 16)))
        any_nan = max_along(max_along(nan, 3), 1)
        amax = tl.where(any_nan > 0, float("nan"), max_along(max_along(magnitude, 3), 1))
        s_dec, enc = _nvfp4_block_scales(amax, s_enc)  # [BR/16, BC/16]
        enc = tl.reshape(tl.broadcast_to(enc[:, None, :, None], (BR // 16, 16, BC // 16, 16)), (BR, BC))
        _nvfp4_write(
            vr_ptr + r * svr_r + c * svr_c, ur_ptr + r * sur_r + c * sur_c, x, enc, inside, STOCHASTIC,
            OUT_FP8,
        )
        tl.store(
            sr_ptr + rb * ssr_r + cb * ssr_c,
            fp8_byte(s_dec, 3, -6).to(tl.uint8),
            mask=(rb * 16 < R) & (cb * 16 < C),
        )
# fmt: on


# ---- launch helpers ------------------------------------------------------------------------------------

# Elements per program: Triton's interpreter (CPU tensors) runs each program as numpy code, so few
# large tiles run fastest there; a GPU wants tiles that fit its registers.
_TILE_INTERPRETED = 1 << 20
_TILE_DEVICE = 1 << 12


def _tile_elements(x: torch.Tensor) -> int:
    return _TILE_DEVICE if x.device.type == "cuda" else _TILE_INTERPRETED


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: float32, bfloat16 and float16 as they are (upcast exactly in the
    kernel); other dtypes through float32 first, as the torch path's `x.float()` does."""
    return x if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else x.float()


def _readable(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels are handed it: bf16 as its int16 bits (see `_as_float32`)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _check_block(block: int) -> None:
    if block <= 0 or block & (block - 1):
        raise ValueError(f"the Triton kernels take power-of-2 block sizes, got {block}: use microscaling.py")


def _blocks_3d(x: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """(P, N, Q): x viewed as [P, N, Q] with `dim` as N."""
    shape = x.shape
    p = 1
    for s in shape[:dim]:
        p *= s
    q = 1
    for s in shape[dim + 1 :]:
        q *= s
    return p, shape[dim], q


def _tiles_3d(x: torch.Tensor, p: int, n: int, q: int, block: int) -> tuple[int, int, int]:
    """(BP, BN, BQ) of a [P, N, Q] kernel: along N a multiple of the block; the tile spreads over N and
    P when Q is 1 (blocks along the contiguous dimension), else over Q first."""
    tile = _tile_elements(x)
    if q == 1:
        bn = max(block, min(_pow2_at_least(n), 128 if x.device.type == "cuda" else tile))
        return max(1, min(_pow2_at_least(p), tile // bn)), bn, 1
    bq = max(1, min(_pow2_at_least(q), tile // block))
    bn = max(block, min(_pow2_at_least(n), tile // bq))
    return max(1, min(_pow2_at_least(p), tile // (bn * bq))), bn, bq


def _moved_empty(x: torch.Tensor, dim: int, last: int, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of x's shape with dim's size `last`, stored with `dim` last (contiguous): the
    layout `microscaling._unblock_1d` gives values and `scales.movedim(-1, dim)` gives scales."""
    shape = list(x.shape)
    moved = shape[:dim] + shape[dim + 1 :] + [last]
    return torch.empty(moved, dtype=dtype, device=x.device).movedim(-1, dim)


# ---- MXFP8 ---------------------------------------------------------------------------------------------


def mx_quantize(
    x: torch.Tensor, dim: int, block: int = MX_BLOCK, encoding: str = "e4m3", two_d: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`microscaling.mx_quantize` in one pass: (FP8 values of x's shape, E8M0 scales as uint8; x's shape
    with dim's size ceil(n / block), or [ceil(R/b), ceil(C/b)] with `two_d`), bit for bit. Values and
    scales are laid out as the torch path lays them out (with `dim` innermost in memory), except that a
    partial last block leaves no padding in the values' rows. `block` must be a power of 2."""
    if encoding not in _FP8:
        raise ValueError(f"MX encoding {encoding!r} is not one of {sorted(_FP8)}")
    _check_block(block)
    limit, mant, min_exp = _FP8[encoding]
    xf = _as_float(x.detach())
    if two_d:
        if xf.dim() != 2:
            raise ValueError(f"2D blocks need a 2-D tensor, got shape {tuple(x.shape)}")
        values, scales, _, _ = _mx_matrix(xf, encoding, block, rowwise=False, columnwise=False, two_d=True)
        return values, scales
    dim = dim % xf.dim()
    p, n, q = _blocks_3d(xf, dim)
    nb = -(-n // block)
    values = _moved_empty(xf, dim, n, torch.uint8)
    scales = _moved_empty(xf, dim, nb, torch.uint8)
    if xf.numel():
        x3, v3, s3 = xf.reshape(p, n, q), values.view(p, n, q), scales.view(p, nb, q)
        bp, bn, bq = _tiles_3d(xf, p, n, q, block)
        grid = (triton.cdiv(p, bp), triton.cdiv(n, bn), triton.cdiv(q, bq))
        _mx_blocks_kernel[grid](
            _readable(x3), v3, s3, p, n, q, *x3.stride(), *v3.stride(), *s3.stride(),
            LIMIT=limit, MANT=mant, MIN_EXP=min_exp, B=block, BP=bp, BN=bn, BQ=bq,
            IN_BF16=x3.dtype == torch.bfloat16,
        **_OPTIONS,
        )  # fmt: skip
    return values.view(_FP8_DTYPES[encoding]), scales


def mx_quantize_both(
    x: torch.Tensor, encoding: str = "e4m3", block: int = MX_BLOCK
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The row-wise (1 x block, along dim 1) and the column-wise (block x 1, along dim 0) MX copies of
    a 2-D x from one read: equal to (mx_quantize(x, 1, ...), mx_quantize(x, 0, ...)), layouts
    included (the column-wise values are stored transposed, dim 0 innermost: the K-major operand of
    the GEMM that reduces over the rows)."""
    if encoding not in _FP8:
        raise ValueError(f"MX encoding {encoding!r} is not one of {sorted(_FP8)}")
    _check_block(block)
    xf = _as_float(x.detach())
    if xf.dim() != 2:
        raise ValueError(f"mx_quantize_both takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, row_scales, columns, column_scales = _mx_matrix(xf, encoding, block, True, True, False)
    return (rows, row_scales), (columns, column_scales)


def _mx_matrix(xf: torch.Tensor, encoding: str, block: int, rowwise: bool, columnwise: bool, two_d: bool):
    limit, mant, min_exp = _FP8[encoding]
    r, c = xf.shape
    rb, cb = -(-r // block), -(-c // block)
    if two_d:
        vr = torch.empty(r, c, dtype=torch.uint8, device=xf.device)
        sr = torch.empty(rb, cb, dtype=torch.uint8, device=xf.device)
    else:
        vr, sr = _moved_empty(xf, 1, c, torch.uint8), _moved_empty(xf, 1, cb, torch.uint8)
    vc, sc = vr, sr  # unwritten unless columnwise
    if columnwise:
        vc, sc = _moved_empty(xf, 0, r, torch.uint8), _moved_empty(xf, 0, rb, torch.uint8)
    if xf.numel():
        side = max(block, _pow2_at_least(int(_tile_elements(xf) ** 0.5)))
        br = max(block, min(side, _pow2_at_least(r)))
        bc = max(block, min(_tile_elements(xf) // br, _pow2_at_least(c)))
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _mx_matrix_kernel[grid](
            _readable(xf), vr, sr, vc, sc, r, c,
            *xf.stride(), *vr.stride(), *sr.stride(), *vc.stride(), *sc.stride(),
            LIMIT=limit, MANT=mant, MIN_EXP=min_exp, B=block, BR=br, BC=bc,
            ROWWISE=rowwise, COLUMNWISE=columnwise, TWO_D=two_d, IN_BF16=xf.dtype == torch.bfloat16,
        **_OPTIONS,
        )  # fmt: skip
    dtype = _FP8_DTYPES[encoding]
    return vr.view(dtype), sr, vc.view(dtype), sc


# ---- NVFP4 ---------------------------------------------------------------------------------------------

_VALUE_DTYPES = (torch.float32, torch.float8_e4m3fn)
# the row-wise copy's arguments of `_nvfp4_rotated_kernel`
_ROWWISE_ARGS = tuple(
    "vr_ptr sr_ptr ur_ptr s_enc_r_ptr svr_p svr_n svr_q ssr_p ssr_n ssr_q sur_p sur_n sur_q".split()
)


def _signs_mask(signs: tuple[int, ...]) -> int:
    """The RHT signs as a 16-bit constant: bit i set where sign i is -1."""
    if len(signs) != NVFP4_BLOCK or any(s not in (1, -1) for s in signs):
        raise ValueError(f"the Triton RHT takes {NVFP4_BLOCK} signs of +-1, got {tuple(signs)}")
    return sum(1 << i for i, s in enumerate(signs) if s == -1)


def _check_rotatable(x: torch.Tensor, dim: int) -> None:
    if x.shape[dim] % NVFP4_BLOCK:
        raise ValueError(
            f"the Hadamard transform works in blocks of {NVFP4_BLOCK}; dimension {dim} has {x.shape[dim]}"
        )


def nvfp4_amax(x: torch.Tensor, dim: int = -1, signs: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """max|x| (float32, 0-d; NaN if x holds one; 0 for an empty x) in one read, of x itself or, with
    `signs`, of `random_hadamard_transform(x, signs, dim)` (computed in the kernel's butterfly order,
    see `nvfp4_quantize_rotated`): the global amax `nvfp4_quantize` starts from."""
    xf = _as_float(x.detach())
    if xf.numel() == 0:
        return torch.zeros((), device=xf.device)
    dim = dim % xf.dim()
    if signs is not None:
        _check_rotatable(xf, dim)
    p, n, q = _blocks_3d(xf, dim)
    x3 = xf.reshape(p, n, q)
    bp, bn, bq = _tiles_3d(xf, p, n, q, NVFP4_BLOCK)
    grid = (triton.cdiv(p, bp), triton.cdiv(n, bn), triton.cdiv(q, bq))
    partials = torch.empty(grid[0] * grid[1] * grid[2], device=xf.device)
    _amax_kernel[grid](
        _readable(x3), partials, partials, p, n, q, *x3.stride(), ROTATE=signs is not None, PLAIN_TOO=False,
        SIGNS=0 if signs is None else _signs_mask(signs), BP=bp, NBK=bn // NVFP4_BLOCK, BQ=bq,
        IN_BF16=x3.dtype == torch.bfloat16,
        **_OPTIONS,
    )  # fmt: skip
    return partials.amax()


def nvfp4_quantize(
    x: torch.Tensor,
    dim: int,
    global_amax: Optional[Amax] = None,
    two_d: bool = False,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    values_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`microscaling.nvfp4_quantize` in one pass over x (two without `global_amax`: the amax first):
    (values of x's shape, E4M3 block scales, S_enc), bit for bit. `values_dtype` float32 (the torch
    function's) or float8_e4m3fn (what the NVFP4 operand stores: every E2M1 value is an E4M3 value; a
    quarter of the bytes). Stochastic rounding draws its uniforms with torch.rand exactly as the torch
    path does (same shape, generator and order), and the kernel reads them: one more read."""
    return _nvfp4(x, dim, global_amax, two_d, stochastic, generator, values_dtype, None)


def nvfp4_quantize_rotated(
    x: torch.Tensor,
    dim: int,
    signs: tuple[int, ...] = RHT_SIGNS,
    global_amax: Optional[Amax] = None,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    values_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nvfp4_quantize(random_hadamard_transform(x.float(), signs, dim), dim, ...)` with the transform in
    the kernel (16-blocks along `dim`, a multiple of 16, else ValueError): nothing transformed is
    written. Bit for bit: the transform's 16-term sums are added in a fixed butterfly order
    (`_fwht16`), the torch path's (`microscaling._butterfly_transform`)."""
    return _nvfp4(x, dim, global_amax, False, stochastic, generator, values_dtype, tuple(signs))


def nvfp4_quantize_both(
    x: torch.Tensor,
    global_amax: Optional[Amax] = None,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    values_dtype: torch.dtype = torch.float32,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The row-wise (1x16, along dim 1) and the column-wise (16x1, along dim 0) NVFP4 copies of a 2-D x
    without Hadamard transform, from one read after the amax's: equal to (nvfp4_quantize(x, 1, ...),
    nvfp4_quantize(x, 0, ...)) called in that order (stochastic draws included), layouts included.
    For the recipe's weights with `disable_2d_quantization`, and its inputs and gradients with
    `disable_rht` (with the RHT, the column-wise copy is `nvfp4_quantize_rotated`'s)."""
    if values_dtype not in _VALUE_DTYPES:
        raise ValueError(f"NVFP4 values_dtype is one of {_VALUE_DTYPES}, got {values_dtype}")
    xf = _as_float(x.detach())
    if xf.dim() != 2:
        raise ValueError(f"nvfp4_quantize_both takes a 2-D tensor, got shape {tuple(x.shape)}")
    out_fp8 = values_dtype == torch.float8_e4m3fn
    s_enc = nvfp4_tensor_scale(nvfp4_amax(xf) if global_amax is None else global_amax).to(xf.device)
    stored = torch.uint8 if out_fp8 else torch.float32
    rows, columns = _nvfp4_matrix(xf, s_enc, stochastic, generator, stored, out_fp8, True, True, False)
    return tuple(
        ((v.view(torch.float8_e4m3fn) if out_fp8 else v), s.view(torch.float8_e4m3fn), s_enc)
        for v, s in (rows, columns)
    )


def nvfp4_quantize_both_rotated(
    x: torch.Tensor,
    signs: tuple[int, ...] = RHT_SIGNS,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    values_dtype: torch.dtype = torch.float32,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The two NVFP4 copies the recipe makes of an input or output gradient x [tokens, features] with
    the RHT: the row-wise copy (1x16 along dim 1, plain) and the column-wise one (16x1 along dim 0, the
    tokens, Hadamard-transformed), equal to (nvfp4_quantize(x, 1, ...), nvfp4_quantize_rotated(x, 0,
    signs, ...)) called in that order (stochastic draws included), each with its own per-tensor amax.
    Two reads: one amax pass computing both amaxes, one pass writing both copies. The token count must
    be a multiple of 16 (ValueError; the recipe does not rotate otherwise: use nvfp4_quantize_both)."""
    if values_dtype not in _VALUE_DTYPES:
        raise ValueError(f"NVFP4 values_dtype is one of {_VALUE_DTYPES}, got {values_dtype}")
    xf = _as_float(x.detach())
    if xf.dim() != 2:
        raise ValueError(f"nvfp4_quantize_both_rotated takes a 2-D tensor, got shape {tuple(x.shape)}")
    _check_rotatable(xf, 0)
    out_fp8, signs_mask = values_dtype == torch.float8_e4m3fn, _signs_mask(tuple(signs))
    stored = torch.uint8 if out_fp8 else torch.float32
    r, c = xf.shape
    rb, cb = r // NVFP4_BLOCK, -(-c // NVFP4_BLOCK)
    vr, sr = _moved_empty(xf, 1, c, stored), _moved_empty(xf, 1, cb, torch.uint8)
    vc, sc = _moved_empty(xf, 0, r, stored), _moved_empty(xf, 0, rb, torch.uint8)
    ur = uc = xf  # unread without stochastic rounding
    if stochastic:  # the torch path's draws, row-wise copy first
        ur = torch.rand(r, cb, NVFP4_BLOCK, generator=generator, device=xf.device).flatten(-2)[:, :c]
        uc = torch.rand(c, rb, NVFP4_BLOCK, generator=generator, device=xf.device).flatten(-2).t()
    s_enc_r = s_enc_c = torch.ones((), device=xf.device)
    if xf.numel():
        x3 = xf.view(1, r, c)
        bp, bn, bq = _tiles_3d(xf, 1, r, c, NVFP4_BLOCK)
        bq = max(bq, NVFP4_BLOCK)  # whole row-wise blocks in a tile
        grid = (1, triton.cdiv(r, bn), triton.cdiv(c, bq))
        partials = torch.empty(2, grid[1] * grid[2], device=xf.device)
        _amax_kernel[grid](
            _readable(x3), partials[0], partials[1], 1, r, c, *x3.stride(), ROTATE=True, PLAIN_TOO=True,
            SIGNS=signs_mask, BP=1, NBK=bn // NVFP4_BLOCK, BQ=bq, IN_BF16=x3.dtype == torch.bfloat16,
            **_OPTIONS,
        )  # fmt: skip
        s_enc_c, s_enc_r = (nvfp4_tensor_scale(amax) for amax in partials.amax(dim=1))
        rows = (vr.view(1, r, c), sr.view(1, r, cb), ur.view(1, r, c), s_enc_r.reshape(1))
        _nvfp4_rotated_kernel[grid](
            _readable(x3), vc.view(1, r, c), sc.view(1, rb, c), uc.view(1, r, c), s_enc_c.reshape(1), 1, r, c,
            *x3.stride(), *vc.view(1, r, c).stride(), *sc.view(1, rb, c).stride(), *uc.view(1, r, c).stride(),
            **dict(zip(_ROWWISE_ARGS, (*rows, *rows[0].stride(), *rows[1].stride(), *rows[2].stride()))),
            SIGNS=signs_mask, ROWWISE=True, STOCHASTIC=stochastic, OUT_FP8=out_fp8,
            IN_BF16=x3.dtype == torch.bfloat16, BP=1, NBK=bn // NVFP4_BLOCK, BQ=bq, **_OPTIONS,
        )  # fmt: skip
    return tuple(
        ((v.view(torch.float8_e4m3fn) if out_fp8 else v), s.view(torch.float8_e4m3fn), s_enc)
        for v, s, s_enc in ((vr, sr, s_enc_r), (vc, sc, s_enc_c))
    )


def _nvfp4(x, dim, global_amax, two_d, stochastic, generator, values_dtype, signs):
    if values_dtype not in _VALUE_DTYPES:
        raise ValueError(f"NVFP4 values_dtype is one of {_VALUE_DTYPES}, got {values_dtype}")
    out_fp8 = values_dtype == torch.float8_e4m3fn
    xf = _as_float(x.detach())
    if two_d and xf.dim() != 2:
        raise ValueError(f"2D blocks need a 2-D tensor, got shape {tuple(x.shape)}")
    if not two_d:
        dim = dim % xf.dim()
        if signs is not None:
            _check_rotatable(xf, dim)
    if global_amax is None:
        global_amax = nvfp4_amax(xf, dim, signs)
    s_enc = nvfp4_tensor_scale(global_amax).to(xf.device)
    stored = torch.uint8 if out_fp8 else torch.float32
    if two_d:
        (values, scales), _ = _nvfp4_matrix(
            xf, s_enc, stochastic, generator, stored, out_fp8, False, False, True
        )
    else:
        values, scales = _nvfp4_blocks(xf, dim, s_enc, stochastic, generator, stored, out_fp8, signs)
    return (values.view(torch.float8_e4m3fn) if out_fp8 else values), scales.view(torch.float8_e4m3fn), s_enc


def _nvfp4_blocks(xf, dim, s_enc, stochastic, generator, stored, out_fp8, signs):
    p, n, q = _blocks_3d(xf, dim)
    nb = -(-n // NVFP4_BLOCK)
    values = _moved_empty(xf, dim, n, stored)
    scales = _moved_empty(xf, dim, nb, torch.uint8)
    if xf.numel() == 0:
        return values, scales
    x3, v3, s3 = xf.reshape(p, n, q), values.view(p, n, q), scales.view(p, nb, q)
    u3 = x3  # unread without stochastic rounding
    if stochastic:  # the torch path's draw: torch.rand of the zero-padded blocks [..., nb, 16], dim last
        moved = list(xf.shape[:dim]) + list(xf.shape[dim + 1 :]) + [nb, NVFP4_BLOCK]
        u = torch.rand(moved, generator=generator, device=xf.device)
        u3 = u.flatten(-2)[..., :n].movedim(-1, dim).reshape(p, n, q)
    bp, bn, bq = _tiles_3d(xf, p, n, q, NVFP4_BLOCK)
    grid = (triton.cdiv(p, bp), triton.cdiv(n, bn), triton.cdiv(q, bq))
    kernel, rotation = _nvfp4_plain_kernel, {}
    if signs is not None:  # no row-wise copy: its arguments are placeholders
        kernel = _nvfp4_rotated_kernel
        rotation = {"SIGNS": _signs_mask(signs), "ROWWISE": False}
        rotation.update(
            zip(_ROWWISE_ARGS, (v3, s3, u3, s_enc.reshape(1), *v3.stride(), *s3.stride(), *u3.stride()))
        )
    kernel[grid](
        _readable(x3), v3, s3, u3, s_enc.reshape(1), p, n, q,
        *x3.stride(), *v3.stride(), *s3.stride(), *u3.stride(), **rotation,
        STOCHASTIC=stochastic, OUT_FP8=out_fp8, BP=bp, NBK=bn // NVFP4_BLOCK, BQ=bq,
        IN_BF16=x3.dtype == torch.bfloat16,
        **_OPTIONS,
    )  # fmt: skip
    return values, scales


def _nvfp4_matrix(xf, s_enc, stochastic, generator, stored, out_fp8, rowwise, columnwise, two_d):
    """The outputs of `_nvfp4_matrix_kernel` ((row-wise or 16x16 values, scales), (column-wise values,
    scales) or None), the draws made as the torch path makes them, in its order (row-wise first)."""
    r, c = xf.shape
    rb, cb = -(-r // NVFP4_BLOCK), -(-c // NVFP4_BLOCK)
    outputs, draws = [], []
    if two_d:
        outputs.append((torch.empty(r, c, dtype=stored, device=xf.device),
                        torch.empty(rb, cb, dtype=torch.uint8, device=xf.device)))  # fmt: skip
        if stochastic:  # [R/16, 16, C/16, 16] of the zero-padded x
            u = torch.rand(rb, NVFP4_BLOCK, cb, NVFP4_BLOCK, generator=generator, device=xf.device)
            draws.append(u.view(rb * NVFP4_BLOCK, cb * NVFP4_BLOCK)[:r, :c])
    for dim, wanted in ((1, rowwise), (0, columnwise)):
        if not wanted:
            continue
        n, nb = xf.shape[dim], (rb, cb)[dim]
        outputs.append((_moved_empty(xf, dim, n, stored), _moved_empty(xf, dim, nb, torch.uint8)))
        if stochastic:  # [other, nb, 16] of the zero-padded x with dim last
            u = torch.rand(xf.shape[1 - dim], nb, NVFP4_BLOCK, generator=generator, device=xf.device)
            draws.append(u.flatten(-2)[:, :n].movedim(-1, dim))
    (vr, sr), (vc, sc) = outputs[0], outputs[-1]
    ur, uc = (draws[0], draws[-1]) if stochastic else (xf, xf)  # unread without stochastic rounding
    if xf.numel():
        side = _pow2_at_least(int(_tile_elements(xf) ** 0.5))
        br = max(NVFP4_BLOCK, min(side, _pow2_at_least(r)))
        bc = max(NVFP4_BLOCK, min(_tile_elements(xf) // br, _pow2_at_least(c)))
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _nvfp4_matrix_kernel[grid](
            _readable(xf), vr, sr, ur, vc, sc, uc, s_enc.reshape(1), r, c, *xf.stride(),
            *vr.stride(), *sr.stride(), *ur.stride(), *vc.stride(), *sc.stride(), *uc.stride(),
            ROWWISE=rowwise, COLUMNWISE=columnwise, TWO_D=two_d, STOCHASTIC=stochastic, OUT_FP8=out_fp8,
            BR=br, BC=bc, IN_BF16=xf.dtype == torch.bfloat16, **_OPTIONS,
        )  # fmt: skip
    return outputs[0], (outputs[1] if len(outputs) > 1 else None)
