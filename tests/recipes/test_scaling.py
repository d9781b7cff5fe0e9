"""Delayed-scaling update: real modules vs the per-column reference, and numeric corner cases."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import fp8train
from fp8train import DelayedScaling, Format
from fp8train.amax.storage import update_scaling
from reference import E4M3_MAX, E5M2_MAX, FLOAT32_MAX, RefScaling, amax_of, f32

# ---- modules over several steps vs the reference -------------------------------------------------


def _microbatch_flag(mode: Optional[bool], step: int) -> Optional[bool]:
    """None/True: that flag every step. False: gradient accumulation, a new weight every 3rd step."""
    if mode is False:
        return step % 3 == 0
    return mode


def _assert_state(meta, ref: RefScaling, what: str) -> None:
    assert torch.equal(meta.amax_history, ref.history_tensor()), f"{what}: amax_history"
    assert torch.equal(meta.scale, ref.scale_tensor()), f"{what}: scale"
    assert torch.equal(meta.scale_inv, ref.scale_inv_tensor()), f"{what}: scale_inv"


def run_against_reference(
    recipe: DelayedScaling,
    mode: Optional[bool],
    steps: int,
    nan_input_step: int = -1,
    nan_grad_step: int = -1,
) -> list[RefScaling]:
    """Train two Linears (2-D and 3-D inputs) in one region; compare their FP8 state every step.

    The loss is sum(y * g), so grad_output is exactly g and the reference knows every amax: input
    amax each call, weight amax only when the weight is cast, grad_output amax each backward.
    NaN amaxes enter the reference as inf (the reduction turns NaN into inf before the update).
    """
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(0)
    mods = [fp8train.Linear(32, 48), fp8train.Linear(16, 24, bias=False)]
    in_shapes, out_shapes = [(4, 32), (2, 3, 16)], [(4, 48), (2, 3, 24)]
    H = recipe.amax_history_len
    fwd_max = E4M3_MAX
    bwd_max = E4M3_MAX if recipe.fp8_format is Format.E4M3 else E5M2_MAX
    fwd_ref = [RefScaling(3, H) for _ in mods]
    bwd_ref = [RefScaling(2, H) for _ in mods]
    for step in range(steps):
        flag = _microbatch_flag(mode, step)
        casts_weight = flag is not False
        mags = (2.0 ** (torch.rand(4, generator=gen) * 16 - 8)).tolist()
        xs = [torch.randn(s, generator=gen) * mags[i] for i, s in enumerate(in_shapes)]
        gs = [torch.randn(s, generator=gen) * mags[2 + i] for i, s in enumerate(out_shapes)]
        if step == nan_input_step:
            xs[0][1, 3] = float("nan")
        if step == nan_grad_step:
            gs[1][0, 1, 2] = float("nan")
        with torch.no_grad():
            for m in mods:
                m.weight.mul_(0.75 + 0.5 * torch.rand((), generator=gen))
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            ys = [m(x, is_first_microbatch=flag) for m, x in zip(mods, xs)]
        sum((y * g).sum() for y, g in zip(ys, gs)).backward()

        for i, m in enumerate(mods):
            x_amax = math.inf if step == nan_input_step and i == 0 else amax_of(xs[i])
            g_amax = math.inf if step == nan_grad_step and i == 1 else amax_of(gs[i])
            w_amax = amax_of(m.weight) if casts_weight else 0.0
            fwd_ref[i].update([x_amax, w_amax, 0.0], recipe, fwd_max)
            bwd_ref[i].update([g_amax, 0.0], recipe, bwd_max)
        fp8train.synchronize()
        for i, m in enumerate(mods):
            _assert_state(m.fp8_meta["scaling_fwd"], fwd_ref[i], f"step {step} module {i} fwd")
            _assert_state(m.fp8_meta["scaling_bwd"], bwd_ref[i], f"step {step} module {i} bwd")
    return fwd_ref + bwd_ref


@pytest.mark.parametrize("mode", [None, True, False], ids=["mb_None", "mb_True", "mb_False"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 31, 1024])
def test_module_state_matches_reference(history_len: int, algo: str, margin: int, mode) -> None:
    recipe = DelayedScaling(margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    refs = run_against_reference(recipe, mode, steps=36)
    weight_rolls = sum(v != 0.0 for v in refs[0].history[1])
    if mode is False:  # the weight column rolled only on the steps that cast the weight
        assert weight_rolls == min(history_len, 12)
    else:
        assert weight_rolls == min(history_len, 36)
    assert refs[0].history[2] == [0.0] * history_len  # the unused output role never rolls


def test_e4m3_format_uses_e4m3_for_gradients() -> None:
    run_against_reference(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4), None, steps=6)


def _recent_three(history: torch.Tensor) -> torch.Tensor:
    return history[:3].amax(dim=0)


def _damped_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe) -> torch.Tensor:
    """Never grow the scale by more than 2x per step."""
    return torch.minimum(fp8_max / amax / 2.0, scale * 2.0)


@pytest.mark.parametrize("history_len", [1, 31])
def test_callables_match_reference(history_len: int) -> None:
    recipe = DelayedScaling(
        amax_history_len=history_len,
        amax_compute_algo=_recent_three,
        scaling_factor_compute_algo=_damped_scale,
    )
    run_against_reference(recipe, None, steps=36)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_nan_input_and_grad_through_modules(algo: str) -> None:
    """A NaN amax is reduced as inf: the history rolls with inf, the scale keeps its last value."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    refs = run_against_reference(recipe, None, steps=10, nan_input_step=2, nan_grad_step=3)
    assert fp8train.reduction_stats()["nonfinite_amax_events"] == 2
    for ref in refs:
        assert all(math.isfinite(s) and s > 0 for s in ref.scale)


# ---- update_scaling directly -----------------------------------------------------------------------


def _state(history: list[list[float]], scale: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.tensor(history, dtype=torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    return h, s, 1.0 / s


def test_zero_amax_does_not_roll_or_change_scale() -> None:
    h, s, si = _state([[3.0, 5.0], [7.0, 1.0]], [2.0, 4.0])
    before = (h.clone(), s.clone(), si.clone())
    update_scaling(h, s, si, torch.zeros(2), DelayedScaling(amax_history_len=2), E4M3_MAX)
    assert all(torch.equal(a, b) for a, b in zip((h, s, si), before))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_inf_amax_rolls_and_keeps_scale(algo: str) -> None:
    h, s, si = _state([[3.0, 5.0], [7.0, 1.0]], [2.0, 4.0])
    last = torch.tensor([math.inf, 0.5])
    update_scaling(h, s, si, last, DelayedScaling(amax_history_len=2, amax_compute_algo=algo), E4M3_MAX)
    assert h[:, 0].tolist() == [math.inf, 3.0] and h[:, 1].tolist() == [0.5, 5.0]
    assert s[0].item() == 2.0 and si[0].item() == 0.5
    expected = E4M3_MAX / 5.0 if algo == "max" else E4M3_MAX / 0.5
    assert s[1].item() == f32(expected)


def test_nan_last_never_poisons_the_scale() -> None:
    h, s, si = _state([[3.0]], [2.0])
    update_scaling(h, s, si, torch.tensor([math.nan]), DelayedScaling(amax_history_len=1), E4M3_MAX)
    assert s.item() == 2.0 and si.item() == 0.5


@pytest.mark.parametrize("margin", [0, 2])
def test_tiny_amax_clamps_scale_to_float32_max(margin: int) -> None:
    h, s, si = _state([[0.0]], [1.0])
    update_scaling(
        h, s, si, torch.tensor([1e-40]), DelayedScaling(amax_history_len=1, margin=margin), E4M3_MAX
    )
    assert h.item() == f32(1e-40)
    assert s.item() == FLOAT32_MAX  # 448 / 1e-40 overflows float32 with or without the margin
    assert si.item() > 0 and si.item() == f32(1 / s.item())


def test_underflowing_scale_keeps_old_value() -> None:
    h, s, si = _state([[0.0]], [3.0])
    update_scaling(h, s, si, torch.tensor([1e30]), DelayedScaling(amax_history_len=1, margin=130), E4M3_MAX)
    assert h.item() == f32(1e30) and s.item() == 3.0


@pytest.mark.parametrize("fp8_max", [E4M3_MAX, E5M2_MAX])
def test_normal_amax(fp8_max: float) -> None:
    h, s, si = _state([[0.0, 0.0, 0.0]], [1.0, 1.0, 1.0])
    last = torch.tensor([2.0, 3.0, 448.0])
    update_scaling(h, s, si, last, DelayedScaling(amax_history_len=1, margin=1), fp8_max)
    assert s.tolist() == [f32(fp8_max / 2.0 / 2), f32(fp8_max / 3.0) / 2, f32(fp8_max / 448.0 / 2)]
    assert si.tolist() == [f32(1 / v) for v in s.tolist()]


def test_scaling_factor_callable_bad_outputs_keep_old_scale() -> None:
    def bad(amax, scale, fp8_max, recipe):
        return torch.tensor([math.nan, 0.0, -1.0, math.inf, 5.0])

    recipe = DelayedScaling(amax_history_len=1, scaling_factor_compute_algo=bad)
    h, s, si = _state([[0.0] * 5], [2.0] * 5)
    update_scaling(h, s, si, torch.ones(5), recipe, E4M3_MAX)
    assert s.tolist() == [2.0, 2.0, 2.0, FLOAT32_MAX, 5.0]
