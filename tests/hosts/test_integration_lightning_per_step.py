"""PyTorch Lightning with per-step amax reduction: `FP8Precision(DelayedScaling(amax_reduction="step"))`
marks the step boundary itself, on 2 real gloo ranks with Lightning's DDP strategy.

Lightning's automatic optimization runs the step's last microbatch inside the closure it passes to
`optimizer.step`, so a boundary before the step (a step pre-hook) came one microbatch early: with
accumulation the run raised at its second optimizer step, without it every step was reduced one step
late. Checked here with no fp8train code in the LightningModule (accumulate_grad_batches=1), with the
LightningModule's own `fp8train.end_step_on(optimizer)` (accumulate_grad_batches=2, which must not
add a second boundary), with a callback that still calls `fp8train.end_step()` in
`on_before_optimizer_step` (the way the guide taught before the plugin marked the boundary: it must
not add a second one either, and is named once as no longer needed), and in manual optimization
(2 microbatches per `optimizer.step()`): 2 amax collectives per optimizer step, one history row per
step, and each row's input amax the MAX over the step's microbatches and both ranks of what the
first layer saw.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fp8train
from integration_helpers import AmaxWire, integration_marks, set_launcher_env
from multirank import run_ranks, run_scenarios, scenario_outcome

pytestmark = integration_marks("lightning", "lightning")

WORLD, STEPS, BATCH, HISTORY = 2, 3, 4, 8
RECIPE = fp8train.DelayedScaling(amax_history_len=HISTORY, amax_reduction="step")
SCENARIOS = {  # name -> (accumulate_grad_batches, end_step_on in configure_optimizers, manual optimization,
    #                   a callback calling fp8train.end_step() in on_before_optimizer_step)
    "accumulate=1, no fp8train code": (1, False, False, False),
    "accumulate=2, end_step_on": (2, True, False, False),
    "manual optimization, accumulate=2": (2, False, True, False),
    "accumulate=1, a callback's end_step": (1, False, False, True),
    "accumulate=2, a callback's end_step": (2, False, False, True),
}


def _run(accum: int, user_hook: bool, manual: bool = False, user_end_step: bool = False) -> dict:
    import warnings

    import lightning.pytorch as pl

    from fp8train.integrations.lightning import FP8Precision

    seen: list[tuple[int, float]] = []  # (optimizer step, input amax of the first layer) per microbatch

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            (x,) = batch
            seen.append((batch_idx // accum, float(x.abs().max())))
            loss = self.net(x).square().mean()
            if manual:  # the boundary at the LightningOptimizer's step, with its do-nothing closure
                self.manual_backward(loss / accum)
                if (batch_idx + 1) % accum == 0:
                    self.optimizers().step()
                    self.optimizers().zero_grad()
            return loss

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            if user_hook:
                fp8train.end_step_on(opt)
            return opt

    wire, per_step = AmaxWire(), []

    class Count(pl.Callback):  # amax collectives counted after each optimizer step
        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_post_hook(lambda *_: per_step.append(wire.amax_calls))

    class EndStep(pl.Callback):  # what the guide taught before the plugin marked the boundary
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            fp8train.end_step()

    g = torch.Generator().manual_seed(1)
    data = (
        torch.randn(STEPS * accum * BATCH * WORLD, 16, generator=g)
        * torch.linspace(0.5, 4, STEPS * accum * BATCH * WORLD)[:, None]
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH)
    model = Plain()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[FP8Precision(RECIPE)],
        accumulate_grad_batches=1 if manual else accum, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Count()] + ([EndStep()] if user_end_step else []),
    )  # fmt: skip
    with wire, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
        fp8train.synchronize()
    named = [w for w in caught if "no longer needed" in str(w.message)]
    expected = torch.zeros(STEPS)
    for step, value in seen:
        expected[step] = max(expected[step], value)
    dist.all_reduce(expected, op=dist.ReduceOp.MAX)  # MAX over the ranks
    history = model.net[0].fp8_meta["scaling_fwd"].amax_history[:, 0]
    return {
        "per_step": [b - a for a, b in zip([0] + per_step, per_step)],
        "steps": fp8train.inspection.amax_group(RECIPE).training_regions,
        "history": history.tolist(),
        "expected": expected.flip(0).tolist() + [0.0] * (HISTORY - STEPS),  # newest row first
        "named": len(named),
    }


def _worker(rank: int, world_size: int) -> dict:
    set_launcher_env(rank, world_size)

    def run_one(name: str):
        fp8train.inspection.reset()
        return _run(*SCENARIOS[name])

    return run_scenarios(list(SCENARIOS), run_one)


def test_fp8_precision_marks_the_step_boundary_in_per_step_mode() -> None:
    runs = run_ranks(_worker, WORLD, timeout_s=300, pg_timeout_s=120)
    for name in SCENARIOS:
        outs = scenario_outcome(runs, name)
        for out in outs:
            assert out["per_step"] == [2] * STEPS and out["steps"] == STEPS, (name, out)
            assert out["history"] == out["expected"], (name, out)
            assert out["named"] == (1 if SCENARIOS[name][3] else 0), (name, out)
        assert outs[0]["history"] == outs[1]["history"]
