"""Activation recomputation: the recomputed forward replays the original FP8 forward exactly.

Replaying means: the same scales (the region's snapshot, even if the group's scales moved since), no
amax recorded, nothing registered again. The proof that matters is that gradients, scales and amax
histories equal those of the run without recomputation bit for bit, step after step; the scales each
cast used are also logged and compared directly.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint

import fp8train
from fp8train.quantization.per_tensor import TensorQuantization
from fp8train.torch_internals import in_backward

RECIPE = fp8train.DelayedScaling(amax_history_len=4)
STEPS = 3
CASTS_PER_FORWARD = 6  # e4m3 input + weight casts: Linear (1 GEMM) and LayerNormMLP (2 GEMMs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(fp8train.Linear(32, 32), torch.nn.GELU(), fp8train.LayerNormMLP(32, 64))


def _x(seed: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _forward(model: torch.nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "plain":
        return model(x)
    if mode == "fp8train":
        return fp8train.checkpoint(model, x)
    return torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)


def _groups():
    group = fp8train.inspection.amax_group(RECIPE, None)
    return group.fwd, group.bwd


def _state() -> list[torch.Tensor]:
    fp8train.synchronize()
    return [t.clone() for g in _groups() for t in (g.storage.history, g.storage.scale, g.storage.scale_inv)]


@pytest.fixture
def cast_log(monkeypatch) -> list:
    """(during backward?, scale) of every forward (e4m3) cast; gradient casts are e5m2 (HYBRID)."""
    log: list = []
    real = TensorQuantization.cast_operands

    def spy(self, x, scale, scale_inv, encoding, *args, **kwargs):
        if encoding == "e4m3":
            log.append((in_backward(), float(scale)))
        return real(self, x, scale, scale_inv, encoding, *args, **kwargs)

    # a spy on the per-tensor recipes' cast (`cast` goes through it too): logs the scales, passes on
    monkeypatch.setattr(TensorQuantization, "cast_operands", spy)
    return log


def _train(mode: str, log: list) -> tuple[list, list]:
    """STEPS steps of one region each: per step the grads and FP8 state, and the casts' scales."""
    fp8train.inspection.reset()
    model = _model()
    results, casts = [], []
    for step in range(STEPS):
        start = len(log)
        x = _x(step)
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = _forward(model, x, mode)
        y.pow(2).mean().backward()
        fwd, bwd = _groups()
        # the recomputation recorded nothing (the slot was cleared at launch) and registered nothing
        assert not fwd.recorded_roles and not bool(fwd.storage.recording.any())
        assert len(fwd.members) == len(bwd.members) == 2
        results.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()] + _state())
        casts.append(log[start:])
        model.zero_grad()
    return results, casts


@pytest.mark.parametrize("mode", ["fp8train", "torch"])
def test_recompute_equals_plain_bitwise(mode: str, cast_log: list) -> None:
    plain, _ = _train("plain", cast_log)
    recomputed, casts = _train(mode, cast_log)
    for a, b in zip(plain, recomputed):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    for step in casts:
        original = [scale for backward, scale in step if not backward]
        replayed = [scale for backward, scale in step if backward]
        assert len(original) == CASTS_PER_FORWARD and replayed == original


def _pipeline(mode: str, log: list) -> tuple[list[torch.Tensor], list]:
    """Per step two regions (microbatches) run forward, then their backwards in reverse order."""
    fp8train.inspection.reset()
    model = _model()
    results, casts = [], []
    for step in range(2):
        start = len(log)
        xs = [_x(10 * step + i) for i in range(2)]
        ys = []
        for x in xs:
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                ys.append(_forward(model, x, mode))
        for y in reversed(ys):
            y.pow(2).mean().backward()
        results += [p.grad.clone() for p in model.parameters()] + [x.grad.clone() for x in xs]
        casts.append(log[start:])
        model.zero_grad()
    assert len(_groups()[0].members) == 2
    return results + _state(), casts


def test_pipeline_style_with_fp8train_checkpoint(cast_log: list) -> None:
    plain, _ = _pipeline("plain", cast_log)
    recomputed, casts = _pipeline("fp8train", cast_log)
    assert len(plain) == len(recomputed) and all(torch.equal(u, v) for u, v in zip(plain, recomputed))
    n = CASTS_PER_FORWARD
    for i, step in enumerate(casts):
        assert [b for b, _ in step] == [False] * 2 * n + [True] * 2 * n
        first, second = [s for _, s in step[:n]], [s for _, s in step[n : 2 * n]]
        if i == 0:
            assert first != second  # region 2 started after region 1's update: other scales
        # backwards ran in reverse order: region 2 was recomputed first, each with its own scales
        assert [s for _, s in step[2 * n : 3 * n]] == second and [s for _, s in step[3 * n :]] == first


def test_nested_checkpoints_equal_plain() -> None:
    def run(nested: bool) -> list[torch.Tensor]:
        fp8train.inspection.reset()
        model = _model()
        out = []
        for step in range(2):
            x = _x(step)
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                if nested:
                    y = fp8train.checkpoint(lambda t: model[2](fp8train.checkpoint(model[:2], t)), x)
                else:
                    y = model(x)
            y.pow(2).mean().backward()
            out += [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        return out + _state()

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


@pytest.mark.parametrize("mode", ["fp8train", "torch"])
def test_high_precision_checkpoint_after_fp8_training(mode: str) -> None:
    """A module trained in FP8, then checkpointed in high precision, recomputes in high precision.

    fp8train.checkpoint knows the regions of the original call, so this holds even while an FP8
    region of the same module awaits its backward. Plain torch checkpoint cannot know then: the
    replayed FP8 forward saves other tensors, and torch's own check raises (never a silent result).
    """
    model = _model()
    x = _x(0)
    reference = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        pending = model(x)
    with fp8train.fp8_autocast(enabled=False):
        y = _forward(model, x, mode)
    if mode == "fp8train":
        grads = torch.autograd.grad(y.pow(2).mean(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    else:
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            torch.autograd.grad(y.pow(2).mean(), list(model.parameters()))
    pending.sum().backward()
    for enabled in (False, None):  # a disabled region, and no region at all
        with fp8train.fp8_autocast(enabled=False) if enabled is False else contextlib.nullcontext():
            y = _forward(model, x, mode)
        grads = torch.autograd.grad(y.pow(2).mean(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_unsupported_patterns_raise_clear_errors() -> None:
    model = _model()
    with pytest.raises(ValueError, match="use_reentrant=False only"):
        fp8train.checkpoint(model, _x(0), use_reentrant=True)
    # reentrant checkpoint: the original forward runs without autograd, so it cannot be matched; also
    # when the module is called outside the checkpoint too (it used to fail in backward, unclearly)
    for shared in (False, True):
        with pytest.raises(RuntimeError, match="use_reentrant=True is not supported"):
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                h = model(_x(1)) if shared else _x(1)
                torch.utils.checkpoint.checkpoint(model, h, use_reentrant=True)
    # plain torch checkpoint with two regions pending: which one is recomputed is ambiguous
    fp8train.inspection.reset()
    model = _model()
    ys = []
    for i in range(2):
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            ys.append(torch.utils.checkpoint.checkpoint(model, _x(i), use_reentrant=False))
    with pytest.raises(RuntimeError, match=r"cannot tell which FP8 forward it repeats \(2 candidate"):
        ys[1].sum().backward()


RETAIN_RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def _retain_loss(model, x, checkpointed: bool) -> torch.Tensor:
    with fp8train.fp8_autocast(fp8_recipe=RETAIN_RECIPE):
        if checkpointed:
            y = fp8train.checkpoint(model, x)
        else:
            y = model(x)
    return y.square().mean()


def test_fp8_checkpoint_recomputes_again_with_retain_graph() -> None:
    """torch enters a checkpoint's recompute context once per recomputation: a second backward over the
    same graph replays the same scales again."""
    grads = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(fp8train.Linear(16, 32), torch.nn.GELU(), fp8train.Linear(32, 16))
        x = torch.randn(8, 16)
        for _ in range(2):  # a second step, so scales are not the initial ones
            loss = _retain_loss(model, x, checkpointed)
            loss.backward(retain_graph=True)
            loss.backward()
        grads[checkpointed] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


RECIPES = [RECIPE, fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()]
RECIPE_IDS = ["delayed", "current", "block"]


def _patterns(mode: str, recipe) -> list[torch.Tensor]:
    """Real-job patterns around recomputation: a step whose graph is dropped (a skipped non-finite
    loss, an OOM retry's failed attempt), a pipeline-style pair of regions recomputed by
    fp8train.checkpoint, two microbatches whose backward runs inside one region, then plain steps."""
    fp8train.inspection.reset()
    model = _model()
    grads = []

    def step(x, fp8_mode):
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = _forward(model, x, fp8_mode)
        y.pow(2).mean().backward()

    step(_x(0), mode)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        dropped = _forward(model, _x(1), mode).pow(2).mean()
    del dropped  # no backward: the graph is dropped
    ys = []
    for i in range(2):  # pipeline style: two regions, then their backwards
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            ys.append(_forward(model, _x(2 + i), "fp8train" if mode != "plain" else "plain"))
    for y in reversed(ys):
        y.pow(2).mean().backward()
    with fp8train.fp8_autocast(fp8_recipe=recipe):  # backward inside the region, per microbatch
        for i in range(2):
            _forward(model, _x(4 + i), mode).pow(2).mean().backward()
    for i in range(3):
        step(_x(6 + i), mode)
    grads += [p.grad.clone() for p in model.parameters()]
    assert fp8train.inspection.regions_owing_backward() == 0
    return grads


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("mode", ["fp8train", "torch"])
def test_dropped_graphs_and_backward_inside_a_region_keep_recomputation_exact(mode, recipe) -> None:
    plain = _patterns("plain", recipe)
    recomputed = _patterns(mode, recipe)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_reentrant_checkpoint_is_refused_with_every_recipe(recipe) -> None:
    model = _model()
    with pytest.raises(RuntimeError, match="use_reentrant=True is not supported"):
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            torch.utils.checkpoint.checkpoint(model, _x(0), use_reentrant=True)
