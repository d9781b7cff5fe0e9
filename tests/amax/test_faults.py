"""Faults across ranks: a dying rank, non-finite values on one rank, ranks that run other models or
recipes, or whose steps diverge. Each fails loudly on every rank, or is survived, never a hang or a
silent divergence.

Every multi-rank test runs real gloo processes with a small process-group timeout, so that a hang
would show up as a TimeoutError of the launcher, never as a stuck test run. A rank that skips a whole
training step, all its FP8 modules and its backward, is not detectable (docs/design.md, section 4).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import fp8train
from fp8train import (
    AmaxReductionError,
    DelayedScaling,
    Format,
    LayoutMismatchError,
    fp8_autocast,
    load_checkpoint,
    save_checkpoint,
)
from fp8train.modules import FP8Module
from helpers import digest, fp8_mlp, fp8_state, rank_batch, train_step
from multirank import assert_ok, run_ranks, run_ranks_outcomes

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

try:  # written alongside these tests; used where present
    from fp8train.telemetry import Telemetry, read_metrics
except ImportError:  # pragma: no cover
    Telemetry = read_metrics = None

PG_TIMEOUT_S = 5.0
RECIPE = DelayedScaling(amax_history_len=4)


def fp8_modules(model: torch.nn.Module) -> list[FP8Module]:
    return [m for m in model.modules() if isinstance(m, FP8Module)]


def probe(model: torch.nn.Module) -> list[float]:
    """An eval forward in FP8 on a fixed batch: depends on weights and scales, records nothing."""
    with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE):
        return model(rank_batch(99, 0)).flatten().tolist()


# ---- a rank dies while reductions are in flight --------------------------------------------------

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
    model = fp8_mlp()
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
                y = model(rank_batch(rank, step))
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
        model = fp8_mlp(seed=123)
        model.load_state_dict(ckpt["model"])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the ranks computed with one thread: same GEMM summation order
        try:
            assert probe(model) == saved["probe"], "the resumed model does not compute what the rank did"
        finally:
            torch.set_num_threads(threads)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = [
            train_step(model, opt, rank_batch(rank, s), RECIPE)
            for s in range(saved["step"], saved["step"] + 2)
        ]
        assert all(math.isfinite(v) for v in losses)
        assert all(bool(torch.isfinite(t).all()) for t in fp8_state(model))


# ---- non-finite values on one rank for one step ---------------------------------------------------

NAN_ACT_STEP, INF_GRAD_STEP, NONFINITE_STEPS = 3, 8, 14
NONFINITE_RECIPE = DelayedScaling(amax_history_len=3, amax_compute_algo="max", fp8_format=Format.HYBRID)


def _nonfinite_worker(rank: int, world_size: int, run_dir: str) -> list[dict]:
    model = fp8_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    telemetry = Telemetry(model, run_dir=os.path.join(run_dir, f"rank{rank}")) if Telemetry else None
    records = []
    for step in range(NONFINITE_STEPS):
        x = rank_batch(rank, step)
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


# ---- mismatched ranks: other models, other recipes, a group without this rank -------------


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
        model = fp8_mlp(widths=widths)
        group = dist.new_group([0, 1])  # a failed process group stays failed: each case gets its own
        result = {"error": None, "step": None}
        for step in range(3):
            try:
                with fp8_autocast(fp8_recipe=recipe, fp8_group=group):
                    y = model(rank_batch(rank, step))
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
    model = fp8_mlp()
    try:
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=11), fp8_group=solo):
            model(rank_batch(rank, 0)).sum().backward()
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


# ---- steps that diverge: a caught exception, a skipped module, an extra region ---------------------------
# A rank that caught an exception inside its region, skipped one of its FP8 modules, or ran an extra
# training region (with its backward inside) would otherwise pair its collectives with other steps'
# on the other ranks and train with different scales, silently.


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
