"""Gradient accumulation with `is_first_microbatch`: the documented loop, checked against a hand-written one.

The documented loop (docs/guide.md): N microbatches per optimizer step, each in its own `fp8_autocast`
region, `is_first_microbatch=True` on the first and `False` on the others. What is truly equal to it?

- The weight does not change within a step, so casting it once is enough: microbatch 1 casts it with
  the weight scale current at microbatch 1, records its amax, and the FP8 weight and its scale_inv are
  reused by microbatches 2..N, which record no weight amax (so the weight history rolls once per step).
- Each microbatch is its own region, so the input and gradient scales DO move between microbatches:
  microbatch i uses the scales updated with the amaxes of microbatch i-1.

So the equivalent loop a user would write without fp8train's cache is not "the same loop with
is_first_microbatch=None" (that recasts the weight every microbatch with a scale that has moved, and
rolls the weight history N times per step). It is the loop below, written from primitives only
(`cast_operand`, `gemm`, `update_scaling`): keep the FP8 weight cast at microbatch 1 for the whole step,
and update the delayed-scaling state after every microbatch with [input amax, weight amax on
microbatch 1 else 0, 0] forward and [grad amax, 0] backward. Losses, accumulated gradients, updated
weights and every scale and history must be bitwise equal to fp8train's, and the weight must be
cast once per step (counted by wrapping the per-tensor recipes' `TensorQuantization.cast_operands`).

"""

from __future__ import annotations

import io

import pytest
import torch

import fp8train
from fp8train.amax import decode_extra_state
from fp8train.amax.storage import update_scaling
from fp8train.numerics.cast import amax, cast_operand
from fp8train.numerics.gemm import gemm
from fp8train.quantization.per_tensor import TensorQuantization

RECIPE = fp8train.DelayedScaling(amax_history_len=16)
STEPS, MICRO = 3, 3
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _weight() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 0.2


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2, 4, 32, generator=g) * (1 + micro), torch.randn(2, 4, 16, generator=g)


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).pow(2).mean() / MICRO


class CastCounter:
    """Scales of the casts of any tensor sharing storage with one of `weights`."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.casts: list[float] = []


@pytest.fixture
def weight_casts(monkeypatch) -> CastCounter:
    counter = CastCounter()
    real = TensorQuantization.cast_operands

    def counting(self, x, scale, *args, **kwargs):
        if any(x.data_ptr() == w.data_ptr() for w in counter.weights):
            counter.casts.append(float(scale))
        return real(self, x, scale, *args, **kwargs)

    # a spy on the per-tensor recipes' cast (`cast` goes through it too): counts, passes on
    monkeypatch.setattr(TensorQuantization, "cast_operands", counting)
    return counter


def _fp8train_loop(first_microbatch_flags: bool, counter: CastCounter) -> dict:
    layer = fp8train.Linear(32, 16, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_weight())
    counter.weights.append(layer.weight)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = {"loss": [], "grad": [], "weight": [], "casts_per_step": []}
    for step in range(STEPS):
        before = len(counter.casts)
        for micro in range(MICRO):
            x, target = _batch(step, micro)
            flag = (micro == 0) if first_microbatch_flags else None
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                y = layer(x, is_first_microbatch=flag)
            loss = _loss(y, target)
            loss.backward()
            out["loss"].append(loss)
        out["casts_per_step"].append(len(counter.casts) - before)
        out["grad"].append(layer.weight.grad.clone())
        opt.step()
        opt.zero_grad()
        out["weight"].append(layer.weight.detach().clone())
    meta = layer.fp8_meta
    out["fwd"] = [t.clone() for t in (meta["scaling_fwd"].amax_history, meta["scaling_fwd"].scale)]
    out["bwd"] = [t.clone() for t in (meta["scaling_bwd"].amax_history, meta["scaling_bwd"].scale)]
    return out


def _user_loop() -> dict:
    """The same training written by hand: one weight cast per step, delayed scaling per microbatch."""
    weight = torch.nn.Parameter(_weight())
    opt = torch.optim.SGD([weight], lr=0.1)
    h = RECIPE.amax_history_len
    fwd_hist, fwd_scale, fwd_sinv = torch.zeros(h, 3), torch.ones(3), torch.ones(3)
    bwd_hist, bwd_scale, bwd_sinv = torch.zeros(h, 2), torch.ones(2), torch.ones(2)
    out = {"loss": [], "grad": [], "weight": []}
    for step in range(STEPS):
        grad = None
        for micro in range(MICRO):
            x, target = _batch(step, micro)
            if micro == 0:  # the step's one weight cast, with the weight scale of microbatch 1
                w_amax = amax(weight)
                q_weight = cast_operand(weight.detach(), fwd_scale[1].clone(), "e4m3", torch.bfloat16)
                w_sinv = fwd_sinv[1].clone()
            x2d = x.reshape(-1, 32)
            qx = cast_operand(x2d, fwd_scale[0].clone(), "e4m3", torch.bfloat16)
            x_sinv = fwd_sinv[0].clone()
            y = gemm(qx, x_sinv, q_weight.t(), w_sinv, x.dtype).reshape(2, 4, 16).requires_grad_()
            last = torch.stack([amax(x), w_amax if micro == 0 else torch.zeros(()), torch.zeros(())])
            update_scaling(fwd_hist, fwd_scale, fwd_sinv, last, RECIPE, E4M3_MAX)
            loss = _loss(y, target)
            (grad_y,) = torch.autograd.grad(loss, y)
            g2d = grad_y.reshape(-1, 16)
            qg = cast_operand(g2d, bwd_scale[0].clone(), "e5m2", torch.bfloat16)
            g_w = gemm(qg.t(), bwd_sinv[0].clone(), qx, x_sinv, weight.dtype)
            last = torch.stack([amax(g2d), torch.zeros(())])
            update_scaling(bwd_hist, bwd_scale, bwd_sinv, last, RECIPE, E5M2_MAX)
            grad = g_w if grad is None else grad + g_w
            out["loss"].append(loss)
        weight.grad = grad
        out["grad"].append(grad.clone())
        opt.step()
        opt.zero_grad()
        out["weight"].append(weight.detach().clone())
    out["fwd"], out["bwd"] = [fwd_hist, fwd_scale], [bwd_hist, bwd_scale]
    return out


def test_cached_weight_loop_equals_hand_written_loop(weight_casts: CastCounter) -> None:
    ours, user = _fp8train_loop(True, weight_casts), _user_loop()
    for key in ("loss", "grad", "weight", "fwd", "bwd"):
        assert len(ours[key]) == len(user[key])
        for a, b in zip(ours[key], user[key]):
            assert torch.equal(a, b), key
    assert ours["casts_per_step"] == [1] * STEPS
    fwd_history = ours["fwd"][0]
    assert int((fwd_history[:, 0] > 0).sum()) == STEPS * MICRO  # input rolls every microbatch
    assert int((fwd_history[:, 1] > 0).sum()) == STEPS  # weight rolls once per step
    assert int((ours["bwd"][0][:, 0] > 0).sum()) == STEPS * MICRO


def test_without_cache_weight_is_cast_every_microbatch(weight_casts: CastCounter) -> None:
    """The counter really counts: with is_first_microbatch=None every microbatch recasts the weight."""
    plain = _fp8train_loop(False, weight_casts)
    assert plain["casts_per_step"] == [MICRO] * STEPS
    assert int((plain["fwd"][0][:, 1] > 0).sum()) == STEPS * MICRO
    assert not torch.equal(plain["weight"][-1], _user_loop()["weight"][-1])


@pytest.mark.parametrize(
    "recipe", [fp8train.DelayedScaling(amax_history_len=4), fp8train.Float8CurrentScaling()]
)
def test_a_step_resumed_after_a_load_reuses_the_cast_weight(recipe) -> None:
    """Microbatch 0 (is_first_microbatch=True), then state_dict and gradients saved; a fresh model in a
    fresh process state loads them and runs microbatch 1 with False: the same FP8 weight as the
    uninterrupted run's cache (rebuilt from the weight and the scale it was cast with), no weight amax
    recorded, so the weight history, every scale and the gradients are bitwise equal. Before, the load
    dropped the cache and microbatch 1 cast the weight again with the moved scale and recorded its amax
    (history column [0.249, 0.249, 0, 0] against [0.249, 0, 0, 0], and another weight gradient)."""

    def model() -> fp8train.Linear:
        torch.manual_seed(0)
        return fp8train.Linear(16, 16)

    def microbatch(layer, micro: int) -> None:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(micro)) * (1 + micro)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = layer(x, is_first_microbatch=micro == 0)
        y.square().mean().backward()

    def result(layer) -> list:
        fp8 = [getattr(meta, a) for meta in layer.fp8_meta.values() for a in ("amax_history", "scale")]
        return [t.clone() for t in (*fp8, layer.weight.grad, layer.bias.grad)]

    fp8train.inspection.reset()
    uninterrupted = model()
    microbatch(uninterrupted, 0)
    saved = (uninterrupted.state_dict(), [p.grad.clone() for p in uninterrupted.parameters()])
    microbatch(uninterrupted, 1)

    fp8train.inspection.reset()
    resumed = model()
    resumed.load_state_dict(saved[0])
    for p, g in zip(resumed.parameters(), saved[1]):
        p.grad = g
    microbatch(resumed, 1)
    for a, b in zip(result(resumed), result(uninterrupted)):
        assert torch.equal(a, b), (a, b)
    if isinstance(recipe, fp8train.DelayedScaling):  # the weight's amax recorded once, by microbatch 0
        assert (uninterrupted.fp8_meta["scaling_fwd"].amax_history[:, 1] > 0).sum() == 1


def test_damaged_weight_cast_scales_are_refused() -> None:
    layer = fp8train.Linear(16, 16)
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        layer(torch.randn(4, 16), is_first_microbatch=True)
    state = layer.state_dict()
    extra = decode_extra_state(state["_extra_state"])
    assert torch.equal(extra["weight_cast_scales"]["0:delayed"], torch.ones(2))  # cast with the initial scale
    extra["weight_cast_scales"]["0:delayed"] = torch.tensor([float("nan"), 1.0])
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    state["_extra_state"] = buffer.getvalue()
    with pytest.raises(ValueError, match="weight_cast_scales are not 2 scales > 0; it is corrupted"):
        fp8train.Linear(16, 16).load_state_dict(state)
