"""The fused Triton microscaling kernels (fp8train/numerics/kernels/triton_microscaling.py;
docs/design.md, section 13, "Fused kernels") run in Triton's interpreter on CPU tensors and equal the
torch path of
microscaling.py (itself checked against torchao and naive references in test_microscaling.py) bit for
bit: values, block scales, the per-tensor scale and amax, every layout; and their rounding helpers equal
the FP8 / E2M1 grids on every representable value, every tie and the float32 neighbours of both.

The interpreter is chosen when a @triton.jit function is decorated (triton.knobs.runtime.interpret, read
from TRITON_INTERPRET), so the kernel module is loaded afresh here, as its own module object, inside a
knobs scope that turns the interpreter on: it works whoever imported triton or the kernels first, and
nothing outside this file sees the setting. Skipped only where triton cannot be imported."""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as error:  # CPU builds without triton: the torch path is all there is
    pytest.skip(f"triton cannot be imported ({error}); pip install triton numpy", allow_module_level=True)

import fp8train
from fp8train.numerics import microscaling as ms
from helpers import fill_special
from reference import E2M1_GRID, E4M3_GRID, E5M2_GRID

INF, NAN = float("inf"), float("nan")
FP8 = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 3, -6, 7, E4M3_GRID),
    "e5m2": (torch.float8_e5m2, 57344.0, 2, -14, 15, E5M2_GRID),
}


def _load_copy(filename: str):
    """kernels/`filename` loaded as a new module (its decorators follow the interpreter setting now)."""
    path = Path(fp8train.__file__).parent / "numerics" / "kernels" / filename
    spec = importlib.util.spec_from_file_location(f"fp8train.numerics.kernels._{path.stem}_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_interpreted():
    """triton_microscaling.py loaded as a new module with the interpreter on for its decorators, its
    rounding helpers (`from .rounding import ...`) from an interpreted copy of rounding.py put in
    sys.modules while it imports: the process's own rounding module may have been decorated compiled."""
    name = "fp8train.numerics.kernels.rounding"
    before = sys.modules.get(name)
    sys.modules[name] = _load_copy("rounding.py")
    try:
        return _load_copy("triton_microscaling.py")
    finally:
        if before is None:
            del sys.modules[name]
        else:
            sys.modules[name] = before


with triton.knobs.runtime.scope():
    triton.knobs.runtime.interpret = True
    tm = _load_interpreted()

    @triton.jit
    def _fp8_helpers_kernel(x_ptr, r_ptr, c_ptr, n, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
                            BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r = tm.round_to_fp8(tl.load(x_ptr + i, mask=i < n, other=0.0), MANT, MIN_EXP)
        tl.store(r_ptr + i, r, mask=i < n)
        tl.store(c_ptr + i, tm.fp8_byte(r, MANT, MIN_EXP).to(tl.uint8), mask=i < n)

    @triton.jit
    def _e2m1_kernel(x_ptr, r_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(r_ptr + i, tm.round_to_e2m1(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)

    @triton.jit
    def _e8m0_kernel(a_ptr, byte_ptr, mult_ptr, n, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(byte_ptr + i, tm.e8m0_byte(tl.load(a_ptr + i, mask=i < n, other=0.0), LIMIT), mask=i < n)
        tl.store(mult_ptr + i, tm.mx_multiplier(i), mask=i < 256)


def _launch(kernel, n: int, *args, **constants) -> None:
    block = 1 << max(0, n - 1).bit_length()
    kernel[(1,)](*args, n, BLOCK=block, **constants)


# ---- comparisons ----------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (int32 of the float32 value; raw bytes of 1-byte dtypes)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).to(torch.int32)
    return t.float().view(torch.int32)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bits (so -0.0 differs from 0.0), or both NaN."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    same = (_bits(a) == _bits(b)) | (a.float().isnan() & b.float().isnan())
    bad = ~same
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {a.numel()} differ, first at {bad.nonzero()[0].tolist()}: "
        f"{a.float()[bad][:4].tolist()} vs {b.float()[bad][:4].tolist()}"
    )


def _assert_same_mx(out, ref, what: str) -> None:
    _assert_same(out[0], ref[0], f"{what} values")
    _assert_same(out[1], ref[1], f"{what} scales")


def _assert_same_nvfp4(out, ref, what: str) -> None:
    for o, r, name in zip(out, ref, ("values", "block scales", "tensor scale")):
        _assert_same(o, r, f"{what} {name}")


# ---- the rounding helpers, on every representable value, tie and neighbour ---------------------------


def _with_neighbours(t: torch.Tensor) -> torch.Tensor:
    t = torch.cat([t, -t])
    return torch.cat([t, torch.nextafter(t, torch.tensor(INF)), torch.nextafter(t, torch.tensor(-INF))])


def _grid_points(grid: list[float]) -> torch.Tensor:
    """Every value of a grid (both signs) and every midpoint of neighbours, with their float32
    neighbours either side."""
    values = torch.tensor(grid, dtype=torch.float64)
    mids = (values[1:] + values[:-1]) / 2
    return _with_neighbours(torch.cat([values, mids]).float())


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_fp8_rounding_and_bytes_equal_the_fp8_cast(encoding: str) -> None:
    """rounding.round_to_fp8 equals torch's FP8 cast (round to nearest even, -0.0 kept) and fp8_byte its
    byte, on every FP8 value, every tie, their float32 neighbours, float32 subnormals and NaN."""
    dtype, fmax, mant, min_exp, _, grid = FP8[encoding]
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-126, 2.0 ** (min_exp - mant - 1), 2.0 ** (min_exp - mant - 2)])
    x = torch.cat([_grid_points(grid), _with_neighbours(tiny), torch.tensor([0.0, -0.0, NAN])])
    x = x.clamp(-fmax, fmax)  # the helper's domain: saturated products (NaN stays)
    rounded = torch.empty_like(x)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    _launch(_fp8_helpers_kernel, x.numel(), x, rounded, codes, MANT=mant, MIN_EXP=min_exp)
    expected = x.to(dtype)
    _assert_same(rounded, expected.float(), f"{encoding} rounding")
    _assert_same(codes.view(dtype), expected, f"{encoding} bytes")
    finite = ~x.isnan()
    grid_values = torch.tensor(grid, dtype=torch.float32)
    on_grid = torch.isin(rounded[finite].abs(), grid_values)
    assert bool(on_grid.all()), "every rounded value is on the hand-decoded grid (reference.py)"


def test_e2m1_rounding_equals_the_torch_path() -> None:
    """round_to_e2m1 equals microscaling.e2m1_round (nearest even, saturating at 6, NaN and -0.0
    kept) on every E2M1 value, tie and neighbour, beyond the grid and on NaN and infinities."""
    x = torch.cat([_grid_points(E2M1_GRID), torch.tensor([6.5, 7.0, 1e30, INF, -INF, NAN, 0.0, -0.0, 1e-45])])
    rounded = torch.empty_like(x)
    _launch(_e2m1_kernel, x.numel(), x, rounded)
    _assert_same(rounded, ms.e2m1_round(x), "E2M1 rounding")
    assert rounded[:8].tolist() == E2M1_GRID  # the grid stays, its ties (0.25 .. 5) go to even codes:
    assert rounded[8:15].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_e8m0_scale_and_multiplier_equal_the_torch_path(encoding: str) -> None:
    """e8m0_byte equals microscaling.e8m0_scale at every power-of-two boundary fmax * 2**k (k over the
    whole E8M0 range) and one float32 step either side, on float32 subnormals, 0, inf and NaN;
    mx_multiplier equals the torch path's multiplier on all 256 bytes."""
    _, fmax, *_ = FP8[encoding]
    k = torch.arange(-149, 128, dtype=torch.float64)
    tops = (fmax * 2.0**k).float()
    tops = tops[torch.isfinite(tops)]
    amax = torch.cat([_with_neighbours(tops).abs(), torch.tensor([0.0, 1e-45, 1e-40, 2.0**-127, INF, NAN])])
    amax = amax[(amax >= 0) | amax.isnan()]
    bytes_ = torch.empty(amax.shape, dtype=torch.int32)
    multipliers = torch.empty(max(256, amax.numel()))
    _launch(_e8m0_kernel, amax.numel(), amax, bytes_, multipliers, LIMIT=fmax)
    assert torch.equal(bytes_.to(torch.uint8), ms.e8m0_scale(amax, encoding))
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    _assert_same(multipliers[:256], ms._mx_encode_multiplier(every_byte), "multipliers")


# ---- inputs ------------------------------------------------------------------------------------------


def _mx_input(encoding: str, block: int = 32) -> torch.Tensor:
    """[3 * block + 8, 6 * block + 8] (partial last blocks both ways), in bands of rows: random,
    outliers, float32 subnormals and the byte-0 threshold, FP8 subnormals beside a large value, blocks
    whose amax is fmax * 2**k or one float32 step off (the scale's rounding-up boundary), blocks of FP8
    ties at scale 2**k and their neighbours, and the special values."""
    _, fmax, *_, grid = FP8[encoding]
    g = torch.Generator().manual_seed(7)
    rows, cols = 3 * block + 8, 6 * block + 8
    x = torch.randn(rows, cols, generator=g)
    x[8:16] *= torch.exp(2.5 * torch.randn(8, cols, generator=g)) * 1e3
    x[16:20] *= 1e-40
    x[20:24] *= 2.0**-119
    x[24:28] *= 1e-3
    x[24:28, ::block] = 1e3
    grid_t = torch.tensor(grid)
    mids = _with_neighbours(((grid_t[1:] + grid_t[:-1]) / 2).float())
    nb = cols // block
    for r in range(28, 60):
        for j in range(nb):
            k = (r * nb + j) % 61 - 30
            top = torch.tensor(fmax * 2.0**k)
            blk = x[r, j * block : (j + 1) * block]
            if (r + j) % 2:
                idx = torch.randint(len(mids), (block,), generator=g)
                blk.copy_(mids[idx] * 2.0**k)
            else:
                blk.mul_(top / 8)
            blk[j % block] = [top, torch.nextafter(top, torch.tensor(INF)), torch.nextafter(top, 0 * top)][
                r % 3
            ]
    return fill_special(x, block)


def _nvfp4_input() -> torch.Tensor:
    """[72, 104] (partial 16-blocks both ways) in bands: random, outliers, blocks far below the tensor
    amax (E4M3 subnormal and zero block scales), float32 subnormals, zero blocks, -0.0 and +-inf
    (NaN, which sets every block NaN, is tested apart)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(72, 104, generator=g)
    x[8:16] *= torch.exp(2.5 * torch.randn(8, 104, generator=g))
    x[16:24] *= 1e-4
    x[24:28] *= 1e-9
    x[28:32] *= 1e-40
    x[40, :16] = 0.0
    x[41, :16] = -0.0
    x[42, 3] = INF
    x[43, 5] = -INF
    x[44:60, 20] = -0.0
    x[0, 0] = 3e4  # the tensor amax
    return x


def _nvfp4_ties() -> torch.Tensor:
    """Blocks at ties with S_enc = 1 (global amax 2688, passed in): block amax 6 * 2**k makes S_dec =
    2**k and the scaled values exact E2M1 midpoints and neighbours; block amax 6 * (an E4M3 midpoint or
    its float32 neighbours) puts S_dec itself on a tie."""
    g = torch.Generator().manual_seed(9)
    mids = _with_neighbours(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
    e4m3 = torch.tensor(E4M3_GRID[1:], dtype=torch.float64)
    s_ties = _with_neighbours(((e4m3[1:] + e4m3[:-1]) / 2).float()).abs()
    rows = []
    for i in range(64):
        k = i % 24 - 16
        blk = mids[torch.randint(len(mids), (16,), generator=g)] * 2.0**k
        blk[i % 16] = 6.0 * 2.0**k
        rows.append(blk)
        rows.append(torch.rand(16, generator=g) * 6.0 * s_ties[(7 * i) % len(s_ties)])
    return torch.stack(rows).reshape(32, 64)


# ---- MXFP8 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_mx_quantize_equals_the_torch_path(encoding: str) -> None:
    """Along either dimension, in 32x32 squares, and both copies from one read (mx_quantize_both), on
    the banded input: partial edge blocks, saturating scales, ties, subnormals, zeros, -0.0, inf, NaN.
    Full-block shapes keep the torch path's strides (the column-wise copy stored transposed)."""
    x = _mx_input(encoding)
    for dim in (0, 1):
        _assert_same_mx(
            tm.mx_quantize(x, dim, 32, encoding), ms.mx_quantize(x, dim, 32, encoding), f"dim {dim}"
        )
    _assert_same_mx(
        tm.mx_quantize(x, 0, 32, encoding, True), ms.mx_quantize(x, 0, 32, encoding, True), "32x32"
    )
    rows, columns = tm.mx_quantize_both(x, encoding)
    _assert_same_mx(rows, ms.mx_quantize(x, 1, 32, encoding), "both, row-wise")
    _assert_same_mx(columns, ms.mx_quantize(x, 0, 32, encoding), "both, column-wise")
    whole = x[:96, :192]
    (rv, rs), (cv, cs) = tm.mx_quantize_both(whole, encoding)
    for (v, s), dim in (((rv, rs), 1), ((cv, cs), 0)):
        ref_v, ref_s = ms.mx_quantize(whole, dim, 32, encoding)
        assert (v.stride(), s.stride()) == (ref_v.stride(), ref_s.stride()), f"layout along dim {dim}"


def test_mx_quantize_other_inputs_equal_the_torch_path() -> None:
    """bf16, fp16 and float64 inputs; non-contiguous ones (a transposed slice, a strided one); 3-D
    inputs along each dimension, contiguous and permuted; 16-blocks; an empty tensor."""
    g = torch.Generator().manual_seed(3)
    x = _mx_input("e4m3")
    cases = [
        ("bf16", x.to(torch.bfloat16), 1),
        ("fp16", (x * 1e-3).to(torch.float16), 0),
        ("float64", x.double() * (1 + 2.0**-30), 1),  # rounds to float32 first, as the torch path does
        ("transposed", x.t()[5:], 1),
        ("strided", x[::2, 1::3], 0),
    ]
    for name, t, dim in cases:
        _assert_same_mx(tm.mx_quantize(t, dim), ms.mx_quantize(t, dim), name)
    _assert_same_mx(tm.mx_quantize_both(x.t())[1], ms.mx_quantize(x.t(), 0), "both of a transposed x")
    three = torch.randn(3, 40, 72, generator=g) * torch.exp(2 * torch.randn(3, 40, 72, generator=g))
    three[1, 3, 5] = NAN
    for t, name in ((three, "3-D"), (three.permute(2, 0, 1), "3-D permuted")):
        for dim in range(3):
            _assert_same_mx(
                tm.mx_quantize(t, dim, 32, "e5m2"), ms.mx_quantize(t, dim, 32, "e5m2"), f"{name} {dim}"
            )
    _assert_same_mx(tm.mx_quantize(x, 1, 16), ms.mx_quantize(x, 1, 16), "16-blocks")
    empty = torch.empty(0, 64)
    _assert_same_mx(tm.mx_quantize(empty, 1), ms.mx_quantize(empty, 1), "empty")


def test_mx_bad_input_is_a_clear_error() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="2-D tensor"):
        tm.mx_quantize(x.view(2, 2, 64), 0, two_d=True)
    with pytest.raises(ValueError, match="not one of"):
        tm.mx_quantize(x, 1, encoding="e3m4")
    with pytest.raises(ValueError, match="power-of-2 block sizes.*microscaling.py"):
        tm.mx_quantize(x, 1, block=24)


# ---- NVFP4 ----------------------------------------------------------------------------------------------


def test_nvfp4_quantize_equals_the_torch_path() -> None:
    """Along either dimension and in 16x16 squares, float32 values or E4M3 bytes (the operand's), on the
    banded input; ties of E2M1 and of the E4M3 block scale with S_enc 1; a given global amax below the
    data (saturation) as a tensor and as a float; NaN data (every block NaN, values 0); inf data (S_enc 1);
    an all-zero tensor; bf16 and 3-D non-contiguous inputs."""
    x = _nvfp4_input()
    for dim in (0, 1):
        _assert_same_nvfp4(tm.nvfp4_quantize(x, dim), ms.nvfp4_quantize(x, dim), f"dim {dim}")
    _assert_same_nvfp4(tm.nvfp4_quantize(x, 0, two_d=True), ms.nvfp4_quantize(x, 0, two_d=True), "16x16")
    values, scales, s_enc = ms.nvfp4_quantize(x, 1)
    as_operand = (values.to(torch.float8_e4m3fn), scales, s_enc)  # exact: what quantization/nvfp4.py stores
    _assert_same_nvfp4(tm.nvfp4_quantize(x, 1, values_dtype=torch.float8_e4m3fn), as_operand, "E4M3 bytes")
    ties = _nvfp4_ties()
    for dim in (0, 1):
        _assert_same_nvfp4(tm.nvfp4_quantize(ties, dim, 2688.0), ms.nvfp4_quantize(ties, dim, 2688.0), "ties")
    amax = torch.tensor(3.0)
    _assert_same_nvfp4(tm.nvfp4_quantize(x, 1, amax), ms.nvfp4_quantize(x, 1, amax), "given amax")
    small = torch.randn(32, 48)
    for name, t in (("NaN", small.index_put((torch.tensor([3]), torch.tensor([7])), torch.tensor(NAN))),
                    ("inf", small.index_put((torch.tensor([3]), torch.tensor([7])), torch.tensor(-INF))),
                    ("zeros", torch.zeros(32, 48)),
                    ("bf16", small.to(torch.bfloat16))):  # fmt: skip
        _assert_same_nvfp4(tm.nvfp4_quantize(t, 1), ms.nvfp4_quantize(t, 1), name)
    three = x[:, :96].reshape(6, 12, 96).permute(2, 0, 1)
    _assert_same_nvfp4(tm.nvfp4_quantize(three, 0), ms.nvfp4_quantize(three, 0), "3-D permuted")


def test_nvfp4_stochastic_rounding_reads_the_torch_paths_draws() -> None:
    """Under the same seed (global generator or a given one) the kernel's stochastic values equal the
    torch path's: the same uniforms in the same order, the same comparisons."""
    x = _nvfp4_input()[:, :96]
    for dim, two_d in ((0, False), (1, False), (0, True)):
        torch.manual_seed(21)
        out = tm.nvfp4_quantize(x, dim, two_d=two_d, stochastic=True)
        torch.manual_seed(21)
        _assert_same_nvfp4(out, ms.nvfp4_quantize(x, dim, two_d=two_d, stochastic=True), f"dim {dim} {two_d}")
    out = tm.nvfp4_quantize(x, 1, stochastic=True, generator=torch.Generator().manual_seed(4))
    ref = ms.nvfp4_quantize(x, 1, stochastic=True, generator=torch.Generator().manual_seed(4))
    _assert_same_nvfp4(out, ref, "generator")
    nearest = ms.nvfp4_quantize(x, 1)[0]
    assert bool((out[0] != nearest).any()), "negative control: stochastic rounding moved some values"


def test_nvfp4_quantize_both_equals_two_torch_calls() -> None:
    """Both NVFP4 copies of a 2-D x from one read: equal to nvfp4_quantize along dim 1 then dim 0, with
    the per-tensor amax, a given one, stochastic draws in the torch path's order, E4M3 bytes, and a
    transposed bf16 input; full-block shapes keep the torch path's strides."""
    x = _nvfp4_input()
    rows, columns = tm.nvfp4_quantize_both(x)
    _assert_same_nvfp4(rows, ms.nvfp4_quantize(x, 1), "row-wise")
    _assert_same_nvfp4(columns, ms.nvfp4_quantize(x, 0), "column-wise")
    whole = x[:64, :96]
    torch.manual_seed(8)
    rows, columns = tm.nvfp4_quantize_both(whole, 2688.0, stochastic=True, values_dtype=torch.float8_e4m3fn)
    torch.manual_seed(8)
    for out, dim in ((rows, 1), (columns, 0)):
        values, scales, s_enc = ms.nvfp4_quantize(whole, dim, 2688.0, stochastic=True)
        _assert_same_nvfp4(out, (values.to(torch.float8_e4m3fn), scales, s_enc), f"stochastic, dim {dim}")
        assert out[0].stride() == values.stride() and out[1].stride() == scales.stride(), f"layout, dim {dim}"
    t = whole.t().to(torch.bfloat16)
    rows, columns = tm.nvfp4_quantize_both(t)
    _assert_same_nvfp4(rows, ms.nvfp4_quantize(t, 1), "bf16 transposed, row-wise")
    _assert_same_nvfp4(columns, ms.nvfp4_quantize(t, 0), "bf16 transposed, column-wise")


def test_nvfp4_quantize_both_rotated_equals_two_torch_calls() -> None:
    """The recipe's NVFP4 input and gradient: the plain row-wise copy and the Hadamard-transformed
    column-wise one from one amax read and one quantizing read, equal to nvfp4_quantize(x, 1) and
    nvfp4_quantize_rotated(x, 0) (itself checked against the torch path above), stochastic draws in
    that order, E4M3 bytes, a bf16 input with a partial last row-wise block, NaN data."""
    x = _nvfp4_input()[:64]
    rows, columns = tm.nvfp4_quantize_both_rotated(x)
    _assert_same_nvfp4(rows, ms.nvfp4_quantize(x, 1), "row-wise")
    _assert_same_nvfp4(columns, tm.nvfp4_quantize_rotated(x, 0), "column-wise")
    t = x[:, :40].to(torch.bfloat16)
    torch.manual_seed(3)
    rows, columns = tm.nvfp4_quantize_both_rotated(t, stochastic=True, values_dtype=torch.float8_e4m3fn)
    torch.manual_seed(3)
    values, scales, s_enc = ms.nvfp4_quantize(t, 1, stochastic=True)
    _assert_same_nvfp4(rows, (values.to(torch.float8_e4m3fn), scales, s_enc), "stochastic row-wise")
    expected = tm.nvfp4_quantize_rotated(t, 0, stochastic=True, values_dtype=torch.float8_e4m3fn)
    _assert_same_nvfp4(columns, expected, "stochastic column-wise")
    x[3, 7] = NAN
    rows, columns = tm.nvfp4_quantize_both_rotated(x)
    _assert_same_nvfp4(rows, ms.nvfp4_quantize(x, 1), "NaN, row-wise")
    _assert_same_nvfp4(columns, tm.nvfp4_quantize_rotated(x, 0), "NaN, column-wise")
    with pytest.raises(ValueError, match="blocks of 16; dimension 0 has 72"):
        tm.nvfp4_quantize_both_rotated(_nvfp4_input())


def _butterfly_rht(x: torch.Tensor, dim: int, signs=ms.RHT_SIGNS) -> torch.Tensor:
    """random_hadamard_transform with the kernel's order of additions (`_fwht16`), in torch."""
    moved = x.float().movedim(dim, -1)
    z = moved.unflatten(-1, (-1, 16)) * torch.tensor([0.25 * s for s in signs])
    for h in (1, 2, 4, 8):
        pairs = z.unflatten(-1, (16 // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        z = torch.stack([a + b, a - b], dim=-2).flatten(-3)
    return (z.flatten(-2) + 0.0).movedim(-1, dim)  # an exact zero sum is +0.0, as the kernel makes it


def _gamma(n: int) -> float:
    """n u / (1 - n u), u = 2**-24: the bound on the relative error of n float32 additions."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def test_nvfp4_rotated_equals_the_torch_path() -> None:
    """The RHT in the kernel: where the transform's float32 sums are exact (small dyadic inputs, any
    order of addition gives them), equal to nvfp4_quantize(random_hadamard_transform(x)) bit for bit,
    along either dimension, stochastic too; on general inputs, equal to the torch path run on the
    kernel's order of additions, which is the transform within float32 summation error (the butterfly
    is 4 additions deep, the matmul's order is unknown: |difference| <= (gamma_4 + gamma_15) *
    sum|x_i| / 4 over the block, plus the products' rounding below float32's normal range)."""
    g = torch.Generator().manual_seed(13)
    exact = torch.randint(-64, 64, (48, 64), generator=g).float() * 2.0 ** torch.randint(
        -4, 4, (48, 1), generator=g
    )
    exact[5, 16:32] = 0.0
    for dim in (0, 1):
        ref = ms.nvfp4_quantize(ms.random_hadamard_transform(exact, ms.RHT_SIGNS, dim), dim)
        _assert_same_nvfp4(tm.nvfp4_quantize_rotated(exact, dim), ref, f"exact sums, dim {dim}")
    torch.manual_seed(2)
    out = tm.nvfp4_quantize_rotated(exact, 0, stochastic=True)
    torch.manual_seed(2)
    ref = ms.nvfp4_quantize(ms.random_hadamard_transform(exact, ms.RHT_SIGNS, 0), 0, stochastic=True)
    _assert_same_nvfp4(out, ref, "exact sums, stochastic")
    x = _nvfp4_input()[:64, :96]
    x[x.isinf()] = 1e3
    for dim in (0, 1):
        rotated = _butterfly_rht(x, dim)
        block_sums = x.abs().movedim(dim, -1).unflatten(-1, (-1, 16)).sum(-1, keepdim=True) / 4
        bound = (_gamma(4) + _gamma(15)) * block_sums.expand(*block_sums.shape[:-1], 16).flatten(-2).movedim(
            -1, dim
        )
        bound += 16 * 2.0**-149  # float32 subnormal inputs: each x/4 may round by half a subnormal step
        assert bool(((rotated - ms.random_hadamard_transform(x, ms.RHT_SIGNS, dim)).abs() <= bound).all())
        _assert_same_nvfp4(tm.nvfp4_quantize_rotated(x, dim), ms.nvfp4_quantize(rotated, dim), f"dim {dim}")
        assert tm.nvfp4_amax(x, dim, ms.RHT_SIGNS).item() == rotated.abs().max().item()
    other = tuple(-s for s in ms.RHT_SIGNS)
    out = tm.nvfp4_quantize_rotated(exact, 1, other)
    _assert_same_nvfp4(
        out, ms.nvfp4_quantize(ms.random_hadamard_transform(exact, other, 1), 1), "other signs"
    )


def test_nvfp4_amax_and_bad_input() -> None:
    """The amax kernel: max|x| with NaN propagating (also in a tile other than the first), 0 when empty;
    errors that say what was wrong."""
    x = _nvfp4_input()
    assert tm.nvfp4_amax(x).item() == x.abs().max().item()
    x[70, 100] = NAN
    assert math.isnan(tm.nvfp4_amax(x, 0).item())
    assert tm.nvfp4_amax(torch.empty(0, 16)).item() == 0.0
    with pytest.raises(ValueError, match="blocks of 16; dimension 1 has 104"):
        tm.nvfp4_quantize_rotated(x, 1)
    with pytest.raises(ValueError, match="16 signs"):
        tm.nvfp4_quantize_rotated(x[:64, :64], 0, (1, -1))
    with pytest.raises(ValueError, match="values_dtype"):
        tm.nvfp4_quantize(x, 0, values_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D tensor"):
        tm.nvfp4_quantize(x.view(2, 36, 104), 0, two_d=True)


def test_the_kernels_run_in_the_interpreter() -> None:
    """The module under test is the interpreted copy (so the tests above ran the kernels' code)."""
    assert isinstance(tm._mx_blocks_kernel, InterpretedFunction)
    assert isinstance(tm._nvfp4_rotated_kernel, InterpretedFunction)


# ---- compiled for a GPU (no GPU needed) ------------------------------------------------------------------


def _compiled_ptx(module, name: str, pointers: dict[str, str], constants: dict, options=None) -> str:
    """PTX of one kernel compiled for sm_90 with the launch options (Triton's frontend, LLVM, ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(module, name)
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constants else pointers.get(p, "i32") for p in params}
    source = ASTSource(fn, signature, {(params.index(k),): v for k, v in constants.items()})
    options = module._OPTIONS if options is None else options
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.slow
def test_the_kernels_compile_for_a_gpu_with_exact_arithmetic() -> None:
    """Every kernel compiles for an NVIDIA GPU (sm_90, no device needed) with the launch options, and
    its PTX has no fused multiply-add (each float32 operation rounds once, as in the interpreter) and
    no approximate division (quotients are IEEE float64 divisions): the interpreter's results are the
    device's."""
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        compiled = _load_interpreted()  # the same file, decorated for compilation
    assert not isinstance(compiled._mx_blocks_kernel, InterpretedFunction)
    mx = {"LIMIT": 448.0, "MANT": 3, "MIN_EXP": -6, "B": 32}
    nv = {"x_ptr": "*i16", "v_ptr": "*fp32", "s_ptr": "*u8", "u_ptr": "*fp32", "s_enc_ptr": "*fp32"}
    mx_ptrs = {"x_ptr": "*i16", "v_ptr": "*u8", "s_ptr": "*u8", "vr_ptr": "*u8", "sr_ptr": "*u8"}
    plain = {"STOCHASTIC": True, "OUT_FP8": False, "IN_BF16": True}
    rotated = {"SIGNS": 0x1234, "STOCHASTIC": False, "OUT_FP8": True, "IN_BF16": True, "BP": 1, "NBK": 4}
    cases = [
        ("_mx_blocks_kernel", mx_ptrs, {**mx, "BP": 32, "BN": 128, "BQ": 1, "IN_BF16": True}),
        (
            "_mx_matrix_kernel",
            {**mx_ptrs, "x_ptr": "*fp32", "vc_ptr": "*u8", "sc_ptr": "*u8"},
            {**mx, "BR": 64, "BC": 64, "IN_BF16": False, "ROWWISE": True, "COLUMNWISE": True, "TWO_D": False},
        ),
        ("_nvfp4_plain_kernel", nv, {**plain, "BP": 32, "NBK": 8, "BQ": 1}),
        (
            "_nvfp4_rotated_kernel",
            {
                **nv,
                "v_ptr": "*u8",
                "vr_ptr": "*u8",
                "sr_ptr": "*u8",
                "ur_ptr": "*fp32",
                "s_enc_r_ptr": "*fp32",
            },
            {**rotated, "BQ": 64, "ROWWISE": True},
        ),
        (
            "_nvfp4_matrix_kernel",
            {
                **nv,
                "vr_ptr": "*u8",
                "sr_ptr": "*u8",
                "ur_ptr": "*fp32",
                "vc_ptr": "*u8",
                "sc_ptr": "*u8",
                "uc_ptr": "*fp32",
            },
            {
                **plain,
                "OUT_FP8": True,
                "BR": 64,
                "BC": 64,
                "ROWWISE": True,
                "COLUMNWISE": True,
                "TWO_D": False,
            },
        ),
        (
            "_amax_kernel",
            {"x_ptr": "*i16", "out_ptr": "*fp32", "out_plain_ptr": "*fp32"},
            {"ROTATE": True, "PLAIN_TOO": True, "SIGNS": 5, "BP": 1, "NBK": 4, "BQ": 64, "IN_BF16": True},
        ),
    ]
    for name, pointers, constants in cases:
        ptx = _compiled_ptx(compiled, name, pointers, constants)
        assert "mul.rn.f32" in ptx and "div.rn.f64" in ptx or name == "_amax_kernel", name
        for forbidden in ("fma.rn.f32", "div.full.f32", "div.approx", "add.ftz.f32", "mul.ftz.f32"):
            assert forbidden not in ptx, f"{name}: {forbidden}"
    fused = _compiled_ptx(compiled, *cases[3], options={"enable_fp_fusion": True})
    assert "fma.rn.f32" in fused, "negative control: Triton's default fuses the butterflies' products"
