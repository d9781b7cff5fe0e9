"""Small helpers shared by the benchmarks: timing side by side, op counting, saving figures."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train as ft

from ..timing import interleaved_times, medians


def interleaved_medians(
    fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each function, run round-robin so that load noise hits all alike."""
    return medians(interleaved_times(fns, repeats, block=1, warmup_blocks=warmup))


def train_step(
    model: torch.nn.Module, x: torch.Tensor, recipe, fp8: bool, backward: Callable[[torch.Tensor], None]
) -> Callable[[], None]:
    """A timeable forward (in an FP8 region when `fp8`) and `backward(output)`; on CUDA it waits for
    the device, so that the time is the kernels' and not the launches'."""

    def fn() -> None:
        with ft.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            y = model(x)
        backward(y)
        if x.is_cuda:
            torch.cuda.synchronize()

    return fn


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def save(out_dir: str, name: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), **result}, f, indent=2)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
