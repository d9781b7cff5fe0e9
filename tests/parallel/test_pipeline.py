"""Pipeline parallelism with torch.distributed.pipelining: FP8 modules in each stage, one
amax group per stage, in both reduction modes, on real gloo ranks.

- per-step mode: the pipeline's FP8 state equals a single process running the same microbatches (bit
  for bit: every step's scales come from the MAX over the step's microbatches, whatever order the
  schedule ran them in), and its losses and parameters agree within fp32 reassociation;
- per-region mode: each stage's FP8 state equals a replay of delayed scaling (tests/reference.py)
  over the regions and backward passes in the order the schedule ran them;
- an amax group spanning stages is an error, never a hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8train
from helpers import REPO
from multirank import run_ranks, run_ranks_outcomes
from reference import E4M3_MAX, E5M2_MAX, RefScaling

pytestmark = pytest.mark.multirank

HISTORY, M, STEPS, WIDTH, BLOCKS = 4, 4, 3, 16, 4
LR = 0.05


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = fp8train.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


class Stage(torch.nn.Module):
    """A stage's blocks, each call one FP8 region (what fp8train.prepare does to a module)."""

    def __init__(self, blocks, recipe, group) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)
        self.recipe, self.group = recipe, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp8train.fp8_autocast(fp8_recipe=self.recipe, fp8_group=self.group):
            return self.blocks(x)


def _blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block() for _ in range(BLOCKS)]


def _data(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(M * 4, WIDTH, generator=g) * (1 + replica), torch.randn(M * 4, WIDTH, generator=g)


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).square().mean()


def _recipe(mode: str) -> fp8train.DelayedScaling:
    return fp8train.DelayedScaling(amax_history_len=HISTORY, amax_reduction=mode)


def _fp8_state(modules) -> list:
    return [
        [m.linear.fp8_meta[k].amax_history.tolist(), m.linear.fp8_meta[k].scale.tolist()]
        for m in modules
        for k in ("scaling_fwd", "scaling_bwd")
    ]


class Capture:
    """The amaxes each block's regions and backward passes recorded, in the order they ran."""

    def __init__(self, blocks) -> None:
        self.events: list[tuple[str, int, list[float]]] = []
        for i, block in enumerate(blocks):
            block.linear.register_forward_hook(lambda mod, inp, out, i=i: self._fwd(i, mod, inp[0]))
            block.linear.register_full_backward_hook(lambda mod, gi, go, i=i: self._bwd(i, go[0]))

    def _fwd(self, i, module, x) -> None:
        if torch.is_grad_enabled() and fp8train.inspection.open_regions():
            w = module.weight.detach()
            self.events.append(("fwd", i, [float(x.detach().abs().max()), float(w.abs().max()), 0.0]))

    def _bwd(self, i, grad_output) -> None:
        self.events.append(("bwd", i, [float(grad_output.abs().max()), 0.0]))


def _pipeline(rank: int, world: int, schedule: str, mode: str, dp: int) -> dict:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pp = world // dp
    pp_rank, replica = rank % pp, rank // pp
    pp_groups = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(dp)]
    stage_groups = [dist.new_group(list(range(s, world, pp))) for s in range(pp)]  # a stage's DP ranks
    blocks = _blocks()
    stages_per_rank = 2 if schedule == "interleaved" else 1
    n_stages = pp * stages_per_rank
    per_stage = BLOCKS // n_stages
    mine = [pp_rank + k * pp for k in range(stages_per_rank)]  # interleaved: stages r and r + pp
    stages = [
        PipelineStage(
            Stage(blocks[s * per_stage : (s + 1) * per_stage], _recipe(mode), stage_groups[pp_rank]),
            s,
            n_stages,
            torch.device("cpu"),
            group=pp_groups[replica],
        )
        for s in mine
    ]
    local = [b for s in stages for b in s.submod.blocks]
    capture = Capture(local)
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=_loss)
    else:
        runner = kinds[schedule](stages[0], n_microbatches=M, loss_fn=_loss)
    losses, states = [], []
    for step in range(STEPS):
        x, target = _data(replica, step)
        out: list = []
        kwargs = {}
        if 0 in mine:
            kwargs["x"] = x
        if n_stages - 1 in mine:
            kwargs.update(target=target, losses=out)
        _step(runner, kwargs)
        if mode == "step":
            fp8train.end_step()
        with torch.no_grad():
            for block in local:
                for p in block.parameters():
                    dist.all_reduce(p.grad, group=stage_groups[pp_rank])  # data parallel: mean
                    p -= LR * p.grad / dp
                    p.grad = None
        losses.append([loss.item() for loss in out])
        fp8train.synchronize()
        states.append(_fp8_state(local))
    return {
        "stages": mine,
        "replica": replica,
        "losses": losses,
        "states": states,
        "params": [p.detach().clone() for b in local for p in b.parameters()],
        "events": capture.events,
    }


def _step(runner, kwargs: dict) -> None:
    args = [kwargs.pop("x")] if "x" in kwargs else []
    runner.step(*args, **kwargs)


def _single_process(mode: str, replicas: int) -> dict:
    """The same microbatches, one region per microbatch over the whole model, in one process."""
    blocks = _blocks()
    model = torch.nn.Sequential(*blocks)
    recipe = _recipe(mode)
    losses, states = [], []
    for step in range(STEPS):
        step_losses = []
        for replica in range(replicas):
            x, target = _data(replica, step)
            for xm, tm in zip(x.chunk(M), target.chunk(M)):
                with fp8train.fp8_autocast(fp8_recipe=recipe):
                    y = model(xm)
                loss = _loss(y, tm)
                loss.backward()
                step_losses.append(loss.item())
        if mode == "step":
            fp8train.end_step()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad / (M * replicas)
                p.grad = None
        losses.append(step_losses)
        fp8train.synchronize()
        states.append(_fp8_state(blocks))
    return {"losses": losses, "states": states, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_per_step_pipeline_equals_a_single_process_over_the_same_microbatches(schedule: str) -> None:
    runs = run_ranks(_pipeline, 2, schedule, "step", 1, timeout_s=180, pg_timeout_s=60)
    reference = _single_process("step", 1)
    per_stage = BLOCKS // (2 * (2 if schedule == "interleaved" else 1))
    states = {}
    for run in runs:
        for k, s in enumerate(run["stages"]):
            for step, state in enumerate(run["states"]):
                states[(step, s)] = state[2 * k * per_stage : 2 * (k + 1) * per_stage]
    for step in range(STEPS):
        flat = [row for s in range(BLOCKS // per_stage) for row in states[(step, s)]]
        assert flat == reference["states"][step], f"FP8 state differs at step {step}"  # bit for bit
    last = next(r for r in runs if r["losses"][0])
    pipeline_losses = torch.tensor(last["losses"])
    assert torch.equal(pipeline_losses[0], torch.tensor(reference["losses"][0]))  # the first step: exact
    # later steps start from parameters whose gradients were summed over microbatches in the
    # schedule's order: fp32 reassociation (a few ulps), which FP8 casts can amplify to one FP8 step
    assert torch.allclose(pipeline_losses, torch.tensor(reference["losses"]), rtol=0.05, atol=1e-6)


def test_per_region_pipeline_state_equals_a_replay_in_schedule_order() -> None:
    runs = run_ranks(_pipeline, 2, "1f1b", "region", 1, timeout_s=180, pg_timeout_s=60)
    recipe = _recipe("region")
    for run in runs:
        n = len(run["params"]) // 2  # blocks on this rank
        replay = {
            "fwd": RefScaling(3 * n, HISTORY),
            "bwd": RefScaling(2 * n, HISTORY),
        }
        # group each region's (or backward pass's) blocks: a region ends after its last block's forward
        pending = {"fwd": [0.0] * (3 * n), "bwd": [0.0] * (2 * n)}
        done = {"fwd": 0, "bwd": 0}
        for kind, block, amaxes in run["events"]:
            width = 3 if kind == "fwd" else 2
            pending[kind][width * block : width * (block + 1)] = amaxes
            done[kind] += 1
            if done[kind] == n:  # the region (pass) is complete: one reduction, one update
                replay[kind].update(pending[kind], recipe, E4M3_MAX if kind == "fwd" else E5M2_MAX)
                pending[kind], done[kind] = [0.0] * (width * n), 0
        state = run["states"][-1]
        for b in range(n):
            for d, kind in enumerate(("fwd", "bwd")):
                width = 3 if kind == "fwd" else 2
                history, scale = state[2 * b + d]
                expected_history = [replay[kind].history[width * b + c] for c in range(width)]
                assert [list(col) for col in zip(*history)] == expected_history
                assert scale == replay[kind].scale[width * b : width * (b + 1)]


def test_two_stages_by_two_data_parallel_ranks_share_scales_within_each_stage() -> None:
    runs = run_ranks(_pipeline, 4, "1f1b", "step", 2, timeout_s=240, pg_timeout_s=60)
    by_stage = {}
    for run in runs:
        by_stage.setdefault(tuple(run["stages"]), []).append(run)
    reference = _single_process("step", 2)
    for stage, replicas in by_stage.items():
        assert replicas[0]["states"] == replicas[1]["states"]  # the stage's DP ranks agree
        per_stage = BLOCKS // 2
        for step in range(STEPS):
            rows = reference["states"][step][2 * stage[0] * per_stage : 2 * (stage[0] + 1) * per_stage]
            assert replicas[0]["states"][step] == rows  # the MAX over both replicas' microbatches
    assert runs[0]["losses"] != runs[2]["losses"] or not runs[0]["losses"][0]


def _spanning(rank: int, world: int, checked: bool) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    blocks = _blocks()
    try:
        module = Stage(blocks[2 * rank : 2 * rank + 2], _recipe("region"), None)  # the world: both stages
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        if checked:
            fp8train.pipeline.check_stage(stage, None)  # what prepare_stage does first
        runner = ScheduleGPipe(stage, n_microbatches=M, loss_fn=_loss)
        x, target = _data(0, 0)
        _step(runner, {"x": x} if rank == 0 else {"target": target})
    except Exception as exc:  # noqa: BLE001 - the verdict is what each rank ends with
        return {"error": type(exc).__name__, "message": f"{exc} {exc.__cause__!r}"}
    return {"error": None}


@pytest.mark.parametrize("checked", [True, False], ids=["prepare_stage", "first-forward"])
def test_an_amax_group_spanning_stages_is_an_error_never_a_hang(checked: bool) -> None:
    """Checked when the stage is built: every rank raises before any communication. Unchecked, the
    first stage's first forward raises (the module's own check) and the next stage, waiting for its
    activations, gets torch.distributed's error when that process ends: an error, never a hang."""
    outcomes = run_ranks_outcomes(_spanning, 2, checked, timeout_s=90, pg_timeout_s=30)
    results = [payload for ok, payload in outcomes]
    assert all(ok for ok, _ in outcomes), results
    assert all(r["error"] is not None for r in results), results
    ours = [r for r in results if "must not span pipeline stages" in r["message"]]
    assert len(ours) == (2 if checked else 1), results


# ---- examples/pipeline.py ------------------------------------------------------------------------------
EXAMPLE = REPO / "examples" / "pipeline.py"


def _example(rank: int, world: int) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = {"micro": example.MICRO}
    for schedule, mode in (("1f1b", "step"), ("gpipe", "region")):
        fp8train.inspection.reset()
        out[mode] = example.train(steps=10 if mode == "step" else 3, schedule=schedule, amax_reduction=mode)
    return out


def test_the_pipeline_example_trains_each_stage_on_its_own_scales() -> None:
    """examples/pipeline.py on 2 stages x 2 data-parallel ranks: the loss falls, each stage's ranks
    hold the same scales, and a stage reduces its amaxes twice per step in per-step mode (whatever
    the number of microbatches) and twice per microbatch in per-region mode."""
    runs = run_ranks(_example, 4, timeout_s=300, pg_timeout_s=60)
    micro = runs[0]["micro"]
    for run in runs:
        step, region = run["step"], run["region"]
        assert all(step["identical"]) and all(region["identical"])
        assert step["launched_per_step"] == [2] * 10, step["launched_per_step"]
        assert region["launched_per_step"] == [2 * micro] * 3, region["launched_per_step"]
    losses = runs[0]["step"]["losses"]
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_pipeline_example_runs_under_torchrun() -> None:
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(EXAMPLE),
        "--steps",
        "3",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "amax reductions per step" in done.stdout, done.stdout
