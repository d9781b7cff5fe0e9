"""Hugging Face Trainer and accelerate: `model = fp8train.prepare(model)` before `Trainer(...)` or
`accelerator.prepare(...)`, nothing else, on 2 real gloo ranks (DDP), gradient accumulation 2.

Checks, on a tiny LlamaForCausalLM trained on byte-level text (ranks get different batches through
the framework's own distributed sampler):

- FP8 really ran: every FP8 module's input and weight histories recorded amaxes;
- the amax reduction is the global MAX: every amax collective's reduced buffer equals the
  elementwise MAX of the ranks' local buffers, which differed; every rank ends with bit-identical
  FP8 state (histories, scales, scale_inv);
- collectives per optimizer step: 4 (per-region mode: a forward and a backward per microbatch, 2
  microbatches), every step, as docs/guide.md says; evaluation (under no_grad) adds none;
- the loss decreases, and the final evaluation loss is within `LOSS_TOLERANCE` of the same run
  without FP8 (see below);
- `Trainer.save_model` round-trips the FP8 state (`fp8train.integrations.hf.from_pretrained`).

LOSS_TOLERANCE: the relative gap |FP8 - fp32| / fp32 of the final evaluation loss of this exact
run (Trainer, 12 optimizer steps), measured over seeds 0-4 with
`PYTHONPATH=tests python tests/hosts/test_integration_hf.py --measure`: 0.0001, 0.0008, 0.0003, 0.0013,
0.0020 (max 0.0020; the runs are deterministic, so the same run without FP8 repeats to the bit).
The bound, 0.008, is 4x the largest measured gap; over the run the loss falls from ~5.6 (first step)
to ~3.64 nats (final evaluation), a change 67x the bound (0.029 nats at 3.64).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import fp8train
from helpers import REPO, fp8_state
from integration_helpers import (
    AmaxWire,
    ByteText,
    assert_ends_near_the_run_without_fp8,
    assert_same_state,
    assert_trained,
    check_wire,
    integration_marks,
    set_launcher_env,
    tiny_llama,
)
from multirank import run_ranks, run_scenarios, scenario_outcome

pytestmark = integration_marks("hf", "transformers", "accelerate")

WORLD = 2
STEPS, ACCUM, BATCH = 12, 2, 4
LOSS_TOLERANCE = 0.008


def _args(seed: int, out_dir: str, save: bool):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=STEPS // 2,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def _trainer_run(seed: int, fp8: bool, out_dir: str, save: bool = False, per_step_mode: bool = False) -> dict:
    from transformers import Trainer, TrainerCallback

    model = tiny_llama(seed)
    if fp8:
        recipe = fp8train.DelayedScaling(amax_reduction="step") if per_step_mode else None
        model = fp8train.prepare(model, recipe=recipe)
    wire = AmaxWire()
    per_step: list[int] = []
    losses: list[float] = []
    saved: dict[int, dict] = {}

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            per_step.append(wire.amax_calls)

        def on_save(self, args, state, control, **kwargs):
            saved[state.global_step] = fp8_state(model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = _args(seed, out_dir, save)
    train = ByteText(STEPS * ACCUM * BATCH * WORLD, seed)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[Count()])
    if per_step_mode:  # the step boundary: the optimizer the Trainer steps (created now, reused by train)
        fp8train.end_step_on(trainer.create_optimizer())
    with wire:
        # no evaluation before training: it moves the Trainer's data order, and a run resumed from a
        # checkpoint then differs from this one (without FP8 too)
        trainer.train()
        fp8train.synchronize()
        after_train = wire.amax_calls
        final_eval = trainer.evaluate(ByteText(32, 1000))["eval_loss"]
        after_eval = wire.amax_calls
    out = {
        "first_loss": losses[0],
        "final_eval": final_eval,
        "losses": losses,
        "eval_collectives": after_eval - after_train,
        "per_step": [b - a for a, b in zip([0] + per_step, per_step)],
        "wire": wire.records,
        "launched": fp8train.inspection.counters()["launched"],
        "saved": saved,
    }
    if fp8:
        out["state"] = fp8_state(model)
    if fp8 and not per_step_mode:
        trainer.save_model(os.path.join(out_dir, "saved"))
        torch.distributed.barrier()
        from transformers import LlamaForCausalLM

        from fp8train.integrations.hf import from_pretrained

        loaded = from_pretrained(LlamaForCausalLM, os.path.join(out_dir, "saved"))
        out["loaded_state"] = fp8_state(loaded)
    return out


def _trainer_resume(seed: int, out_dir: str) -> dict:
    """A fresh prepared model (other weights) resumes the fp8 run's mid-run checkpoint to the end."""
    from transformers import Trainer, TrainerCallback

    model = fp8train.prepare(tiny_llama(seed + 1))
    restored = {}

    class Restored(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            restored["state"] = fp8_state(model)

    trainer = Trainer(
        model=model,
        args=_args(seed, out_dir + "-resumed", save=False),
        train_dataset=ByteText(STEPS * ACCUM * BATCH * WORLD, seed),
        callbacks=[Restored()],
    )
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{STEPS // 2}"))
    fp8train.synchronize()
    return {"restored": restored["state"], "final": fp8_state(model)}


def _example(out_dir: str) -> str:
    """examples/hf_trainer.py's main(), in this rank (torchrun's environment is set), 3 steps."""
    import contextlib
    import io

    path = REPO / "examples" / "hf_trainer.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv, sys.argv = sys.argv, [path, "--steps", "3", "--output-dir", out_dir]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            example.main()
    finally:
        sys.argv = argv
    dist.barrier()  # rank 0 writes the saved model
    saved = any(f.endswith(".safetensors") for f in os.listdir(os.path.join(out_dir, "final")))
    return printed.getvalue() + ("saved" if saved else "")


class GatherBytes:
    """Bytes FSDP2 all-gathers (it gathers through this one collective), counted while installed."""

    def __init__(self) -> None:
        self.name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self.real, self.bytes = getattr(dist, self.name), 0

    def __enter__(self) -> GatherBytes:
        def counted(output, input, *args, **kwargs):
            self.bytes += input.numel() * input.element_size()
            return self.real(output, input, *args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc) -> None:
        setattr(dist, self.name, self.real)


def _fresh_accelerate_state() -> None:
    """accelerate keeps one process-wide state, made by the first Accelerator (the Trainer's, in an
    earlier scenario): forget it, as accelerate's own tests do, so that a new one's settings apply."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _accelerate_run(seed: int) -> dict:
    from accelerate import Accelerator

    _fresh_accelerate_state()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = fp8train.prepare(tiny_llama(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.utils.data.DataLoader(ByteText(STEPS * ACCUM * BATCH * WORLD, seed), batch_size=BATCH)
    model, opt, data = accelerator.prepare(model, opt, data)
    wire, per_step, losses = AmaxWire(), [], []
    with wire:
        for batch in data:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                per_step.append(wire.amax_calls)
        fp8train.synchronize()
    return {
        "wrapper": type(model).__name__,
        "losses": losses,
        "per_step": [b - a for a, b in zip([0] + per_step, per_step)],
        "wire": wire.records,
        "state": fp8_state(accelerator.unwrap_model(model)),
    }


def _accelerate_fsdp_type() -> str:
    """What accelerate makes of an FSDP2 plugin on CPU ranks (the guide says why it is ignored)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _fresh_accelerate_state()
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    return str(accelerator.distributed_type)


def _fsdp2_run(seed: int, fp8_gather: bool) -> dict:
    """FSDP2 (`fully_shard` per decoder layer and the root) around a prepared model, a plain loop
    with gradient accumulation: what accelerate's FSDP2 plugin does on GPUs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = fp8train.prepare(tiny_llama(seed), fsdp_fp8_all_gather=fp8_gather)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    windows = ByteText(STEPS * ACCUM * BATCH * WORLD, seed).windows[dist.get_rank() :: WORLD]
    wire, per_step, losses, gathers = AmaxWire(), [], [], GatherBytes()
    with wire, gathers:
        for step in range(STEPS):
            for micro in range(ACCUM):
                ids = windows[(step * ACCUM + micro) * BATCH : (step * ACCUM + micro + 1) * BATCH]
                loss = model(input_ids=ids, labels=ids).loss
                (loss / ACCUM).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            per_step.append(wire.amax_calls)
        fp8train.synchronize()
    return {
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "gather_bytes": gathers.bytes,
        "losses": losses,
        "per_step": [b - a for a, b in zip([0] + per_step, per_step)],
        "wire": wire.records,
        "state": fp8_state(model),
    }


def _worker(rank: int, world_size: int, names: list[str], out_dir: str) -> dict:
    set_launcher_env(rank, world_size)

    def run_one(name: str):
        fp8train.inspection.reset()
        if name == "trainer_resume":
            return _trainer_resume(0, os.path.join(out_dir, "trainer_fp8"))
        if name == "example":
            return _example(os.path.join(out_dir, name))
        if name == "trainer_per_step":
            return _trainer_run(0, True, os.path.join(out_dir, name), per_step_mode=True)
        if name.startswith("trainer"):
            fp8 = name == "trainer_fp8"
            return _trainer_run(0, fp8, os.path.join(out_dir, name), save=fp8)
        if name == "accelerate_ddp":
            return _accelerate_run(0)
        if name == "accelerate_fsdp_plugin":
            return _accelerate_fsdp_type()
        return _fsdp2_run(0, fp8_gather=name == "fsdp2_fp8_gather")

    return run_scenarios(names, run_one)


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        names = [
            "trainer_fp8", "trainer_resume", "trainer_fp32", "trainer_per_step", "accelerate_ddp",
            "accelerate_fsdp_plugin",
            "fsdp2", "fsdp2_fp8_gather", "example",
        ]  # fmt: skip
        yield run_ranks(_worker, WORLD, names, tmp, timeout_s=300, pg_timeout_s=120)


def test_trainer_trains_in_fp8_with_the_global_max_on_every_rank(runs) -> None:
    r = scenario_outcome(runs, "trainer_fp8")
    for out in r:
        assert_trained(out["state"])
    assert_same_state(r[0]["state"], r[1]["state"], "FP8 state of rank 0 vs rank 1")
    check_wire([out["wire"] for out in r])


def test_trainer_collectives_per_optimizer_step(runs) -> None:
    r = scenario_outcome(runs, "trainer_fp8")
    for out in r:
        assert out["per_step"] == [2 * ACCUM] * STEPS, out["per_step"]
        assert out["eval_collectives"] == 0, "evaluation launched amax collectives"
        assert out["launched"] == 2 * ACCUM * STEPS
    assert scenario_outcome(runs, "trainer_fp32")[0]["per_step"] == [0] * STEPS


def test_trainer_with_per_step_reduction_makes_two_collectives_per_optimizer_step(runs) -> None:
    """DelayedScaling(amax_reduction="step") and end_step_on(the Trainer's optimizer): the two
    microbatches' amaxes are MAXed locally and reduced once per direction at the optimizer step."""
    r = scenario_outcome(runs, "trainer_per_step")
    for out in r:
        assert_trained(out["state"])
        assert out["per_step"] == [2] * STEPS, out["per_step"]
        assert out["eval_collectives"] == 0
    assert_same_state(r[0]["state"], r[1]["state"], "FP8 state of rank 0 vs rank 1")
    check_wire([out["wire"] for out in r])


def test_trainer_loss_decreases_and_ends_near_the_run_without_fp8(runs) -> None:
    fp8, ref = scenario_outcome(runs, "trainer_fp8")[0], scenario_outcome(runs, "trainer_fp32")[0]
    fp8_losses = (fp8["first_loss"], fp8["final_eval"])
    assert_ends_near_the_run_without_fp8(*fp8_losses, ref["final_eval"], LOSS_TOLERANCE)


def test_trainer_save_model_round_trips_the_fp8_state(runs) -> None:
    for out in scenario_outcome(runs, "trainer_fp8"):
        assert_same_state(out["loaded_state"], out["state"], "FP8 state loaded from save_model")


def test_trainer_resumes_a_checkpoint_with_its_fp8_state(runs) -> None:
    """resume_from_checkpoint restores the FP8 state saved mid-run (into a model with other weights),
    on every rank, and training on from there ends bit for bit where the uninterrupted run did."""
    full = scenario_outcome(runs, "trainer_fp8")
    for out, resumed in zip(full, scenario_outcome(runs, "trainer_resume")):
        assert sorted(out["saved"]) == [STEPS // 2, STEPS]
        assert_same_state(resumed["restored"], out["saved"][STEPS // 2], "FP8 state restored by the Trainer")
        assert_same_state(resumed["final"], out["state"], "resumed run vs uninterrupted run")


def test_the_example_trains_with_four_collectives_per_step(runs) -> None:
    printed = scenario_outcome(runs, "example")[0]
    assert "final eval loss" in printed and "(FP8)" in printed, printed
    assert "amax collectives per optimizer step: [4]" in printed and printed.endswith("saved"), printed


def test_accelerate_ignores_an_fsdp_plugin_on_cpu(runs) -> None:
    """accelerate turns FSDP on only for accelerator device types (GPU, XPU, NPU, ...): on CPU ranks
    the plugin is ignored and the model would be wrapped in DDP. If this starts failing, accelerate
    supports FSDP on CPU: test fp8train through its plugin then (the FSDP2 tests below use
    fully_shard directly)."""
    assert scenario_outcome(runs, "accelerate_fsdp_plugin") == ["DistributedType.MULTI_CPU"] * WORLD


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_fp8_gather"])
def test_fsdp2_around_a_prepared_model_with_gradient_accumulation(runs, name: str) -> None:
    r = scenario_outcome(runs, name)
    for out in r:
        assert out["sharded"]  # FSDP2 really sharded every parameter
        assert_trained(out["state"])
        assert out["per_step"] == [2 * ACCUM] * STEPS, out["per_step"]
    assert_same_state(r[0]["state"], r[1]["state"], f"{name}: FP8 state of rank 0 vs rank 1")
    check_wire([out["wire"] for out in r])
    losses = r[0]["losses"]
    assert sum(losses[-4:]) < sum(losses[:4]) - 4 * 0.3, losses


def test_fsdp2_fp8_all_gather_is_bitwise_equal_with_fewer_bytes(runs) -> None:
    plain, fp8_gather = scenario_outcome(runs, "fsdp2"), scenario_outcome(runs, "fsdp2_fp8_gather")
    for a, b in zip(plain, fp8_gather):
        assert b["losses"] == a["losses"]
        assert_same_state(b["state"], a["state"], "FSDP2 with and without FP8 all-gather")
        assert 0 < b["gather_bytes"] < 0.75 * a["gather_bytes"], (b["gather_bytes"], a["gather_bytes"])


def test_accelerate_prepare_with_gradient_accumulation(runs) -> None:
    r = scenario_outcome(runs, "accelerate_ddp")
    for out in r:
        assert out["wrapper"] == "DistributedDataParallel"
        assert_trained(out["state"])
        assert out["per_step"] == [2 * ACCUM] * STEPS, out["per_step"]
    assert_same_state(r[0]["state"], r[1]["state"], "accelerate: FP8 state of rank 0 vs rank 1")
    check_wire([out["wire"] for out in r])
    losses = r[0]["losses"]
    assert sum(losses[-4:]) < sum(losses[:4]) - 4 * 0.3, losses


def _measure(seeds: list[int]) -> None:
    """The loss gap of the Trainer run over several seeds (the docstring's figures)."""
    with tempfile.TemporaryDirectory() as tmp:
        for row in run_ranks(_measure_worker, WORLD, seeds, tmp, timeout_s=1800)[0]:
            seed, first, fp8, fp32, gap = row
            print(f"seed {seed}: first step {first:.4f}, final fp8 {fp8:.4f}, fp32 {fp32:.4f}, gap {gap:.4f}")


def _measure_worker(rank: int, world_size: int, seeds: list[int], out_dir: str) -> list:
    set_launcher_env(rank, world_size)
    gaps = []
    for seed in seeds:
        fp8train.inspection.reset()
        a = _trainer_run(seed, True, os.path.join(out_dir, f"a{seed}"))
        fp8train.inspection.reset()
        b = _trainer_run(seed, False, os.path.join(out_dir, f"b{seed}"))
        gap = abs(a["final_eval"] - b["final_eval"]) / b["final_eval"]
        gaps.append((seed, a["first_loss"], a["final_eval"], b["final_eval"], gap))
    return gaps


if __name__ == "__main__" and "--measure" in sys.argv:
    _measure(list(range(5)))
