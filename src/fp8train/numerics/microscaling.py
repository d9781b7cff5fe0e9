"""Microscaling formats: the pure quantization arithmetic of MXFP8 and NVFP4. docs/design.md, section 13.

MXFP8 (OCP MX): blocks of 32 consecutive values along the GEMM's reduction dimension (or 32x32 weight
blocks), E4M3 (or E5M2) values, one E8M0 scale per block: a power of two, the block's amax / fp8_max
rounded up (TransformerEngine's rule, not the OCP "floor" rule), so no value is clipped beyond
float32's rounding of that quotient (the OCP rule clips the top of the block).
NVFP4: blocks of 16 (or 16x16 weight blocks), E2M1 values, an E4M3 block scale under one float32
per-tensor scale; a 16-point random Hadamard transform for the weight-gradient operands, and
stochastic rounding for gradients.

Pure functions on tensors (any device, no state), all arithmetic in float32 with each rounding named:
the emulated GEMM `microscaled_mm` and the tests rely on knowing exactly where rounding happens.
The inverses (dequantizers, unpacking, the inverse transform, unswizzling) are test oracles only and
live in tests/inverses.py.
A last block along a dimension that is not a multiple of the block size is partial: its scale comes
from its own elements, exactly as if the tensor were padded with zeros (TransformerEngine refuses such
shapes for MXFP8; its NVFP4 reference pads with zeros).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = [
    "MX_BLOCK", "NVFP4_BLOCK", "E2M1_MAX", "E2M1_VALUES", "RHT_SIGNS", "RHT_SEED",
    "e8m0_scale", "e8m0_to_float", "mx_quantize",
    "e2m1_round", "pack_e2m1",
    "nvfp4_tensor_scale", "nvfp4_quantize",
    "hadamard_matrix", "random_hadamard_transform",
    "rowwise_scales", "microscaled_mm", "swizzle_scales", "float32_matmul", "SWIZZLE_TILE",
]  # fmt: skip

MX_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLOAT32_MAX = torch.finfo(torch.float32).max
# the E2M1 magnitudes, indexed by their 3-bit code (sign is bit 3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MX_ENCODINGS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}

# The RHT's fixed random signs: torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(RHT_SEED))
# * 2 - 1, written out so that no torch version or device can change them (tests/recipes/test_microscaling.py
# draws them again).
RHT_SEED = 2024
RHT_SIGNS = (-1, -1, -1, -1, 1, -1, -1, 1, 1, 1, 1, -1, 1, -1, -1, -1)

Amax = Union[torch.Tensor, float]


# ---- exact float32 matmuls --------------------------------------------------------------------


def float32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of float32 tensors in float32, which the emulated GEMMs and the Hadamard transform argue
    their exactness in: autocast off, and torch's fp32 matmul precision "highest" (no TF32 on CUDA,
    no bf16 inside oneDNN) whatever the training script set, restored after. Traced code
    (torch.compile) keeps the autocast guard only: dynamo cannot trace the precision switch, so a
    compiled graph follows the script's setting (docs/design.md, section 13)."""
    device_type = a.device.type
    if device_type not in ("cpu", "cuda"):
        return a @ b
    if torch.compiler.is_compiling():
        with torch.autocast(device_type, enabled=False):
            return a @ b
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device_type, enabled=False):
            return a @ b
    finally:
        torch.set_float32_matmul_precision(precision)


# ---- blocks ------------------------------------------------------------------------------------


def _blocks_1d(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """x (float32) with `dim` moved last, zero-padded to a multiple of `block`, as [..., nb, block]."""
    moved = x.movedim(dim, -1)
    pad = -moved.shape[-1] % block
    padded = F.pad(moved, (0, pad)) if pad else moved.contiguous()  # copied only where needed
    return padded.unflatten(-1, (padded.shape[-1] // block, block))


def _unblock_1d(blocks: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return blocks.flatten(-2)[..., :n].movedim(-1, dim)


def _blocks_2d(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [R, C] (float32) zero-padded to multiples of `block`, as [R/block, block, C/block, block]."""
    if x.dim() != 2:
        raise ValueError(f"2D blocks need a 2-D tensor, got shape {tuple(x.shape)}")
    pad = (0, -x.shape[1] % block, 0, -x.shape[0] % block)
    padded = F.pad(x, pad) if any(pad) else x.contiguous()  # copied only where needed
    r, c = padded.shape
    return padded.view(r // block, block, c // block, block)


def _block_amax(blocks: torch.Tensor, two_d: bool) -> torch.Tensor:
    """max|x| per block (+0.0 for a zero block), NaN if the block holds a NaN (torch's max
    reductions propagate NaN). Blocks along one dimension: the max and the min along the contiguous
    dimension, two reductions without the temporary |x| (faster on CPU, as 2-D blocks are not)."""
    if two_d:
        return blocks.abs().amax(dim=(1, 3))
    return torch.maximum(blocks.amax(-1), blocks.amin(-1).neg()).abs_()


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| in one pass (aminmax) without the temporary |x|; NaN propagates."""
    low, high = torch.aminmax(x)
    return torch.maximum(high, low.neg()).abs_()


def _per_block(t: torch.Tensor, two_d: bool) -> torch.Tensor:
    """A per-block tensor shaped to broadcast against its blocks."""
    return t[:, None, :, None] if two_d else t.unsqueeze(-1)


def _true_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """float32 a / b (b = 6, 448 or 57344) correctly rounded, eager and compiled alike. Inductor on
    GPUs turns a division by any constant (a Python number, a constant-filled tensor) into a
    multiplication by its rounded reciprocal, which misses the correctly rounded quotient in about
    half the cases. So the quotient is taken in float64 and rounded once to float32: correctly
    rounded as an fp64 division (53 >= 2 x 24 + 2 bits: double rounding is innocuous), and as an fp64
    multiplication by 1/b too, because its error (2**-52) is far below the distance of a / b from any
    float32 rounding midpoint (b's odd part is 3 or 7: at least 2**-28 relative, for normal
    quotients; subnormal ones only choose between E8M0 bytes 0 and 1, and are 0 in E4M3)."""
    return (a.double() / b).float()


# ---- MXFP8 ---------------------------------------------------------------------------------------


def e8m0_scale(amax: torch.Tensor, encoding: str = "e4m3") -> torch.Tensor:
    """The E8M0 scale (uint8, bias 127) of blocks with this amax: amax / fp8_max rounded up to a power
    of two, saturating at 2**127 (TransformerEngine's `float_to_e8m0`; torchao's RCEIL mode).

    Exact: `amax / fp8_max` is one correctly rounded float32 division; the rounding up is read off its
    bits (exponent field, plus one when any mantissa bit is set), not from a float log2, which rounds
    2**k * (1 + 2**-23) down to k. Subnormal quotients round up too: at most 2**-127 (including 0) is
    byte 0, above it byte 1. NaN is 255 (the E8M0 NaN); +inf is 254 (2**127, saturated)."""
    descale = _true_div(amax.float(), _MX_ENCODINGS[encoding][1])
    bits = descale.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    biased = exponent + round_up.to(torch.int32)
    biased = torch.where(torch.isinf(descale), 254, biased)
    return torch.where(torch.isnan(descale), 255, biased).to(torch.uint8)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent (integer tensor in [-149, 127]) as exact float32, built from float64 bits."""
    bits = (exponent.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64).to(torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """The decode value 2**(byte - 127) of E8M0 scales, float32 (exact: 2**-127 is a float32
    subnormal, 2**127 is normal); 255 is NaN."""
    value = _pow2(scales.to(torch.int32) - 127)
    return torch.where(scales == 255, float("nan"), value)


def _mx_encode_multiplier(scales: torch.Tensor) -> torch.Tensor:
    """What values are multiplied by before the cast: 2**(127 - byte), except 1 for byte 0 (as TE's
    `exp2f_rcp` and torchao's RCEIL mode do) and NaN for 255. Byte 0 means amax <= fp8_max * 2**-127
    (2.6e-36 for E4M3): multiplied by 1, such values round to FP8 zero, where 2**127 would have kept
    them. Following TE here keeps the values bit-identical to TE's and torchao's."""
    multiplier = _pow2(127 - scales.to(torch.int32).clamp(max=254))
    multiplier = torch.where(scales == 0, 1.0, multiplier)
    return torch.where(scales == 255, float("nan"), multiplier)


def mx_quantize(
    x: torch.Tensor, dim: int, block: int = MX_BLOCK, encoding: str = "e4m3", two_d: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantization of `x` in blocks of `block` consecutive elements along `dim` (the GEMM's
    reduction dimension), or in block x block squares of a 2-D `x` with `two_d` (`dim` is then unused:
    the same blocks serve x and x.T). Returns the FP8 values (x's shape, float8_e4m3fn or float8_e5m2)
    and the E8M0 scales (uint8; x's shape with dim's size ceil(n / block), or [ceil(R/b), ceil(C/b)]).

    values = fp8(saturate(x * 2**(127 - scale))): the multiplication by a power of two is exact (an
    fp32 underflow only touches values far below the FP8 subnormals), saturation only bites when the
    rounded `amax / fp8_max` fell below the true quotient, and the FP8 cast rounds to nearest even.
    Edge cases: an all-zero block has scale 0 and zero values; a block with a NaN has scale 255 and
    NaN values; a block with an infinity (no NaN) has scale 254, its infinities saturate to
    +-fp8_max and its finite values flush to 0 (so dequantizing gives +-inf back, by overflow); a
    block whose amax is at most fp8_max * 2**-127 has scale 0 and zero values (see
    `_mx_encode_multiplier`). A partial last block is scaled from its own elements."""
    dtype, limit = _MX_ENCODINGS[encoding]
    xf = x if x.dtype in (torch.bfloat16, torch.float16) else x.float()  # the product is float32
    blocks = _blocks_2d(xf, block) if two_d else _blocks_1d(xf, dim, block)
    scales = e8m0_scale(_block_amax(blocks, two_d), encoding)
    scaled = blocks * _per_block(_mx_encode_multiplier(scales), two_d)
    values = scaled.clamp_(-limit, limit).to(dtype)
    if two_d:
        return values.view(blocks.shape[0] * block, -1)[: x.shape[0], : x.shape[1]], scales
    return _unblock_1d(values, dim, x.shape[dim]), scales.movedim(-1, dim)


# ---- E2M1 ----------------------------------------------------------------------------------------


def e2m1_round(
    x: torch.Tensor, stochastic: bool = False, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """x rounded to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} with x's sign, saturating at +-6, in
    float32; NaN stays NaN, -0.0 stays -0.0.

    Round to nearest even (default): adding k = 1.5 * 2**(e + 22), where 2**e is the value's binade
    (at least 1, the smallest normal), puts the sum in a binade whose float32 spacing is the E2M1
    spacing there (0.5 below 2, then 1, then 2), so float32's own rounding of the sum is E2M1's,
    ties to even; subtracting k is exact (as `cast._round_to_fp8_grid` does for FP8).

    Stochastic (`stochastic=True`): |x| between neighbours lo < hi rounds up when u < (|x| - lo) /
    (hi - lo), u = torch.rand (from `generator` if given, else the global generator: reproducible
    under a seed). lo, the difference and the quotient are exact (a power-of-two step, Sterbenz), so
    P(up) is the exact fraction rounded up to torch.rand's grid (2**-24 on CPU): unbiased up to
    2**-24 of a step. Values on the grid never move; saturation happens before rounding."""
    magnitude = x.float().abs().clamp_(max=E2M1_MAX)
    if not stochastic:
        k = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**e (inf for NaN)
        k = k.clamp_(min=1.0).mul_(1.5 * 2.0**22)
        return (magnitude + k).sub_(k).copysign_(x.float())
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    low = torch.floor(magnitude / step) * step
    u = torch.rand(magnitude.shape, generator=generator, device=magnitude.device)
    up = u < (magnitude - low) / step
    return torch.where(up, low + step, low).copysign_(x.float())


_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values (float32 on the grid, e.g. from `nvfp4_quantize`) as 4-bit codes, two per byte along
    the last dimension (even length): element 2i in the low nibble, 2i+1 in the high one (the layout of
    torchao and TransformerEngine). A code is sign << 3 | index into E2M1_VALUES; -0.0 keeps its sign.
    Values off the grid raise ValueError."""
    if values.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 packs pairs along the last dimension; got length {values.shape[-1]}")
    v = values.float()
    magnitude = v.abs()
    index = torch.bucketize(magnitude, _E2M1_TABLE[:8].to(v.device))
    index = index.clamp_(max=7)
    if not bool((_E2M1_TABLE[:8].to(v.device)[index] == magnitude).all()):
        raise ValueError("pack_e2m1 takes values on the E2M1 grid (NaN and off-grid values have no code)")
    codes = (index | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# ---- NVFP4 ---------------------------------------------------------------------------------------


def nvfp4_tensor_scale(amax: Amax) -> torch.Tensor:
    """The per-tensor encode scale S_enc = 448 * 6 / amax, float32 (one correctly rounded division),
    capped at the float32 maximum (a tiny amax), and 1 where amax is 0 or the quotient is 0 (amax
    inf); NaN for a NaN amax. `amax` may come from outside (reduced across ranks)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    s_enc = torch.full_like(amax, E4M3_MAX * E2M1_MAX).div_(amax).clamp_(max=FLOAT32_MAX)
    return torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)


def nvfp4_quantize(
    x: torch.Tensor,
    dim: int,
    global_amax: Optional[Amax] = None,
    two_d: bool = False,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of `x` in blocks of 16 along `dim` (or 16x16 squares of a 2-D `x` with
    `two_d`). Returns (values: float32 E2M1 values, x's shape; block scales: float8_e4m3fn, x's shape
    with dim's size ceil(n / 16), or [ceil(R/16), ceil(C/16)]; S_enc: the float32 per-tensor scale).
    Dequantized: values * block_scale / S_enc (tests/inverses.py's `nvfp4_dequantize`).

    S_enc = nvfp4_tensor_scale(global_amax), global_amax = max|x| unless given (a NaN anywhere makes
    it NaN). Per block, in float32, each step one rounding:
      S_dec = e4m3(min((block_amax * S_enc) / 6, 448))     (round to nearest even; no lower clamp)
      enc   = min(1 / (S_dec / S_enc), FLOAT32_MAX)
      value = e2m1_round(clamp(x * enc, -6, 6))            (nearest even, or stochastic)
    Edge cases: an all-zero block has S_dec 0 and zero values; so does, in effect, a block so small
    next to the tensor amax that S_dec rounds to 0 (enc is capped, the values saturate or stay 0, and
    dequantize to +-0). A block with a NaN has a NaN scale and zero values; an infinity (no NaN)
    saturates to +-6 at scale 448 (an infinite data amax gives S_enc 1, TransformerEngine's rule, so
    it dequantizes to +-2688). Values above a given global_amax saturate (scale 448, +-6)."""
    xf = x.float()
    if global_amax is None:
        global_amax = _amax(xf) if xf.numel() else torch.zeros((), device=xf.device)
    s_enc = nvfp4_tensor_scale(global_amax).to(xf.device)
    blocks = _blocks_2d(xf, NVFP4_BLOCK) if two_d else _blocks_1d(xf, dim, NVFP4_BLOCK)
    block_amax = _block_amax(blocks, two_d)
    s_dec = _true_div(block_amax * s_enc, E2M1_MAX).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.ones_like(block_amax).div_(s_dec.float() / s_enc).clamp_(max=FLOAT32_MAX)
    scaled = (blocks * _per_block(enc, two_d)).clamp_(-E2M1_MAX, E2M1_MAX)
    values = e2m1_round(scaled, stochastic, generator)
    values = values.masked_fill_(torch.isnan(values), 0.0)  # a NaN block: its scale says so
    if two_d:
        return values.view(blocks.shape[0] * NVFP4_BLOCK, -1)[: x.shape[0], : x.shape[1]], s_dec, s_enc
    return _unblock_1d(values, dim, x.shape[dim]), s_dec.movedim(-1, dim), s_enc


# ---- random Hadamard transform ---------------------------------------------------------------------


def hadamard_matrix(
    signs: tuple[int, ...] = RHT_SIGNS, device: Optional[torch.device] = None
) -> torch.Tensor:
    """diag(signs) @ H / sqrt(n), float32, H the n x n Sylvester Hadamard matrix (n = len(signs), a power
    of 2). Entries are +-1/sqrt(n) (+-1/4 for n = 16: exact), and it is orthogonal: M @ M.T = I, exactly
    in float32 for n = 16 (every product is +-1/16 and every partial sum a multiple of 1/16).

    Built on `device` from Python numbers (kernel arguments): no tensor is made from host data."""
    n = len(signs)
    if n & (n - 1) or n == 0:
        raise ValueError(f"a Hadamard matrix needs a power-of-2 size, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    d = torch.stack([torch.full((), s / n**0.5, device=device) for s in signs])
    return d[:, None] * h


# The RHT matrix of each (device, signs), made once: a steady NVFP4 step builds none. Float32 only
# (the transform works in float32). Under torch.compile the matrix is traced instead (device ops
# on constants), so that a graph holds no reference to this cache.
_HADAMARD_BY_DEVICE: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _hadamard_on(device: torch.device, signs: tuple[int, ...]) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return hadamard_matrix(signs, device)
    key = (device, tuple(signs))
    matrix = _HADAMARD_BY_DEVICE.get(key)
    if matrix is None:
        matrix = _HADAMARD_BY_DEVICE[key] = hadamard_matrix(key[1], device)
    return matrix


def random_hadamard_transform(
    x: torch.Tensor, signs: tuple[int, ...] = RHT_SIGNS, dim: int = -1
) -> torch.Tensor:
    """Each block of 16 consecutive elements along `dim` (the reduction dimension; a multiple of 16, else
    ValueError) multiplied by `hadamard_matrix(signs)`, in float32: y = x @ M per block. M is
    orthogonal, so transforming both operands of a GEMM along its reduction dimension leaves the product
    unchanged (A M)(B M).T = A B.T, while spreading each block's outliers over all 16 elements. Each
    output is a float32 sum of 16 products +-x/4 (each exact): rounding only in the additions, which are
    made in the fast Walsh-Hadamard butterfly order (`_butterfly_transform`), the fused kernel's
    (kernels/triton_microscaling.py, `_fwht16`): the two agree bit for bit."""
    return _butterfly_transform(x, signs, dim)


def _butterfly_transform(x: torch.Tensor, signs: tuple[int, ...], dim: int) -> torch.Tensor:
    """x @ M per block of n along `dim`, M = diag(signs) H / sqrt(n): z = x * (+-1/sqrt(n)) (exact for
    n = 16), then log2(n) butterfly stages, index bit 0 first, each pair (a, b) -> (a + b, a - b), one
    float32 rounding per addition; + 0.0 last: an exactly zero sum is +0.0, as from a matmul."""
    n = len(signs)
    moved = x.float().movedim(dim, -1)
    if moved.shape[-1] % n:
        raise ValueError(
            f"the Hadamard transform works in blocks of {n}; dimension {dim} has {moved.shape[-1]}"
        )
    z = moved.unflatten(-1, (moved.shape[-1] // n, n)) * _hadamard_on(x.device, signs)[:, 0]
    half = 1
    while half < n:
        pairs = z.unflatten(-1, (n // (2 * half), 2, half))
        a, b = pairs.select(-2, 0), pairs.select(-2, 1)
        z = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        half *= 2
    return (z + 0.0).flatten(-2).movedim(-1, dim)


# ---- scale layouts of the hardware GEMMs -------------------------------------------------------------

# cuBLAS's "blocked" layout of MX/NVFP4 block scales: the [rows, scale columns] matrix padded with zeros
# to multiples of (128, 4) and cut into 128 x 4 tiles, stored tile after tile (row tiles outer); inside
# a tile, the scale of (r, c) sits at byte (r % 32) * 16 + (r // 32) * 4 + c (cuBLAS's 1D block scaling
# factors layout: 32 row groups of 4 interleaved 32-row slices).
SWIZZLE_TILE = (128, 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-row block scales [rows, nb] (any dtype) in cuBLAS's blocked layout, flat: round_up(rows, 128)
    * round_up(nb, 4) elements, the padding zero (what torch._scaled_mm's MX and NVFP4 kernels take)."""
    rows, cols = scales.shape
    tr, tc = SWIZZLE_TILE
    padded = scales.new_zeros(-(-rows // tr) * tr, -(-cols // tc) * tc)
    padded[:rows, :cols] = scales
    # [row tile, r // 32, r % 32, column tile, c] -> [row tile, column tile, r % 32, r // 32, c]
    tiles = padded.view(padded.shape[0] // tr, 4, 32, padded.shape[1] // tc, tc)
    return tiles.permute(0, 3, 2, 1, 4).contiguous().flatten()


# ---- the emulated blockwise GEMM -------------------------------------------------------------------


def rowwise_scales(scales: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """2-D block scales [ceil(rows/block), nb] repeated to one row of scales per row [rows, nb], the
    form `microscaled_mm` takes."""
    return scales.repeat_interleave(block, 0)[:rows]


def _decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 = E8M0 (MX); a float dtype (E4M3 block scales of NVFP4, or float32) as its value."""
    return e8m0_to_float(scales) if scales.dtype == torch.uint8 else scales.float()


def microscaled_mm(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    b_values: torch.Tensor,
    b_scales: torch.Tensor,
    block: int,
    a_tensor_scale: Optional[torch.Tensor] = None,
    b_tensor_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """a @ b.T for block-scaled operands, emulated in float32 as a block-scaled tensor-core GEMM computes
    it: a_values [M, K] and b_values [N, K], both blocked along K (the reduction), with per-row block
    scales a_scales [M, ceil(K/block)] and b_scales [N, ceil(K/block)] (2-D block scales through
    `rowwise_scales`); uint8 scales are E8M0, others are taken as their values. With tensor scales
    (NVFP4's S_enc), the result is divided by each.

    y = (sum over blocks j of (a_j . b_j) * sa_j * sb_j) / S_enc_a / S_enc_b: one float32 dot product
    per block (exact for E2M1 operands: every partial sum is a multiple of 1/4 below 2**10), scaled
    exactly (powers of two for MX; for NVFP4 an exact block dot product times two E4M3 values has at
    most 20 significant bits), accumulated over blocks in float32. A partial last block is padded with
    zeros in both operands (adding 0 exactly). NaN scales give NaN outputs where they are used."""
    m, k = a_values.shape
    n, k_b = b_values.shape
    if k != k_b:
        raise ValueError(f"reduction dimensions differ: a has {k}, b has {k_b}")
    a_blocks = _blocks_1d(a_values.float(), -1, block).transpose(0, 1)  # [nb, M, block]
    b_blocks = _blocks_1d(b_values.float(), -1, block).permute(1, 2, 0)  # [nb, block, N]
    sa = _decode_scales(a_scales).t().unsqueeze(-1)  # [nb, M, 1]
    sb = _decode_scales(b_scales).t().unsqueeze(1)  # [nb, 1, N]
    out = torch.zeros(m, n, device=a_values.device)
    chunk = max(1, (1 << 24) // max(1, m * n))  # bounded memory: chunk * M * N partial products
    for start in range(0, a_blocks.shape[0], chunk):
        part = torch.bmm(a_blocks[start : start + chunk], b_blocks[start : start + chunk])
        out += (part * sa[start : start + chunk] * sb[start : start + chunk]).sum(0)
    if a_tensor_scale is not None:
        out = out / a_tensor_scale.float()
    if b_tensor_scale is not None:
        out = out / b_tensor_scale.float()
    return out
