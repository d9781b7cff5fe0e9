"""What FP8 layers save for backward: bytes counted with saved-tensor hooks per recipe and option,
and the backward with FP8 bytes saved equal bit for bit to the one without (same FP8 values)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fp8train
from fp8train.modules.layernorm_linear import _ActivationSavedFP8
from fp8train.numerics.gemm import Operand, operand_dtype
from fp8train.numerics.microscaling import e8m0_to_float
from fp8train.quantization.block_scaling import TILE, quantize_tiles
from fp8train.saved import ENV_SAVE_FP8, decode_fp8, pack, saves_fp8_bytes, unpack
from fp8train.tools.bench.memory import saved_bytes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RECIPES = {
    "delayed": fp8train.DelayedScaling,
    "current": fp8train.Float8CurrentScaling,
    "block": fp8train.Float8BlockScaling,
    "mxfp8": fp8train.MXFP8BlockScaling,
    "nvfp4": fp8train.NVFP4BlockScaling,
}
T, H, F_ = 512, 256, 1024  # tokens, hidden, ffn: every dimension a whole number of 128-tiles


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_decode_fp8_is_torchs_conversion_for_every_byte(dtype, out) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    want, got = codes.to(out), decode_fp8(codes, out)
    assert got.dtype == out and got.shape == codes.shape
    bits = torch.int16 if out == torch.bfloat16 else torch.int32
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # NaN payloads may differ; everything else bit for bit
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_e2m1_values_pack_two_to_a_byte_and_come_back(monkeypatch) -> None:
    monkeypatch.setenv(ENV_SAVE_FP8, "1")
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    values = grid[torch.randint(0, 16, (32, 48), generator=torch.Generator().manual_seed(0))]
    scales = torch.rand(2, 48).to(torch.float8_e4m3fn).float()
    operand = Operand(values.to(torch.float8_e4m3fn), scales, (16, 1), tensor_scale=torch.tensor(3.0))
    packed, form = pack(operand, e2m1=True)
    assert packed.values.dtype == torch.uint8 and packed.values.shape == (32, 24)
    assert packed.scale_inv.dtype == torch.float8_e4m3fn
    back = unpack(packed, form)
    assert torch.equal(back.values.view(torch.uint8), operand.values.view(torch.uint8))  # -0.0 kept
    assert torch.equal(back.scale_inv, scales) and back.layout == operand.layout


def test_e8m0_scales_are_kept_as_their_bytes_and_come_back(monkeypatch) -> None:
    monkeypatch.setenv(ENV_SAVE_FP8, "1")
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    operand = Operand(torch.zeros(8, 1024).to(torch.float8_e4m3fn), e8m0_to_float(codes), (1, 32))
    packed, form = pack(operand, e8m0=True)
    assert torch.equal(packed.scale_inv, codes)  # every byte, 0 (2**-127, subnormal) and 255 (NaN) too
    back = unpack(packed, form).scale_inv
    assert torch.equal(back.view(torch.int32), operand.scale_inv.view(torch.int32))


def test_the_option_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(ENV_SAVE_FP8, "yes")
    with pytest.raises(ValueError, match="FP8TRAIN_SAVE_FP8='yes' is not valid"):
        saves_fp8_bytes()
    with pytest.raises(ValueError, match="save_activation_input_fp8 must be True or False"):
        fp8train.LayerNormMLP(32, 64, save_activation_input_fp8="yes")


def _mlp_saved(
    recipe: str | None, x: torch.Tensor, **kw
) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """Saved bytes of LayerNormMLP's forward, its grads, and the saved tensors by storage."""
    torch.manual_seed(0)
    m = fp8train.LayerNormMLP(H, F_, **kw)
    x = x.clone().requires_grad_()
    with fp8train.fp8_autocast(enabled=recipe is not None, fp8_recipe=RECIPES[recipe]() if recipe else None):
        y, total, tensors = saved_bytes(lambda: m(x), m.parameters())
    torch.manual_seed(1)  # NVFP4's stochastic gradient rounding: the same draws in every run
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return total, [x.grad, *(p.grad for p in m.parameters())], tensors


def _bf16_autocast_saved(x: torch.Tensor) -> int:
    ref = torch.nn.Sequential(
        torch.nn.LayerNorm(H), torch.nn.Linear(H, F_), torch.nn.GELU("tanh"), torch.nn.Linear(F_, H)
    )
    with torch.autocast("cpu", torch.bfloat16):
        return saved_bytes(lambda: ref(x.clone().requires_grad_()), ref.parameters())[1]


def _frozen_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the one region's frozen scales that delayed scaling's GEMMs save views of."""
    frozen = [t for t in tensors if t.dim() == 0 and t.dtype == torch.float32]
    assert len(frozen) == 1, [(tuple(t.shape), t.dtype) for t in tensors]
    return frozen[0].untyped_storage().nbytes()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_saved_bytes_per_recipe_fp8_vs_bf16_autocast_vs_fp32(recipe, monkeypatch) -> None:
    """Every forward tensor of the block saved in FP8: 1 byte per element of each GEMM operand and of
    the activation's input (NVFP4's operands half a byte), plus scales; only the norm's fp32 input
    (and its per-row statistics) in high precision. The counts are exact up to the scales."""
    x = torch.randn(T, H)
    bf16 = _bf16_autocast_saved(x)
    fp32, _, _ = _mlp_saved(None, x)
    monkeypatch.setenv(ENV_SAVE_FP8, "0")
    default, _, default_tensors = _mlp_saved(recipe, x)
    monkeypatch.setenv(ENV_SAVE_FP8, "1")
    fp8, _, tensors = _mlp_saved(recipe, x, save_activation_input_fp8=True)
    norm = T * H * 4 + 2 * T * 4  # the LayerNorm's fp32 input, mean and rstd
    operand_elements = T * H + H * F_ + F_ * H + T * F_  # fc1's x and w, fc2's w and x
    values = operand_elements // 2 if recipe == "nvfp4" else operand_elements
    activation = T * F_ + T * F_ // TILE * 4  # E4M3 bytes and one fp32 scale per 1x128 tile
    # per-tensor: fp32 scalars; block: fp32 per tile; MXFP8: a byte per 32; NVFP4: a byte per 16
    scales = {
        "delayed": 64,
        "current": 64,
        "block": 4 * (T * H + T * F_) // TILE + 4 * 2 * H * F_ // TILE**2,
        "mxfp8": operand_elements // 32,
        "nvfp4": operand_elements // 16 + 64,
    }
    handle = (
        8  # the module's handle, an int64 scalar tensor both GEMMs save (compiled graphs name modules by it)
    )
    if recipe == "delayed":  # both GEMMs save views of one storage, the region's frozen scales (a stack
        # over the amax group's roles, which grows with the modules the group has met: shared by every
        # GEMM of the region), and the region's token
        scales["delayed"] = _frozen_bytes(tensors) + 8
    low = norm + values + activation + handle
    assert low <= fp8 <= low + scales[recipe], (recipe, fp8, low)
    big = [t for t in tensors if t.numel() >= T * H and t.dtype.itemsize > 1]
    assert [tuple(t.shape) for t in big] == [(T, H)]  # only the norm's input
    assert fp8 < 0.62 * bf16 < bf16 < fp32  # measured: 0.43 (NVFP4) to 0.61 (MXFP8's fp32 scales)
    if recipe in ("delayed", "current"):  # by default: the CPU's bf16-path operands (gemm.operand_dtype:
        # fp32 where the CPU has no bf16 instructions, bf16 where it has them), fp32 h
        extra = operand_dtype("bf16", torch.device("cpu")).itemsize - 1
        frozen = _frozen_bytes(default_tensors) - _frozen_bytes(tensors) if recipe == "delayed" else 0
        assert default == fp8 + frozen + extra * operand_elements + (3 * T * F_ - T * F_ // TILE * 4)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_backward_from_fp8_bytes_equals_the_backward_from_the_gemms_operands(recipe, monkeypatch) -> None:
    x = torch.randn(T, H)
    monkeypatch.setenv(ENV_SAVE_FP8, "0")
    before, grads, _ = _mlp_saved(recipe, x)
    monkeypatch.setenv(ENV_SAVE_FP8, "1")
    after, grads_bytes, _ = _mlp_saved(recipe, x)
    for g, gb in zip(grads, grads_bytes):
        assert torch.equal(g, gb)
    if recipe in ("delayed", "current", "nvfp4"):  # bf16 values (the CPU's GEMM path), E2M1 in bytes
        assert after < before  # the option did something


def test_activation_gradient_is_taken_at_the_saved_fp8_values() -> None:
    """Bit for bit the gradient of gelu at h's E4M3 tiles; against the gradient at h itself within
    the bound the tile quantization gives: |gelu'(h) - gelu'(q)| <= L |h - q|, L = max |gelu''|."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 2 * TILE, generator=g) * 3).requires_grad_()
    grad = torch.randn(64, 2 * TILE, generator=g)
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    (got,) = torch.autograd.grad(_ActivationSavedFP8.apply(h, act), h, grad)
    q_values, scale_inv = quantize_tiles(h.detach(), 1, power_2=True)
    q = Operand(q_values, scale_inv, (1, TILE)).dequantize().requires_grad_()
    (at_q,) = torch.autograd.grad(act(q), q, grad)
    assert torch.equal(got, at_q)
    (exact,) = torch.autograd.grad(act(h), h, grad)
    grid = torch.linspace(-10, 10, 200001, dtype=torch.float64).requires_grad_()
    (d1,) = torch.autograd.grad(act(grid).sum(), grid, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), grid)
    lipschitz = d2.abs().max().item() * 1.01  # the grid's step: well within 1%
    bound = grad.abs() * lipschitz * (h.detach() - q.detach()).abs() + 1e-6 * grad.abs()
    assert ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, exact)  # the values saved are FP8 ones, not h


def test_activation_input_in_fp8_refuses_a_double_backward() -> None:
    m = fp8train.LayerNormMLP(32, 128, save_activation_input_fp8=True)
    x = torch.randn(16, 32, requires_grad=True)
    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
        y = m(x)
    with pytest.raises(RuntimeError, match="activation whose input was saved in FP8"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_outside_fp8_the_activation_input_is_kept_in_high_precision() -> None:
    x = torch.randn(T, H)
    plain, grads, _ = _mlp_saved(None, x)
    option, grads_option, _ = _mlp_saved(None, x, save_activation_input_fp8=True)
    assert plain == option and all(torch.equal(a, b) for a, b in zip(grads, grads_option))


def test_fp8_gemm_outputs_are_in_the_autocast_dtype() -> None:
    """Under torch.autocast an FP8 GEMM's output is the autocast dtype (TransformerEngine's rule):
    the fp32 output rounded once. Gradients stay in their tensors' dtypes."""
    torch.manual_seed(0)
    m = fp8train.Linear(64, 32)
    m2 = copy.deepcopy(m)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
        y32 = m(x)
        with torch.autocast("cpu", torch.bfloat16):
            y16 = m2(x)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))
    y16.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m2.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_with_the_activation_input_in_fp8_trains_like_without(activation) -> None:
    """The gradients with h saved in FP8 differ from those without by the activation's error at h's
    E4M3 values (at most L * 2**-4 relative, L <= 1.1 for GELU and SiLU-gated products of unit-scale
    inputs) on top of both runs' own FP8 gradient error (each within U_E5M2 + U_E4M3 of the exact
    gradient, normwise, as tests/modules/test_modules.py bounds): within 2 * (U_E5M2 + U_E4M3) + 2**-4."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    grads, saved = [], []
    for option in (False, True):
        torch.manual_seed(0)
        m = fp8train.LayerNormMLP(128, 256, activation=activation, save_activation_input_fp8=option)
        xi = x.clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
            y, total, _ = saved_bytes(lambda m=m, xi=xi: m(xi), m.parameters())
        y.square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in m.parameters())])
        saved.append(total)
    tol = 2 * (2.0**-3 + 2.0**-4) + 2.0**-4
    for a, b in zip(*grads):
        assert torch.isfinite(b).all()
        assert (b - a).norm() <= tol * a.norm()
    assert not all(torch.equal(a, b) for a, b in zip(*grads))
    halves = 2 if activation == "swiglu" else 1  # h: fp32 (4 bytes) -> 1 byte and a scale per tile
    gated = 64 * 256 * 4 if activation == "swiglu" else 0  # silu(gate), which the product also saves
    assert saved[0] - saved[1] == 64 * halves * 256 * 3 - 64 * halves * 256 // 128 * 4 + gated
