"""FP8 modules: FP8 vs fp32 within FP8 error bounds, exact torch.nn equivalence outside FP8 regions."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import fp8train
from reference import E4M3_MAX, E5M2_MAX, RefScaling, amax_of, quant_error_bound, quantize_ref

U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3  # unit roundoff of each format (round to nearest)
# Normwise relative error allowed per FP8 GEMM: each exact product carries at most u_a + u_b (+ u_a u_b).
FWD_TOL = 2 * U_E4M3
BWD_TOL = U_E5M2 + U_E4M3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, fp8: bool) -> list[torch.Tensor]:
    """Output, grad of the input and grads of every parameter of one step with loss sum(y * g)."""
    module.zero_grad()
    x = x.clone().requires_grad_()
    with fp8train.fp8_autocast(enabled=fp8):
        y = module(x)
    (y * g).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "Linear": lambda: fp8train.Linear(64, 96),
    "LayerNormLinear-LayerNorm": lambda: fp8train.LayerNormLinear(64, 96),
    "LayerNormLinear-RMSNorm": lambda: fp8train.LayerNormLinear(64, 96, normalization="RMSNorm"),
    "LayerNormMLP-gelu": lambda: fp8train.LayerNormMLP(64, 128),
    "LayerNormMLP-swiglu": lambda: fp8train.LayerNormMLP(64, 128, activation="swiglu", bias=False),
}


@pytest.mark.parametrize("x_shape", [(24, 64), (2, 12, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("name", list(MODULES))
def test_fp8_forward_backward_within_fp8_error(name: str, x_shape: tuple) -> None:
    torch.manual_seed(0)
    module = MODULES[name]()
    x = torch.randn(x_shape) * 3
    out_features = 64 if "MLP" in name else 96
    g = torch.randn(*x_shape[:-1], out_features)
    ref = _run(module, x, g, fp8=False)
    gemms = 2 if "MLP" in name else 1
    names = ["y", "grad_x"] + [n for n, _ in module.named_parameters()]
    for step in range(3):  # step 0 runs with scale 1, later ones with delayed scales
        got = _run(module, x, g, fp8=True)
        for what, a, b in zip(names, got, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, what
            tol = gemms * (FWD_TOL if what == "y" else BWD_TOL)
            err = _rel(a, b)
            assert err <= tol, f"step {step} {what}: relative error {err:.4f} > {tol}"
            if what in ("bias", "fc2_bias"):  # a sum of grad_output in high precision
                assert err < 1e-6, what
        assert _rel(got[0], ref[0]) > 1e-3  # it really ran in FP8


def _linear_bound(x, sx, w, sw, mx: int, ex: int, mw: int, ew: int) -> torch.Tensor:
    """Elementwise worst-case |FP8 GEMM - exact| for x @ w.T without saturation (bf16 output)."""
    dx = quant_error_bound(x, sx, mx, ex)
    dw = quant_error_bound(w, sw, mw, ew)
    ax, aw = x.double().abs(), w.double().abs()
    k = x.shape[-1]
    return dx @ (aw + dw).T + ax @ dw.T + (2.0**-8 + (k + 3) * 2.0**-24) * ((ax + dx) @ (aw + dw).T)


@pytest.mark.parametrize("norm", [None, "LayerNorm", "RMSNorm"])
def test_fp8_gemms_within_elementwise_bound(norm) -> None:
    """Every element of y, grad_x (Linear) and grad_w within the rigorous rounding bound of FP8 operands."""
    torch.manual_seed(1)
    if norm is None:
        module = fp8train.Linear(48, 40)
    else:
        module = fp8train.LayerNormLinear(48, 40, normalization=norm)
    x = torch.randn(3, 10, 48) * torch.logspace(-2, 1, 48)
    g = torch.randn(3, 10, 40) * 1e-3
    for _ in range(3):
        fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
        sx, sw, sg = fwd.scale[0].item(), fwd.scale[1].item(), bwd.scale[0].item()
        y, gx, *grads = _run(module, x, g, fp8=True)
        gw = (
            grads[0]
            if norm is None
            else dict(zip([n for n, _ in module.named_parameters()], grads))["weight"]
        )
        with torch.no_grad():
            inp = (x if norm is None else module.norm(x)).reshape(-1, 48)
        w, g2 = module.weight.detach(), g.reshape(-1, 40)
        exact_y = inp.double() @ w.double().T + module.bias.double()
        bound_y = _linear_bound(inp, sx, w, sw, 3, -6, 3, -6) + 2.0**-23 * exact_y.abs()  # + the bias add
        assert ((y.reshape(-1, 40).double() - exact_y).abs() <= bound_y).all()
        exact_gw = g2.double().T @ inp.double()
        assert ((gw.double() - exact_gw).abs() <= _linear_bound(g2.T, sg, inp.T, sx, 2, -14, 3, -6)).all()
        if norm is None:
            exact_gx = g2.double() @ w.double()
            bound = _linear_bound(g2, sg, w.T, sw, 2, -14, 3, -6)
            assert ((gx.reshape(-1, 48).double() - exact_gx).abs() <= bound).all()


def test_linear_equals_fp8_emulation_with_its_delayed_scales(monkeypatch) -> None:
    """The module quantizes with exactly the scales of the previous step (E4M3 fwd, E5M2 grads).

    The expected scales come from the reference, not from fp8_meta: reading fp8_meta would complete
    pending reductions itself and hide a module that reads scales before waiting for them.
    """
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")  # fp32 accumulation: differences are accumulation only
    torch.manual_seed(2)
    layer = fp8train.Linear(32, 16)
    recipe = fp8train.DelayedScaling(amax_history_len=2)
    fwd_ref, bwd_ref = RefScaling(3, 2), RefScaling(2, 2)
    for step in range(4):
        x = torch.randn(2, 8, 32) * (step + 1)
        g = torch.randn(2, 8, 16) * 10 ** (-step)
        (sx, sw, _), (dx, dw, _) = fwd_ref.scale, fwd_ref.scale_inv
        sg, dg = bwd_ref.scale[0], bwd_ref.scale_inv[0]
        layer.zero_grad()
        x_in = x.clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = layer(x_in)
        (y * g).sum().backward()
        gx, gw, gb = x_in.grad, layer.weight.grad, layer.bias.grad
        qx = quantize_ref(x.reshape(-1, 32), sx, torch.float8_e4m3fn, E4M3_MAX)
        qw = quantize_ref(layer.weight, sw, torch.float8_e4m3fn, E4M3_MAX)
        qg = quantize_ref(g.reshape(-1, 16), sg, torch.float8_e5m2, E5M2_MAX)
        checks = [
            (
                y.reshape(-1, 16),
                (qx @ qw.T) * dx * dw + layer.bias.double(),
                qx.abs() @ qw.abs().T * dx * dw,
                32,
            ),
            (gx.reshape(-1, 32), (qg @ qw) * dg * dw, qg.abs() @ qw.abs() * dg * dw, 16),
            (gw, (qg.T @ qx) * dg * dx, qg.abs().T @ qx.abs() * dg * dx, 16),
        ]
        for i, (got, want, magnitude, k) in enumerate(checks):
            bound = (k + 4) * 2.0**-24 * (magnitude + layer.bias.double().abs().max())
            assert ((got.double() - want).abs() <= bound).all(), f"step {step} check {i}"
        assert torch.allclose(gb, g.sum((0, 1)), rtol=1e-6, atol=0)
        fwd_ref.update([amax_of(x), amax_of(layer.weight), 0.0], recipe, E4M3_MAX)
        bwd_ref.update([amax_of(g), 0.0], recipe, E5M2_MAX)


# ---- outside an FP8 region: exactly torch.nn ------------------------------------------------------


def _grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, **region) -> list[torch.Tensor]:
    module.zero_grad()
    x = x.clone().requires_grad_()
    if region:
        with fp8train.fp8_autocast(**region):
            y = module(x)
    else:
        y = module(x)
    (y * g).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def _assert_all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), i


@pytest.mark.parametrize("region", [{}, {"enabled": False}], ids=["no_region", "disabled_region"])
@pytest.mark.parametrize("x_shape", [(5, 20), (2, 3, 20)])
def test_outside_fp8_equals_torch_nn(region: dict, x_shape: tuple) -> None:
    torch.manual_seed(3)
    x, g = torch.randn(x_shape), torch.randn(*x_shape[:-1], 12)
    ours = fp8train.Linear(20, 12)
    theirs = torch.nn.Linear(20, 12)
    theirs.load_state_dict({"weight": ours.weight.detach(), "bias": ours.bias.detach()})
    _assert_all_equal(_grads(ours, x, g, **region), _grads(theirs, x, g))

    ln = fp8train.LayerNormLinear(20, 12)
    with torch.no_grad():
        ln.norm.weight.uniform_(0.5, 1.5)
        ln.norm.bias.uniform_(-0.5, 0.5)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(20), torch.nn.Linear(20, 12))
    seq.load_state_dict(
        {"0.weight": ln.norm.weight, "0.bias": ln.norm.bias, "1.weight": ln.weight, "1.bias": ln.bias}
    )
    a, b = _grads(ln, x, g, **region), _grads(seq, x, g)
    _assert_all_equal(a[:2], b[:2])
    _assert_all_equal(a[2:4], b[4:6])  # weight, bias
    _assert_all_equal(a[4:], b[2:4])  # norm weight, bias

    rms = fp8train.RMSNorm(20)
    ref_rms = torch.nn.RMSNorm(20, eps=1e-5)
    _assert_all_equal(_grads(rms, x, torch.ones(x_shape)), _grads(ref_rms, x, torch.ones(x_shape)))
    norm = fp8train.LayerNorm(20)
    _assert_all_equal(
        _grads(norm, x, torch.ones(x_shape)), _grads(torch.nn.LayerNorm(20), x, torch.ones(x_shape))
    )


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_outside_fp8_equals_torch(activation: str) -> None:
    torch.manual_seed(4)
    mlp = fp8train.LayerNormMLP(16, 24, activation=activation, normalization="RMSNorm")
    x = torch.randn(2, 5, 16)

    def manual(x):
        h = F.linear(F.rms_norm(x, (16,), mlp.norm.weight, 1e-5), mlp.fc1_weight, mlp.fc1_bias)
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return F.linear(h, mlp.fc2_weight, mlp.fc2_bias)

    assert torch.equal(mlp(x), manual(x))
    with fp8train.fp8_autocast(enabled=False):
        assert torch.equal(mlp(x), manual(x))


def test_calibrating_records_amaxes_and_computes_in_high_precision() -> None:
    torch.manual_seed(5)
    layer = fp8train.Linear(16, 8)
    x = torch.randn(4, 16) * 7
    with fp8train.fp8_autocast(enabled=False, calibrating=True):
        y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    history = layer.fp8_meta["scaling_fwd"].amax_history
    assert history[0].tolist() == [amax_of(x), amax_of(layer.weight), 0.0]
    assert layer.fp8_meta["scaling_fwd"].scale[0].item() == torch.tensor(E4M3_MAX / amax_of(x)).item()


# ---- is_first_microbatch ---------------------------------------------------------------------------


def test_first_microbatch_caches_weight_and_false_reuses_it() -> None:
    torch.manual_seed(6)
    layer = fp8train.Linear(16, 8)
    x = torch.randn(4, 16)
    with fp8train.fp8_autocast():
        y_first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(3.0)  # the optimizer would not do this mid-accumulation; the cache must win
        y_cached = layer(x, is_first_microbatch=False)
        y_fresh = layer(x, is_first_microbatch=None)
    assert torch.equal(y_first, y_cached)  # the cached FP8 weight, not the new one
    assert not torch.equal(y_first, y_fresh)  # None casts the current weight
    history = layer.fp8_meta["scaling_fwd"].amax_history
    assert history[0, 1].item() == amax_of(layer.weight)  # True and None recorded, max of both


def test_false_records_no_weight_amax_so_the_weight_column_does_not_roll() -> None:
    torch.manual_seed(7)
    layer = fp8train.Linear(16, 8)
    meta = layer.fp8_meta["scaling_fwd"]
    amaxes = []
    for step, flag in enumerate([True, False, False, True, None]):
        x = torch.randn(4, 16) * (step + 1)
        with torch.no_grad():
            layer.weight.mul_(1.5)
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling(amax_history_len=8)):
            y = layer(x, is_first_microbatch=flag)
        y.sum().backward()
        if flag is not False:
            amaxes.append(amax_of(layer.weight))
        fp8train.synchronize()
        assert meta.amax_history[:, 0].count_nonzero().item() == step + 1  # the input rolls every step
        assert meta.amax_history[: len(amaxes), 1].tolist() == amaxes[::-1]
        assert meta.amax_history[len(amaxes) :, 1].count_nonzero().item() == 0
    assert len(amaxes) == 3
