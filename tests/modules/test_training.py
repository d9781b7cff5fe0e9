"""End to end: a small model trained 200 steps in FP8 reaches the loss of the same model in fp32."""

from __future__ import annotations

import pytest
import torch

import fp8train
from helpers import mse_step

D, HIDDEN, OUT, BATCH, STEPS = 32, 64, 8, 64, 200


def _train(fp8: bool) -> tuple[list[float], float, torch.nn.Module]:
    """Same init and data for both runs: a noisy teacher regression (noise floor 0.09)."""
    fp8train.inspection.reset()
    g = torch.Generator().manual_seed(7)
    teacher_a = torch.randn(D, HIDDEN, generator=g) / D**0.5
    teacher_b = torch.randn(HIDDEN, OUT, generator=g) / HIDDEN**0.5

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, D, generator=g)
        return x, torch.tanh(x @ teacher_a) @ teacher_b + 0.3 * torch.randn(n, OUT, generator=g)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        fp8train.LayerNormLinear(D, HIDDEN),
        torch.nn.GELU(),
        fp8train.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        fp8train.Linear(HIDDEN, OUT),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    recipe = fp8train.DelayedScaling(amax_history_len=16)
    losses = []
    for _ in range(STEPS):
        x, y = batch(BATCH)
        losses.append(mse_step(model, opt, x, y, recipe, enabled=fp8).item())
    x, y = batch(1024)
    with torch.no_grad():
        eval_loss = torch.nn.functional.mse_loss(model(x), y).item()  # high precision, outside FP8
    return losses, eval_loss, model


@pytest.fixture
def one_thread():
    """A tiny model runs fastest on one thread, and stays fast when other processes load the CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fp8_training_matches_fp32_within_two_percent(one_thread) -> None:
    ref_losses, ref_eval, _ = _train(fp8=False)
    losses, eval_loss, model = _train(fp8=True)
    ref_final, final = sum(ref_losses[-20:]) / 20, sum(losses[-20:]) / 20
    assert ref_final < 0.4 * ref_losses[0]  # it learned: the comparison is not between two untrained models
    assert abs(final - ref_final) <= 0.02 * ref_final, (final, ref_final)
    assert abs(eval_loss - ref_eval) <= 0.02 * ref_eval, (eval_loss, ref_eval)
    assert losses != ref_losses  # the FP8 run really computed in FP8
    scales = model[2].fp8_meta["scaling_fwd"].scale
    assert scales[0].item() != 1.0 and scales[1].item() != 1.0
