"""FP8 Linear forward+backward vs bf16 torch.nn.Linear at large square shapes (torch._scaled_mm)."""

from __future__ import annotations

import torch

import fp8train as ft
from fp8train.gemm import choose_path

from .common import interleaved_medians, train_step


def run(sizes=(4096, 8192), device: str = "cuda", repeats: int = 20) -> dict:
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
