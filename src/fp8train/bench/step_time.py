"""Step time (forward + backward) of an MLP block: FP8 (eager and torch.compile) vs fp32 and bf16
torch.nn, and torchao.float8 where installed. All run round-robin in one process."""

from __future__ import annotations

import copy

import torch

import fp8train as ft

from .common import interleaved_medians, train_step


def _mlp(linear, hidden: int, ffn: int) -> torch.nn.Module:
    return torch.nn.Sequential(linear(hidden, ffn), torch.nn.GELU(approximate="tanh"), linear(ffn, hidden))


def _torchao(reference: torch.nn.Module):
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    return convert_to_float8_training(copy.deepcopy(reference))


def run(
    hidden: int = 1024,
    ffn: int = 4096,
    tokens: int = 1024,
    repeats: int = 12,
    device: str = "cpu",
    threads: int = 2,
    compiled: bool = True,
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fp32 = _mlp(torch.nn.Linear, hidden, ffn).to(device)
    fp8 = _mlp(ft.Linear, hidden, ffn).to(device)
    fp8.load_state_dict(fp32.state_dict(), strict=False)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    x_bf16 = x.detach().to(torch.bfloat16).requires_grad_()
    recipe = ft.DelayedScaling(amax_history_len=16)

    def step(model, inp, fp8_region=False):
        return train_step(model, inp, recipe, fp8_region, lambda y: y.float().square().mean().backward())

    fns = {
        "fp32 torch.nn": step(fp32, x),
        "bf16 torch.nn": step(bf16, x_bf16),
        "fp8 fp8train": step(fp8, x, fp8_region=True),
    }
    if compiled:
        fns["fp8 fp8train, torch.compile(fullgraph=True)"] = step(
            torch.compile(copy.deepcopy(fp8), fullgraph=True), x, fp8_region=True
        )
        fns["bf16 torch.nn, torch.compile"] = step(torch.compile(copy.deepcopy(bf16)), x_bf16)
    peer = _torchao(fp32)
    if peer is not None:
        fns["fp8 torchao.float8 (dynamic)"] = step(peer, x)
    times = interleaved_medians(fns, repeats)
    bf16_time, eager = times["bf16 torch.nn"], times["fp8 fp8train"]
    rows = [
        {"config": name, "ms": 1e3 * t, "vs_bf16": t / bf16_time, "vs_fp8_eager": t / eager}
        for name, t in times.items()
    ]
    shape = {"hidden": hidden, "ffn": ffn, "tokens": tokens}
    return {"shape": shape, "device": device, "threads": threads, "rows": rows}
