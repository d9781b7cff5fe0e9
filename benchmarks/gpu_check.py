"""What only a CUDA machine can show, as JSON: run by scripts/gpu_check.sh on a GPU, dry-run on CPU.

    python benchmarks/gpu_check.py SECTION [--device cuda|cpu] [--quick] [--out DIR]

Sections (each writes DIR/SECTION.json, with "ok" and the figures, also when a check fails):
- paths: FP8 modules call torch._scaled_mm (counted), and the GEMM path chosen per shape.
- emulation: the same module on CUDA (torch._scaled_mm) and on the CPU emulation (exact products,
  fp32 GEMM): outputs and input gradients within FP8 accumulation tolerance, scales identical.
- syncs: steady training steps with the amax reduction running (a one-rank process group forced to
  reduce, so headers, checks and launches all run) under torch.cuda.set_sync_debug_mode("error"),
  asynchronous and blocking, with telemetry: any host synchronisation raises.
- speed: CUDA-event timings of forward + backward, FP8 vs bf16, for Linear and LayerNormMLP at 4096
  and 8192, and for a small launch-bound model (where host synchronisations would show).
- idle: the share of a steady step's wall time in which the GPU ran no kernel (torch.profiler).
On the CPU (`--device cpu`) the sections run at tiny sizes with host timers and no sync debug mode:
a dry run of the code, which the test suite does (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import fp8train as ft
from fp8train import regions, registry
from fp8train.gemm import choose_path
from fp8train.telemetry import Telemetry

RECIPE = ft.DelayedScaling(amax_history_len=16)
SECTIONS = ("paths", "emulation", "syncs", "speed", "idle")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mlp(hidden: int, ffn: int, device, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        ft.LayerNormLinear(hidden, hidden, device=device, params_dtype=dtype),
        ft.LayerNormMLP(hidden, ffn, device=device, params_dtype=dtype),
        ft.Linear(hidden, hidden, device=device, params_dtype=dtype),
    )


def _step(model, x, fp8: bool = True) -> torch.Tensor:
    with ft.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
        y = model(x)
    loss = y.float().square().mean()
    loss.backward()
    return loss.detach()


# ---- sections ------------------------------------------------------------------------------------------
def paths(device: torch.device, quick: bool) -> dict:
    calls = {"n": 0}
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        n = 64 if quick else 1024
        model = _mlp(n, 2 * n, device)
        _step(model, torch.randn(n, n, device=device, dtype=torch.bfloat16))
    finally:
        torch._scaled_mm = real
    shapes = [(n, n, n), (n, n, 24), (17, n, n)]
    chosen = {f"{m}x{k}x{n_}": choose_path(device, m, k, n_) for m, k, n_ in shapes}
    expected = 4 * 3 if device.type == "cuda" else 0  # 4 GEMMs, forward and two backward each
    return {
        "ok": calls["n"] == expected,
        "scaled_mm_calls": calls["n"],
        "expected": expected,
        "paths": chosen,
    }


def emulation(device: torch.device, quick: bool) -> dict:
    """The same training on `device` (its own path) and on the CPU's fp32 emulation (exact products)."""
    n = 64 if quick else 512
    runs = {}
    for name, where, path in (("device", device, "auto"), ("cpu_emulation", torch.device("cpu"), "fp32")):
        os.environ["FP8TRAIN_GEMM"] = path
        ft.inspection.reset()
        model = _mlp(n, 2 * n, where, dtype=torch.float32)
        x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(1)).to(where).requires_grad_()
        for _ in range(3):  # delayed scaling: the last step casts with scales from the earlier ones
            x.grad = None
            _step(model, x)
        with ft.fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        runs[name] = (
            y.detach().double().cpu(),
            x.grad.double().cpu(),
            [m.fp8_meta["scaling_fwd"].scale.cpu() for m in model],
        )
    os.environ.pop("FP8TRAIN_GEMM")
    (y, grad, scales), (y_ref, grad_ref, scales_ref) = runs["device"], runs["cpu_emulation"]
    out = {
        "y_rel_err": float((y - y_ref).norm() / y_ref.norm()),
        "grad_rel_err": float((grad - grad_ref).norm() / grad_ref.norm()),
        "scales_equal": all(torch.equal(a, b) for a, b in zip(scales, scales_ref)),
    }
    # Both cast alike; they differ by accumulation order, and the amaxes (so the scales) by as much.
    # The CPU dry run compares the bf16 emulation, whose outputs are rounded to bf16: only the code runs.
    tolerance = 1e-3 if device.type == "cuda" else 0.5
    out["ok"] = out["y_rel_err"] < tolerance and out["grad_rel_err"] < 10 * tolerance
    return out


def _force_reduction_on_one_rank(device: torch.device) -> None:
    """A one-rank process group whose amax group reduces anyway: every part of the reduction runs."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    registry._reduces = lambda recipe, process_group: recipe.reduce_amax


def syncs(device: torch.device, quick: bool) -> dict:
    _force_reduction_on_one_rank(device)
    n = 64 if quick else 1024
    out = {"ok": True, "sync_debug_mode": device.type == "cuda"}
    for mode in ("1", "0"):
        os.environ[regions.ENV_ASYNC] = mode
        ft.inspection.reset()
        model = _mlp(n, 2 * n, device)
        tel = Telemetry(model)
        x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        for i in range(3):  # warm-up: modules join, the collective size is settled (host reads allowed)
            tel.log_step(i, loss=_step(model, x))
        _sync(device)
        error = None
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(3, 13):
                tel.log_step(i, loss=_step(model, x))
                for p in model.parameters():
                    p.grad = None
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        stats = ft.reduction_stats()
        name = "async" if mode == "1" else "blocking"
        out[name] = {"steady_steps": 10, "sync_error": error, "launched": stats["launched"]}
        out["ok"] = out["ok"] and error is None and stats["launched"] >= 2 * 13
    os.environ.pop(regions.ENV_ASYNC)
    return out


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn`: CUDA events on the GPU, the host clock on the CPU."""
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def speed(device: torch.device, quick: bool) -> dict:
    rows = []
    sizes = (64,) if quick else (4096, 8192)
    repeats = 3 if quick else 10
    for n in sizes:
        for kind in ("Linear", "LayerNormMLP"):
            torch.manual_seed(0)
            if kind == "Linear":
                fp8 = ft.Linear(n, n, bias=False, device=device, params_dtype=torch.bfloat16)
                ref = torch.nn.Linear(n, n, bias=False, device=device, dtype=torch.bfloat16)
            else:
                fp8 = ft.LayerNormMLP(
                    n, 4 * n if n <= 4096 else 2 * n, device=device, params_dtype=torch.bfloat16
                )
                ref = _reference_mlp(fp8)
            x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
            rows.append({"module": kind, "n": n, **_compare(fp8, ref, x, device, repeats)})
            ft.inspection.reset()
    # launch-bound: small layers, where the host's issue rate (and any synchronisation) sets the pace
    small = _mlp(256, 512, device)
    reference = torch.nn.Sequential(*[_reference(m) for m in small])
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    rows.append(
        {"module": "small launch-bound MLP", "n": 256, **_compare(small, reference, x, device, repeats)}
    )
    return {"ok": True, "timer": "cuda events" if device.type == "cuda" else "host clock", "rows": rows}


def _compare(fp8: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor, device, repeats: int) -> dict:
    fp8_ms = _time(lambda: _step(fp8, x), device, repeats)
    bf16_ms = _time(lambda: _step(reference, x, fp8=False), device, repeats)
    return {"fp8_ms": fp8_ms, "bf16_ms": bf16_ms, "speedup": bf16_ms / fp8_ms}


def _reference(module: torch.nn.Module) -> torch.nn.Module:
    """The same weights as plain bf16 torch modules (for timing only)."""
    if isinstance(module, ft.LayerNormMLP):
        return _reference_mlp(module)
    linear = _copy_linear(module.weight, module.bias)
    if isinstance(module, ft.LayerNormLinear):
        w = module.weight
        return torch.nn.Sequential(torch.nn.LayerNorm(w.shape[1], device=w.device, dtype=w.dtype), linear)
    return linear


def _copy_linear(weight: torch.Tensor, bias) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                            dtype=weight.dtype)  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _reference_mlp(mlp: ft.LayerNormMLP) -> torch.nn.Module:
    w = mlp.fc1_weight
    return torch.nn.Sequential(
        torch.nn.LayerNorm(w.shape[1], device=w.device, dtype=w.dtype),
        _copy_linear(mlp.fc1_weight, mlp.fc1_bias),
        torch.nn.GELU(approximate="tanh"),
        _copy_linear(mlp.fc2_weight, mlp.fc2_bias),
    )


def idle(device: torch.device, quick: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    n = 64 if quick else 2048
    model = _mlp(n, 4 * n, device)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        _step(model, x)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = 5
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(model, x)
            for p in model.parameters():
                p.grad = None
        _sync(device)
        wall_us = 1e6 * (time.perf_counter() - t0)
    if device.type != "cuda":
        return {"ok": True, "note": "no GPU: nothing to measure", "wall_ms_per_step": wall_us / 1e3 / steps}
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"
    )
    busy, end = 0.0, -1.0
    for start, stop in kernels:  # the union of kernel intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = (kernels[-1][1] - kernels[0][0]) if kernels else wall_us
    return {"ok": True, "wall_ms_per_step": wall_us / 1e3 / steps, "gpu_busy_share": busy / span,
            "gpu_idle_share": 1 - busy / span}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    parser.add_argument("--out", default=os.environ.get("GPU_RESULTS", "gpu-results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    try:
        result = globals()[args.section](device, args.quick)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    result.update(section=args.section, device=str(device), seconds=time.perf_counter() - start)
    result.update(torch=torch.__version__, gpu=gpu)
    with open(os.path.join(args.out, f"{args.section}.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in result.items() if k != "error"}, default=str))
    if "error" in result:
        print(result["error"], file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
