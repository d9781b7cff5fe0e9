"""The GPU check's `grouped` section (benchmarks/gpu_check.py): a mixture-of-experts layer's expert GEMMs,
forward and backward, at a DeepSeek-V3-like expert shape (hidden 7168, expert intermediate 2048, 16
local experts, 8192 routed rows with uneven routing: some experts' rows off 16, one expert empty).

Timed (CUDA events, medians): the expert MLP (gate_up: hidden -> 2 x intermediate, SiLU(gate) * up,
down: intermediate -> hidden) in bf16 through torch.nn.functional.grouped_mm (the high-precision
grouped reference), and through fp8train's `ExpertsLinear` in FP8 delayed scaling: Format.E4M3 (all
three GEMMs of each layer in one torch._scaled_grouped_mm each), Format.HYBRID (E5M2 gradients:
forward grouped, backward one torch._scaled_mm per expert), and E4M3 with FP8TRAIN_GROUPED_GEMM=off (one
torch._scaled_mm per expert and role). Checked: the grouped kernel is chosen on compute capability 9.x
and 10.x and called 3 times per layer per step with E4M3 (counted); every output finite; FP8 against
bf16 within FP8's error (relative Frobenius error of the output and the input gradient < 0.15: E5M2
gradients keep 2 mantissa bits); the grouped kernel against one GEMM per expert within 2e-2 (different
kernels accumulate differently, and experts off 16 rows are emulated per expert).

On the CPU (the dry run) the sizes are small and the grouped kernel absent (torch has no CPU kernel):
the same code runs through the emulation, and the section says why the kernel is not chosen.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from gpu_check_probes import env_set, median_seconds

import fp8train as ft
from fp8train.modules import grouped_gemm

__all__ = ["grouped_section"]

FULL = {"hidden": 7168, "inter": 2048, "experts": 16, "rows": 8192, "warmup": 2, "iters": 5}
QUICK = {"hidden": 64, "inter": 32, "experts": 4, "rows": 96, "warmup": 1, "iters": 2}


@contextlib.contextmanager
def _counted() -> Iterator[list]:
    """Counts the grouped kernel's calls made by fp8train (its one binding in grouped_gemm.py)."""
    calls: list = []
    original = grouped_gemm.scaled_grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    grouped_gemm.scaled_grouped_mm = counting
    try:
        yield calls
    finally:
        grouped_gemm.scaled_grouped_mm = original


def _splits(rows: int, experts: int, generator: torch.Generator) -> list[int]:
    """Uneven routing: multinomial counts over experts with skewed weights, expert 1 empty."""
    weights = torch.rand(experts, generator=generator) + 0.2
    weights[1] = 0.0
    picks = torch.multinomial(weights, rows, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=experts).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grouped_section(device: torch.device, quick: bool, progress: Callable[[dict], None]) -> dict:
    sizes = QUICK if quick else FULL
    hidden, inter, experts_n, rows = sizes["hidden"], sizes["inter"], sizes["experts"], sizes["rows"]
    gen = torch.Generator().manual_seed(0)
    splits = _splits(rows, experts_n, gen)
    offs = torch.tensor(splits, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    bf16 = dict(dtype=torch.bfloat16, device=device)

    def experts():
        """The two expert layers, the same weights each time (one pair per recipe: a module trains
        under one recipe)."""
        torch.manual_seed(0)
        first = ft.ExpertsLinear(experts_n, hidden, 2 * inter, params_dtype=torch.bfloat16, device=device)
        second = ft.ExpertsLinear(experts_n, inter, hidden, params_dtype=torch.bfloat16, device=device)
        return first, second

    x = torch.randn(rows, hidden, **bf16)
    grad = torch.randn(rows, hidden, **bf16)
    native, why = grouped_gemm.grouped_kernel_choice(device)
    out: dict = {
        "shape": {**sizes, "splits": splits},
        "grouped_kernel_chosen": native,
        "why": why,
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
    }

    def mlp(first, second, inp):
        h = first(inp)
        gate, up = h.chunk(2, dim=-1)
        return second(F.silu(gate) * up)

    def bf16_step(layers, keep: dict):
        inp = x.detach().requires_grad_()
        w1 = layers[0].weight.transpose(-2, -1)  # (E, hidden, 2 inter), column-major as grouped_mm wants
        w2 = layers[1].weight.transpose(-2, -1)
        y = mlp(lambda t: F.grouped_mm(t, w1, offs=offs), lambda t: F.grouped_mm(t, w2, offs=offs), inp)
        y.backward(grad)
        keep.update(y=y.detach(), dx=inp.grad)

    def fp8_step(layers, recipe, keep: dict):
        inp = x.detach().requires_grad_()
        with ft.fp8_autocast(fp8_recipe=recipe):
            y = mlp(lambda t: layers[0](t, offs), lambda t: layers[1](t, offs), inp)
        y.backward(grad)
        keep.update(y=y.detach(), dx=inp.grad)

    def step(layers, recipe, keep: dict) -> None:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        if recipe is None:
            bf16_step(layers, keep)
        else:
            fp8_step(layers, recipe, keep)

    results: dict = {}
    variants = {
        "bf16_grouped_mm": (None, "auto"),
        "fp8_e4m3_grouped": (ft.DelayedScaling(fp8_format=ft.Format.E4M3), "auto"),
        "fp8_hybrid": (ft.DelayedScaling(fp8_format=ft.Format.HYBRID), "auto"),
        "fp8_e4m3_per_expert": (ft.DelayedScaling(fp8_format=ft.Format.E4M3), "off"),
    }
    for name, (recipe, setting) in variants.items():
        keep: dict = {}
        layers = experts()
        with env_set(grouped_gemm.ENV_GROUPED_GEMM, setting), _counted() as calls:
            run = functools.partial(step, layers, recipe, keep)
            ms = 1e3 * median_seconds(run, device, sizes["iters"], sizes["warmup"])
            per_step = len(calls) / (sizes["warmup"] + sizes["iters"])
        del layers
        results[name] = keep
        out[name] = {"ms": ms, "grouped_calls_per_step": per_step}
        progress(out)
    ref = results["bf16_grouped_mm"]
    for name in ("fp8_e4m3_grouped", "fp8_hybrid", "fp8_e4m3_per_expert"):
        out[name]["rel_err_y_vs_bf16"] = _rel(results[name]["y"], ref["y"])
        out[name]["rel_err_dx_vs_bf16"] = _rel(results[name]["dx"], ref["dx"])
    out["grouped_vs_per_expert_rel"] = max(
        _rel(results["fp8_e4m3_grouped"][k], results["fp8_e4m3_per_expert"][k]) for k in ("y", "dx")
    )
    finite = all(bool(torch.isfinite(t).all()) for r in results.values() for t in r.values())
    fp8_close = all(
        out[n][k] < 0.15
        for n in ("fp8_e4m3_grouped", "fp8_hybrid")
        for k in ("rel_err_y_vs_bf16", "rel_err_dx_vs_bf16")
    )
    expected_native = device.type == "cuda" and tuple(out["capability"])[0] in (9, 10)
    calls_ok = (not native) or (
        out["fp8_e4m3_grouped"]["grouped_calls_per_step"] == 6  # 2 layers x (forward, dgrad, wgrad)
        and out["fp8_hybrid"]["grouped_calls_per_step"] == 2  # forward only
        and out["fp8_e4m3_per_expert"]["grouped_calls_per_step"] == 0
    )
    out["ok"] = (
        finite
        and fp8_close
        and calls_ok
        and native == expected_native
        and (out["grouped_vs_per_expert_rel"] < 2e-2)
    )
    bf16_ms = out["bf16_grouped_mm"]["ms"]
    out["figure"] = (
        f"experts {experts_n}x({hidden}->{2 * inter}->{hidden}), {rows} rows, fwd+bwd: bf16 grouped_mm "
        f"{bf16_ms:.2f} ms; FP8 E4M3 grouped {out['fp8_e4m3_grouped']['ms']:.2f} ms "
        f"({bf16_ms / out['fp8_e4m3_grouped']['ms']:.2f}x), HYBRID {out['fp8_hybrid']['ms']:.2f} ms, "
        f"per expert {out['fp8_e4m3_per_expert']['ms']:.2f} ms; grouped kernel "
        f"{'on' if native else 'off: ' + why}"
    )
    return out
