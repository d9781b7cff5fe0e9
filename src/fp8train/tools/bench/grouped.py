"""Grouped expert GEMMs: a training step (forward and backward) of `fp8train.GroupedLinear` under delayed
scaling beside a loop of `fp8train.Linear` (its definition: the same GEMMs, one module per expert), a
loop of high-precision `torch.nn.functional.linear` and torch's bf16 grouped GEMM
(`torch.nn.functional.grouped_mm`, where it runs on the device). Round-robin in one process; the CPU and
the instructions torch's kernels use on it (`torch.backends.cpu.get_cpu_capability()`) are named."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

import fp8train as ft

from .cast_passes import _cpu_model
from .common import interleaved_medians


def _steps(experts: int, k: int, n: int, splits: list[int], device: str) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    grouped = ft.GroupedLinear(experts, k, n, bias=False, device=device)
    linears = [ft.Linear(k, n, bias=False, device=device) for _ in range(experts)]
    weights = torch.stack([w.detach() for w in grouped.gemm_weights()]).requires_grad_()
    x = torch.randn(sum(splits), k, device=device)
    recipe = ft.DelayedScaling()
    offs = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)

    def fp8_grouped() -> None:
        with ft.fp8_autocast(fp8_recipe=recipe):
            y = grouped(x, splits)
        y.sum().backward()

    def fp8_linear_loop() -> None:
        with ft.fp8_autocast(fp8_recipe=recipe):
            y = torch.cat([lin(part) for lin, part in zip(linears, x.split(splits))])
        y.sum().backward()

    def fp32_loop() -> None:
        y = torch.cat([F.linear(part, w) for part, w in zip(x.split(splits), weights)])
        y.sum().backward()

    steps = {"fp8_grouped": fp8_grouped, "fp8_linear_loop": fp8_linear_loop, "fp32_linear_loop": fp32_loop}
    w16, x16 = weights.detach().bfloat16().requires_grad_(), x.bfloat16()
    try:  # bf16 grouped GEMM: CUDA SM80+, and a CPU fallback in recent torch
        F.grouped_mm(x16, w16.transpose(-2, -1), offs=offs).sum().backward()

        def bf16_grouped_mm() -> None:
            F.grouped_mm(x16, w16.transpose(-2, -1), offs=offs).sum().backward()

        steps["bf16_grouped_mm"] = bf16_grouped_mm
    except (RuntimeError, NotImplementedError, AttributeError):
        pass
    return steps


def run(
    shapes=((8, 512, 1024, 2048), (64, 256, 512, 4096)),
    repeats: int = 10,
    threads: int = 1,
    device: str = "cpu",
) -> dict:
    """`shapes`: (experts, in_features, out_features, tokens); tokens spread evenly but for one empty
    expert and one with twice its share (uneven routing)."""
    torch.set_num_threads(threads)
    rows = []
    for experts, k, n, tokens in shapes:
        share = tokens // experts
        splits = [share] * experts
        splits[0], splits[-1] = 0, share * 2 + tokens - share * experts  # one empty, one busy expert
        times = interleaved_medians(_steps(experts, k, n, splits, device), repeats)
        flops = 3 * 2 * tokens * k * n  # forward, dgrad, wgrad
        for name, seconds in times.items():
            rows.append({
                "experts": experts, "in": k, "out": n, "tokens": tokens, "variant": name,
                "ms": 1e3 * seconds, "gflops": flops / seconds / 1e9,
                "vs_fp8_linear_loop": times["fp8_linear_loop"] / seconds,
            })  # fmt: skip
    return {
        "threads": threads,
        "device": device,
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "rows": rows,
    }
