"""Faults and bad configuration: a dying rank, non-finite values, mismatched ranks, interrupted steps.

Every multi-rank test runs real gloo processes with a small process-group timeout, so that a hang
would show up as a TimeoutError of the launcher, never as a stuck test run.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import os
import pickle
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import fp8train
from fp8train import (
    AmaxReductionError,
    CheckpointError,
    DelayedScaling,
    Format,
    fp8_autocast,
    load_checkpoint,
    save_checkpoint,
)
from fp8train.amax import decode_extra_state
from fp8train.modules import FP8Module
from helpers import digest, fp8_state
from multirank import assert_ok, run_ranks_outcomes

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

try:  # written alongside these tests; used where present
    from fp8train.telemetry import Telemetry, read_metrics
except ImportError:  # pragma: no cover
    Telemetry = read_metrics = None

PG_TIMEOUT_S = 5.0
RECIPE = DelayedScaling(amax_history_len=4)

# ---- shared helpers ------------------------------------------------------------------------------


def make_model(seed: int = 0, widths: tuple[int, ...] = (16, 16, 16)) -> torch.nn.Sequential:
    """FP8 Linears with a GELU between them: two FP8 modules, 6 forward and 4 backward roles."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(torch.nn.GELU())
        layers.append(fp8train.Linear(a, b))
    return torch.nn.Sequential(*layers)


def batch(rank: int, step: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=gen) * (1.0 + rank) * scale


def fp8_modules(model: torch.nn.Module) -> list[FP8Module]:
    return [m for m in model.modules() if isinstance(m, FP8Module)]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, recipe=RECIPE) -> float:
    with fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def probe(model: torch.nn.Module) -> list[float]:
    """An eval forward in FP8 on a fixed batch: depends on weights and scales, records nothing."""
    with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE):
        return model(batch(99, 0)).flatten().tolist()


# ---- 1. a rank dies while reductions are in flight --------------------------------------------------

FAIL_STEP = 5


def _die(mode: str, flag_dir: str, world_size: int) -> None:
    if mode == "raise":
        raise RuntimeError("injected failure on the victim rank")
    if mode == "exit":
        os._exit(1)
    # "stall": alive but silent (a hung GPU, a stopped process) until every survivor has given up.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(flag_dir, f"done{r}")) for r in range(world_size - 1)):
            return
        time.sleep(0.05)


def _rank_failure_worker(rank: int, world_size: int, mode: str, ckpt_dir: str) -> dict:
    victim = world_size - 1
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    saved: Optional[dict] = None
    t_fail = None
    step = -1
    try:
        for step in range(FAIL_STEP + 4):
            if step % 2 == 0:  # every rank keeps its own checkpoint, written atomically
                state = {"model": model.state_dict(), "step": step}
                save_checkpoint(state, os.path.join(ckpt_dir, f"rank{rank}.pt"))
                saved = {"step": step, "digest": digest(state), "probe": probe(model)}
            if step == FAIL_STEP:
                t_fail = time.monotonic()
            with fp8_autocast(fp8_recipe=RECIPE):
                y = model(batch(rank, step))
            # This step's forward amax reduction is now in flight (and the previous backward's may be).
            if rank == victim and step == FAIL_STEP:
                _die(mode, ckpt_dir, world_size)
                return {"stalled": True}
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"error": None, "step": step}
    except AmaxReductionError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "step": step,
            "elapsed": time.monotonic() - (t_fail or time.monotonic()),
            "saved": saved,
        }
    finally:
        open(os.path.join(ckpt_dir, f"done{rank}"), "w").close()


@pytest.mark.multirank
@pytest.mark.parametrize(
    "mode,world_size,async_env", [("raise", 2, "1"), ("exit", 3, "1"), ("stall", 2, "1"), ("exit", 2, "0")]
)
def test_rank_failure_raises_on_survivors_and_keeps_checkpoint(
    tmp_path, mode: str, world_size: int, async_env: str
) -> None:
    """Survivors raise AmaxReductionError well before a hang; their last checkpoint loads and runs.

    The bound on `elapsed` (4x the process-group timeout) only separates "raised" from "hung": a
    stalled peer makes the survivor wait out the timeout once, a dead one fails it at once.
    """
    env = {ENV_ASYNC: async_env}
    outcomes = run_ranks_outcomes(
        _rank_failure_worker,
        world_size,
        mode,
        str(tmp_path),
        env=env,
        timeout_s=120,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    victim_ok, victim = outcomes[-1]
    if mode == "raise":
        assert not victim_ok and "injected failure" in victim
    elif mode == "exit":
        assert not victim_ok and "exited with code 1" in victim
    else:
        assert victim_ok and victim == {"stalled": True}

    for rank, (ok, res) in enumerate(outcomes[:-1]):
        assert ok, f"survivor {rank} crashed instead of raising a clear error:\n{res}"
        assert res["error"] == "AmaxReductionError", f"survivor {rank} did not notice the failure: {res}"
        assert "amax all-reduce" in res["message"] and "died, stalled" in res["message"]
        if mode == "stall":
            assert "Timed out" in res["message"], res["message"]
        assert FAIL_STEP <= res["step"] <= FAIL_STEP + 1, "the failure must surface within one step"
        assert res["elapsed"] < 4 * PG_TIMEOUT_S, f"survivor {rank} took {res['elapsed']:.1f}s to notice"

        # The last checkpoint is the one written before the failure, intact, loadable, and it runs.
        saved = res["saved"]
        assert saved["step"] == FAIL_STEP - FAIL_STEP % 2
        ckpt = load_checkpoint(tmp_path / f"rank{rank}.pt")
        assert ckpt["step"] == saved["step"] and digest(ckpt) == saved["digest"]
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")], "leftover temp files"
        model = make_model(seed=123)
        model.load_state_dict(ckpt["model"])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the ranks computed with one thread: same GEMM summation order
        try:
            assert probe(model) == saved["probe"], "the resumed model does not compute what the rank did"
        finally:
            torch.set_num_threads(threads)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = [train_step(model, opt, batch(rank, s)) for s in range(saved["step"], saved["step"] + 2)]
        assert all(math.isfinite(v) for v in losses)
        assert all(bool(torch.isfinite(t).all()) for t in fp8_state(model))


# ---- 2. non-finite values on one rank for one step ---------------------------------------------------

NAN_ACT_STEP, INF_GRAD_STEP, NONFINITE_STEPS = 3, 8, 14
NONFINITE_RECIPE = DelayedScaling(amax_history_len=3, amax_compute_algo="max", fp8_format=Format.HYBRID)


def _nonfinite_worker(rank: int, world_size: int, run_dir: str) -> list[dict]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    telemetry = Telemetry(model, run_dir=os.path.join(run_dir, f"rank{rank}")) if Telemetry else None
    records = []
    for step in range(NONFINITE_STEPS):
        x = batch(rank, step)
        if rank == 1 and step == NAN_ACT_STEP:
            x[0, 0] = float("nan")  # an activation: every later activation and gradient goes NaN
        with fp8_autocast(fp8_recipe=NONFINITE_RECIPE):
            y = model(x)
        if rank == 1 and step == INF_GRAD_STEP:  # one gradient: grad_output of the last layer only

            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g[0, 0] = float("inf")
                return g

            y.register_hook(poison)
        loss = y.float().pow(2).mean()
        loss.backward()
        # What a training loop does with a non-finite gradient: every rank skips the step.
        finite = torch.tensor([float(all(bool(p.grad.isfinite().all()) for p in model.parameters()))])
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if finite.item() == 1.0:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if telemetry is not None:
            telemetry.log_step(step, loss=loss.item())
        fwd = [m.fp8_meta["scaling_fwd"] for m in fp8_modules(model)]
        bwd = [m.fp8_meta["scaling_bwd"] for m in fp8_modules(model)]
        records.append(
            {
                "loss": loss.item(),
                "stepped": finite.item() == 1.0,
                "fwd": [[t.tolist() for t in (m.amax_history, m.scale, m.scale_inv)] for m in fwd],
                "bwd": [[t.tolist() for t in (m.amax_history, m.scale, m.scale_inv)] for m in bwd],
                "events": fp8train.reduction_stats()["nonfinite_amax_events"],
                "weights_finite": all(bool(p.isfinite().all()) for p in model.parameters()),
            }
        )
    if telemetry is not None:
        telemetry.close()  # writes the last step's record (records are completed one step late)
    return records


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.multirank
def test_nonfinite_on_one_rank_keeps_scales_and_recovers(tmp_path) -> None:
    ranks = assert_ok(
        run_ranks_outcomes(_nonfinite_worker, 2, str(tmp_path), timeout_s=90, pg_timeout_s=PG_TIMEOUT_S)
    )
    for r0, r1 in zip(*ranks):
        # A NaN on rank 1 reaches rank 0 as inf: both apply the same update, bit for bit.
        assert r0["fwd"] == r1["fwd"] and r0["bwd"] == r1["bwd"] and r0["events"] == r1["events"]
        assert r0["stepped"] == r1["stepped"]

    rec = ranks[0]
    h = NONFINITE_RECIPE.amax_history_len
    for direction, fp8_max in (("fwd", 448.0), ("bwd", 57344.0)):
        prev_scales = None
        for step, r in enumerate(rec):
            scales = []
            for hist, scale, scale_inv in r[direction]:
                for c, (s, si) in enumerate(zip(scale, scale_inv)):
                    assert math.isfinite(s) and s > 0 and math.isfinite(si) and si > 0, (direction, step, c)
                    column = [row[c] for row in hist]
                    if any(math.isinf(v) for v in column):  # inf in the window: the old scale stays
                        assert s == prev_scales[len(scales) + c], (direction, step, c)
                    elif max(column) > 0:  # finite window: the scale follows it again
                        assert s == _f32(_f32(fp8_max / _f32(max(column))) / 2**NONFINITE_RECIPE.margin)
                    else:
                        assert s == 1.0
                scales += scale
            prev_scales = scales

    def inf_rows(step: int, direction: str) -> list[tuple[int, int]]:
        return [
            (m, c)
            for m, (hist, _, _) in enumerate(rec[step][direction])
            for c, v in enumerate(hist[0])
            if math.isinf(v)
        ]

    # The NaN activation: every input role (layer 1's and, through it, layer 2's) and both
    # grad_outputs went non-finite for exactly the window of the history; then they left it.
    assert inf_rows(NAN_ACT_STEP, "fwd") == [(0, 0), (1, 0)]
    assert inf_rows(NAN_ACT_STEP, "bwd") == [(0, 0), (1, 0)]
    after = NAN_ACT_STEP + h
    assert all(math.isfinite(v) for m in rec[after]["fwd"] for row in m[0] for v in row)
    # The inf gradient: only the last layer's grad_output role.
    assert inf_rows(INF_GRAD_STEP, "bwd") == [(1, 0)] and inf_rows(INF_GRAD_STEP, "fwd") == []
    assert all(math.isfinite(v) for m in rec[INF_GRAD_STEP + h]["bwd"] for row in m[0] for v in row)
    frozen = rec[INF_GRAD_STEP - 1]["bwd"][1][1][0]
    assert [rec[s]["bwd"][1][1][0] for s in range(INF_GRAD_STEP, INF_GRAD_STEP + h)] == [frozen] * h
    assert rec[INF_GRAD_STEP + h]["bwd"][1][1][0] != frozen, "the scale must update again"

    # Counted: 0 before, then one event per role and step whose reduced amax was not finite.
    expected, events = 0, []
    for step in range(NONFINITE_STEPS):
        expected += len(inf_rows(step, "fwd")) + len(inf_rows(step, "bwd"))
        events.append(rec[step]["events"])
        assert rec[step]["events"] == expected
    assert events[NAN_ACT_STEP - 1] == 0 and events[-1] == 5

    if Telemetry is not None:  # the telemetry log names each event's role, on every rank
        names = {
            NAN_ACT_STEP: {"0/input", "2/input", "0/grad_output", "2/grad_output"},
            INF_GRAD_STEP: {"2/grad_output"},
        }
        for rank in range(2):
            log = [
                r
                for r in read_metrics(str(tmp_path / f"rank{rank}" / "metrics.jsonl"))
                if r["kind"] == "step"
            ]
            assert [r["reduction"]["nonfinite_amax_events"] for r in log] == events
            for r in log:
                flagged = {name for name, role in r["roles"].items() if role["nonfinite"]}
                assert flagged == names.get(r["step"], set()), (rank, r["step"], flagged)
                assert r["events"]["nonfinite"] == len(flagged)

    # Training recovered: the poisoned steps were skipped on both ranks, every later loss is finite.
    for r in ranks:
        assert [s["stepped"] for s in r] == [
            s not in (NAN_ACT_STEP, INF_GRAD_STEP) for s in range(NONFINITE_STEPS)
        ]
        assert all(math.isfinite(s["loss"]) for s in r[NAN_ACT_STEP + 1 :]) and r[-1]["weights_finite"]


# ---- 3 and 5. mismatched ranks: other models, other recipes, a group without this rank -------------


# Each case uses its own history length, so that it gets fresh amax groups in the same processes.
def _row(history: torch.Tensor, row: int) -> torch.Tensor:
    return history[row]


MISMATCH_CASES = {
    # case: (rank 0 (widths, recipe), rank 1 (widths, recipe))
    "extra_layer": (
        ((16, 16, 16), DelayedScaling(amax_history_len=5)),
        ((16, 16, 16, 16), DelayedScaling(amax_history_len=5)),
    ),
    "other_widths": (
        ((16, 16, 16), DelayedScaling(amax_history_len=6)),
        ((16, 32, 16), DelayedScaling(amax_history_len=6)),
    ),
    "margin": (
        ((16, 16, 16), DelayedScaling(amax_history_len=7)),
        ((16, 16, 16), DelayedScaling(amax_history_len=7, margin=1)),
    ),
    "history_len": (
        ((16, 16, 16), DelayedScaling(amax_history_len=8)),
        ((16, 16, 16), DelayedScaling(amax_history_len=9)),
    ),
    "algo": (
        ((16, 16, 16), DelayedScaling(amax_history_len=10)),
        ((16, 16, 16), DelayedScaling(amax_history_len=10, amax_compute_algo="most_recent")),
    ),
    # callables with the same name: known by their code, constants and arguments, not their name
    "lambda": (
        ((16, 16, 16), DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.amax(0))),
        ((16, 16, 16), DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h[0])),
    ),
    "partial": (
        ((16, 16, 16), DelayedScaling(amax_history_len=4, amax_compute_algo=functools.partial(_row, row=0))),
        ((16, 16, 16), DelayedScaling(amax_history_len=4, amax_compute_algo=functools.partial(_row, row=1))),
    ),
}


def _mismatch_worker(rank: int, world_size: int) -> dict:
    out = {}
    for case, per_rank in MISMATCH_CASES.items():
        widths, recipe = per_rank[rank]
        model = make_model(widths=widths)
        group = dist.new_group([0, 1])  # a failed process group stays failed: each case gets its own
        result = {"error": None, "step": None}
        for step in range(3):
            try:
                with fp8_autocast(fp8_recipe=recipe, fp8_group=group):
                    y = model(batch(rank, step))
                y.float().pow(2).mean().backward()
            except Exception as exc:
                result = {"error": type(exc).__name__, "message": str(exc), "step": step}
                break
        state = [
            t
            for m in fp8_modules(model)
            for k in ("scaling_fwd", "scaling_bwd")
            for t in (m.fp8_meta[k].scale, m.fp8_meta[k].amax_history)
        ]
        result["untouched"] = all(bool((t == (1.0 if t.dim() == 1 else 0.0)).all()) for t in state)
        out[case] = result

    # A group this rank is not part of: rank 1 passes the group {0} (which rank 0 may legally use).
    solo = dist.new_group([0])
    model = make_model()
    try:
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=11), fp8_group=solo):
            model(batch(rank, 0)).sum().backward()
        out["foreign_group"] = {"error": None}
    except Exception as exc:
        out["foreign_group"] = {"error": type(exc).__name__, "message": str(exc)}
    out["stack_empty"] = fp8train.inspection.open_regions() == 0
    return out


@pytest.fixture(scope="module")
def mismatch_outcomes() -> list[dict]:
    return assert_ok(run_ranks_outcomes(_mismatch_worker, 2, timeout_s=90, pg_timeout_s=PG_TIMEOUT_S))


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["extra_layer", "other_widths"])
def test_different_models_fail_on_all_ranks_in_second_step(mismatch_outcomes, case: str) -> None:
    """Every rank raises at the same launch: the one two launches after the first (the second step's
    region exit; docs/design.md, section 3), and nothing was applied from the mismatched reductions."""
    for rank, out in enumerate(mismatch_outcomes):
        res = out[case]
        assert res["error"] == "LayoutMismatchError" and res["step"] == 1, (rank, res)
        assert "FP8 layout mismatch in the fwd amax group" in res["message"]
        assert res["untouched"], "a scale or history changed although the layouts disagreed"
    if case == "extra_layer":  # what differs is named: 2 vs 3 modules, 6 vs 9 roles
        assert "roles: this rank 6, group min 6 max 9" in mismatch_outcomes[0][case]["message"]
        assert "modules: this rank 3, group min 2 max 3" in mismatch_outcomes[1][case]["message"]


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["margin", "history_len", "algo", "lambda", "partial"])
def test_different_recipes_fail_instead_of_diverging(mismatch_outcomes, case: str) -> None:
    """Same model, recipes differing in one field: without the recipe in the layout fingerprint the
    ranks would silently compute different scales from the same reduced amaxes."""
    for rank, out in enumerate(mismatch_outcomes):
        res = out[case]
        assert res["error"] == "LayoutMismatchError" and res["step"] == 1, (rank, res)
        assert "ranks use different recipes" in res["message"]
        _, recipe = MISMATCH_CASES[case][rank]
        assert f"margin={recipe.margin}" in res["message"]
        assert f"amax_history_len={recipe.amax_history_len}" in res["message"]
        assert res["untouched"]


@pytest.mark.multirank
def test_group_without_this_rank_is_a_value_error(mismatch_outcomes) -> None:
    assert mismatch_outcomes[0]["foreign_group"] == {"error": None}  # a one-rank group: no reduction
    res = mismatch_outcomes[1]["foreign_group"]
    assert res["error"] == "ValueError" and "not a member of the amax reduction group" in res["message"]
    assert all(out["stack_empty"] for out in mismatch_outcomes)


# ---- 4. interrupted steps (one process) ---------------------------------------------------------------


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a failure in the middle of the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exc: type) -> torch.Tensor:
        ctx.exc = exc
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise ctx.exc("injected failure in backward")


class TwoLayer(torch.nn.Module):
    """Linear -> GELU -> (failure point) -> Linear. A backward failure hits after layer 2's FP8 backward
    recorded its grad_output amax and before layer 1's ran: the half-recorded state to get rid of."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = fp8train.Linear(16, 16), fp8train.Linear(16, 16)
        self.fail: Optional[tuple[str, type]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.l1(x))
        if self.fail is not None:
            where, exc = self.fail
            if where == "forward":
                raise exc("injected failure in forward")
            if where == "backward_op":
                h = _RaiseInBackward.apply(h, exc)
            else:  # "backward_hook"

                def hook(grad: torch.Tensor) -> torch.Tensor:
                    raise exc("injected failure in a backward hook")

                h.register_hook(hook)
        return self.l2(h)


def _clean_registry() -> None:
    assert fp8train.inspection.open_regions() == 0, "a failed region stayed on the stack"
    for fwd in (group.fwd for group in fp8train.inspection.amax_groups()):
        assert fwd.recorded_roles == () and not bool(fwd.storage.recording.any()), "stale forward amaxes"


def _train_with_interruption(
    fail_at: Optional[int], where: str, exc: type, steps: int = 6, resume_dir=None
) -> tuple[list[float], list[torch.Tensor]]:
    """Train `steps` steps; at `fail_at` first attempt a step on an extreme batch that fails `where`.

    where="reference_forward_only": instead of failing, run that batch's forward and drop the graph
    (what a backward failure leaves behind, minus the half-run backward). With `resume_dir`, save a
    checkpoint right after the failure and continue with a fresh model and optimizer loaded from it.
    """
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        if step == fail_at:
            bad = batch(7, step, scale=10.0)  # large amaxes: a leak into the next step would show
            if where == "reference_forward_only":
                with fp8_autocast(fp8_recipe=RECIPE):
                    model(bad)
            else:
                model.fail = (where, exc)
                with pytest.raises(exc, match="injected failure"):
                    train_step(model, opt, bad)
                model.fail = None
                opt.zero_grad(set_to_none=True)  # a failed backward may have left partial gradients
            _clean_registry()
            if resume_dir is not None:
                path = os.path.join(resume_dir, "ckpt.pt")
                save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()}, path)
                ckpt = load_checkpoint(path)
                model = TwoLayer()
                model.load_state_dict(ckpt["model"])
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt.load_state_dict(ckpt["opt"])
        losses.append(train_step(model, opt, batch(0, step)))
    return losses, [p.detach().clone() for p in model.parameters()] + fp8_state(model)


def _assert_same_run(a, b) -> None:
    assert a[0] == b[0], "losses differ"
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "state differs"


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_inside_fp8_region_is_as_if_the_step_never_happened(exc: type) -> None:
    reference = _train_with_interruption(None, "", exc)
    _assert_same_run(_train_with_interruption(2, "forward", exc), reference)


@pytest.mark.parametrize("where,exc", [("backward_op", RuntimeError), ("backward_hook", KeyboardInterrupt)])
def test_failure_inside_backward_leaks_no_amax_into_the_next_step(where: str, exc: type) -> None:
    """The failed step's forward completed (its amaxes were reduced, as on every rank), its backward
    did not: the run must equal one where that forward ran and no backward followed."""
    reference = _train_with_interruption(2, "reference_forward_only", exc)
    _assert_same_run(_train_with_interruption(2, where, exc), reference)


def test_checkpoint_saved_after_interrupted_backward_resumes_exactly(tmp_path) -> None:
    reference = _train_with_interruption(2, "reference_forward_only", KeyboardInterrupt)
    resumed = _train_with_interruption(2, "backward_hook", KeyboardInterrupt, resume_dir=str(tmp_path))
    _assert_same_run(resumed, reference)


# ---- 5. bad configuration (one process) --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"margin": -1}, "margin"),
        ({"margin": 0.5}, "margin"),
        ({"margin": True}, "margin"),
        ({"fp8_format": Format.E5M2}, "fp8_format"),
        ({"fp8_format": "e4m3"}, "fp8_format"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_history_len": 2.0}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"scaling_factor_compute_algo": 2.0}, "scaling_factor_compute_algo"),
        ({"reduce_amax": "yes"}, "reduce_amax"),
    ],
)
def test_invalid_recipe_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"DelayedScaling.{field} must be"):
        DelayedScaling(**kwargs)


def test_recipe_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="fp8_recipe must be a fp8train.DelayedScaling"):
        with fp8_autocast(fp8_recipe={"margin": 0}):
            pass
    assert fp8train.inspection.open_regions() == 0


@pytest.mark.parametrize("value", ["2", "true", "", "async", "0 1"])
def test_invalid_async_env_is_a_clear_error_and_leaves_no_region(monkeypatch, value: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monkeypatch.setenv(ENV_ASYNC, value)
    with pytest.raises(ValueError, match=f"{ENV_ASYNC}={value!r} is not valid: use 1 .* or 0"):
        train_step(model, opt, batch(0, 0))
    assert fp8train.inspection.open_regions() == 0 and fp8train.inspection.current_region() is None
    assert all(bool((t[1] == 1).all()) for t in [fp8_state(model)[i : i + 3] for i in (0, 3, 6, 9)])
    for ok in ("0", "1", " 1 "):
        monkeypatch.setenv(ENV_ASYNC, ok)
        assert math.isfinite(train_step(model, opt, batch(0, 1)))


@pytest.fixture
def saved_checkpoint(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        train_step(model, opt, batch(0, step))
    path = tmp_path / "good.pt"
    save_checkpoint({"model": model.state_dict()}, path)
    return path, model


@pytest.mark.parametrize("cut", [0, 0.01, 0.3, 0.9, 0.999])
def test_truncated_checkpoint_is_a_checkpoint_error(saved_checkpoint, tmp_path, cut: float) -> None:
    """torch.load alone reports these as OSError 'Invalid argument', EOFError or a miniz error."""
    good, _ = saved_checkpoint
    data = good.read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match="truncated.pt.*(empty|truncated)"):
        load_checkpoint(bad)


def test_garbage_file_is_a_checkpoint_error(tmp_path) -> None:
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match="not a complete torch.save archive"):
        load_checkpoint(bad)


def test_python_objects_need_weights_only_false_and_say_so(tmp_path) -> None:
    path = tmp_path / "with_args.pt"
    save_checkpoint({"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="weights_only=False") as error:
        load_checkpoint(path)
    assert "damaged" not in str(error.value)
    assert load_checkpoint(path, weights_only=False)["args"].lr == 0.1


def test_failed_save_keeps_the_previous_checkpoint(saved_checkpoint) -> None:
    path, _ = saved_checkpoint
    before = path.read_bytes()
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_checkpoint({"model": lambda: None}, path)  # cannot be pickled: fails half-way
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temporary file left behind"


def _damaged(extra_state: bytes, key: str, value: float) -> bytes:
    """A module's extra state with the first forward `key` value replaced, as a damaged file gives it.

    The state is serialized bytes inside the checkpoint (pickled as text), so the damage is made on
    the decoded tensors rather than by flipping bytes of the file."""
    state = decode_extra_state(extra_state)
    state["scaling_fwd"][key].view(-1)[0] = value
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "key,value",
    [
        ("scale", -1.0),  # a flipped sign bit
        ("scale", 0.0),
        ("scale", float("inf")),
        ("scale_inv", float("nan")),
        ("amax_history", float("nan")),
        ("amax_history", -3.0),
    ],
)
def test_damaged_fp8_state_is_refused(saved_checkpoint, key: str, value: float) -> None:
    """torch.save has no checksum, so damaged values load; the FP8 state refuses impossible ones."""
    good, _ = saved_checkpoint
    state = load_checkpoint(good)["model"]
    state["0._extra_state"] = _damaged(state["0._extra_state"], key, value)
    with pytest.raises(ValueError, match=f"scaling_fwd: checkpoint {key}.*corrupted"):
        make_model(seed=5).load_state_dict(state)


def test_foreign_checkpoints_are_refused_by_name(saved_checkpoint) -> None:
    _, model = saved_checkpoint
    good = model.state_dict()
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    with pytest.raises(RuntimeError, match='Missing key.*"0._extra_state"'):
        make_model().load_state_dict(plain.state_dict())
    mlp = torch.nn.Sequential(fp8train.LayerNormMLP(16, 32), torch.nn.GELU(), fp8train.Linear(16, 16))
    with pytest.raises((ValueError, RuntimeError), match="different model|Missing key"):
        make_model().load_state_dict(mlp.state_dict())
    for extra, message in [
        (b"extra state of another library", "not an fp8train"),
        ({"version": 2, "scaling_fwd": {}}, "not an fp8train"),
        ({"version": 1, "scaling_fwd": {"scale": [1.0]}, "scaling_bwd": {}}, "not fp8train's"),
        (
            {
                "version": 1,
                "scaling_fwd": decode_extra_state(good["2._extra_state"])["scaling_bwd"],
                "scaling_bwd": {},
            },
            "different model",
        ),
    ]:
        state = dict(good)
        state["0._extra_state"] = extra
        with pytest.raises(ValueError, match=message):
            make_model().load_state_dict(state)
