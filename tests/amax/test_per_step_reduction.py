"""Per-step amax reduction (`DelayedScaling(amax_reduction="step")`).

The amaxes of all microbatches of an optimizer step are MAX-accumulated locally and reduced once per
direction at the step boundary (`fp8train.end_step()`); scales are constant within a step and the
history rolls once per step. Checked against the naive reference of tests/reference.py fed with the
amaxes the layers really saw (captured by hooks), MAX over microbatches and ranks: a mode that rolled
per microbatch, or kept only one microbatch's amaxes, fails it.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import fp8train
from helpers import digest, fp8_mlp, fp8_state, sgd
from multirank import AllReduceSpy, run_ranks
from reference import E4M3_MAX, E5M2_MAX, RefScaling

HISTORY = 4
STEP = fp8train.DelayedScaling(amax_history_len=HISTORY, amax_reduction="step")
REGION = fp8train.DelayedScaling(amax_history_len=HISTORY)
WIDTHS = (16, 32, 16)  # fp8_mlp: Linear(16, 32), GELU, Linear(32, 16); more layers add Linear(32, 32)s
M, STEPS = 4, 3


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, 16, generator=g) * (1 + micro + rank)  # microbatches differ in range


class Capture:
    """Per FP8 Linear: the amaxes of its input, weight and output gradient, MAX over a step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = [m for m in model if isinstance(m, fp8train.Linear)]
        self.fwd = [[0.0, 0.0, 0.0] for _ in self.linears]
        self.bwd = [[0.0, 0.0] for _ in self.linears]
        for i, m in enumerate(self.linears):
            m.register_forward_hook(lambda mod, inp, out, i=i: self._forward(i, mod, inp[0]))
            m.register_full_backward_hook(lambda mod, gi, go, i=i: self._backward(i, go[0]))

    def _forward(self, i: int, module, x) -> None:
        if torch.is_grad_enabled():
            self.fwd[i][0] = max(self.fwd[i][0], float(x.detach().abs().max()))
            self.fwd[i][1] = max(self.fwd[i][1], float(module.weight.detach().abs().max()))

    def _backward(self, i: int, grad_output) -> None:
        self.bwd[i][0] = max(self.bwd[i][0], float(grad_output.abs().max()))

    def take(self) -> tuple[list[float], list[float]]:
        """This step's amaxes in storage order (MAX over ranks when distributed), then reset."""
        fwd = [v for row in self.fwd for v in row]
        bwd = [v for row in self.bwd for v in row]
        if dist.is_initialized():
            t = torch.tensor(fwd + bwd, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            fwd, bwd = t[: len(fwd)].tolist(), t[len(fwd) :].tolist()
        self.fwd = [[0.0, 0.0, 0.0] for _ in self.linears]
        self.bwd = [[0.0, 0.0] for _ in self.linears]
        return fwd, bwd


def _state(model) -> tuple[list, list]:
    linears = [m for m in model if isinstance(m, fp8train.Linear)]
    out = []
    for key in ("scaling_fwd", "scaling_bwd"):
        history = torch.cat([m.fp8_meta[key].amax_history for m in linears], dim=1)
        scale = torch.cat([m.fp8_meta[key].scale for m in linears])
        out.append((history.t().tolist(), scale.tolist()))
    return out


def _train(rank: int, model, recipe, steps: int = STEPS, mode: str = "plain", boundary=True) -> dict:
    capture = Capture(model)
    ref_fwd = RefScaling(3 * len(capture.linears), HISTORY)
    ref_bwd = RefScaling(2 * len(capture.linears), HISTORY)
    log = {"loss": [], "scales_within_step_constant": [], "matches_reference": []}
    for step in range(steps):
        scales_seen = []
        for micro in range(M):
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                x = _batch(rank, step, micro)
                if mode == "fp8train-checkpoint":
                    y = fp8train.checkpoint(model, x)
                elif mode == "torch-checkpoint":
                    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
                else:
                    y = model(x)
            (y.square().mean() / M).backward()
            log["loss"].append(y.detach().square().mean().item())
            scales_seen.append(
                digest([m.fp8_meta[k].scale for m in capture.linears for k in ("scaling_fwd", "scaling_bwd")])
            )
        if boundary:
            fp8train.end_step()
        sgd(model, 0.05)
        log["scales_within_step_constant"].append(len(set(scales_seen)) == 1)
        fwd, bwd = capture.take()
        ref_fwd.update(fwd, recipe, E4M3_MAX)
        ref_bwd.update(bwd, recipe, E5M2_MAX)
        (h_f, s_f), (h_b, s_b) = _state(model)
        log["matches_reference"].append(
            h_f == ref_fwd.history
            and s_f == ref_fwd.scale
            and h_b == ref_bwd.history
            and s_b == ref_bwd.scale
        )
    log["fp8"] = digest(fp8_state(model))
    return log


@pytest.mark.parametrize("mode", ["plain", "fp8train-checkpoint", "torch-checkpoint"])
def test_one_update_per_step_from_the_max_over_microbatches(mode: str) -> None:
    log = _train(0, fp8_mlp(0, WIDTHS), STEP, mode=mode)
    assert all(log["scales_within_step_constant"]), log
    assert all(log["matches_reference"]), log
    if mode != "plain":
        assert log == _train(0, fp8_mlp(0, WIDTHS), STEP)


def test_the_reference_tells_per_step_from_per_region() -> None:
    """The same loop in per-region mode rolls the history M times a step: the check must fail."""
    log = _train(0, fp8_mlp(0, WIDTHS), REGION)
    assert not all(log["scales_within_step_constant"]) and not any(log["matches_reference"][1:])


def test_the_reference_tells_a_step_that_keeps_its_first_microbatch_from_the_max(monkeypatch) -> None:
    """A broken per-step mode that keeps the step's first microbatch's amaxes instead of the MAX over
    its microbatches must fail the reference check: later microbatches have a larger range (_batch)."""
    from fp8train.amax.reduction import Direction

    def first_only(self) -> None:
        if self.recorded_columns:
            storage = self.storage
            storage.accumulated.copy_(
                torch.where(storage.accumulated > 0, storage.accumulated, storage.recording)
            )
            storage.recording.zero_()
            self.recorded_columns.clear()

    # a planted bug (a mutation test): no seam may make the library accumulate wrongly
    monkeypatch.setattr(Direction, "accumulate", first_only)
    log = _train(0, fp8_mlp(0, WIDTHS), STEP)
    assert all(log["scales_within_step_constant"]) and not any(log["matches_reference"]), log


def test_a_missing_boundary_is_an_error_and_a_second_one_does_nothing() -> None:
    model = fp8_mlp(0, WIDTHS)
    with pytest.raises(RuntimeError, match=r"fp8train.end_step\(\) was not called"):
        _train(0, model, STEP, boundary=False)
    fp8train.inspection.reset()
    model = fp8_mlp(0, WIDTHS)
    _train(0, model, STEP, steps=1)
    before = digest(fp8_state(model))
    fp8train.end_step()  # doubled: nothing trained since the last boundary
    fp8train.synchronize()
    assert digest(fp8_state(model)) == before


def test_end_step_on_the_optimizer_marks_the_boundary() -> None:
    model = fp8_mlp(0, WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = fp8train.end_step_on(opt)
    for step in range(STEPS):
        for micro in range(M):
            with fp8train.fp8_autocast(fp8_recipe=STEP):
                y = model(_batch(0, step, micro))
            (y.square().mean() / M).backward()
        opt.step()
        opt.zero_grad()
    handle.remove()
    assert fp8train.inspection.amax_group(STEP).training_regions == STEPS  # one reduction per step


def test_a_checkpoint_saved_mid_step_resumes_bitwise() -> None:
    """Saved after microbatch 2 of step 1 with the step's amaxes so far, loaded into a fresh model and
    process state: the rest of the run equals the uninterrupted one. The microbatches before the save
    have the largest values, so a checkpoint without the step's amaxes so far would change the
    step's scales (checked: dropping them from the checkpoint fails this test)."""

    def run(save_at=None, start=None):
        model = fp8_mlp(0, WIDTHS)
        if start is not None:
            model.load_state_dict(start[0])
            for p, g in zip(model.parameters(), start[1]):
                p.grad = g
        saved = None
        for step in range(0 if start is None else start[2][0], STEPS):
            for micro in range(M):
                if start is not None and (step, micro) < start[2]:
                    continue
                with fp8train.fp8_autocast(fp8_recipe=STEP):
                    y = model(_batch(0, step, micro) * (M - micro) ** 2)
                (y.square().mean() / M).backward()
                if (step, micro) == save_at:
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                    saved = (buffer.getvalue(), [p.grad.clone() for p in model.parameters()])
            fp8train.end_step()
            sgd(model, 0.05)
        return digest(fp8_state(model)), digest(model.state_dict()), saved

    uninterrupted = run()
    _, _, (blob, grads) = run(save_at=(1, 1))
    fp8train.inspection.reset()
    state = torch.load(io.BytesIO(blob), weights_only=True)
    resumed = run(start=(state, grads, (1, 2)))
    assert resumed[:2] == uninterrupted[:2]


def test_a_mid_step_load_into_the_running_model_continues_the_step() -> None:
    """Rolling back to a mid-step checkpoint in the running process (load_state_dict into the live
    model after microbatch 2 of step 1, grads kept): a load is not an optimizer step, so the step goes
    on and the run equals the uninterrupted one (before: the load's parameter copy read as a missing
    boundary, a RuntimeError at the next microbatch)."""

    def run(rollback: bool):
        fp8train.inspection.reset()
        model = fp8_mlp(0, WIDTHS)
        for step in range(STEPS):
            for micro in range(M):
                with fp8train.fp8_autocast(fp8_recipe=STEP):
                    y = model(_batch(0, step, micro) * (M - micro) ** 2)
                (y.square().mean() / M).backward()
                if rollback and (step, micro) == (1, 1):
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                    model.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
            fp8train.end_step()
            sgd(model, 0.05)
        return digest(fp8_state(model)), digest(model.state_dict())

    assert run(rollback=True) == run(rollback=False)


# ---- on real ranks -------------------------------------------------------------------------------------
def _ranks(rank: int, world: int) -> dict:
    out = {}
    for mode in ("1", "0"):  # asynchronous, blocking
        import os

        os.environ["NVTE_ASYNC_AMAX_REDUCTION"] = mode
        fp8train.inspection.reset()
        out[f"async={mode}"] = _train(rank, fp8_mlp(0, WIDTHS), STEP)
    os.environ.pop("NVTE_ASYNC_AMAX_REDUCTION")
    counts = {}
    for name, recipe in (("step", STEP), ("region", REGION)):
        for layers in (1, 4):
            fp8train.inspection.reset()
            model = fp8_mlp(0, (16,) + (32,) * (layers - 1) + (16,))
            with AllReduceSpy() as spy:
                for step in range(2):
                    before = spy.calls
                    for micro in range(M):
                        with fp8train.fp8_autocast(fp8_recipe=recipe):
                            y = model(_batch(rank, step, micro))
                        (y.square().mean() / M).backward()
                    fp8train.end_step()
                    fp8train.synchronize()
                    sgd(model, 0.05)
                counts[(name, layers)] = spy.calls - before  # the second step's collectives
    out["counts"] = counts
    fp8train.inspection.reset()
    model = fp8_mlp(0, WIDTHS)
    try:  # rank 1 forgets the boundary once: every rank raises at the next step's first call
        for step in range(3):
            for micro in range(M):
                with fp8train.fp8_autocast(fp8_recipe=STEP):
                    y = model(_batch(rank, step, micro))
                (y.square().mean() / M).backward()
            fp8train.end_step() if step != 0 else None
            sgd(model, 0.05)
        out["missing"] = None
    except RuntimeError as exc:
        out["missing"] = (step, str(exc)[:80])
    return out


@pytest.mark.multirank
def test_two_ranks_reduce_once_per_step_bitwise_in_both_modes() -> None:
    runs = run_ranks(_ranks, 2, timeout_s=180, pg_timeout_s=60)
    for out in runs:
        a, b = out["async=1"], out["async=0"]
        assert a == b  # asynchronous and blocking: bit for bit
        assert all(a["matches_reference"]) and all(a["scales_within_step_constant"])
        # per step 2 collectives (one per direction), per region 2M; neither depends on the layers
        assert out["counts"] == {("step", 1): 2, ("step", 4): 2, ("region", 1): 2 * M, ("region", 4): 2 * M}
        assert out["missing"] is not None and out["missing"][0] == 1
    assert runs[0]["async=1"]["fp8"] == runs[1]["async=1"]["fp8"]
    assert runs[0]["async=1"]["loss"] != runs[1]["async=1"]["loss"]  # different data: a real reduction
