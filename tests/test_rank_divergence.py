"""Ranks whose steps diverge fail loudly instead of pairing different steps' collectives.

A rank that caught an exception inside its region, skipped one of its FP8 modules, or ran an extra
training region (with its backward inside) would otherwise pair its collectives with other steps'
on the other ranks and train with different scales, silently. (A rank that skips a whole training
step, all its FP8 modules and its backward, is not detectable: docs/design.md, section 4.)
"""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train import LayoutMismatchError, fp8_autocast
from multirank import run_ranks

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def _diverging_rank(rank: int, world_size: int, how: str) -> dict:
    torch.manual_seed(0)
    first, second = fp8train.Linear(16, 16), fp8train.Linear(16, 16)
    scales = []
    try:
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + rank)
            diverge = rank == 1 and step == 1
            with fp8_autocast(fp8_recipe=RECIPE):
                if diverge and how == "caught_exception":
                    try:
                        with fp8_autocast(fp8_recipe=RECIPE):
                            second(first(x))
                            raise RuntimeError("bad batch")
                    except RuntimeError:
                        pass  # the rank "skips the batch" and carries on
                    y = None
                elif diverge and how == "skipped_module":
                    y = first(x)  # data-dependent control flow skipped `second` on this rank only
                else:
                    y = second(first(x))
            if how == "extra_region" and rank == 0 and step == 1:
                with fp8_autocast(fp8_recipe=RECIPE):
                    second(first(x)).sum().backward()
            if y is not None:
                y.square().mean().backward()
            scales.append(first.fp8_meta["scaling_fwd"].scale.tolist())
    except LayoutMismatchError as exc:
        return {"error": str(exc), "scales": scales}
    return {"error": None, "scales": scales}


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["caught_exception", "skipped_module", "extra_region"])
def test_diverging_rank_raises_on_every_rank(how: str) -> None:
    results = run_ranks(_diverging_rank, 2, how, timeout_s=90, pg_timeout_s=30)
    for r in results:
        assert r["error"] is not None, f"{how}: a rank trained on with scales {r['scales']}"
        assert "layout mismatch" in r["error"]
    # by the second step after the divergence (step 1): the header is checked on the device and the
    # host reads the result without waiting; no rank applied a scale from a mispaired reduction, so
    # the scales both ranks read agree, and none moved after the divergence
    common = min(len(r["scales"]) for r in results)
    for r in results:
        assert len(r["scales"]) <= 3, r["scales"]
        assert all(scales == r["scales"][1] for scales in r["scales"][2:]), r["scales"]
    assert results[0]["scales"][:common] == results[1]["scales"][:common]
    if how == "extra_region":
        assert "training_region" in results[0]["error"]
