"""Eager FP8 casts: kernels, passes, temporaries and ms per cast of `fp8train.numerics.cast` beside the
unfused cast it replaced (kept below as it was, for these figures only), and the FP8 MLP step (delayed
scaling) with either cast against bf16 torch.nn. All side by side in one process, round-robin."""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch

import fp8train as ft

from ...numerics import cast
from ...numerics.formats import fp8_dtype, fp8_max
from ...quantization import per_tensor
from ..timing import interleaved_times, medians
from . import lean_path
from .common import PassCounter, train_step
from .step_time import _mlp

_FORMATS = {"e4m3": (3, -6), "e5m2": (2, -14)}


def unfused_cast_operand(
    x: torch.Tensor, scale: torch.Tensor, encoding: str, dtype: torch.dtype
) -> torch.Tensor:
    """The cast before fusion (fp8train 0.x up to this benchmark's commit): an upcast copy, the
    product, abs, saturation, the rounding's five passes on a second temporary, copysign and a copy:
    9 to 11 passes, two or three temporaries the size of the operand."""
    limit = fp8_max(encoding)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.to(torch.float32) * scale).clamp_(-limit, limit).to(fp8_dtype(encoding))
    magnitude = (x.to(torch.float32) * scale).abs_().clamp_(max=limit)
    mantissa_bits, min_exponent = _FORMATS[encoding]
    k = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)
    k.clamp_(min=2.0**min_exponent).mul_(1.5 * 2.0 ** (23 - mantissa_bits))
    return magnitude.add_(k).sub_(k).copysign_(x).to(dtype)


CASTS = {"unfused": unfused_cast_operand, "fused": cast.cast_operand}


@contextmanager
def _per_tensor_cast(impl):
    """Delayed and current scaling cast through `per_tensor.cast_with_amax` (the seam): `impl` (a cast
    of `cast_operand`'s signature, the amax one pass more) instead, for a while; None: the seam."""
    if impl is None:
        yield
        return

    def seam(x, scale, encoding, dtype, *, transposed, amax_out):
        if amax_out is not None:
            torch.maximum(amax_out, cast.amax(x), out=amax_out)
        values = impl(x, scale, encoding, dtype)
        return values, (values.t().contiguous() if transposed else None)

    saved = per_tensor.cast_with_amax
    per_tensor.cast_with_amax = seam
    try:
        yield
    finally:
        per_tensor.cast_with_amax = saved


def _cast_rows(shapes, repeats: int) -> list[dict]:
    rows = []
    scale = torch.tensor(7.0)
    for shape in shapes:
        for x_dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape) * 3).to(x_dtype)
            for target in (torch.bfloat16, torch.float8_e4m3fn):
                fns = {name: (lambda f: lambda: f(x, scale, "e4m3", target))(f) for name, f in CASTS.items()}
                out = {name: fn() for name, fn in fns.items()}
                assert torch.equal(out["fused"].view(torch.uint8), out["unfused"].view(torch.uint8))
                census = {}
                for name, fn in fns.items():
                    with PassCounter() as counter:
                        result = fn()
                    census[name] = (counter.kernels, counter.largest_temporary(result) * 4 / 2**20)
                times = medians(interleaved_times(fns, repeats, warmup_blocks=2, clock=_clock()))
                rows.append({
                    "shape": "x".join(map(str, shape)), "x": str(x_dtype)[6:], "to": str(target)[6:],
                    "unfused_ms": 1e3 * times["unfused"], "fused_ms": 1e3 * times["fused"],
                    "speedup": times["unfused"] / times["fused"],
                    "unfused_kernels": census["unfused"][0], "fused_kernels": census["fused"][0],
                    "unfused_temp_MiB": census["unfused"][1], "fused_temp_MiB": census["fused"][1],
                })  # fmt: skip
    return rows


def _step_rows(hidden: int, ffn: int, tokens: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    fp32 = _mlp(torch.nn.Linear, hidden, ffn)
    fp8 = _mlp(ft.Linear, hidden, ffn)
    fp8.load_state_dict(fp32.state_dict(), strict=False)
    bf16 = fp32.to(torch.bfloat16)
    x = torch.randn(tokens, hidden, requires_grad=True)
    x_bf16 = x.detach().bfloat16().requires_grad_()
    recipe = ft.DelayedScaling(amax_history_len=16)

    def backward(y: torch.Tensor) -> None:
        y.float().square().mean().backward()

    def step_with(impl):
        step = train_step(copy.deepcopy(fp8), x, recipe, True, backward)

        def fn() -> None:
            with _per_tensor_cast(impl):
                step()

        return fn

    fns = {"bf16 torch.nn": train_step(bf16, x_bf16, None, False, backward)}
    fns.update({f"fp8 fp8train, {name} cast": step_with(impl) for name, impl in CASTS.items()})
    fns["fp8 fp8train, compiled cast (cast_with_amax)"] = step_with(None)
    times = medians(interleaved_times(fns, repeats, warmup_blocks=2, clock=_clock()))
    unfused = times["fp8 fp8train, unfused cast"]
    return [
        {"config": name, "ms": 1e3 * t, "vs_bf16": t / times["bf16 torch.nn"], "vs_unfused": t / unfused}
        for name, t in times.items()
    ]


def _clock():
    """One thread: its CPU time, which a loaded machine's other jobs do not inflate; else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def run(
    shapes=((1024, 1024), (4096, 1024), (4096, 4096)), step=(1024, 4096, 1024), repeats=12, threads=1
) -> dict:
    torch.set_num_threads(threads)
    return {
        "threads": threads,
        "clock": "thread CPU time" if threads == 1 else "wall time",
        "cpu": _cpu_model(),
        "rows": _cast_rows(shapes, repeats),
        "step_shape": dict(zip(("hidden", "ffn", "tokens"), step)),
        "step": _step_rows(*step, repeats),
        "census": _census_rows(step),
    }


def _census_rows(step) -> list[dict]:
    """lean_path's counts of the MLP step with the compiled cast and output (the default) and without
    (FP8TRAIN_FUSED_CAST=0: torch's eager kernels)."""
    hidden, ffn, tokens = step
    saved = cast.COMPILED_KERNELS.enabled
    results = {}
    try:
        for name, on in (("compiled cast and output", True), ("torch ops (FP8TRAIN_FUSED_CAST=0)", False)):
            cast.COMPILED_KERNELS.set_enabled(on)
            results[name] = lean_path.rows(lean_path.census((hidden, ffn, hidden), tokens, warmup=1))
    finally:
        cast.COMPILED_KERNELS.set_enabled(saved)
    names = list(results)
    return [
        {"count": row["count"], **{name: results[name][i]["value"] for name in names}}
        for i, row in enumerate(results[names[0]])
    ]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"
