"""Distributed checkpoint/resume: a 2-rank DDP run saved at step K continues bit-identically in new processes.

The first set of processes trains STEPS steps three times (fresh model, fresh process group, so fresh
amax groups, each time): asynchronous reduction with a save after step K, blocking with a save after
step K, and asynchronous without saving. Only rank 0 saves, right after the optimizer step, while the
step's backward reduction is still in flight (rank 1 is held back before that backward so the
collective cannot have completed): `state_dict()` completes it without issuing a collective. A second
set of new processes loads each checkpoint and runs steps K..STEPS-1. Losses and FP8 state (scales,
scale_inv, amax histories of both directions) must equal the uninterrupted run bitwise, in both modes,
and the modes must equal each other. The 2-rank checkpoint also loads on a single process.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import fp8train
from fp8train.amax import decode_extra_state
from helpers import digest, fp8_state
from multirank import run_ranks

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

RECIPE = fp8train.DelayedScaling(amax_history_len=8)
STEPS, K = 6, 3
MODES = {"async": "1", "blocking": "0"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        fp8train.Linear(32, 64), torch.nn.GELU(), fp8train.LayerNormMLP(64, 64), fp8train.Linear(64, 16)
    )


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 32, generator=g) * (1 + rank), torch.randn(8, 16, generator=g)


def _steps(rank: int, model, opt, first: int, save_path=None) -> dict:
    """Train steps first..STEPS-1 under DDP; optionally rank 0 saves right after step K-1's update."""
    out = {"loss": [], "fp8": [], "params": [], "saved_in_flight": None}
    for step in range(first, STEPS):
        x, target = _data(rank, step)
        with fp8train.fp8_autocast(fp8_recipe=RECIPE, fp8_group=model.process_group):
            loss = (model(x) - target).pow(2).mean()
        if save_path and rank == 1 and step == K - 1:
            time.sleep(0.2)  # rank 0's backward reduction of this step stays in flight meanwhile
        loss.backward()
        opt.step()
        opt.zero_grad()
        if save_path and step == K - 1 and rank == 0:
            group = fp8train.inspection.amax_group(RECIPE, model.process_group)
            out["saved_in_flight"] = group.fwd.in_flight + group.bwd.in_flight > 0
            state = {"model": model.module.state_dict(), "optim": opt.state_dict()}  # finishes, no collective
            torch.save(state, save_path)
        out["loss"].append(loss.item())
        out["fp8"].append(digest(fp8_state(model.module)))
        out["params"].append(digest(list(model.parameters())))
    fp8train.synchronize()
    return out


def _new_run(checkpoint=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = _model()
    opt_state = None
    if checkpoint is not None:
        state = torch.load(checkpoint, weights_only=False)
        module.load_state_dict(state["model"])
        opt_state = state["optim"]
    model = DDP(module, process_group=dist.new_group([0, 1]))  # a fresh group: fresh amax groups
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    return model, opt


def _uninterrupted(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    for name, save in (("async", True), ("blocking", True), ("async_nosave", False)):
        os.environ[ENV_ASYNC] = MODES[name.split("_")[0]]
        model, opt = _new_run()
        path = os.path.join(directory, f"{name}.pt") if save else None
        results[name] = _steps(rank, model, opt, 0, path)
        dist.barrier()
    return results


def _resumed(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    for name in MODES:
        os.environ[ENV_ASYNC] = MODES[name]
        model, opt = _new_run(os.path.join(directory, f"{name}.pt"))
        results[name] = _steps(rank, model, opt, K)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict], str]:
    directory = str(tmp_path_factory.mktemp("resume"))
    full = run_ranks(_uninterrupted, 2, directory, timeout_s=150)
    resumed = run_ranks(_resumed, 2, directory, timeout_s=150)
    return full, resumed, directory


@pytest.mark.multirank
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_continues_bitwise(runs, mode: str) -> None:
    full, resumed, _ = runs
    for rank in range(2):
        a, b = full[rank][mode], resumed[rank][mode]
        for key in ("loss", "fp8", "params"):
            assert b[key] == a[key][K:], (rank, key)
    if mode == "async":
        assert full[0][mode]["saved_in_flight"] is True  # the save really met an in-flight reduction


@pytest.mark.multirank
def test_async_blocking_and_saving_change_nothing(runs) -> None:
    full, _, _ = runs
    for rank in range(2):
        reference = full[rank]["async_nosave"]
        for name in ("async", "blocking"):
            for key in ("loss", "fp8", "params"):
                assert full[rank][name][key] == reference[key], (rank, name, key)
        assert len(set(reference["fp8"])) == STEPS  # the FP8 state moved every step
    assert full[0]["async"]["fp8"] == full[1]["async"]["fp8"]  # one state for the amax group


@pytest.mark.multirank
def test_two_rank_checkpoint_loads_on_one_process(runs) -> None:
    """Different world size: FP8 state is replicated, so the single process resumes with the same scales.

    Its first forward (rank 0's data for step K) gives rank 0's loss of step K exactly; then it trains on.
    """
    full, _, directory = runs
    state = torch.load(os.path.join(directory, "async.pt"), weights_only=False)
    model = _model()
    model.load_state_dict(state["model"])
    loaded = fp8_state(model)
    saved = [
        t
        for key, extra in state["model"].items()
        if key.endswith("_extra_state")
        for d in (decode_extra_state(extra)["scaling_fwd"], decode_extra_state(extra)["scaling_bwd"])
        for t in (d["amax_history"], d["scale"], d["scale_inv"])
    ]
    assert len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(loaded, saved))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["optim"])
    losses = []
    for step in range(K, K + 2):
        x, target = _data(0, step)
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == full[0]["async"]["loss"][K]
    assert all(torch.isfinite(torch.tensor(losses)))
    history = model[0].fp8_meta["scaling_fwd"].amax_history
    assert float(history[0, 0]) == float(_data(0, K + 1)[0].abs().max())  # now its own, unreduced amax
