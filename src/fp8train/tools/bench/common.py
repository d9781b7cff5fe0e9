"""Small helpers shared by the benchmarks: timing side by side, op and graph counting, saving figures."""

from __future__ import annotations

import collections
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
    """Counts aten ops dispatched inside the `with` block: `count` in all, `ops` per overload packet
    ('aten._scaled_mm')."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class GraphCounter:
    """A torch.compile backend that counts the graphs dynamo gives it and runs them with `backend`
    (the tests' and the GPU check's recompile counter)."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


_ALLOCATIONS = ("empty", "empty_like", "empty_strided")


class PassCounter(TorchDispatchMode):
    """What the aten ops inside the `with` block cost in memory: `kernels`, the ops that are neither
    views nor bare allocations (one kernel each on CUDA); `elements`, the sum over kernels of the
    largest tensor each reads or writes (divided by an operand's numel: the passes over it); and the
    tensors ops created (functional ops' outputs), for `largest_temporary`."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.elements = 0
        self._fresh: list[tuple[int, int]] = []  # (data_ptr, numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        results = _tensors([out])
        if not func._schema.is_mutable:
            self._fresh += [(t.data_ptr(), t.numel()) for t in results]
        if func.overloadpacket.__name__ not in _ALLOCATIONS:
            tensors = _tensors([*args, *(kwargs or {}).values()])
            self.kernels += 1
            self.elements += max(t.numel() for t in tensors + results)
        return out

    def largest_temporary(self, result: torch.Tensor) -> int:
        """The most elements of a tensor the block created other than `result`'s storage."""
        return max((n for ptr, n in self._fresh if ptr != result.data_ptr()), default=0)


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _tensors(v)
    return found


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
