"""PyTorch Lightning: `Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[FP8Precision()],
accumulate_grad_batches=2)` and an unchanged LightningModule, on 2 real gloo ranks.

The ranks are started by `run_ranks` with torchrun's environment (Lightning then sees an external
launch, as under torchrun, and reuses the process group); Lightning's own DDP strategy, sampler
and gradient accumulation do the rest. Checks, on a small byte-level language model (embedding,
two FP8 linear layers, an FP8 head) trained on the standard library's source:

- FP8 really ran (every FP8 module recorded input and weight amaxes), every amax collective's
  reduced buffer is the elementwise MAX of the ranks' local ones (which differed: Lightning's
  distributed sampler gives each rank its own batches), and the ranks end with bit-identical FP8
  state;
- 4 amax collectives per optimizer step (2 microbatches x forward and backward), every step;
  `trainer.validate` (no_grad) adds none;
- the loss decreases, and the final validation loss is within `LOSS_TOLERANCE` of the same run
  without the plugin;
- resuming (scenario "resume"): `trainer.fit(LitModel(), ckpt_path=...)` from an end-of-epoch
  checkpoint ends bit for bit where the uninterrupted run ends (weights and FP8 state);
  `validate` / `test` / `predict` with `ckpt_path` on a fresh module, `LitModel.load_from_checkpoint`
  plus `FP8Precision.load_checkpoint`, and `ckpt_path` into a module converted and trained before, all
  restore the saved FP8 state and give the saved module's losses.

LOSS_TOLERANCE: relative gap |FP8 - fp32| / fp32 of the final validation loss of this run,
measured over seeds 0-4 (`PYTHONPATH=tests python tests/hosts/test_integration_lightning.py --measure`):
0.0026, 0.0024, 0.0002, 0.0075, 0.0001 (max 0.0075; the runs are deterministic: the same run
without FP8 repeats to the bit). The bound, 0.03, is 4x the largest measured gap; over the run the
validation loss falls from ~5.7 to ~3.76 nats, a change 17x the bound (0.11 nats at 3.76).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import pytest
import torch

import fp8train
from helpers import fp8_state
from integration_helpers import (
    AmaxWire,
    ByteText,
    assert_ends_near_the_run_without_fp8,
    assert_same_state,
    assert_trained,
    check_wire,
    integration_marks,
    set_launcher_env,
)
from multirank import run_ranks, run_scenarios, scenario_outcome

pytestmark = integration_marks("lightning", "lightning")

WORLD = 2
STEPS, ACCUM, BATCH = 12, 2, 4
LOSS_TOLERANCE = 0.03


def _module(seed: int):
    import lightning.pytorch as pl

    class ByteLM(pl.LightningModule):
        """A plain LightningModule: nothing in it knows about FP8."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.embed = torch.nn.Embedding(256, 64)
            self.up = torch.nn.Linear(64, 128)
            self.down = torch.nn.Linear(128, 64)
            self.head = torch.nn.Linear(64, 256)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            h = h + self.down(torch.nn.functional.gelu(self.up(h)))
            return self.head(h)

        def _loss(self, batch) -> torch.Tensor:
            ids = batch["input_ids"]
            logits = self(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def test_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("test_loss", loss, sync_dist=True)
            return loss

        def predict_step(self, batch, batch_idx):
            return self._loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    return ByteLM()


def _trainer(plugins: list, **kwargs):
    import lightning.pytorch as pl

    settings = dict(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp",
        accumulate_grad_batches=ACCUM,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=4,
    )
    return pl.Trainer(plugins=plugins, **(settings | kwargs))


def _run(seed: int, fp8: bool) -> dict:
    import lightning.pytorch as pl

    from fp8train.integrations.lightning import FP8Precision

    wire = AmaxWire()
    per_step: list[int] = []

    class Count(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            per_step.append(wire.amax_calls)

    model = _module(seed)
    train = torch.utils.data.DataLoader(ByteText(STEPS * ACCUM * BATCH * WORLD, seed), batch_size=BATCH)
    val = torch.utils.data.DataLoader(ByteText(64, 1000), batch_size=8)
    plugins = [FP8Precision()] if fp8 else []
    trainer = _trainer(plugins, callbacks=[Count()])
    with wire:
        first = trainer.validate(model, val, verbose=False)[0]["val_loss"]
        before_fit = wire.amax_calls
        trainer.fit(model, train)
        fp8train.synchronize()
        after_fit = wire.amax_calls
        final = trainer.validate(model, val, verbose=False)[0]["val_loss"]
        after_val = wire.amax_calls
    out = {
        "first": first,
        "final": final,
        "eval_collectives": (before_fit, after_val - after_fit),
        "per_step": [b - a for a, b in zip([0] + per_step, per_step)],
        "wire": wire.records,
        "converted": sorted(n for n, m in model.named_modules() if isinstance(m, fp8train.FP8Module)),
    }
    if fp8:
        out["state"] = fp8_state(model)
    return out


EPOCH_STEPS = 2  # optimizer steps per epoch in the resume scenario
LOGGED = {"validate": "val_loss", "test": "test_loss"}


def _resume(seed: int, out_dir: str) -> dict:
    """One epoch, an end-of-epoch checkpoint, and every standard way back from it (module docstring)."""
    from fp8train.integrations.lightning import FP8Precision

    train = torch.utils.data.DataLoader(ByteText(EPOCH_STEPS * ACCUM * BATCH * WORLD, seed), batch_size=BATCH)
    val = torch.utils.data.DataLoader(ByteText(32, 1000), batch_size=8)

    def trainer(epochs: int):
        return _trainer([FP8Precision()], max_epochs=epochs, max_steps=-1)

    def losses(stage: str, model, **kwargs) -> list[float]:
        run = getattr(trainer(1), stage)
        if stage == "predict":
            return [float(x) for x in run(model, val, **kwargs)]
        return [run(model, val, verbose=False, **kwargs)[0][LOGGED[stage]]]

    uninterrupted = _module(seed)
    trainer(2).fit(uninterrupted, train)
    saved_module = _module(seed)
    first_epoch = trainer(1)
    first_epoch.fit(saved_module, train)
    path = os.path.join(out_dir, "epoch1.ckpt")
    first_epoch.save_checkpoint(path)
    torch.distributed.barrier()
    out = {"saved": fp8_state(saved_module), "uninterrupted": fp8_state(uninterrupted)}
    out["saved_losses"] = {stage: losses(stage, saved_module) for stage in ("validate", "test", "predict")}

    resumed = _module(seed + 1)
    trainer(2).fit(resumed, train, ckpt_path=path)
    out["resumed"] = fp8_state(resumed)
    out["resumed_weights_equal"] = [
        torch.equal(a, b) for a, b in zip(resumed.parameters(), uninterrupted.parameters())
    ]

    out["fresh"] = {}
    for stage in ("validate", "test", "predict"):
        fresh = _module(seed + 1)
        out["fresh"][stage] = (stage, losses(stage, fresh, ckpt_path=path), fp8_state(fresh))

    loaded = type(saved_module).load_from_checkpoint(path)  # the weights only
    FP8Precision().load_checkpoint(loaded, path)  # the FP8 state
    out["loaded"] = ("validate", losses("validate", loaded), fp8_state(loaded))

    # converted and trained before (the uninterrupted run's module, whose own FP8 state differs)
    out["converted_before"] = (
        "validate",
        losses("validate", uninterrupted, ckpt_path=path),
        fp8_state(uninterrupted),
    )
    return out


def _worker(rank: int, world_size: int, names: list[str], out_dir: str, seed: int = 0) -> dict:
    set_launcher_env(rank, world_size)

    def run_one(name: str):
        fp8train.inspection.reset()
        if name == "resume":
            return _resume(seed, out_dir)
        return _run(seed, name == "fp8")

    return run_scenarios(names, run_one)


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        yield run_ranks(_worker, WORLD, ["fp8", "fp32", "resume"], tmp, timeout_s=420, pg_timeout_s=120)


def test_lightning_trains_in_fp8_with_the_global_max_on_every_rank(runs) -> None:
    r = scenario_outcome(runs, "fp8")
    for out in r:
        assert out["converted"] == ["down", "head", "up"]
        assert_trained(out["state"])
    assert_same_state(r[0]["state"], r[1]["state"], "FP8 state of rank 0 vs rank 1")
    check_wire([out["wire"] for out in r])


def test_lightning_collectives_per_optimizer_step(runs) -> None:
    for out in scenario_outcome(runs, "fp8"):
        assert out["per_step"] == [2 * ACCUM] * STEPS, out["per_step"]
        assert out["eval_collectives"] == (0, 0), "validation launched amax collectives"
    fp32 = scenario_outcome(runs, "fp32")[0]
    assert fp32["per_step"] == [0] * STEPS and fp32["converted"] == []


def test_lightning_loss_decreases_and_ends_near_the_run_without_fp8(runs) -> None:
    fp8, ref = scenario_outcome(runs, "fp8")[0], scenario_outcome(runs, "fp32")[0]
    assert_ends_near_the_run_without_fp8(fp8["first"], fp8["final"], ref["final"], LOSS_TOLERANCE)


def test_lightning_resumes_a_fresh_module_as_the_uninterrupted_run(runs) -> None:
    for out in scenario_outcome(runs, "resume"):
        assert_trained(out["saved"])
        assert any(  # the second epoch changed the FP8 state: the comparisons below can fail
            not torch.equal(a, b) for a, b in zip(out["saved"], out["uninterrupted"])
        )
        assert_same_state(out["resumed"], out["uninterrupted"], "FP8 state resumed vs uninterrupted")
        assert all(out["resumed_weights_equal"]), out["resumed_weights_equal"]


def test_lightning_restores_the_fp8_state_in_every_standard_way(runs) -> None:
    for out in scenario_outcome(runs, "resume"):
        ways = {f"{stage}(ckpt_path=...) on a fresh module": r for stage, r in out["fresh"].items()}
        ways["load_from_checkpoint + FP8Precision.load_checkpoint"] = out["loaded"]
        ways["validate(ckpt_path=...) on a module converted before"] = out["converted_before"]
        for way, (stage, losses, state) in ways.items():
            assert_same_state(state, out["saved"], way)
            assert losses == out["saved_losses"][stage], (way, losses, out["saved_losses"][stage])


def test_fp8_precision_converts_in_place_once_and_checks_its_recipe() -> None:
    from fp8train.integrations.lightning import FP8Precision

    plugin = FP8Precision(module_filter_fn=lambda module, fqn: fqn != "head")
    model = _module(0)
    up = model.up
    assert plugin.convert_module(model) is model
    assert isinstance(model.up, fp8train.Linear) and model.up.weight is up.weight
    assert type(model.head) is torch.nn.Linear  # kept by the filter
    converted = model.up
    plugin.convert_module(model)  # again: nothing changes
    assert model.up is converted
    with plugin.forward_context():
        assert fp8train.inspection.open_regions() == 1
    with pytest.raises(ValueError, match="recipe must be"):
        FP8Precision(recipe="fp8")


@pytest.fixture(scope="module")
def one_process_checkpoints():
    """Checkpoints of one FP8 training step (full and weights-only) and of one step without FP8, each
    from one process."""
    from fp8train.integrations.lightning import FP8Precision

    train = torch.utils.data.DataLoader(ByteText(2 * BATCH, 0), batch_size=BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, plugins in (("fp8", [FP8Precision()]), ("fp32", [])):
            fp8train.inspection.reset()
            trainer = _trainer(plugins, devices=1, strategy="auto", accumulate_grad_batches=1, max_steps=1)
            model = _module(0)
            trainer.fit(model, train)
            paths[name] = os.path.join(tmp, f"{name}.ckpt")
            trainer.save_checkpoint(paths[name])
            if name == "fp8":
                paths["saved"] = fp8_state(model)
                paths["weights_only"] = os.path.join(tmp, "weights_only.ckpt")
                trainer.save_checkpoint(paths["weights_only"], weights_only=True)
        yield paths
        fp8train.inspection.reset()


def _one_process(plugin):
    return _trainer([plugin], devices=1, strategy="auto", accumulate_grad_batches=1)


def test_load_from_checkpoint_alone_warns_naming_the_line_to_add(one_process_checkpoints) -> None:
    from fp8train.integrations.lightning import FP8Precision

    path, val = one_process_checkpoints["fp8"], torch.utils.data.DataLoader(ByteText(8, 1000), batch_size=8)
    model = type(_module(0)).load_from_checkpoint(path)  # the weights only: no plugin is called here
    with pytest.warns(UserWarning, match=r"add `FP8Precision\(\).load_checkpoint\(model, path\)`"):
        _one_process(FP8Precision()).validate(model, val, verbose=False)

    model = type(_module(0)).load_from_checkpoint(path)
    FP8Precision().load_checkpoint(model, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="FP8Precision")
        _one_process(FP8Precision()).validate(model, val, verbose=False)
    assert_same_state(fp8_state(model), one_process_checkpoints["saved"], "FP8 state after load_checkpoint")


def test_restoring_refuses_fp8_state_that_does_not_fit(one_process_checkpoints) -> None:
    from fp8train.integrations.lightning import FP8Precision

    paths, val = one_process_checkpoints, torch.utils.data.DataLoader(ByteText(8, 1000), batch_size=8)
    keeps_head = FP8Precision(module_filter_fn=lambda module, fqn: fqn != "head")
    with pytest.raises(
        ValueError,
        match=r"state for head._extra_state, which are not FP8 layers here\): .* FP8Precision\(module_filter",
    ):
        keeps_head.load_checkpoint(_module(1), paths["fp8"])
    # a checkpoint without FP8 state: a fresh module starts its FP8 state, a converted one refuses it
    fresh = _module(1)
    _one_process(FP8Precision()).validate(fresh, val, ckpt_path=paths["fp32"], verbose=False)
    assert isinstance(fresh.up, fp8train.Linear)
    converted = FP8Precision().load_checkpoint(_module(1), paths["fp8"])
    with pytest.raises(ValueError, match="holds no FP8 state .* restore it into a fresh LightningModule"):
        _one_process(FP8Precision()).validate(converted, val, ckpt_path=paths["fp32"], verbose=False)


def test_a_weights_only_checkpoint_keeps_the_fp8_state_with_the_weights(one_process_checkpoints) -> None:
    """The documented limit: Lightning calls no plugin when it writes a weights-only checkpoint, so
    its FP8 state stays in the weights, for a module converted before the restore."""
    from fp8train.integrations.lightning import FP8_STATE_KEY, FP8Precision

    path, val = (
        one_process_checkpoints["weights_only"],
        torch.utils.data.DataLoader(ByteText(8, 1000), batch_size=8),
    )
    saved = torch.load(path, weights_only=True)
    assert FP8_STATE_KEY not in saved and "up._extra_state" in saved["state_dict"]
    with pytest.raises(RuntimeError, match="Unexpected key.*_extra_state"):
        _one_process(FP8Precision()).validate(_module(1), val, ckpt_path=path, verbose=False)
    model = _module(1)
    FP8Precision().convert_module(model)
    _one_process(FP8Precision()).validate(model, val, ckpt_path=path, verbose=False)
    assert_same_state(
        fp8_state(model), one_process_checkpoints["saved"], "weights-only restore, converted first"
    )


def _measure_worker(rank: int, world_size: int, seeds: list[int], out_dir: str) -> list:
    set_launcher_env(rank, world_size)
    rows = []
    for seed in seeds:
        fp8train.inspection.reset()
        a = _run(seed, True)
        fp8train.inspection.reset()
        b = _run(seed, False)
        rows.append((seed, a["first"], a["final"], b["final"], abs(a["final"] - b["final"]) / b["final"]))
    return rows


if __name__ == "__main__" and "--measure" in sys.argv:
    with tempfile.TemporaryDirectory() as tmp:
        for seed, first, fp8, fp32, gap in run_ranks(
            _measure_worker, WORLD, list(range(5)), tmp, timeout_s=1800
        )[0]:
            print(f"seed {seed}: first {first:.4f}, final fp8 {fp8:.4f}, fp32 {fp32:.4f}, gap {gap:.4f}")
