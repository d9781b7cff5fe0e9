"""GEMM speed on a GPU, measured the way TransformerEngine publishes it, and a real training step.

- `run`: `fp8train bench gpu`, an FP8 Linear forward+backward against bf16 `torch.nn.Linear` at
  square shapes.
- `te_gemm_table`: TransformerEngine's GEMM table (its docs, "low precision training: speedups"):
  the 12 GEMMs of one layer of its 5B model (hidden 4096, FFN 16384) at M = 31 x 512 = 15,872
  tokens, 4 fprop, 4 dgrad and 4 wgrad shapes, each timed as a forward: bf16 `torch.matmul`, an
  fp8train delayed-scaling Linear forward (both operands cast every call, as TE's "autocast" mode
  does) and `torch._scaled_mm` of operands quantized beforehand, fast accumulation off and on. Timed
  TE's way: a leading 4096^2 GEMM hides the launch, 10 warm-ups, 50 back-to-back iterations between
  one pair of CUDA events. TE measured on H200: delayed scaling 1.69x bf16, pre-quantized FP8 1.92x.
- `training_steps`: what users get: an fp8train Linear forward+backward per fprop shape, eager and
  compiled, against bf16 `torch.nn.Linear`, with peak memory.
On the CPU the same code runs at tiny sizes with the host clock (the GPU check's dry run).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch

import fp8train as ft
from fp8train.numerics.gemm import choose_path, has_scaled_mm

from .common import interleaved_medians, train_step

__all__ = ["run", "te_shapes", "time_like_te", "te_gemm_table", "training_steps", "TE_H200", "TE_M"]

TE_M = 31 * 512  # TransformerEngine's GEMM benchmark: 15,872 tokens
TE_HIDDEN, TE_FFN = 4096, 16384
TE_H200 = {"delayed": 1.69, "current": 1.57, "block": 1.41, "pre_quantized": 1.92}  # x bf16, H200 NVL


def run(sizes=(4096, 8192), device: str = "cuda", repeats: int = 20) -> dict:
    """`fp8train bench gpu`: FP8 Linear forward+backward vs bf16 torch.nn.Linear at square shapes."""
    rows = []
    recipe = ft.DelayedScaling(amax_history_len=16)
    for n in sizes:
        torch.manual_seed(0)
        bf16 = torch.nn.Linear(n, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = ft.Linear(n, n, bias=False, device=device, params_dtype=torch.bfloat16)
        x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)

        def backward(y: torch.Tensor) -> None:
            y.backward(torch.ones_like(y))

        fns = {
            "bf16": train_step(bf16, x, recipe, False, backward),
            "fp8": train_step(fp8, x, recipe, True, backward),
        }
        times = interleaved_medians(fns, repeats)
        with torch.no_grad(), ft.fp8_autocast(fp8_recipe=recipe):
            y = fp8(x).double()
        exact = x.detach().double() @ fp8.weight.detach().double().T
        flops = 3 * 2 * n**3  # forward, dgrad, wgrad
        rows.append(
            {
                "n": n,
                "path": choose_path(torch.device(device), n, n, n),
                "bf16_ms": 1e3 * times["bf16"],
                "fp8_ms": 1e3 * times["fp8"],
                "speedup": times["bf16"] / times["fp8"],
                "fp8_tflops": flops / times["fp8"] / 1e12,
                "fp8_rel_error": float((y - exact).norm() / exact.norm()),  # FP8 operands: about 3-4%
            }
        )
    return {"device": device, "rows": rows}


def te_shapes(m: int = TE_M, hidden: int = TE_HIDDEN, ffn: int = TE_FFN) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of the 12 GEMMs of one transformer layer, as TE's table lists them."""
    layers = {
        "qkv": (hidden, 3 * hidden),
        "proj": (hidden, hidden),
        "fc1": (hidden, ffn),
        "fc2": (ffn, hidden),
    }
    shapes = [(f"{name} fprop", m, k, n) for name, (k, n) in layers.items()]
    shapes += [(f"{name} dgrad", m, n, k) for name, (k, n) in layers.items()]
    shapes += [(f"{name} wgrad", k, m, n) for name, (k, n) in layers.items()]
    return shapes


def time_like_te(fn: Callable[[], object], device: torch.device, warmup: int = 10, iters: int = 50) -> float:
    """Milliseconds per call, TE's way: warm-ups, then `iters` calls back to back between one pair of
    CUDA events, behind a leading 4096^2 GEMM that keeps the GPU busy while the first launches queue.
    The host clock on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1e3 * (time.perf_counter() - start) / iters
    lead = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    lead @ lead
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def _pre_quantized(m: int, k: int, n: int, device: torch.device) -> dict[str, Optional[Callable]]:
    """`torch._scaled_mm` of e4m3 operands made beforehand (a row-major, b column-major), bf16 out,
    fast accumulation off and on (None where torch has no such kernel on the device)."""
    labels = {f"scaled_mm_fast_accum_{'on' if fast else 'off'}": fast for fast in (False, True)}
    if not has_scaled_mm(device.type):
        return dict.fromkeys(labels)
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)

    def product(fast: bool) -> Callable:
        return lambda: torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return {label: product(fast) for label, fast in labels.items()}


def te_gemm_table(
    device: torch.device,
    m: int = TE_M,
    hidden: int = TE_HIDDEN,
    ffn: int = TE_FFN,
    warmup: int = 10,
    iters: int = 50,
) -> Iterator[dict]:
    """One row per GEMM of `te_shapes` (yielded as each is measured), then a "layer total" row."""
    recipe = ft.DelayedScaling(amax_history_len=16)
    totals: dict[str, float] = {}
    flops_total = 0
    for name, mm, k, n in te_shapes(m, hidden, ffn):
        torch.manual_seed(0)
        x = torch.randn(mm, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        layer = ft.Linear(k, n, bias=False, device=device, params_dtype=torch.bfloat16)

        def fp8train_forward() -> None:
            with ft.fp8_autocast(fp8_recipe=recipe):
                layer(x)

        fns = {"bf16": lambda: torch.matmul(x, w), "fp8train_delayed": fp8train_forward}
        fns.update(_pre_quantized(mm, k, n, device))
        flops = 2 * mm * k * n
        flops_total += flops
        row: dict = {"gemm": name, "m": mm, "k": k, "n": n, "path": choose_path(device, mm, k, n)}
        with torch.no_grad():
            for label, fn in fns.items():
                ms = None if fn is None else time_like_te(fn, device, warmup, iters)
                row[f"{label}_ms"] = ms
                row[f"{label}_tflops"] = None if ms is None else flops / ms / 1e9
                if ms is not None:
                    totals[label] = totals.get(label, 0.0) + ms
        _add_speedups(row)
        yield row
    total = {"gemm": "layer total (12 GEMMs)", "m": m, "k": hidden, "n": ffn, "path": ""}
    for label, ms in totals.items():
        total[f"{label}_ms"] = ms
        total[f"{label}_tflops"] = flops_total / ms / 1e9
    _add_speedups(total)
    yield total


def _add_speedups(row: dict) -> None:
    bf16 = row.get("bf16_ms")
    for label, te_label in (
        ("fp8train_delayed", "delayed"),
        ("scaled_mm_fast_accum_on", "pre_quantized"),
        ("scaled_mm_fast_accum_off", "pre_quantized"),
    ):
        ms = row.get(f"{label}_ms")
        row[f"{label}_vs_bf16"] = bf16 / ms if bf16 and ms else None
        row[f"{label}_te_h200"] = TE_H200[te_label]


def training_steps(
    device: torch.device,
    m: int = TE_M,
    hidden: int = TE_HIDDEN,
    ffn: int = TE_FFN,
    warmup: int = 3,
    iters: int = 10,
    compile_backend: Optional[str] = "inductor",
) -> Iterator[dict]:
    """A Linear forward+backward per fprop shape of `te_shapes`: bf16 torch.nn.Linear, fp8train eager,
    fp8train compiled (`compile_backend`, None: not compiled); ms, speedups and peak memory."""
    recipe = ft.DelayedScaling(amax_history_len=16)
    for name, mm, k, n in te_shapes(m, hidden, ffn)[:4]:
        torch.manual_seed(0)
        x = torch.randn(mm, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(mm, n, device=device, dtype=torch.bfloat16)
        bf16 = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = ft.Linear(k, n, bias=False, device=device, params_dtype=torch.bfloat16)
        variants = {"bf16": (bf16, False), "fp8train_eager": (fp8, True)}
        if compile_backend is not None:
            variants["fp8train_compiled"] = (torch.compile(fp8, backend=compile_backend), True)
        row: dict = {"layer": name.split()[0], "m": mm, "k": k, "n": n}
        for label, (module, fp8_on) in variants.items():

            def step(module=module, fp8_on=fp8_on) -> None:
                with ft.fp8_autocast(enabled=fp8_on, fp8_recipe=recipe):
                    y = module(x)
                y.backward(grad)
                x.grad = None
                for p in module.parameters():
                    p.grad = None

            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            ms = time_like_te(step, device, warmup, iters)
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = 3 * 2 * mm * k * n / ms / 1e9
            if device.type == "cuda":
                row[f"{label}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        for label in variants:
            if label != "bf16":
                row[f"{label}_vs_bf16"] = row["bf16_ms"] / row[f"{label}_ms"]
        yield row
