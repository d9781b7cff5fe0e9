"""The amax protocol under real training patterns, not only lockstep loops.

Real gloo ranks. Every scenario ends in correct training (checked bit for bit against the same run
without the pattern) or in the same clear error on every rank; none may hang or kill a process.

1. Regions that only some ranks enter or that train nothing: rank-0-only validation (no_grad and
   inference_mode inside the region) followed by a save and a barrier, a region every rank enters
   but only rank 0 evaluates in, uneven validation shards, a high-precision region with grad on one
   rank, an out-of-memory retry inside the region on one rank, a second FP8 model trained or
   calibrated by one rank alone, nested groups on several process groups with one evaluated by
   rank 0 first, and (3 ranks) a model trained by a subgroup that the third rank never runs.
2. Rank 0 loads a checkpoint, DDP broadcasts parameters but not FP8 state: a StateMismatchError on
   every rank (also when only the amax histories differ); `fp8train.broadcast_fp8_state` after it,
   or torch.distributed.checkpoint loading on every rank, continues exactly like the uninterrupted
   run.
3. Divergence in a step that grows the layout (the first step, or the step where a module first
   trains): LayoutMismatchError on every rank, never collectives of different sizes. (A rank that
   skips a whole training step, e.g. raises before any FP8 call, only shifts which steps pair:
   docs/design.md, section 4.)
4. DDP join() with uneven inputs: a clear error on every rank at once; join(throw_on_early_termination=
   True) works and ends with DDP's own error on every rank.
5. torch.utils.checkpoint(use_reentrant=True) over a module also called outside it: the documented
   RuntimeError.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

import fp8train
from fp8train import DelayedScaling, LayoutMismatchError, StateMismatchError, fp8_autocast
from fp8train.amax import settings
from helpers import digest, fp8_mlp, fp8_state, rank_batch, sgd
from multirank import AllReduceSpy, run_ranks, run_scenarios, scenario_outcome

RECIPE = DelayedScaling(amax_history_len=4)
LR = 0.05
WIDTHS = (16, 32, 16)  # Linear(16, 32), GELU, Linear(32, 16)


def train_step(model: torch.nn.Module, x: torch.Tensor, group, backward: bool = True) -> float:
    with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
        y = model(x)
    loss = y.float().pow(2).mean()
    if backward:
        loss.backward()
        sgd(model, LR)
    return loss.item()


def fp8_digest(model: torch.nn.Module) -> str:
    return digest(fp8_state(model))


# ---- 1. regions that only some ranks enter, or that train nothing -------------------------------------
def _rank_local_regions(rank: int, ddp: DDP, local: torch.nn.Module, step: int, group, solo) -> None:
    model = ddp.module
    if step == 1:  # rank 0 validates alone, saves, then every rank meets at a barrier
        if rank == 0:
            with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group), torch.no_grad():
                model(rank_batch(99, step))
            torch.save(model.state_dict(), io.BytesIO())
        dist.barrier(group)
    if step == 2:  # every rank enters a region; only rank 0 evaluates in it (inference_mode)
        with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
            if rank == 0:
                with torch.inference_mode():
                    model(rank_batch(98, step))
    if step == 3:  # uneven validation shards: rank 0 has one batch more
        for i in range(3 if rank == 0 else 2):
            with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
                model(rank_batch(90 + i, step))
    if step == 4 and rank == 1:  # a high-precision region with grad on, on one rank
        with fp8_autocast(enabled=False, fp8_recipe=RECIPE, fp8_group=group):
            model(rank_batch(97, step)).sum()
    if step == 5:  # a second FP8 model that each rank trains, then calibrates, alone
        recipe = DelayedScaling(amax_history_len=4, reduce_amax=False) if rank == 0 else RECIPE
        own = None if rank == 0 else solo[rank]
        for i in range(2):
            with fp8_autocast(fp8_recipe=recipe, fp8_group=own):
                y = local(rank_batch(80 + i, step))
            y.square().mean().backward()
            sgd(local, LR)
        with torch.no_grad(), fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe, fp8_group=own):
            local(rank_batch(85, step))


def _train_step_retrying(ddp: DDP, x: torch.Tensor, group, fail_first: bool) -> float:
    """A step whose first attempt (on this rank) fails after one FP8 call, inside the region, and is
    retried there: the usual out-of-memory retry. The failed attempt's graph is dropped."""
    with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
        if fail_first:
            try:
                ddp.module[0](x)
                raise MemoryError("out of memory (simulated)")
            except MemoryError:
                pass
        y = ddp(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    sgd(ddp.module, LR)
    return loss.item()


def rank_local(rank: int, world: int) -> dict:
    solo = [dist.new_group([r]) for r in range(world)]
    runs = {}
    for variant in ("lockstep", "with rank-local regions"):
        group = dist.new_group(list(range(world)))
        ddp = DDP(fp8_mlp(0, WIDTHS), process_group=group)
        local = fp8_mlp(7, WIDTHS)
        log = []
        with AllReduceSpy() as spy:
            for step in range(6):
                before = spy.calls
                retry = variant != "lockstep" and rank == 0 and step == 4
                loss = _train_step_retrying(ddp, rank_batch(rank, step), group, retry)
                if variant != "lockstep":
                    _rank_local_regions(rank, ddp, local, step, group, solo)
                collectives = spy.calls - before
                log.append({"loss": loss, "fp8": fp8_digest(ddp.module), "amax_collectives": collectives})
        runs[variant] = log
    return runs


def nested_groups(rank: int, world: int) -> dict:
    """Three recipes (amax groups) in nested regions, two of them on their own process groups; rank 0
    also evaluates model B before the others train, in the first (size handshake) step and later.
    The groups launch in the order they first trained, the same on every rank."""
    recipes = [DelayedScaling(amax_history_len=4, margin=m) for m in range(3)]
    runs = {}
    for variant in ("lockstep", "rank 0 evaluates B first"):
        pg_b, pg_c = dist.new_group([0, 1]), dist.new_group([0, 1])
        a, b, c = fp8_mlp(1, WIDTHS), fp8_mlp(2, WIDTHS), fp8_mlp(3, WIDTHS)
        log = []
        for step in range(4):
            x = rank_batch(rank, step)
            with fp8_autocast(fp8_recipe=recipes[0]):
                if variant != "lockstep" and rank == 0 and step in (0, 2):
                    with torch.no_grad(), fp8_autocast(fp8_recipe=recipes[1], fp8_group=pg_b):
                        b(x)
                h = a(x)
                with fp8_autocast(fp8_recipe=recipes[2], fp8_group=pg_c):
                    h = c(h)
                with fp8_autocast(fp8_recipe=recipes[1], fp8_group=pg_b):
                    h = b(h)
            h.float().pow(2).mean().backward()
            for m in (a, b, c):
                sgd(m, LR)
            log.append([fp8_digest(m) for m in (a, b, c)])
        runs[variant] = log
    return runs


def three_ranks(rank: int, world: int) -> dict:
    """Model A is trained by ranks {0, 1} only; model B by all three ranks, in the same steps."""
    pair, everyone = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    a, b = fp8_mlp(1, WIDTHS), fp8_mlp(2, WIDTHS)
    losses = []
    for step in range(4):
        if rank < 2:
            train_step(a, rank_batch(rank, step), pair)
        losses.append(train_step(b, rank_batch(rank, step), everyone))
    return {"a": fp8_digest(a) if rank < 2 else None, "b": fp8_digest(b), "losses": losses}


# ---- 2. a checkpoint loaded on rank 0 only ------------------------------------------------------------
def rank0_load(rank: int, world: int, directory: str) -> dict:
    path, dcp_dir = os.path.join(directory, "model.pt"), os.path.join(directory, "dcp")
    group = dist.new_group([0, 1])
    model = fp8_mlp(0, WIDTHS)
    ddp = DDP(model, process_group=group)
    for step in range(3):
        train_step(ddp, rank_batch(rank, step), group)
    if rank == 0:
        torch.save(model.state_dict(), path)  # finishes the step's reductions first
    dcp.save({"model": model.state_dict()}, checkpoint_id=dcp_dir, process_group=group)
    dist.barrier(group)
    out = {"uninterrupted": [train_step(ddp, rank_batch(rank, step), group) for step in range(3, 6)]}
    out["uninterrupted_fp8"] = fp8_digest(model)
    for how in ("rank 0 loads", "rank 0 loads, then broadcast_fp8_state", "dcp on every rank"):
        group = dist.new_group([0, 1])
        fresh = fp8_mlp(5, WIDTHS)
        if how.startswith("rank 0") and rank == 0:
            fresh.load_state_dict(torch.load(path))
        if how.startswith("dcp"):
            state = {"model": fresh.state_dict()}
            dcp.load(state, checkpoint_id=dcp_dir, process_group=group)
            fresh.load_state_dict(state["model"])
        ddp = DDP(fresh, process_group=group)  # broadcasts rank 0's parameters, not FP8 state
        if how.endswith("broadcast_fp8_state"):
            fp8train.broadcast_fp8_state(fresh, src=0, group=group)
        losses = []
        try:
            for step in range(3, 6):
                losses.append(train_step(ddp, rank_batch(rank, step), group))
            out[how] = {"losses": losses, "fp8": fp8_digest(fresh), "error": None}
        except StateMismatchError as exc:
            out[how] = {"losses": losses, "error": str(exc)}
            try:  # too late to resynchronise: every rank refuses, none waits in the broadcast
                fp8train.broadcast_fp8_state(fresh, src=0, group=group)
            except RuntimeError as late:
                out[how]["broadcast_after_failure"] = str(late)
    return out


def history_only_load(rank: int, world: int) -> dict:
    """Rank 0 alone reloads an earlier checkpoint whose scales equal the current ones but whose amax
    history does not (same data on both ranks, a spike in step 0, frozen weights): the first
    reduction after the load must fail, before any step trains with different scales."""
    group = dist.new_group([0, 1])
    model = fp8_mlp(0, WIDTHS)
    saved, scales = None, []
    for step in range(7):
        if step == 3 and rank == 0:
            model.load_state_dict(torch.load(io.BytesIO(saved)))
        try:
            with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
                scales.append(model[0].fp8_meta["scaling_fwd"].scale.tolist())
                y = model(rank_batch(0, step) * (100.0 if step == 0 else 1.0))
            y.float().pow(2).mean().backward()
            model.zero_grad(set_to_none=True)  # frozen weights: only the FP8 state moves
        except StateMismatchError:
            return {"error_step": step, "scales": scales}
        if step == 1:
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            saved = buffer.getvalue()
    return {"error_step": None, "scales": scales}


# ---- 3. divergence in a step that grows the layout ---------------------------------------------------------
GROWTH_CASES = {
    # case: (step at which rank 1 diverges, what it does)
    "skips its backward in the first step": 0,
    "raises after its FP8 calls in the first step": 0,
    "skips a module in the step it first trains": 2,
    "skips its backward in the step a module first trains": 2,
}


def _growth_step(case: str, model, extra, x, group, step: int, diverge: bool) -> None:
    new_module = case.endswith("first trains") and step >= 2
    with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
        y = model(x)
        if new_module and not (diverge and case.startswith("skips a module")):
            y = extra(y)
        if diverge and case.startswith("raises after"):
            raise ValueError("bad batch")
    if not (diverge and case.startswith("skips its backward")):
        y.float().pow(2).mean().backward()
        sgd(model, LR)


def growth(rank: int, world: int) -> dict:
    """With collectives that carry 4 amaxes at first, the model's 6 forward roles grow the size at step 0
    and `extra`'s 3 more at step 2: both growth steps settle the size in a blocking handshake."""
    out = {}
    with settings.override(initial_wire=4):  # read by each new channel
        for case, diverge_at in GROWTH_CASES.items():
            out[case] = _growth_case(rank, case, diverge_at)
    return out


def _growth_case(rank: int, case: str, diverge_at: int) -> dict:
    group = dist.new_group([0, 1])
    model, extra = fp8_mlp(0, WIDTHS), fp8train.Linear(16, 16)  # `extra` joins the model at step 2
    for step in range(5):
        diverge = rank == 1 and step == diverge_at
        try:
            _growth_step(case, model, extra, rank_batch(rank, step), group, step, diverge)
        except ValueError as exc:
            assert str(exc) == "bad batch"  # the rank skips the batch and carries on
        except LayoutMismatchError as exc:
            return {"error": str(exc), "step": step}
    return {"error": None}


# ---- 4. DDP join() with uneven inputs ------------------------------------------------------------------
def join(rank: int, world: int) -> dict:
    out = {}
    for throw in (False, True):
        group = dist.new_group([0, 1])
        ddp = DDP(fp8_mlp(0, WIDTHS), process_group=group)
        steps = 0
        try:
            with ddp.join(throw_on_early_termination=throw):
                for step in range(3 if rank == 0 else 2):  # rank 1 runs out of data first
                    train_step(ddp, rank_batch(rank, step), group)
                    steps += 1
            error = None
        except RuntimeError as exc:
            error = str(exc)
        fp8train.synchronize()
        out[throw] = {"error": error, "steps": steps, "fp8": fp8_digest(ddp.module)}
    return out


# ---- 5. reentrant checkpointing over a module also called outside it --------------------------------------
def reentrant(rank: int, world: int) -> dict:
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    shared = fp8train.Linear(16, 16)
    x = rank_batch(rank, 0).requires_grad_()
    try:
        with fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
            h = torch.utils.checkpoint.checkpoint(shared, x, use_reentrant=True)
            y = shared(h)
        y.sum().backward()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


SCENARIOS = {
    "rank_local": rank_local,
    "nested_groups": nested_groups,
    "rank0_load": rank0_load,
    "history_only_load": history_only_load,
    "growth": growth,
    "join": join,
    "reentrant": reentrant,
}


def _worker(rank: int, world: int, names: list[str], directory: str) -> dict:
    def run_one(name: str):
        fp8train.inspection.reset()
        return SCENARIOS[name](rank, world, *((directory,) if name == "rank0_load" else ()))

    return run_scenarios(names, run_one)


outcome = scenario_outcome


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("patterns"))
    return run_ranks(_worker, 2, list(SCENARIOS), directory, timeout_s=240, pg_timeout_s=30)


@pytest.mark.multirank
def test_rank_local_regions_change_nothing(two_ranks):
    runs = outcome(two_ranks, "rank_local")
    for rank_runs in runs:
        # bit for bit the lockstep run, with the same amax collectives per step: evaluation, extra
        # validation batches, high-precision regions and other groups' regions launch nothing
        assert rank_runs["with rank-local regions"] == rank_runs["lockstep"]
        counts = [s["amax_collectives"] for s in rank_runs["lockstep"]]
        assert counts == [2] * 6  # one per direction (the first step's sizes fit INITIAL_WIRE)
    assert [s["fp8"] for s in runs[0]["lockstep"]] == [s["fp8"] for s in runs[1]["lockstep"]]


@pytest.mark.multirank
def test_nested_groups_launch_in_training_order_whatever_ranks_evaluate(two_ranks):
    runs = outcome(two_ranks, "nested_groups")
    for rank_runs in runs:
        assert rank_runs["rank 0 evaluates B first"] == rank_runs["lockstep"]
    assert runs[0]["lockstep"] == runs[1]["lockstep"]


@pytest.mark.multirank
def test_a_subgroup_model_the_third_rank_never_runs():
    runs = run_ranks(three_ranks, 3, timeout_s=120, pg_timeout_s=30)
    assert runs[0]["a"] == runs[1]["a"] and runs[2]["a"] is None
    assert runs[0]["b"] == runs[1]["b"] == runs[2]["b"]
    assert len({tuple(r["losses"]) for r in runs}) == 3  # different data per rank: a real reduction


@pytest.mark.multirank
def test_rank0_load_is_caught_and_broadcast_fp8_state_fixes_it(two_ranks):
    runs = outcome(two_ranks, "rank0_load")
    for out in runs:
        caught = out["rank 0 loads"]
        # the first reduction's state check fails; every rank raises two launches later, at the second
        # region's exit, and nothing was applied from it
        assert caught["error"] is not None and len(caught["losses"]) == 1, caught
        assert "broadcast_fp8_state" in caught["error"] and "different scales" in caught["error"]
        assert "already failed" in caught["broadcast_after_failure"]
        for how in ("rank 0 loads, then broadcast_fp8_state", "dcp on every rank"):
            assert out[how]["error"] is None, out[how]["error"]
            assert out[how]["losses"] == out["uninterrupted"], how
            assert out[how]["fp8"] == out["uninterrupted_fp8"], how
    assert runs[0]["uninterrupted_fp8"] == runs[1]["uninterrupted_fp8"]


@pytest.mark.multirank
def test_a_load_that_changes_only_the_history_is_caught_at_once(two_ranks):
    for out in outcome(two_ranks, "history_only_load"):
        assert out["error_step"] == 4, out  # the reduction of step 3, checked when step 4 needs it
        assert out["scales"][3] == out["scales"][2]  # the loaded scales equal the current ones...
    runs = outcome(two_ranks, "history_only_load")
    assert runs[0]["scales"] == runs[1]["scales"]  # ...and no step ran with different scales


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(GROWTH_CASES))
def test_divergence_in_a_growth_step_is_a_layout_mismatch_on_every_rank(two_ranks, case):
    for rank, out in enumerate(outcome(two_ranks, "growth")):
        result = out[case]
        assert result["error"] is not None, f"rank {rank} trained on: {case}"
        assert "FP8 layout mismatch" in result["error"]
        assert result["step"] <= GROWTH_CASES[case] + 2


@pytest.mark.multirank
def test_ddp_join_is_refused_on_every_rank_unless_it_throws(two_ranks):
    runs = outcome(two_ranks, "join")
    for out in runs:
        refused = out[False]
        assert refused["steps"] == 0 and "join(throw_on_early_termination=True)" in refused["error"]
        throwing = out[True]  # DDP's own error on every rank once rank 1 runs out, after 2 good steps
        assert throwing["steps"] == 2 and "exhausted" in throwing["error"]
    assert runs[0][True]["fp8"] == runs[1][True]["fp8"]


@pytest.mark.multirank
def test_reentrant_checkpoint_over_a_shared_module_is_the_documented_error(two_ranks):
    for out in outcome(two_ranks, "reentrant"):
        assert out["error"] is not None and "use_reentrant=True is not supported" in out["error"]
