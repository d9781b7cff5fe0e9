"""Step time (forward + backward) of an MLP block: FP8 with each recipe (delayed scaling eager and
under torch.compile, current and block scaling) vs fp32 and bf16 torch.nn, and torchao.float8
where installed, on CUDA. All run round-robin in one process. Each configuration's output error
against a float64 copy says what precision it really ran in. Where the CPU has no bf16
instructions, torch's bf16 GEMM is two orders of magnitude slower than fp32 and the bf16 baselines
are left out (`bf16_baselines`)."""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

import fp8train as ft

from ...numerics import cast
from ...numerics.gemm import bf16_kernel
from ..timing import interleaved_times, medians
from .common import interleaved_medians, train_step


def _mlp(linear, hidden: int, ffn: int) -> torch.nn.Module:
    return torch.nn.Sequential(linear(hidden, ffn), torch.nn.GELU(approximate="tanh"), linear(ffn, hidden))


def _torchao(reference: torch.nn.Module):
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    return convert_to_float8_training(copy.deepcopy(reference))


def _without_compiled_cast(fn):
    """`fn` with the eager casts and GEMM outputs as torch ops (FP8TRAIN_FUSED_CAST=0), as before."""

    def step() -> None:
        saved = cast.COMPILED_KERNELS.enabled
        cast.COMPILED_KERNELS.set_enabled(False)
        try:
            fn()
        finally:
            cast.COMPILED_KERNELS.set_enabled(saved)

    return step


def gpt_steps(layers: int = 12, batch: int = 8) -> dict:
    """{"fp32": step, "fp8": step}: one training step (forward, loss, backward) of the demo's tiny GPT
    (hidden 64) with `layers` blocks on `batch` sequences, in fp32 and in FP8 (delayed scaling,
    eager); one model, built here from torch's current random state."""
    from ..models import GPT, MODEL_SIZES

    cfg = dataclasses.replace(MODEL_SIZES["tiny"], layers=layers)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    recipe = ft.DelayedScaling(amax_history_len=16)

    def step(fp8: bool):
        def fn() -> None:
            with ft.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                loss = model.loss(tokens)
            loss.backward()

        return fn

    return {"fp32": step(False), "fp8": step(True)}


def gpt_rows(layers: int = 12, batch: int = 8, repeats: int = 12, threads: int = 1) -> list[dict]:
    """The demo's tiny GPT (hidden 64) with `layers` blocks: fp8 (delayed scaling, eager) vs fp32,
    and fp8 with the casts and GEMM outputs as torch's eager kernels (FP8TRAIN_FUSED_CAST=0), round-
    robin, in thread CPU time at 1 thread (wall time else); where fp8train's per-call costs, not the
    casts' passes, are the FP8 step's; the fp8 row also has its aten calls per GEMM beyond the fp32
    step's (`lean_path.gpt_census`)."""
    from .lean_path import gpt_census

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fns = gpt_steps(layers, batch)
    fns["fp8, torch-op casts and outputs"] = _without_compiled_cast(fns["fp8"])
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = medians(interleaved_times(fns, repeats, warmup_blocks=2, clock=clock))
    census = gpt_census(layers, batch)
    return [
        {"config": f"tiny GPT, {layers} layers: {name}", "ms": 1e3 * t, "vs_fp32": t / times["fp32"],
         "clock": "thread CPU time" if threads == 1 else "wall time",
         "aten_calls_per_gemm_beyond_fp32": census["extra_aten_calls_per_gemm"] if name == "fp8" else None}
        for name, t in times.items()
    ]  # fmt: skip


def run(
    hidden: int = 1024,
    ffn: int = 4096,
    tokens: int = 1024,
    repeats: int = 12,
    device: str = "cpu",
    threads: int = 2,
    compiled: bool = True,
    bf16_baselines: bool = True,
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fp32 = _mlp(torch.nn.Linear, hidden, ffn).to(device)
    fp8 = _mlp(ft.Linear, hidden, ffn).to(device)
    fp8.load_state_dict(fp32.state_dict(), strict=False)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    x_bf16 = x.detach().to(torch.bfloat16).requires_grad_()
    delayed = ft.DelayedScaling(amax_history_len=16)
    # (model, input, recipe or None for no FP8 region); each recipe its own copy (a module keeps one)
    configs = {
        "fp32 torch.nn": (fp32, x, None),
        **({"bf16 torch.nn": (bf16, x_bf16, None)} if bf16_baselines else {}),
        "fp8 fp8train": (fp8, x, delayed),
        "fp8 fp8train, current scaling": (copy.deepcopy(fp8), x, ft.Float8CurrentScaling()),
        "fp8 fp8train, block scaling": (copy.deepcopy(fp8), x, ft.Float8BlockScaling()),
    }
    if compiled:
        compiled_fp8 = torch.compile(copy.deepcopy(fp8), fullgraph=True)
        configs["fp8 fp8train, torch.compile(fullgraph=True)"] = (compiled_fp8, x, delayed)
        if bf16_baselines:
            configs["bf16 torch.nn, torch.compile"] = (torch.compile(copy.deepcopy(bf16)), x_bf16, None)
    peer = _torchao(fp32) if device == "cuda" else None  # on CPU: > 5 min a step (torchao 0.18)
    if peer is not None:
        configs["fp8 torchao.float8 (dynamic)"] = (peer, x, None)

    def backward(y: torch.Tensor) -> None:
        y.float().square().mean().backward()

    configs["fp8 fp8train, torch-op cast (before issue 37)"] = (copy.deepcopy(fp8), x, delayed)
    fns = {
        name: train_step(model, inp, recipe, recipe is not None, backward)
        for name, (model, inp, recipe) in configs.items()
    }
    fns["fp8 fp8train, torch-op cast (before issue 37)"] = _without_compiled_cast(
        fns["fp8 fp8train, torch-op cast (before issue 37)"]
    )
    times = interleaved_medians(fns, repeats)
    with torch.no_grad():
        exact = copy.deepcopy(fp32).double()(x.detach().double())
    fp32_time, eager = times["fp32 torch.nn"], times["fp8 fp8train"]
    bf16_time = times.get("bf16 torch.nn")
    rows = []
    for name, (model, inp, recipe) in configs.items():
        with torch.no_grad(), ft.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = model(inp).double()
        t = times[name]
        error = float((y - exact).norm() / exact.norm())
        rows.append({"config": name, "ms": 1e3 * t, "vs_fp32": t / fp32_time,
                     "vs_bf16": None if bf16_time is None else t / bf16_time, "vs_fp8_eager": t / eager,
                     "output_rel_error": error})  # fmt: skip
    shape = {"hidden": hidden, "ffn": ffn, "tokens": tokens}
    kernel, why = bf16_kernel(torch.device(device))
    return {
        "shape": shape,
        "device": device,
        "threads": threads,
        "bf16_kernel": f"{kernel}: {why}",
        "rows": rows,
    }
