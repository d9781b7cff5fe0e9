"""One rank of the demo (launched by `fp8train demo` through torchrun).

Trains the small GPT on real text (the standard library's source, byte-level; or the synthetic
Markov language) in FP8 with each chosen recipe (delayed scaling also again with the other
amax-reduction mode), then the same model and data with FP8 disabled as the reference. Rank 0 writes
run_dir/metrics.jsonl (telemetry) and run_dir/summary.json; every rank runs the same code so that
the ranks stay in step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import fp8train
from fp8train.amax import settings
from fp8train.debug_switches import apply_environment
from fp8train.modules import FP8Module
from fp8train.numerics.gemm import cpu_bf16_instructions
from fp8train.quantization import recipe_kind
from fp8train.recipe import Recipe
from fp8train.telemetry import Telemetry
from fp8train.tensor_stats import GemmStatistics

from .data import TEXT_SOURCE, MarkovTask, stdlib_text, text_batches
from .models import GPT, MODEL_SIZES, GPTConfig, MoE, next_token_loss
from .quant_error import DelayedScales, TensorTap, mean_errors, quantization_errors, sample_gemms
from .timing import interleaved_times, medians, quartiles, slowest_rank

__all__ = ["train_phase", "timed_pass", "main", "measure_telemetry_overhead", "DEMO_RECIPES"]

MOE_EXPERTS = 4  # `--model moe`: experts per MoE block (top-2 routing)

DEMO_RECIPES = {
    "delayed": fp8train.DelayedScaling(amax_history_len=16),  # short window: scales visibly follow amaxes
    "current": fp8train.Float8CurrentScaling(),
    "block": fp8train.Float8BlockScaling(),
    "mxfp8": fp8train.MXFP8BlockScaling(),
    "nvfp4": fp8train.NVFP4BlockScaling(),
}


def _lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, min(10, steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def fp8_state_digest(model: torch.nn.Module) -> str:
    """A hash of every FP8 scale and amax history of `model` (equal digests = bit-identical state)."""
    h = hashlib.sha256()
    for module in model.modules():
        if isinstance(module, FP8Module):
            for key in ("scaling_fwd", "scaling_bwd"):
                meta = module.fp8_meta[key]
                for t in (meta.scale, meta.amax_history):
                    h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class _Trainer:
    """One configuration's model, optimizer and training step (FP8 with `recipe`, or high precision:
    fp32, or bf16 autocast with `bf16`), shared by the training runs and the timed pass."""

    def __init__(
        self,
        recipe: Optional[Recipe],
        cfg: GPTConfig,
        args: argparse.Namespace,
        device: torch.device,
        steps: int,
        bf16: bool = False,
    ) -> None:
        self.recipe, self.fp8, self.bf16 = recipe, recipe is not None, bf16
        self.steps, self.lr, self.device = steps, args.lr, device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group() if dist.is_initialized() else None  # a fresh amax group per run
        torch.manual_seed(args.seed)
        self.model = GPT(cfg).to(device)
        if recipe is not None:  # built from fp8train modules, not converted: the switches applied here
            apply_environment(self.model)
        self.net = self.model
        if self.world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, process_group=self.group)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def step(self, step: int, tokens: torch.Tensor) -> float:
        """One optimizer step on `tokens`; the loss averaged over ranks."""
        for pg in self.opt.param_groups:
            pg["lr"] = _lr(step, self.steps, self.lr)
        tokens = tokens.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            with fp8train.fp8_autocast(enabled=self.fp8, fp8_recipe=self.recipe, fp8_group=self.group):
                logits = self.net(tokens[:, :-1])
        loss = next_token_loss(logits, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        mean_loss = loss.detach().clone()
        work = dist.all_reduce(mean_loss, async_op=True) if self.world > 1 else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if work is not None:
            work.wait()
        return float(mean_loss) / self.world


def _quant_error_steps(steps: int, every: int) -> set[int]:
    """The steps whose quantization error is measured: every `every`-th and the last (none if 0)."""
    return set(range(0, steps, every)) | {steps - 1} if every > 0 else set()


def train_phase(
    name: str,
    recipe: Optional[Recipe],
    cfg: GPTConfig,
    data: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    run_dir: Optional[str],
) -> dict:
    """Train a fresh model (same seed, same data) for len(data) steps in FP8 with `recipe` (None: the
    high-precision reference); return this rank's figures."""
    fp8 = recipe is not None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    trainer = _Trainer(recipe, cfg, args, device, len(data))
    model = trainer.model
    fp8train.synchronize()
    fp8train.reset_reduction_stats()  # before the telemetry takes its baseline
    delayed = isinstance(recipe, fp8train.DelayedScaling)
    async_mode = settings.asynchronous() if delayed else None
    tensor_stats = None  # the sampled GEMMs' tensor statistics, on the quant-error steps' schedule
    if fp8 and args.quant_error_every:
        what_if = DEMO_RECIPES["mxfp8" if recipe_kind(recipe) != "mxfp8" else "current"]  # the same tensors
        layers = ",".join(sample_gemms(model))
        tensor_stats = GemmStatistics(model, every=args.quant_error_every, layers=layers, what_if=what_if)
    tel = Telemetry(
        model, run_dir, every=args.log_every, tensorboard=args.tensorboard, run=name, statistics=tensor_stats
    )
    tel.write({
        "kind": "meta", "run": name, "fp8": fp8, "async": async_mode,
        "world_size": world, "device": str(device), "model": cfg.as_dict(), "model_size": args.model_size,
        "steps": len(data), "batch_size": args.batch_size, "seed": args.seed,
        "params": sum(p.numel() for p in model.parameters()), "recipe": repr(recipe),
        "recipe_kind": recipe_kind(recipe) if fp8 else None, "data": args.data,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
    })  # fmt: skip
    measured = _quant_error_steps(len(data), args.quant_error_every) if fp8 else set()
    tap = TensorTap(model, sample_gemms(model)) if measured else None
    if fp8:  # which layers run in FP8 (docs/telemetry.md)
        tel.write_coverage(recipe)
    tokens_per_step = world * data.shape[1] * (data.shape[2] - 1)
    bar = _progress(name, len(data), rank)
    losses, step_times, errors = [], [], []
    start = time.perf_counter()
    for step in range(len(data)):
        scales = None
        if step in measured:  # before the step's forward: the scales delayed scaling casts with
            scales = {n: DelayedScales.read(m) for n, m in tap.modules.items()} if delayed else None
            tap.arm()
        t0 = time.perf_counter()
        global_loss = trainer.step(step, data[step])
        step_s = time.perf_counter() - t0
        experts = _tokens_per_expert(trainer.model)  # MoE blocks (--model moe): this rank's routing
        record = tel.log_step(
            step, loss=global_loss, tokens_per_s=tokens_per_step / step_s, step_s=step_s, **experts
        )
        if step in measured:
            errors.append(_quant_error_record(name, step, recipe, tap.disarm(), scales))
            tel.write(errors[-1])
        losses.append(global_loss)
        step_times.append(step_s)
        if bar is not None:
            wait_ms = 1e3 * record["reduction_delta"]["exposed_wait_s"] if record else float("nan")
            bar.set_postfix_str(
                f"loss {global_loss:.3f}  {tokens_per_step / step_s:,.0f} tok/s  amax wait {wait_ms:.3f} ms"
            )
            bar.update(1)
    if tap is not None:
        tap.remove()
    tel.flush()  # the last step's record (records are completed one logged step late)
    fp8train.synchronize()
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    stats = fp8train.reduction_stats()
    all_stats = [stats]
    if world > 1:
        all_stats = [None] * world
        dist.all_gather_object(all_stats, stats)
    tail = max(1, len(losses) // 10)
    median_step = statistics.median(step_times)
    result = {
        "kind": "phase_end",
        "run": name,
        "fp8": fp8,
        "recipe_kind": recipe_kind(recipe) if fp8 else None,
        "async": async_mode,
        "steps": len(losses),
        "final_loss": sum(losses[-tail:]) / tail,
        "last_loss": losses[-1],
        "losses": losses,
        "wall_s": wall,
        "median_step_s": median_step,
        "tokens_per_s": tokens_per_step / median_step,
        "reduction_per_rank": all_stats,
        "events": tel.totals,
        "loss_digest": hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:16],
        "fp8_state_digest": fp8_state_digest(model) if delayed else None,
        "quant_error_mean": mean_errors(errors),
    }
    tel.write(result)
    tel.close()
    if world > 1:
        dist.barrier()
    return result


def _quant_error_record(name: str, step: int, recipe: Recipe, captured: dict, scales: Optional[dict]) -> dict:
    """The `quant_error` record of one measured step: relative error per sampled GEMM and role."""
    errors = {
        gemm: quantization_errors(recipe, tensors, scales[gemm] if scales else None)
        for gemm, tensors in captured.items()
    }
    return {"kind": "quant_error", "run": name, "step": step, "recipe": recipe_kind(recipe),
            "rel_error": errors}  # fmt: skip


BF16_RUN = "bf16-autocast"


def timed_pass(
    phases: list[tuple[str, Optional[Recipe], Optional[bool]]],
    cfg: GPTConfig,
    data: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
) -> Optional[dict]:
    """Median step time of each recipe (its first run), the fp32 reference and bf16 autocast, from a
    pass after training that alternates them in blocks of `--timing-block` steps (one untimed block
    each, then `--timing-rounds` rounds; each step's time is its slowest rank's): the training runs
    follow one another, so a change of machine load between them would pass for a difference of
    recipe. Short blocks and many rounds spread every configuration's samples over the whole pass.
    Fresh models, same step as training, no telemetry. None with --timing-rounds 0."""
    if args.timing_rounds == 0:
        return None
    trainers: dict[str, _Trainer] = {}
    kinds = set()
    for name, recipe, async_mode in phases:
        kind = recipe_kind(recipe) if recipe is not None else "fp32"
        if kind in kinds:
            continue  # delayed scaling's second run differs only in the reduction mode
        kinds.add(kind)
        if async_mode is not None:
            os.environ[settings.ENV_ASYNC] = "1" if async_mode else "0"
        trainers[name] = _Trainer(recipe, cfg, args, device, len(data))
    trainers[BF16_RUN] = _Trainer(None, cfg, args, device, len(data), bf16=True)
    counters = dict.fromkeys(trainers, 0)

    def step_of(name: str):
        def fn() -> None:
            i = counters[name] % len(data)
            counters[name] += 1
            trainers[name].step(i, data[i])

        return fn

    times = interleaved_times({n: step_of(n) for n in trainers}, args.timing_rounds, args.timing_block)
    fp8train.synchronize()
    per_rank = [times]
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, times)
    stats = {n: quartiles(v) for n, v in slowest_rank(per_rank).items()}
    return {
        "method": "interleaved",
        "block": args.timing_block,
        "rounds": args.timing_rounds,
        "warmup_blocks": 1,
        "recipe_kind": {
            n: (recipe_kind(t.recipe) if t.fp8 else ("bf16" if t.bf16 else "fp32"))
            for n, t in trainers.items()
        },  # fmt: skip
        "median_ms": {n: 1e3 * q[1] for n, q in stats.items()},
        "quartiles_ms": {n: [1e3 * q[0], 1e3 * q[2]] for n, q in stats.items()},
        "median_ms_per_rank": [{n: 1e3 * statistics.median(v) for n, v in r.items()} for r in per_rank],
    }


PROGRESS_LINES = 10  # lines per phase where stderr is not a terminal (a log file, a pipe)


def _progress(name: str, total: int, rank: int):
    """Rank 0's progress bar: tqdm's on a terminal; elsewhere, where its carriage-return redraws would
    fill a log, a plain line every total / PROGRESS_LINES steps (also without tqdm)."""
    if rank != 0:
        return None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=f"{name:>12}", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        except ImportError:
            pass
    return LineProgress(name, total)


class LineProgress:
    """The part of tqdm's interface the demo uses, printing whole lines: one every `every` steps and
    one at the last step."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.postfix = name, total, 0, ""
        self.every = max(1, math.ceil(total / PROGRESS_LINES))

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done % self.every == 0 or self.done == self.total:
            print(
                f"{self.name:>12}: step {self.done}/{self.total}  {self.postfix}", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        pass


def _tokens_per_expert(model: torch.nn.Module) -> dict:
    """{"tokens_per_expert": {MoE block name: tokens this rank routed to each expert}} of the latest
    forward, or {} for a model without MoE blocks."""
    counts = {n: m.last_tokens_per_expert for n, m in model.named_modules() if isinstance(m, MoE)}
    return {"tokens_per_expert": counts} if counts else {}


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fp8train.tools.demo_worker")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", choices=("gpt", "moe"), default="gpt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--compare-modes", action="store_true")
    p.add_argument("--recipe", choices=(*DEMO_RECIPES, "all"), default="delayed")
    p.add_argument("--data", choices=("text", "markov"), default="text")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--quant-error-every", type=int, default=10)
    p.add_argument("--timing-rounds", type=int, default=10)
    p.add_argument("--timing-block", type=int, default=2)
    return p.parse_args(argv)


def _dataset(args: argparse.Namespace, rank: int) -> tuple[GPTConfig, torch.Tensor, Optional[float], str]:
    """(model config, this rank's [steps, batch, seq_len + 1] tokens, the loss floor if known, source)."""
    cfg = MODEL_SIZES[args.model_size]
    if getattr(args, "model", "gpt") == "moe":
        cfg = dataclasses.replace(cfg, experts=MOE_EXPERTS)
    seed = args.seed * 7919 + 1 + rank
    if args.data == "markov":
        task = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=args.seed)
        data = task.sample(args.steps * args.batch_size, seed=seed)
        data = data.view(args.steps, args.batch_size, cfg.seq_len + 1)
        return cfg, data, task.loss_floor(), f"synthetic Markov language ({cfg.vocab_size} tokens)"
    cfg = dataclasses.replace(cfg, vocab_size=256)
    text = stdlib_text()
    data = text_batches(text, args.steps, args.batch_size, cfg.seq_len, seed)
    return cfg, data, None, f"{TEXT_SOURCE}: {len(text) / 1e6:.1f} MB"


def _phases(args: argparse.Namespace) -> list[tuple[str, Optional[Recipe], Optional[bool]]]:
    """(run name, recipe, async mode to set) for each training run, the reference last."""
    phases = []
    for kind in DEMO_RECIPES if args.recipe == "all" else (args.recipe,):
        recipe = DEMO_RECIPES[kind]
        if kind != "delayed":
            phases.append((f"fp8-{kind}", recipe, None))
            continue
        primary = settings.asynchronous()
        phases.append(("fp8-async" if primary else "fp8-blocking", recipe, primary))
        if args.compare_modes:
            phases.append(("fp8-blocking" if primary else "fp8-async", recipe, not primary))
    if not args.no_reference:
        phases.append(("reference", None, None))
    return phases


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, data, floor, source = _dataset(args, rank)
    run_dir = args.run_dir if rank == 0 else None
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
    results = []
    phases = _phases(args)
    for name, recipe, async_mode in phases:
        if async_mode is not None:
            os.environ[settings.ENV_ASYNC] = "1" if async_mode else "0"
        results.append(train_phase(name, recipe, cfg, data, args, device, run_dir))
    timing = timed_pass(phases, cfg, data, args, device)
    if rank == 0:
        summary = {
            "world_size": world,
            "device": str(device),
            "backend": backend,
            "model_size": args.model_size,
            "params": sum(p.numel() for p in GPT(cfg).parameters()),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "data": source,
            "loss_floor": floor,
            "phases": {r["run"]: {k: v for k, v in r.items() if k != "losses"} for r in results},
            "step_timing": timing,
        }
        if device.type == "cpu":  # the report says why bf16 autocast is slow where the CPU lacks bf16
            native, why = cpu_bf16_instructions()
            summary["cpu_bf16_instructions"] = {"native": native, "why": why}
        with open(os.path.join(args.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measure_telemetry_overhead(
    model_size: str = "small", steps: int = 60, seed: int = 0, block: int = 5
) -> dict:
    """Median step time of the demo model on one process with telemetry off vs on (interleaved blocks
    of `block` steps, `steps` in all, the first block of each untimed).

    Also times `log_step` itself, which does not depend on how noisy the machine is.
    """
    import tempfile

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = MODEL_SIZES[model_size]
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = MarkovTask(cfg.vocab_size, cfg.seq_len, seed).sample(steps * 8, seed + 1).view(steps, 8, -1)
    log_times: list[float] = []
    step = 0

    def train_step() -> torch.Tensor:
        nonlocal step
        with fp8train.fp8_autocast(fp8_recipe=DEMO_RECIPES["delayed"]):
            loss = model.loss(data[step])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        return loss

    with tempfile.TemporaryDirectory() as tmp, Telemetry(model, tmp) as tel:

        def logged() -> None:
            loss = train_step()
            t1 = time.perf_counter()
            tel.log_step(step - 1, loss=loss.item())
            log_times.append(time.perf_counter() - t1)

        if steps < 4 * block:
            raise ValueError(f"the overhead measurement needs at least {4 * block} steps (got {steps})")
        rounds = steps // (2 * block) - 1  # a round: a block of each; one round's worth warms up
        times = medians(interleaved_times({"off": lambda: train_step().item(), "on": logged}, rounds, block))
    off, on = times["off"], times["on"]
    return {
        "model_size": model_size,
        "steps": step,
        "median_step_ms_off": 1e3 * off,
        "median_step_ms_on": 1e3 * on,
        "overhead_pct": 100 * (on - off) / off,
        "median_log_step_ms": 1e3 * statistics.median(log_times),
        "log_step_pct_of_step": 100 * statistics.median(log_times) / off,
    }


if __name__ == "__main__":
    sys.exit(main())
