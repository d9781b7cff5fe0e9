"""FP8 cast and GEMM paths: saturation, rounding, and the paths agreeing within their rounding."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

import fp8train
from fp8train.numerics import cast
from fp8train.numerics.cast import amax, cast_operand, quantize
from fp8train.numerics.gemm import bf16_kernel, choose_path, cpu_bf16_instructions, gemm, has_scaled_mm
from fp8train.tools.bench.common import PassCounter
from reference import E4M3_MAX, E5M2_MAX, quant_error_bound

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT = {"e4m3": (3, -6, E4M3_MAX), "e5m2": (2, -14, E5M2_MAX)}  # mantissa bits, min exponent, max


# ---- cast --------------------------------------------------------------------------------------


def test_amax() -> None:
    x = torch.tensor([[1.0, -7.5], [3.0, 0.25]])
    assert amax(x).item() == 7.5 and amax(x).dtype == torch.float32
    assert amax(x.to(torch.bfloat16)).item() == 7.5
    assert amax(torch.empty(0, 4)).item() == 0.0
    assert torch.isnan(amax(torch.tensor([1.0, float("nan")])))
    assert amax(torch.tensor([1.0, -float("inf")])).item() == float("inf")


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_quantize_saturates_instead_of_overflowing(encoding: str) -> None:
    limit = FORMAT[encoding][2]
    q = quantize(torch.tensor([1e9, -1e9, 2 * limit, -float("inf")]), torch.tensor(1.0), encoding)
    assert q.dtype == DTYPES[encoding]
    assert q.float().tolist() == [limit, -limit, limit, -limit]


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_quantize_is_exact_on_representable_values(encoding: str) -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(DTYPES[encoding]).float()
    values = values[torch.isfinite(values)]
    assert torch.equal(quantize(values, torch.tensor(1.0), encoding).float(), values)
    # a power-of-two scale only moves the exponent
    assert torch.equal(quantize(values / 4, torch.tensor(4.0), encoding).float(), values)


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_quantize_rounding_error_is_bounded(encoding: str) -> None:
    mbits, emin, limit = FORMAT[encoding]
    x = torch.randn(4096) * torch.logspace(-6, 2, 4096)
    scale = limit / x.abs().max().item()
    q = quantize(x, torch.tensor(scale), encoding).double() / scale
    err = (q - x.double()).abs()
    assert (err <= quant_error_bound(x, scale, mbits, emin)).all()
    assert err.max() > 0  # it really was rounded to FP8


def _naive_cast(x: torch.Tensor, scale: float, encoding: str) -> torch.Tensor:
    """The FP8 cast in its plainest form: the float32 product, saturated, converted by torch."""
    limit = FORMAT[encoding][2]
    return (x.float() * torch.tensor(scale)).clamp(-limit, limit).to(DTYPES[encoding])


@functools.cache
def _hard_values(encoding: str) -> torch.Tensor:
    """Every FP8 value, every tie between neighbours and its float32 neighbours, zeros of both signs,
    NaN, values beyond the range, and a wide random sample, of both signs."""
    limit = FORMAT[encoding][2]
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(DTYPES[encoding]).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor(float("inf"))
    g = torch.Generator().manual_seed(7)
    sample = [torch.randn(100_000, generator=g) * 10.0**e for e in range(-12, 8, 2)]
    special = torch.tensor([0.0, -0.0, float("nan"), 2 * limit, -2 * limit, float("inf"), -float("inf")])
    x = torch.cat([grid, ties, torch.nextafter(ties, inf), torch.nextafter(ties, -inf), special, *sample])
    return torch.cat([x, -x])  # callers do not modify it (cached)


def _cast_and_amax(x, scale, encoding, dtype, transposed, seam=None):
    """`cast.cast_with_amax` (or `seam`, of its signature) with a fresh amax slot (0: neutral for the
    MAX): (values, values_t, max|x|)."""
    from fp8train.numerics import cast

    amax_out = torch.zeros((), dtype=torch.float32)
    values, values_t = (seam or cast.cast_with_amax)(
        x, scale, encoding, dtype, transposed=transposed, amax_out=amax_out
    )
    return values, values_t, amax_out


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    return (got.view(bits) == want.view(bits)) | (got.float().isnan() & want.float().isnan())


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, "fp8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_casts_equal_the_fp8_cast_bit_for_bit(encoding: str, dtype, x_dtype: torch.dtype) -> None:
    """cast_operand (float arithmetic, in pieces on the CPU) and quantize give exactly what torch's
    FP8 cast of the saturated float32 product gives (and back, for bf16/fp32 operands), -0.0 and
    NaN included, from float32 and from bf16 inputs (read as they are, multiplied in float32)."""
    dtype = DTYPES[encoding] if dtype == "fp8" else dtype
    x = _hard_values(encoding).to(x_dtype)
    for scale in (1.0, 3.0, 2.0**-7):
        want = _naive_cast(x, scale, encoding).to(dtype)
        got = cast_operand(x, torch.tensor(scale), encoding, dtype)
        same = _same_bits(got, want)
        assert got.dtype == dtype and bool(same.all()), x[~same][:5]
        if dtype in DTYPES.values():
            assert torch.equal(
                quantize(x, torch.tensor(scale), encoding).view(torch.uint8), got.view(torch.uint8)
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rounding_by_conversion_equals_the_arithmetic(monkeypatch, dtype) -> None:
    """CUDA rounds bf16/fp32 operands by converting to FP8 and back (4 kernels): forced here on the
    CPU, it gives the arithmetic's values bit for bit."""
    x = _hard_values("e4m3")
    want = cast_operand(x, torch.tensor(3.0), "e4m3", dtype)
    # the device decides how it rounds (no setting may): the CUDA answer, forced on the CPU
    monkeypatch.setattr(cast, "_rounds_by_conversion", lambda device: True)
    with PassCounter() as counter:
        got = cast_operand(x, torch.tensor(3.0), "e4m3", dtype)
    assert bool(_same_bits(got, want).all())
    assert counter.kernels == 4 * len(cast._pieces(x, torch.tensor(3.0), got))


# the kernels (= passes over the operand) of each cast; before fusion: 10 to a bf16 operand and 9 to
# an fp32 one from float32 (one more from bf16: an upcast copy first), 3 to FP8 (4 from bf16)
CAST_PASSES = {torch.bfloat16: 8, torch.float32: 7, torch.float8_e4m3fn: 3}


@pytest.mark.parametrize("dtype", list(CAST_PASSES))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cast_makes_few_passes_and_no_full_size_temporaries(monkeypatch, dtype, x_dtype) -> None:
    """Whole (as on CUDA and under compile): 8 kernels to a bf16 operand, 7 to fp32, 3 to FP8, each
    one pass. In pieces (the CPU, eagerly, for large tensors; made small here): the same passes, and no
    temporary larger than a piece."""
    x, scale = torch.randn(64, 512).to(x_dtype), torch.tensor(5.0)
    with PassCounter() as whole:
        want = cast_operand(x, scale, "e4m3", dtype)
    assert whole.kernels == CAST_PASSES[dtype] and whole.elements == CAST_PASSES[dtype] * x.numel()
    # a constant of the hot path, not a setting (issue 37: no lookup per cast); small pieces for a test
    monkeypatch.setattr(cast, "PIECE_ELEMENTS", 1024)
    piece = 1024 * torch.get_num_threads()
    with PassCounter() as pieces:
        got = cast_operand(x, scale, "e4m3", dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert pieces.elements == CAST_PASSES[dtype] * x.numel()
    assert 0 < pieces.largest_temporary(got) <= piece < x.numel()


def test_cast_in_pieces_cuts_scales_that_vary_along_the_first_dimension(monkeypatch) -> None:
    """Block scales (one per tile, broadcast over the tile) are cut with the rows they scale; a scale
    that broadcasts over dim 0 is shared; rows longer than a piece go one by one."""
    g = torch.Generator().manual_seed(3)
    tiles = torch.randn(8, 4, 3, 128, generator=g) * 50
    block_scales = torch.rand(8, 1, 3, 1, generator=g) * 4 + 0.5
    cases = [
        (tiles, block_scales),
        (tiles, torch.rand(1, 1, 3, 1, generator=g) + 0.5),
        (torch.randn(3, 5000, generator=g), torch.rand(5000, generator=g) + 0.5),
        (torch.randn(70_000, generator=g), torch.tensor(7.0)),
    ]
    wants = [cast_operand(x, s, "e4m3", torch.bfloat16) for x, s in cases]
    monkeypatch.setattr(cast, "PIECE_ELEMENTS", 700)  # the hot path's constant (above), made small
    for (x, s), want in zip(cases, wants):
        assert len(cast._pieces(x, s, want)) > 1
        assert torch.equal(cast_operand(x, s, "e4m3", torch.bfloat16), want)


def test_amax_is_one_pass() -> None:
    """The CPU's amax: one aminmax pass (then scalar ops); elsewhere one vector_norm kernel, which
    gives the same values (NaN propagates, infinities count, bf16 read as it is)."""
    for x in (torch.randn(64, 512), torch.randn(64, 512).bfloat16()):
        with PassCounter() as counter:
            amax(x)
        assert counter.elements < 2 * x.numel()
    for values in ([1.0, -7.5, 3.0], [1.0, float("nan"), -2.0], [1.0, -float("inf")], [-0.0, 0.0]):
        for x in (torch.tensor(values), torch.tensor(values).bfloat16()):
            with PassCounter() as counter:
                by_norm = cast._amax_by_norm(x)
            want = x.float().abs().amax()
            assert counter.kernels == 1 and by_norm.dtype == torch.float32
            assert torch.equal(by_norm, want) or (by_norm.isnan() and want.isnan())


# ---- GEMM paths --------------------------------------------------------------------------------


PATH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _operands(m: int, k: int, n: int, a_enc: str = "e4m3", b_enc: str = "e4m3", path: str = "scaled_mm"):
    """FP8-valued operands, held as FP8 (scaled_mm) or exactly in the emulation's dtype."""
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    a = (torch.randn(m, k, generator=g) * 40).clamp(-448, 448).to(DTYPES[a_enc])
    b_t = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(DTYPES[b_enc])
    if path in PATH_DTYPES:
        a, b_t = a.to(PATH_DTYPES[path]), b_t.to(PATH_DTYPES[path])
    return a, torch.tensor(0.0371), b_t.t(), torch.tensor(2.75)  # b is a transposed (weight-like) view


def _exact(a, a_sinv, b, b_sinv) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product (float64) and |a| @ |b| scaled, the magnitude accumulation error scales with."""
    s = a_sinv.double() * b_sinv.double()
    return (a.double() @ b.double()) * s, (a.double().abs() @ b.double().abs()) * s


# torch's CPU kernel of _scaled_mm came after torch 2.7 (the lowest supported): its path where it runs
CPU_PATHS = ("scaled_mm", "bf16", "fp32") if has_scaled_mm("cpu") else ("bf16", "fp32")
needs_cpu_scaled_mm = pytest.mark.skipif(
    not has_scaled_mm("cpu"), reason="no CPU torch._scaled_mm in this torch"
)

PATH_SHAPES = [  # torch._scaled_mm takes dimensions that are multiples of 16 only
    (path, shape)
    for path in CPU_PATHS
    for shape in [(32, 48, 64), (17, 33, 5)]
    if path != "scaled_mm" or all(d % 16 == 0 for d in shape)
]


@pytest.mark.parametrize("encodings", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("path,shape", PATH_SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_paths_agree_with_exact_product(path, shape, encodings, out_dtype) -> None:
    m, k, n = shape
    a, a_sinv, b, b_sinv = _operands(m, k, n, *encodings, path=path)
    exact, magnitude = _exact(a, a_sinv, b, b_sinv)
    out = gemm(a, a_sinv, b, b_sinv, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # fp32 accumulation of exact products, plus the scale multiply (k + 3 roundings of 2**-24)...
    bound = (k + 3) * 2.0**-24 * magnitude
    # ...plus one bf16 rounding where the path or the output dtype is bf16 (two for a bf16 path with a
    # bf16 output: the GEMM's and the output's)
    roundings = (path == "bf16") + (out_dtype == torch.bfloat16)
    bound = bound + roundings * 2.0**-8 * exact.abs()
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_gemm_paths_agree_with_each_other() -> None:
    outs = {}
    for p in CPU_PATHS:
        a, a_sinv, b, b_sinv = _operands(64, 128, 32, path=p)
        outs[p] = gemm(a, a_sinv, b, b_sinv, torch.float32).double()
    _, magnitude = _exact(a, a_sinv, b, b_sinv)
    tol = 2 * 131 * 2.0**-24 * magnitude
    assert "scaled_mm" not in outs or ((outs["scaled_mm"] - outs["fp32"]).abs() <= tol).all()
    assert ((outs["bf16"] - outs["fp32"]).abs() <= tol + 2.0**-8 * outs["fp32"].abs()).all()
    assert not torch.equal(outs["bf16"], outs["fp32"])  # bf16 output rounding is visible


@pytest.mark.parametrize(
    "flags,isa,native",
    [
        ("fpu avx2 fma", None, False),  # an AVX2-only CPU (AMD EPYC before Zen 4): fp32 kernel
        ("fpu avx2 avx512f avx512_bf16", None, True),
        ("fpu avx2 amx_bf16 avx512_bf16", "AVX2", False),  # oneDNN kept below the CPU
        ("fpu avx2 amx_bf16 avx512_bf16", "AVX512_CORE_AMX", True),
        ("fp asimd bf16", None, True),  # Arm's "Features" line
    ],
)
def test_bf16_kernel_follows_the_cpus_instructions(tmp_path, monkeypatch, flags, isa, native) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\n{'Features' if 'asimd' in flags else 'flags'}\t\t: {flags}\n")
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    found, why = cpu_bf16_instructions(str(info))
    assert found is native and (isa in why if isa and not native else True)
    assert cpu_bf16_instructions(str(tmp_path / "absent")) == (
        False, f"the CPU's instructions are unknown here (no {tmp_path / 'absent'})"
    )  # fmt: skip


@pytest.mark.parametrize("forced,kernel", [("yes", "bf16"), ("no", "fp32"), ("auto", None)])
def test_the_cpu_probe_can_be_forced_either_way(monkeypatch, forced, kernel) -> None:
    """FP8TRAIN_CPU_BF16 forces the probe's answer, so that either kernel runs on any CPU; auto is the
    CPU's own answer, and a bad value is refused by name."""
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    monkeypatch.setenv("FP8TRAIN_CPU_BF16", forced)
    got, why = bf16_kernel(torch.device("cpu"))
    if kernel is None:
        assert got == ("bf16" if cpu_bf16_instructions()[0] else "fp32")
    else:
        assert got == kernel and f"FP8TRAIN_CPU_BF16={forced} forces the probe" in why
        a, a_sinv, b, b_sinv = _operands(64, 256, 96, path="bf16")
        y = gemm(a, a_sinv, b, b_sinv, torch.float32)
        # either kernel rounds the product once to bf16 before scaling it
        rounded = (y / (a_sinv * b_sinv)).to(torch.bfloat16).float() * (a_sinv * b_sinv)
        assert torch.equal(y, rounded)
    monkeypatch.setenv("FP8TRAIN_CPU_BF16", "maybe")
    with pytest.raises(ValueError, match="FP8TRAIN_CPU_BF16='maybe' is not valid: use auto, yes or no"):
        bf16_kernel(torch.device("cpu"))


_EITHER_KERNEL = """
import os, sys, torch
from fp8train.numerics.gemm import bf16_kernel, gemm
from test_cast_gemm import _operands
a, a_sinv, b, b_sinv = _operands(64, 256, 96, path="bf16")
out = {"kernel": bf16_kernel(torch.device("cpu"))}
out["auto"] = gemm(a, a_sinv, b, b_sinv, torch.float32)
os.environ["FP8TRAIN_GEMM"] = "bf16"
out["forced"] = (bf16_kernel(torch.device("cpu")), gemm(a, a_sinv, b, b_sinv, torch.float32))
torch.save(out, sys.argv[1])
"""


def test_bf16_path_has_the_same_numerics_on_either_kernel(tmp_path) -> None:
    """On a CPU without bf16 instructions (here: oneDNN limited to AVX2, which makes torch's bf16 GEMM
    two orders of magnitude slower than fp32, as on such a CPU) the bf16 path multiplies in fp32 and
    rounds the output to bf16: the same exact products, fp32 accumulation and one bf16 rounding, so
    it differs from the bf16 kernel only where the two accumulation orders straddle a bf16 rounding
    boundary."""
    env = {k: v for k, v in os.environ.items() if k != "FP8TRAIN_GEMM"}
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports this module and its helpers
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    path = tmp_path / "out.pt"
    subprocess.run(
        [sys.executable, "-c", _EITHER_KERNEL, str(path)],
        env=env,
        check=True,
        timeout=120,
    )
    out = torch.load(path)
    # the reason names what keeps bf16 away: oneDNN's limit where the CPU has bf16 instructions, the
    # CPU itself where it has none (the expectation follows the machine the suite runs on)
    has_bf16 = cpu_bf16_instructions()[0]
    why = "ONEDNN_MAX_CPU_ISA=AVX2" if has_bf16 else "this CPU has no bf16 instructions"
    assert out["kernel"][0] == "fp32" and why in out["kernel"][1], out["kernel"]
    (forced_kernel, _), native = out["forced"]
    assert forced_kernel == "bf16"
    step = 2.0**-7 * native.abs()  # one bf16 step (8 significant bits), at most
    assert ((native - out["auto"]).abs() <= step).all()
    assert (native != out["auto"]).float().mean() < 0.01  # accumulation-order differences only
    a, a_sinv, b, b_sinv = _operands(64, 256, 96, path="fp32")
    fp32 = gemm(a, a_sinv, b, b_sinv, torch.float32)
    assert ((out["auto"] - fp32).abs() > 0).float().mean() > 0.5  # rounded to bf16, unlike fp32


def test_choose_path_defaults_and_fallback(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    assert choose_path(cpu, 32, 32, 32) == "bf16"  # the fastest exact path on CPU
    assert choose_path(cpu, 17, 33, 5) == "bf16"
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    assert choose_path(cpu, 32, 48, 64) == ("scaled_mm" if has_scaled_mm("cpu") else "bf16")
    for shape in [(17, 32, 32), (32, 33, 32), (32, 32, 5)]:
        assert choose_path(cpu, *shape) in ("bf16", "fp32")  # an emulation, not an error
    a, a_sinv, b, b_sinv = _operands(17, 33, 5)
    why = "multiple of 16" if has_scaled_mm("cpu") else "no such kernel"
    with pytest.raises(ValueError, match=why):  # FP8 operands the hardware GEMM cannot take
        gemm(a, a_sinv, b, b_sinv, torch.float32)
    layer = fp8train.Linear(33, 5)  # the module falls back to the emulation for such shapes
    with fp8train.fp8_autocast():
        y = layer(torch.randn(17, 33))
    assert torch.isfinite(y).all() and y.shape == (17, 5)
    for forced in ("bf16", "fp32", "auto", ""):
        monkeypatch.setenv("FP8TRAIN_GEMM", forced)
        assert choose_path(cpu, 32, 32, 32) == (forced if forced in ("bf16", "fp32") else "bf16")


@pytest.mark.parametrize("value", ["fp16", "SCALED_MM", "1"])
def test_invalid_gemm_env_is_a_clear_error(monkeypatch, value: str) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", value)
    with pytest.raises(ValueError, match="FP8TRAIN_GEMM.*auto, scaled_mm, bf16 or fp32"):
        choose_path(torch.device("cpu"), 32, 32, 32)
    layer = fp8train.Linear(32, 32)
    with pytest.raises(ValueError, match="FP8TRAIN_GEMM"):
        with fp8train.fp8_autocast():
            layer(torch.randn(32, 32))


def _module_run(monkeypatch, path: str) -> tuple[torch.Tensor, ...]:
    """Two training steps of a Linear with the given GEMM path; outputs and grads of the second."""
    monkeypatch.setenv("FP8TRAIN_GEMM", path)
    fp8train.inspection.reset()
    torch.manual_seed(0)
    layer = fp8train.Linear(48, 64)
    x = torch.randn(2, 16, 48, requires_grad=True)
    g = torch.randn(2, 16, 64)
    for _ in range(2):
        layer.zero_grad()
        x.grad = None
        with fp8train.fp8_autocast():
            y = layer(x)
        (y * g).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@needs_cpu_scaled_mm
def test_module_scaled_mm_and_fp32_paths_agree(monkeypatch) -> None:
    scaled = _module_run(monkeypatch, "scaled_mm")
    fp32 = _module_run(monkeypatch, "fp32")
    for name, s, f in zip(("y", "grad_x", "grad_w", "grad_b"), scaled, fp32):
        tol = 1e-5 * f.abs().max().item()
        assert (s - f).abs().max().item() <= tol, name
