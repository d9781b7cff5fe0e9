"""NVTE_ASYNC_AMAX_REDUCTION: accepted values, a clear error otherwise, read at every region entry.

Single process: the mode a region runs in is `fp8train.inspection.current_region().async_op` (what
its launches pass on); that both modes compute the same thing is tested on real ranks in
amax/test_reduction_multirank.py.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import pytest
import torch

import fp8train
from fp8train import DelayedScaling
from helpers import fp8_mlp, fp8_state, rank_batch, train_step

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)


RECIPE = DelayedScaling(amax_history_len=4)


def _set(monkeypatch: pytest.MonkeyPatch, value: Optional[str]) -> None:
    if value is None:
        monkeypatch.delenv(ENV_ASYNC, raising=False)
    else:
        monkeypatch.setenv(ENV_ASYNC, value)


def _train_step(model: torch.nn.Module, seed: int) -> bool:
    """One FP8 training step; returns the async flag the region was entered with."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        mode = fp8train.inspection.current_region().async_op
        y = model(x)
    y.float().square().mean().backward()
    return mode


@pytest.mark.parametrize("value", ["yes", "2", "true", "-1", "on", "async"])
def test_invalid_value_raises_at_region_entry(monkeypatch, value):
    model = fp8train.Linear(16, 16)
    _train_step(model, 0)
    history = model.fp8_meta["scaling_fwd"].amax_history.clone()
    _set(monkeypatch, value)
    entered = False
    with pytest.raises(ValueError) as info:
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            entered = True
    assert not entered, "the region body ran although the variable is invalid"
    message = str(info.value)
    assert ENV_ASYNC in message and repr(value) in message
    rest = message.replace(repr(value), "")
    assert re.search(r"\b1\b", rest) and re.search(r"\b0\b", rest), f"accepted values not named: {message}"
    # nothing moved, and the library is usable once the value is fixed
    assert fp8train.inspection.open_regions() == 0 and fp8train.inspection.current_region() is None
    assert torch.equal(model.fp8_meta["scaling_fwd"].amax_history, history)
    _set(monkeypatch, "0")
    assert _train_step(model, 1) is False
    assert torch.equal(model.fp8_meta["scaling_fwd"].amax_history[1], history[0])  # rolled once


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False)])
def test_accepted_values(monkeypatch, value, expected):
    _set(monkeypatch, value)
    assert _train_step(fp8train.Linear(16, 16), 0) is expected


def test_a_change_between_steps_takes_effect(monkeypatch):
    model = fp8train.Linear(16, 16)
    sequence = [None, "0", "1", "0", "0", None, "1"]
    seen = []
    for step, value in enumerate(sequence):
        _set(monkeypatch, value)
        seen.append(_train_step(model, step))
    assert seen == [value != "0" for value in sequence]


def test_a_change_inside_a_region_waits_for_the_next_region(monkeypatch):
    _set(monkeypatch, "1")
    model = fp8train.Linear(16, 16)
    x = torch.randn(8, 16)
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        _set(monkeypatch, "0")
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):  # a nested region does not re-read it
            y = model(x)
        assert fp8train.inspection.current_region().async_op is True
    y.float().sum().backward()
    assert _train_step(model, 1) is False


@pytest.mark.parametrize("value", ["2", "true", "", "async", "0 1"])
def test_invalid_async_env_is_a_clear_error_and_leaves_no_region(monkeypatch, value: str) -> None:
    model = fp8_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monkeypatch.setenv(ENV_ASYNC, value)
    with pytest.raises(ValueError, match=f"{ENV_ASYNC}={value!r} is not valid: use 1 .* or 0"):
        train_step(model, opt, rank_batch(0, 0), RECIPE)
    assert fp8train.inspection.open_regions() == 0 and fp8train.inspection.current_region() is None
    assert all(bool((t[1] == 1).all()) for t in [fp8_state(model)[i : i + 3] for i in (0, 3, 6, 9)])
    for ok in ("0", "1", " 1 "):
        monkeypatch.setenv(ENV_ASYNC, ok)
        assert math.isfinite(train_step(model, opt, rank_batch(0, 1), RECIPE))
