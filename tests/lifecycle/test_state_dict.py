"""Checkpoints: FP8 state in state_dict, bit-identical resume, and clear errors on a misfit."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fp8train
from fp8train import DelayedScaling
from fp8train.amax import decode_extra_state
from helpers import fp8_state, mse_step

RECIPE = DelayedScaling(amax_history_len=4)  # short: the window rolls over within the test


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        fp8train.LayerNormMLP(16, 32, activation="swiglu"),
        fp8train.LayerNormLinear(16, 24, normalization="RMSNorm"),
        fp8train.Linear(24, 8),
    )


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (torch.randn(6, 16, generator=g) * (1 + i % 3), torch.randn(6, 8, generator=g)) for i in range(steps)
    ]


def _saved(obj) -> dict:
    """Through bytes, as a checkpoint file would be, and loadable with weights_only=True."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("target", ["fresh", "trained"])
def test_state_dict_round_trip_includesfp8_state(target: str) -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, t in _data(3):
        mse_step(model, opt, x, t, RECIPE)
    sd = model.state_dict()
    assert {"0._extra_state", "1._extra_state", "2._extra_state"} <= set(sd)
    assert decode_extra_state(sd["2._extra_state"])["scaling_fwd"]["amax_history"].shape == (4, 3)
    assert decode_extra_state(sd["0._extra_state"])["scaling_bwd"]["scale"].shape == (4,)

    # into a model that never trained (state held by the module until it joins a group), or into one
    # that already trains (state copied into its columns of the group's storage)
    fresh = _model(1) if target == "fresh" else _trained(_model(1), RECIPE, steps=1)
    fresh.load_state_dict(_saved(sd))
    for a, b in zip(fp8_state(model), fp8_state(fresh)):
        assert torch.equal(a, b)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if not name.endswith("_extra_state"):
            assert torch.equal(a, b), name
    assert any(bool((t != 1).any()) for t in fp8_state(fresh)[1::3])  # non-trivial scales came across


@pytest.mark.parametrize("fresh_process", [True, False], ids=["fresh_registry", "same_registry"])
def test_resume_is_bit_identical(fresh_process: bool) -> None:
    steps, k = 9, 4
    data = _data(steps)
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, checkpoint = [], None
    for step, (x, t) in enumerate(data):
        if step == k:  # in-flight reductions of step k-1 are completed by state_dict
            checkpoint = _saved({"model": model.state_dict(), "optim": opt.state_dict()})
        losses.append(mse_step(model, opt, x, t, RECIPE))
    final_state, final_params = fp8_state(model), [p.detach().clone() for p in model.parameters()]

    if fresh_process:
        fp8train.inspection.reset()
    resumed = _model(123)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=3e-3)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optim"])
    resumed_losses = [mse_step(resumed, resumed_opt, x, t, RECIPE) for x, t in data[k:]]

    for step, (a, b) in enumerate(zip(losses[k:], resumed_losses), start=k):
        assert torch.equal(a, b), f"loss differs at step {step}: {a.item()!r} vs {b.item()!r}"
    for a, b in zip(final_state, fp8_state(resumed)):
        assert torch.equal(a, b)
    for a, b in zip(final_params, resumed.parameters()):
        assert torch.equal(a, b)


def _trained(model, recipe: DelayedScaling, steps: int = 2) -> torch.nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, t in _data(steps):
        mse_step(model, opt, x, t, recipe)
    return model


def test_other_history_length_is_a_clear_error() -> None:
    sd = _trained(_model(0), RECIPE).state_dict()
    other = DelayedScaling(amax_history_len=8)
    # into a model already training with another history length: refused at load
    with pytest.raises(ValueError, match="amax history length 4.*amax_history_len=8"):
        _trained(_model(1), other).load_state_dict(sd)
    # into a model that has not trained yet: refused when it first trains with the other recipe
    fresh = _model(2)
    fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match="amax history length 4.*amax_history_len=8"):
        _trained(fresh, other, steps=1)


def test_other_shapes_are_a_clear_error() -> None:
    linear_state = fp8train.Linear(16, 16).get_extra_state()  # 3 forward roles
    mlp = fp8train.LayerNormMLP(16, 32)  # 6 forward roles
    sd = mlp.state_dict()
    sd["_extra_state"] = linear_state
    with pytest.raises(ValueError, match="6 roles"):
        mlp.load_state_dict(sd)
    state = decode_extra_state(_trained(_model(0), RECIPE)[2].get_extra_state())
    state["scaling_fwd"]["scale"] = state["scaling_fwd"]["scale"][:2]
    with pytest.raises(ValueError, match=r"scale \(2,\).*3 roles"):
        fp8train.Linear(24, 8).set_extra_state(state)


@pytest.mark.parametrize("state", [None, {"foo": 1}, b"\x00\x01", {"version": 2, "scaling_fwd": {}}])
def test_foreign_state_is_a_clear_error(state) -> None:
    layer = fp8train.Linear(8, 8)
    sd = layer.state_dict()
    sd["_extra_state"] = state
    with pytest.raises(ValueError, match="not an fp8train"):
        layer.load_state_dict(sd)


COPY_RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def test_deepcopy_of_a_trained_module_owns_its_state() -> None:
    """A copy (EMA, AveragedModel) carries the module's FP8 state, not the whole amax group, and trains."""
    model = torch.nn.Sequential(fp8train.Linear(16, 16), fp8train.Linear(16, 16))
    for _ in range(2):
        with fp8train.fp8_autocast(fp8_recipe=COPY_RECIPE):
            y = model(torch.randn(4, 16))
        y.sum().backward()
    before = fp8_state(model[0])
    twin = copy.deepcopy(model[0])
    for a, b in zip(before, fp8_state(twin)):
        assert torch.equal(a, b)
    assert twin.fp8_meta["scaling_fwd"].direction is None  # its own state until it trains
    group = model[0].fp8_meta["scaling_fwd"].direction
    members = list(group.members)
    with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling(amax_history_len=4, margin=1)):
        twin(torch.randn(4, 16)).sum().backward()  # trains under another recipe: its own group
    assert group.members == members
    for a, b in zip(before, fp8_state(model[0])):
        assert torch.equal(a, b)  # the original did not move
