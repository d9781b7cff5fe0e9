"""The fused Triton casts (fp8train.numerics.kernels) equal the torch path bit for bit, run in Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1 while the kernels are imported; it needs numpy, a test
dependency). Without triton installed, the whole file is skipped, and only then.

References: cast.cast_operand / cast.amax (per-tensor), quantization/current.py's current_scales,
quantization/block_scaling.py's quantize_tiles and the operands BlockQuantization builds; the rounding
helper itself against torch's own FP8 conversion (round-to-nearest-even on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot be tested")
# the interpreter computes in numpy, which warns where a product overflows to inf or is inf * 0 (as it should)
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),  # inf * 0
]


@contextlib.contextmanager
def _interpreter():
    """TRITON_INTERPRET=1 while the kernels are decorated (triton.jit reads it then), restored after."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


with _interpreter():
    import triton.language as tl

    from fp8train.numerics.kernels import rounding, triton_cast

    if not triton_cast.INTERPRETED:  # imported compiled earlier in this process
        triton_cast = importlib.reload(triton_cast)

    @triton.jit
    def _round_kernel(x_ptr, rounded_ptr, byte_ptr, n, MANTISSA_BITS: tl.constexpr,
                      MIN_EXPONENT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        rounded = rounding.round_to_fp8(tl.load(x_ptr + offsets, mask=mask), MANTISSA_BITS, MIN_EXPONENT)
        tl.store(rounded_ptr + offsets, rounded, mask=mask)
        tl.store(byte_ptr + offsets, rounding.fp8_byte(rounded, MANTISSA_BITS, MIN_EXPONENT), mask=mask)


from fp8train.numerics import kernels  # noqa: E402
from fp8train.numerics.cast import amax, cast_operand  # noqa: E402
from fp8train.quantization.block_scaling import TILE, _tiles, quantize_tiles  # noqa: E402
from fp8train.quantization.current import current_scales  # noqa: E402

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}  # mantissa bits, min exponent, max
INF = torch.tensor(float("inf"))


def _same_bits(got: torch.Tensor, want: torch.Tensor, nan_sign: bool = True) -> torch.Tensor:
    """Equal bits, NaN equal to NaN in float outputs (their payloads differ between torch's own
    vectorized and scalar conversions); FP8 bytes compare exactly, NaN's 0x7F/0xFF included, unless
    not `nan_sign` (which NaN a product of two NaNs or of inf and 0 gives is the hardware's)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.contiguous().view(bits) == want.contiguous().view(bits)
    if got.element_size() > 1 or not nan_sign:
        same |= got.float().isnan() & want.float().isnan()
    return same


def _assert_same(
    got: torch.Tensor, want: torch.Tensor, x: torch.Tensor | None = None, nan_sign: bool = True
) -> None:
    same = _same_bits(got, want, nan_sign)
    where = "" if x is None else f" at x = {x.reshape(same.shape)[~same][:5].tolist()}"
    assert bool(same.all()), f"{int((~same).sum())} differ: {got[~same][:5]} vs {want[~same][:5]}{where}"


def _grid(encoding: str) -> torch.Tensor:
    """Every finite FP8 value (float32), ascending, one zero."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(DTYPES[encoding]).float()
    return grid[grid.isfinite()].unique()


@functools.cache
def _hard_values(encoding: str, sample_per_decade: int = 1_000) -> torch.Tensor:
    """Every FP8 value, every tie between neighbours and its float32 neighbours, the values'
    neighbours, zeros of both signs, NaN, values beyond the range and inf, and a wide random sample
    (subnormals to saturation), of both signs."""
    limit = FORMAT[encoding][2]
    grid = _grid(encoding)
    ties = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(7)
    sample = [torch.randn(sample_per_decade, generator=g) * 10.0**e for e in range(-12, 8, 2)]
    special = torch.tensor([0.0, -0.0, float("nan"), 2 * limit, limit * 1.0625, float("inf")])
    x = torch.cat(
        [grid, torch.nextafter(grid, INF), torch.nextafter(grid, -INF), ties, torch.nextafter(ties, INF),
         torch.nextafter(ties, -INF), special, *sample]
    )  # fmt: skip
    return torch.cat([x, -x])


def _as_rows(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x padded with zeros to whole rows of `cols` (off every tile used here)."""
    return torch.cat([x, x.new_zeros(-x.numel() % cols)]).view(-1, cols)


# -- the rounding helper ------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_rounding_helper_equals_the_fp8_cast_on_every_value_tie_and_neighbour(encoding: str) -> None:
    """round_to_fp8 and fp8_byte against torch's FP8 conversion (ties to even): every FP8 value,
    every tie and their float32 neighbours, every float32 between 0 and twice the smallest subnormal
    in steps, NaN, of both signs. The byte is torch's byte, -0.0 and NaN's sign included."""
    mantissa_bits, min_exponent, limit = FORMAT[encoding]
    grid = _grid(encoding)
    ties = (grid[1:] + grid[:-1]) / 2
    tiny = torch.linspace(0, 2.0 ** (min_exponent - mantissa_bits + 1), 4097)
    x = torch.cat(
        [grid, ties, torch.nextafter(ties, INF), torch.nextafter(ties, -INF), torch.nextafter(grid, INF),
         torch.nextafter(grid, -INF), tiny, torch.tensor([0.0, float("nan")])]
    )  # fmt: skip
    x = torch.cat([x, -x]).clamp(-limit, limit)  # the helper's domain: saturated products
    rounded = torch.empty_like(x)
    byte = torch.empty_like(x, dtype=torch.int32)
    block = 4096
    _round_kernel[(triton.cdiv(x.numel(), block),)](
        x, rounded, byte, x.numel(), mantissa_bits, min_exponent, block
    )
    want = x.to(DTYPES[encoding])
    _assert_same(rounded, want.float(), x)
    assert torch.equal(byte.to(torch.uint8), want.view(torch.uint8)), x[
        byte.to(torch.uint8) != want.view(torch.uint8)
    ]
    # the ties really are ties, and went to the even neighbour, some up and some down
    t = ties[ties > 0]
    up = rounded[len(grid) : len(grid) + len(ties)][ties > 0] > t
    assert bool(up.any()) and bool((~up).any())


# -- per-tensor casts ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cast_with_amax_equals_cast_operand_bit_for_bit(encoding: str, dtype, x_dtype: torch.dtype) -> None:
    """Values, transposed copy and recorded amax against cast_operand and cast.amax: every FP8 value,
    tie and neighbour, +-0, NaN, inf, values beyond the range, subnormals, with scales that keep,
    enlarge (saturating most of the sample) and shrink (into the subnormals) the values."""
    dtype = DTYPES[encoding] if dtype == "fp8" else dtype
    x = _as_rows(_hard_values(encoding), 301).to(x_dtype)
    for scale in (1.0, 3.0, 2.0**-7, 2.0**12):
        scale = torch.tensor(scale)
        amax_out = torch.zeros(())
        values, values_t = kernels.cast_with_amax(
            x, scale, encoding, dtype, transposed=True, amax_out=amax_out, tile=(256, 512)
        )
        want = cast_operand(x, scale, encoding, dtype)
        _assert_same(values, want, x)
        _assert_same(values_t, want.t().contiguous())
        assert bool(amax_out.isnan()) and bool(amax(x).isnan())  # NaN in, NaN amax
    finite = torch.where(x.isnan(), 0.0, x)
    amax_out = torch.zeros(())
    kernels.cast_with_amax(
        finite, scale, encoding, dtype, transposed=False, amax_out=amax_out, tile=(256, 512)
    )
    assert torch.equal(amax_out, amax(finite)) and bool(amax_out.isinf())
    finite = finite.clamp(-1e4, 1e4)
    kernels.cast_with_amax(
        finite, scale, encoding, dtype, transposed=False, amax_out=amax_out, tile=(256, 512)
    )
    assert bool(amax_out.isinf()), "the amax is maxed into amax_out, not overwritten"
    amax_out.zero_()
    kernels.cast_with_amax(
        finite, scale, encoding, dtype, transposed=False, amax_out=amax_out, tile=(256, 512)
    )
    assert torch.equal(amax_out, amax(finite))


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_cast_with_amax_takes_degenerate_scales_as_cast_operand_does(encoding: str) -> None:
    """Scales a broken history could hold: 0 (x * 0 keeps x's sign, inf * 0 is NaN), inf, NaN, a
    subnormal and the float32 maximum: the kernel's float32 product is cast_operand's (a NaN's sign
    aside where the product makes a NaN of two operands that are not one NaN: the hardware's choice,
    the x86 "indefinite" -NaN on the CPU, a positive canonical NaN on NVIDIA GPUs)."""
    x = _hard_values(encoding, 10)
    for scale in (0.0, float("inf"), float("nan"), 2.0**-140, 3.4e38):
        for dtype in (DTYPES[encoding], torch.float32):
            values, _ = kernels.cast_with_amax(
                x, torch.tensor(scale), encoding, dtype, transposed=False, amax_out=None, tile=(1, 8192)
            )
            _assert_same(values, cast_operand(x, torch.tensor(scale), encoding, dtype), x, nan_sign=False)


def _layouts() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(37, 50, generator=g) * 100
    cube = torch.randn(3, 19, 45, generator=g) * 100
    return [
        ("2-D off tile", base),
        ("one element", base[:1, :1]),
        ("transposed view", base.t()),
        ("strided columns", base[:, ::3]),
        ("3-D", cube),
        ("3-D permuted", cube.permute(1, 0, 2)),
        ("3-D sliced", cube[:, 2:, 1::2]),
        ("1-D", base[0]),
        ("4-D", torch.randn(2, 3, 5, 7, generator=g)),
        ("bf16 3-D", cube.bfloat16()),
        ("float64", base.double()),
    ]


@pytest.mark.parametrize("name,x", _layouts(), ids=[name for name, _ in _layouts()])
def test_cast_with_amax_on_shapes_off_the_tile_and_non_contiguous_inputs(name: str, x: torch.Tensor) -> None:
    """Masked edges (a 32x32 tile over shapes off it), strided and 3-D inputs read through their strides,
    the transposed copy of x seen as rows of its last dimension, and the amax, for both encodings."""
    for encoding, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.bfloat16)):
        scale = torch.tensor(0.7)
        amax_out = torch.zeros(())
        transposed = x.dim() in (2, 3)
        values, values_t = kernels.cast_with_amax(
            x, scale, encoding, dtype, transposed=transposed, amax_out=amax_out, tile=(32, 32)
        )
        want = cast_operand(x, scale, encoding, dtype)
        assert values.shape == x.shape
        _assert_same(values, want)
        if transposed:
            _assert_same(values_t, want.reshape(-1, x.shape[-1]).t().contiguous())
        else:
            assert values_t is None
        assert torch.equal(amax_out, amax(x))


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_amax_then_cast_equals_current_scaling(encoding: str) -> None:
    """Current scaling's two reads: amax, then scale and scale_inv (fp8_max / amax by a true division,
    capped at the float32 maximum, 1 for a zero, inf or NaN amax) and the cast, against current_scales
    and cast_operand, on ordinary tensors and on ones whose amax is zero, tiny (the cap), inf or NaN."""
    g = torch.Generator().manual_seed(5)
    ordinary = torch.randn(70, 90, generator=g) * 3.7
    cases = {
        "ordinary": ordinary,
        "zeros": torch.zeros(33, 40).index_fill_(0, torch.tensor([3]), -0.0),
        "tiny amax": torch.full((20, 30), 1e-44),
        "inf": ordinary.index_fill(1, torch.tensor([7]), float("inf")),
        "nan": ordinary.index_fill(0, torch.tensor([69]), float("nan")),
        "bf16": ordinary.bfloat16(),
    }
    for name, x in cases.items():
        for dtype in (torch.float32, DTYPES[encoding]):
            got = kernels.amax_then_cast(x, encoding, dtype, transposed=True, tile=(128, 128))
            scale, scale_inv = current_scales(x, encoding)
            want = cast_operand(x, scale, encoding, dtype)
            _assert_same(got.values, want)
            _assert_same(got.values_t, want.t().contiguous())
            _assert_same(got.amax, amax(x))
            assert torch.equal(got.scale, scale) and torch.equal(got.scale_inv, scale_inv), name


# -- block scaling ------------------------------------------------------------------------------


def _block_input(rows: int, cols: int) -> torch.Tensor:
    """Outliers, a NaN tile, an inf tile, a zero tile, a tile of subnormal-sized values (its scale is
    capped at the float32 maximum) and exact ties of the scaled values."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, cols, generator=g)
    x[3] *= 2.0**17
    x[rows // 2, 5] = 2.0**20
    x[1, 130] = float("nan")
    x[140, 2] = float("inf")
    x[128:, 256:] = 0.0  # whole zero tiles: 1x128 in x and x.t(), a 128x128 block
    x[130, 261] = -0.0
    x[:2, 256:] = 1e-41
    x[5, :64] = (torch.arange(64) + 0.5) / 2**4  # ties after a power-of-2 scale
    return x


@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_1x128_tiles_and_their_transposed_tiles_equal_the_block_quantizer(power_2: bool, x_dtype) -> None:
    """One read makes what BlockQuantization.quantize_input makes in two quantize_tiles calls: x in 1x128
    tiles along its last dimension (float32 values) and x.t() in 1x128 tiles along the tokens (FP8
    values), scales included, on a shape off every tile and a non-contiguous input."""
    x = _block_input(200, 300).to(x_dtype)
    for source in (x, x.t().contiguous().t()):
        forward, wgrad = kernels.cast_tiles_1x128(source, power_2, transposed_dtype=torch.float8_e4m3fn)
        want_forward = _tiles(source, power_2)
        want_wgrad = _tiles(source, power_2, transposed=True, fp8=True)
        for got, want in ((forward, want_forward), (wgrad, want_wgrad)):
            assert got.layout == want.layout
            _assert_same(got.values, want.values.contiguous())
            assert torch.equal(got.scale_inv, want.scale_inv)
    forward, none = kernels.cast_tiles_1x128(x, power_2, torch.bfloat16, encoding="e5m2", block_m=64)
    values, scale_inv = quantize_tiles(x, 1, power_2, "e5m2", torch.bfloat16)
    assert none is None and torch.equal(forward.scale_inv, scale_inv)
    _assert_same(forward.values, values.contiguous())


@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_128x128_blocks_equal_the_block_quantizer(power_2: bool, dtype: torch.dtype) -> None:
    """BlockQuantization.quantize_weight's operand (128x128 blocks, partial at the edges)."""
    x = _block_input(200, 300)
    got = kernels.cast_blocks_128x128(x, power_2, dtype)
    values, scale_inv = quantize_tiles(x, TILE, power_2, dtype=dtype)
    assert got.block == (TILE, TILE) and not got.transposed
    _assert_same(got.values, values.contiguous())
    assert torch.equal(got.scale_inv, scale_inv)


# -- the face -----------------------------------------------------------------------------------


def test_availability_and_bad_input() -> None:
    assert kernels.interpreted()
    assert kernels.fused_cast_available("cpu", allow_interpreter=True)
    assert not kernels.fused_cast_available("cpu")  # interpreted kernels only where asked for
    assert not kernels.fused_cast_available("cuda")  # interpreted: not a GPU's kernels
    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match="float32 0-dim tensor"):
        kernels.cast_with_amax(
            x, torch.tensor(1.0), "e4m3", torch.float32, transposed=False, amax_out=torch.zeros(1)
        )
    with pytest.raises(ValueError, match="written as torch.float8_e5m2"):
        kernels.cast_with_amax(
            x, torch.tensor(1.0), "e5m2", torch.float8_e4m3fn, transposed=False, amax_out=None
        )
    with pytest.raises(ValueError, match="float32, bfloat16 or an FP8 dtype"):
        kernels.cast_with_amax(x, torch.tensor(1.0), "e4m3", torch.float16, transposed=False, amax_out=None)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        kernels.cast_with_amax(x[0], torch.tensor(1.0), "e4m3", torch.float32, transposed=True, amax_out=None)
    with pytest.raises(ValueError, match="no transposed copy"):
        triton_cast.cast_tiles(x, 128, "e4m3", torch.float32, True, transposed_dtype=torch.float32)
    empty = kernels.cast_with_amax(
        x[:0], torch.tensor(1.0), "e4m3", torch.float32, transposed=True, amax_out=None
    )
    assert empty[0].shape == (0, 4) and empty[1].shape == (4, 0)


def _run_without_triton(code: str) -> None:
    """`code` in a fresh process with triton hidden (sys.modules['triton'] = None), whether or not
    triton is installed here; it must exit cleanly."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['triton'] = None\n" + code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_fp8train_imports_and_runs_without_triton() -> None:
    """Triton is a test dependency: with it hidden, fp8train imports, the kernels say they are not
    available and the torch path casts."""
    _run_without_triton(
        "import torch, fp8train\n"
        "from fp8train.numerics import kernels\n"
        "assert not kernels.fused_cast_available('cuda')\n"
        "assert not kernels.fused_cast_available('cpu', allow_interpreter=True)\n"
        "from fp8train.numerics.cast import quantize\n"
        "assert quantize(torch.ones(3), torch.tensor(2.0), 'e4m3').float().tolist() == [2.0] * 3\n"
        "assert 'fp8train.numerics.kernels.triton_cast' not in sys.modules\n"
    )


def test_probing_the_per_tensor_casts_without_triton_answers_and_imports_nothing() -> None:
    """The kernels' face looks its per-tensor casts up on first use (a module `__getattr__`, PEP 562);
    without triton a lookup raises AttributeError naming the fix, so `hasattr` and `getattr(...,
    default)` answer instead of raising ImportError."""
    _run_without_triton(
        "import pytest\n"
        "from fp8train.numerics import kernels\n"
        "assert not hasattr(kernels, 'cast_with_amax')\n"
        "assert getattr(kernels, 'amax_then_cast', None) is None\n"
        "with pytest.raises(AttributeError, match='triton'):\n"
        "    kernels.cast_with_amax\n"
        "assert not hasattr(kernels, 'no_such_kernel')\n"
        "assert 'fp8train.numerics.kernels.triton_cast' not in sys.modules\n"
    )


_COMPILE_FOR_SM90 = r"""
import re, sys, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp8train.numerics.kernels import triton_cast as tc

assert not tc.INTERPRETED
common = dict(MANTISSA_BITS=3, MIN_EXPONENT=-6, FP8_MAX=448.0, OUT_KIND=2, TRANSPOSED=True, INT64=False)
tensor = {"x_ptr": "*bf16", "out_ptr": "*u8", "out_t_ptr": "*u8", "scale_ptr": "*fp32", "amax_ptr": "*i32",
          "scale_inv_ptr": "*fp32", **{k: "i32" for k in "M N S sx_a sx_b sx_c so_a so_b so_c".split()}}
tiles = {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_inv_ptr": "*fp32", "out_t_ptr": "*u8",
         "scale_inv_t_ptr": "*fp32", **{k: "i32" for k in "M N sx0 sx1 SCALE_COLS SCALE_T_COLS".split()}}
per_tensor = dict(common, SPLIT_ROWS=False, BLOCK_M=64, BLOCK_N=128)
variants = {
    "delayed": (tc._tensor_kernel, tensor, dict(per_tensor, RECORD_AMAX=True, SCALE_FROM_AMAX=False)),
    "current": (tc._tensor_kernel, tensor, dict(per_tensor, RECORD_AMAX=False, SCALE_FROM_AMAX=True)),
    "tiles": (tc._tiles_kernel, tiles, dict(common, POWER_2=False, OUT_T_KIND=2, ROWS=1, BLOCK_M=128,
                                            TILE_N=128)),
}
found = {}
for name, (fn, types, consts) in variants.items():
    source = ASTSource(fn=fn, signature={**types, **{k: "constexpr" for k in consts}}, constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z_]+(?:\.[a-z0-9_]+)*)", ptx, re.M)
    found[name] = sorted({op for op in ops if op.startswith(("div", "atom", "red", "rcp", "cvt.rn.satf"))})
print(json.dumps(found))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_exact_division_and_no_per_element_integer_division() -> None:
    """Without a GPU: the kernels compile for SM90 (Triton's own compiler and ptxas, no device needed),
    their scales use the correctly rounded division (div.rn, never an approximate one), the delayed cast
    records its amax by an integer atomic max, no FP8 conversion instruction is used (the bytes are
    integer arithmetic) and no 64-bit division is left per element."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, said explicitly (silences its warning)
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, timeout=900, env=env
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("triton's CUDA backend has no ptxas here")
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    every = {op for ops in found.values() for op in ops}
    assert not {op for op in every if "approx" in op or op.startswith(("div.s64", "div.u64", "rcp"))}, found
    assert not {op for op in every if op.startswith("cvt.rn.satfinite")}, found
    assert any(op.startswith("div.rn.f32") for op in found["current"]) and not any(
        op.startswith("div.rn") for op in found["delayed"]
    ), found
    assert any(op.startswith(("atom.global", "red.global")) and "max" in op for op in found["delayed"]), found
