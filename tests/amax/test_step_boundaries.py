"""Per-step amax reduction in real use: optimizers that step with a closure, a rank that runs
no microbatch in a step, and a mid-step checkpoint saved by rank 0 alone.

- A closure runs the step's last forward and backward inside `optimizer.step` (Lightning's automatic
  optimization, LBFGS); `end_step_on(optimizer)` takes the boundary after it, so the run equals the
  same run without a closure, bit for bit (before: the boundary came first, and the run raised at
  its second step, or reduced every step one step late).
- Every boundary launches every per-step group the rank has trained in, with zeros where it trained
  nothing, so a rank without microbatches in a step pairs its collectives with the others' (before:
  gloo aborted the process); the FP8 state equals the naive reference fed with the amaxes the layers
  saw, MAX over microbatches and ranks.
- A checkpoint saved mid-step holds the saving rank's amaxes of the step only: loading it on another
  rank is refused, naming the fix (before: it resumed silently with rank 0's partial MAX as the
  group's); each rank's own mid-step state resumes on that rank, in that group, bit for bit (before
  the record of who saved it, that was refused too); into another group it is refused.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from test_per_step_reduction import HISTORY, STEP, WIDTHS, Capture, _batch, _state

import fp8train
from helpers import digest, fp8_mlp, fp8_state
from multirank import run_ranks, run_scenarios, scenario_outcome
from reference import E4M3_MAX, E5M2_MAX, RefScaling

pytestmark = pytest.mark.multirank
STEPS = 3


def _sync_grads(model: torch.nn.Module) -> None:
    """Data parallelism by hand: the mean gradient over the ranks (zeros from a rank that ran nothing)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _microbatch(model, rank: int, step: int, micro: int, accum: int) -> float:
    with fp8train.fp8_autocast(fp8_recipe=STEP):
        y = model(_batch(rank, step, micro))
    loss = y.square().mean() / accum
    loss.backward()
    return loss.item()


# ---- closures ----------------------------------------------------------------------------------------
def _closure_run(rank: int, accum: int, closure: bool) -> dict:
    """SGD steps of `accum` microbatches; with `closure` the last one runs inside `opt.step(closure)`."""
    fp8train.inspection.reset()
    model = fp8_mlp(0, WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fp8train.end_step_on(opt)
    losses, states = [], []
    for step in range(STEPS):
        for micro in range(accum - 1 if closure else accum):
            losses.append(_microbatch(model, rank, step, micro, accum))
        if closure:

            def last_microbatch(step=step):
                losses.append(_microbatch(model, rank, step, accum - 1, accum))
                _sync_grads(model)
                return losses[-1]

            opt.step(last_microbatch)
        else:
            _sync_grads(model)
            opt.step()
        opt.zero_grad()
        states.append(digest(fp8_state(model)))
    return {"losses": losses, "states": states, "params": digest(list(model.parameters()))}


def _lbfgs_run(rank: int) -> dict:
    """LBFGS evaluates its closure several times per step, at other parameters each time: each call
    ends a step of its own (one reduction per direction and call)."""
    fp8train.inspection.reset()
    model = fp8_mlp(0, WIDTHS)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3, history_size=2)
    fp8train.end_step_on(opt)
    calls = []

    def closure():
        opt.zero_grad()
        loss = _microbatch(model, rank, 0, len(calls), 1)
        _sync_grads(model)
        calls.append(loss)
        return torch.tensor(loss)

    for _ in range(2):
        opt.step(closure)
    fp8train.synchronize()
    group = fp8train.inspection.amax_group(STEP)
    return {"calls": len(calls), "steps": group.training_regions, "fp8": digest(fp8_state(model))}


def _closures(rank: int, world: int) -> dict:
    def run_one(name: str):
        if name == "lbfgs":
            return _lbfgs_run(rank)
        accum = int(name[-1])
        return {"closure": _closure_run(rank, accum, True), "plain": _closure_run(rank, accum, False)}

    return run_scenarios(["accumulate=1", "accumulate=2", "lbfgs"], run_one)


def test_a_closure_step_marks_the_boundary_after_its_last_microbatch() -> None:
    runs = run_ranks(_closures, 2, timeout_s=240, pg_timeout_s=60)
    for name in ("accumulate=1", "accumulate=2"):
        outs = scenario_outcome(runs, name)
        for out in outs:
            assert out["closure"] == out["plain"], name  # losses, FP8 state after every step, parameters
        assert outs[0]["closure"]["states"] == outs[1]["closure"]["states"]
        assert outs[0]["closure"]["losses"] != outs[1]["closure"]["losses"]  # different data per rank
    lbfgs = scenario_outcome(runs, "lbfgs")
    for out in lbfgs:
        assert out["calls"] > 2 and out["steps"] == out["calls"], out  # a boundary after each evaluation
    assert lbfgs[0]["fp8"] == lbfgs[1]["fp8"]


# ---- a rank without microbatches ---------------------------------------------------------------------
def _uneven(rank: int, world: int, empty: str) -> dict:
    """Step 1: rank 0 runs 2 microbatches, rank 1 none (`empty="none"`), or only a region that calls no
    FP8 module (`empty="region"`); both synchronise gradients and step. Every step is checked against
    the reference fed with the amaxes the layers saw, MAX over microbatches and ranks."""
    fp8train.inspection.reset()
    model = fp8_mlp(0, WIDTHS)
    capture = Capture(model)
    ref_fwd, ref_bwd = RefScaling(6, HISTORY), RefScaling(4, HISTORY)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fp8train.end_step_on(opt)
    matches = []
    for step in range(STEPS):
        micros = 0 if (step == 1 and rank == 1) else 2
        for micro in range(micros):
            _microbatch(model, rank, step, micro, 2)
        if micros == 0 and empty == "region":
            with fp8train.fp8_autocast(fp8_recipe=STEP):  # grad enabled, no FP8 call
                (model[0].bias.sum() * 0).backward()
        _sync_grads(model)
        opt.step()
        opt.zero_grad()
        fwd, bwd = capture.take()
        ref_fwd.update(fwd, STEP, E4M3_MAX)
        ref_bwd.update(bwd, STEP, E5M2_MAX)
        (h_f, s_f), (h_b, s_b) = _state(model)
        matches.append(
            (h_f, s_f, h_b, s_b) == (ref_fwd.history, ref_fwd.scale, ref_bwd.history, ref_bwd.scale)
        )
    return {
        "matches": matches,
        "fp8": digest(fp8_state(model)),
        "steps": fp8train.inspection.amax_group(STEP).training_regions,
    }


@pytest.mark.parametrize("empty", ["none", "region"])
def test_a_rank_without_microbatches_in_a_step_pairs_its_collectives(empty: str) -> None:
    outs = run_ranks(_uneven, 2, empty, timeout_s=180, pg_timeout_s=30)
    for out in outs:
        assert out["matches"] == [True] * STEPS and out["steps"] == STEPS, out
    assert outs[0]["fp8"] == outs[1]["fp8"]


# ---- a mid-step checkpoint saved by rank 0 ------------------------------------------------------------
def _mid_step_save(rank: int, world: int) -> dict:
    """2 microbatches a step, gradients synchronised after each, rank 1's data larger. Rank 0 saves
    after microbatch 0 of step 2 (and, as a control, at the boundary after step 1's optimizer step);
    both ranks load the boundary file and finish the run; both load the mid-step file into a new
    model: rank 1 is refused (rank 0's partial amaxes are not its own), rank 0 takes its own."""

    def batch(step: int, micro: int) -> torch.Tensor:
        return _batch(0, step, micro) * (4.0 if rank == 1 else 1.0)

    def run(load_at=None, blobs=None):
        fp8train.inspection.reset()
        model = fp8_mlp(0, WIDTHS)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        fp8train.end_step_on(opt)
        saved, inputs = {}, []

        def point_reached(point) -> None:
            if rank == 0 and point in ("after step 1", (2, 0)):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                saved[point] = (buffer.getvalue(), [str(w.message) for w in caught])
            if point == load_at:
                dist.barrier()
                model.load_state_dict(torch.load(io.BytesIO(blobs[point]), weights_only=True))

        for step in range(STEPS):
            for micro in range(2):
                with fp8train.fp8_autocast(fp8_recipe=STEP):
                    y = model(batch(step, micro))
                (y.square().mean() / 2).backward()
                _sync_grads(model)
                point_reached((step, micro))
            opt.step()
            opt.zero_grad()
            point_reached(f"after step {step}")
            inputs.append(model[0].fp8_meta["scaling_fwd"].amax_history[0, 0].item())  # reduced input amax
        return inputs, saved

    uninterrupted, saved = run()
    blobs = [{p: b for p, (b, _) in saved.items()} if rank == 0 else None]
    dist.broadcast_object_list(blobs, src=0)
    out = {"uninterrupted": uninterrupted, "warnings": {p: w for p, (_, w) in saved.items()}}
    out["boundary"] = run(load_at="after step 1", blobs=blobs[0])[0]
    try:
        fp8_mlp(0, WIDTHS).load_state_dict(torch.load(io.BytesIO(blobs[0][(2, 0)]), weights_only=True))
        out["mid_step"] = "loaded"
    except ValueError as exc:
        out["mid_step"] = str(exc)
    return out


def test_a_mid_step_checkpoint_saved_by_rank_0_is_refused_on_the_other_ranks() -> None:
    outs = run_ranks(_mid_step_save, 2, timeout_s=180, pg_timeout_s=30)
    for out in outs:
        assert out["boundary"] == out["uninterrupted"]  # saved at the boundary: resumes exactly
    refused = outs[1]["mid_step"]  # never silently other scales
    assert "saved in the middle of an optimizer step" in refused and "loaded by global rank 1" in refused
    assert "resume from a checkpoint saved at a step boundary" in refused
    assert outs[0]["mid_step"] == "loaded"  # rank 0's own partial, on rank 0
    assert outs[0]["uninterrupted"] == outs[1]["uninterrupted"]
    assert (
        outs[0]["warnings"]["after step 1"] == []
        and "middle of an optimizer step" in outs[0]["warnings"][(2, 0)][0]
    )


# ---- a mid-step checkpoint that every rank saves for itself -------------------------------------------
def _every_rank_saves_mid_step(rank: int, world: int) -> dict:
    """2 microbatches a step, gradients synchronised after each, rank 1's data larger. Every rank
    saves its own state after microbatch 0 of step 2, then "restarts" (fp8train's state reset, a new
    model loaded from its file) and finishes the run from microbatch 1 of step 2: its own mid-step
    state resumes bit for bit. A rank loading the other's file, or its own into another amax group,
    is refused (on every rank alike here, since every rank does the same)."""

    def batch(step: int, micro: int) -> torch.Tensor:
        return _batch(0, step, micro) * (4.0 if rank == 1 else 1.0)

    def train(model, start, stop, save_at=None, group=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        fp8train.end_step_on(opt)
        inputs, saved = [], None
        for step, micro in [(s, m) for s in range(STEPS) for m in range(2)]:
            if not start <= (step, micro) < stop:
                continue
            with fp8train.fp8_autocast(fp8_recipe=STEP, fp8_group=group):
                y = model(batch(step, micro))
            (y.square().mean() / 2).backward()
            _sync_grads(model)
            if (step, micro) == save_at:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the warning says where it resumes
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                saved = buffer.getvalue()
            if micro == 1:
                opt.step()
                opt.zero_grad()
                inputs.append(model[0].fp8_meta["scaling_fwd"].amax_history[0, 0].item())
        return inputs, saved, digest(fp8_state(model))

    def restarted(blob: bytes, group=None) -> tuple:
        fp8train.inspection.reset()
        model = fp8_mlp(0, WIDTHS)
        model.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        return train(model, (2, 1), (STEPS, 0), group=group)

    fp8train.inspection.reset()
    uninterrupted, _, final = train(fp8_mlp(0, WIDTHS), (0, 0), (STEPS, 0))
    fp8train.inspection.reset()
    before, blob, _ = train(fp8_mlp(0, WIDTHS), (0, 0), (2, 1), save_at=(2, 0))
    blobs: list = [None] * world
    dist.all_gather_object(blobs, blob)
    out = {"uninterrupted": uninterrupted, "final": final}
    after, _, out["resumed_final"] = restarted(blobs[rank])
    out["resumed"] = before + after
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes both
    for name, other, group in (("other rank's", blobs[1 - rank], None), ("other group", blobs[rank], alone)):
        try:
            restarted(other, group)
            out[name] = "resumed"
        except ValueError as error:
            out[name] = str(error)
        dist.barrier()
    return out


def test_a_mid_step_checkpoint_every_rank_saves_for_itself_resumes_on_that_rank() -> None:
    outs = run_ranks(_every_rank_saves_mid_step, 2, timeout_s=180, pg_timeout_s=30)
    for rank, out in enumerate(outs):
        assert out["resumed"] == out["uninterrupted"], out  # the reduced input amax of every step
        assert out["resumed_final"] == out["final"]  # and the whole FP8 state, bit for bit
        assert "saved in the middle of an optimizer step" in out["other rank's"], out
        assert (
            f"global rank {1 - rank}" in out["other rank's"]
            and f"loaded by global rank {rank}" in (out["other rank's"])
        )
        assert f"loaded into the amax group of ranks [{rank}]" in out["other group"], out
    assert outs[0]["uninterrupted"] == outs[1]["uninterrupted"]


# ---- which modules FSDP2 manages (their boundary is the user's: check_step_open skips them) ----------------
def _fsdp_managed(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from fp8train.torch_internals import managed_by_fsdp2

    model = fp8_mlp(0, WIDTHS)
    fully_shard(model[0])

    class FSDPLookalike(torch.nn.Linear):  # a user's class whose name merely starts with FSDP
        pass

    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicated = replicate(fp8_mlp(1, WIDTHS))  # built on FSDP2's classes, but it gathers nothing
    modules = (model[0], model[2], FSDPLookalike(2, 2), replicated)
    return {"managed": [managed_by_fsdp2(m) for m in modules]}


@pytest.mark.multirank
def test_fsdp2_managed_modules_are_told_by_their_class_not_their_name() -> None:
    for result in run_ranks(_fsdp_managed, 2, timeout_s=240):
        assert result["managed"] == [True, False, False, False]
