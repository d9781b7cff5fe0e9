"""The fused update: modules see the real (rolled) storage, and its cost does not grow with modules."""

from __future__ import annotations

import collections

import pytest
import torch

import fp8train
from fp8train import DelayedScaling
from fp8train.tools.bench.common import OpCounter
from reference import amax_of


def _step(mods: list[torch.nn.Module], xs: list[torch.Tensor], recipe: DelayedScaling) -> None:
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        loss = sum(m(x).float().square().mean() for m, x in zip(mods, xs))
    loss.backward()


def test_module_history_is_the_rolled_storage() -> None:
    """After k steps the module's input rows are the amaxes of steps k-1..0, in that order."""
    recipe = DelayedScaling(amax_history_len=8)
    mods = [fp8train.Linear(16, 16), fp8train.Linear(16, 16)]
    amaxes: list[list[float]] = [[], []]
    held = None
    for k in range(1, 6):
        xs = [torch.randn(4, 16) * (k + 10 * i) for i in range(2)]
        _step(mods, xs, recipe)
        for i in range(2):
            amaxes[i].append(amax_of(xs[i]))
        fp8train.synchronize()
        for i, m in enumerate(mods):
            history = m.fp8_meta["scaling_fwd"].amax_history
            assert history[:k, 0].tolist() == amaxes[i][::-1]
            assert history[k:, 0].abs().sum().item() == 0.0
        if k == 2:
            held = mods[1].fp8_meta["scaling_fwd"].amax_history  # a view taken now...
    # ...shows the later updates too: it is the storage that the update rolls, not a temporary.
    assert held[:5, 0].tolist() == amaxes[1][::-1]
    storage = fp8train.inspection.amax_group(recipe, None).fwd.storage
    for i, m in enumerate(mods):
        meta = m.fp8_meta["scaling_fwd"]
        for name, whole in (("amax_history", storage.history), ("scale", storage.scale)):
            view = getattr(meta, name)
            assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(), name
        assert torch.equal(meta.amax_history, storage.history[:, 3 * i : 3 * i + 3])


def test_modules_of_a_region_share_one_contiguous_storage() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    mods = [fp8train.Linear(8, 8), fp8train.LayerNormMLP(8, 16), fp8train.Linear(8, 8)]
    _step(mods, [torch.randn(2, 8) for _ in mods], recipe)
    group = fp8train.inspection.amax_group(recipe, None)
    fwd, bwd = group.fwd, group.bwd
    assert fwd.storage.history.shape == (4, 3 + 6 + 3) and bwd.storage.history.shape == (4, 2 + 4 + 2)
    assert fwd.storage.history.is_contiguous()
    offsets = [m.fp8_meta["scaling_fwd"].offset for m in mods]
    assert offsets == [0, 3, 9]


def _finish_ops(num_modules: int, recipe: DelayedScaling) -> tuple[collections.Counter, collections.Counter]:
    """aten ops executed by completing the pending reductions (fwd, bwd) after one training step of N
    Linears: the fused update."""
    fp8train.inspection.reset()
    mods = [fp8train.Linear(8, 8) for _ in range(num_modules)]
    x = torch.randn(2, 8)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        h = x
        for m in mods:
            h = m(h)
    h.square().sum().backward()
    group = fp8train.inspection.amax_group(recipe, None)
    fwd, bwd = group.fwd, group.bwd
    assert fwd.pending_reductions == bwd.pending_reductions == 1 and fwd.storage.num_roles == 3 * num_modules
    counts = []
    for group in (fwd, bwd):
        before = group.storage.history.clone()
        with OpCounter() as counter:
            group.complete()
        assert not torch.equal(before, group.storage.history)  # the update did run
        counts.append(counter.ops)
    return counts[0], counts[1]


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(amax_history_len=16),
        DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent", margin=1),
    ],
    ids=["max", "most_recent"],
)
def test_update_op_count_is_independent_of_module_count(recipe: DelayedScaling) -> None:
    few_fwd, few_bwd = _finish_ops(4, recipe)
    many_fwd, many_bwd = _finish_ops(64, recipe)
    assert sum(few_fwd.values()) > 0
    assert few_fwd == many_fwd and few_bwd == many_bwd
    # a small fixed number: no per-module (or per-column) Python loop hides inside
    assert sum(many_fwd.values()) < 60, dict(many_fwd)  # the update and the history digest roll
