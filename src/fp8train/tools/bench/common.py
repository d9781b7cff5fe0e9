"""Small helpers shared by the benchmarks: timing side by side, op and graph counting, saving figures."""

from __future__ import annotations

import collections
import json
import os
import platform
import sys
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


GEMM_OPS = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_mm_v2")


class StepCensus(TorchDispatchMode):
    """What the aten ops inside the `with` block cost, GEMMs apart: `calls` (every op, views included;
    `ops` per name), `gemms`, and `elements`: the sum over the other ops that are neither views nor
    bare allocations of the largest tensor each reads or writes (`by_op` per name). Divided by the
    elements of the operands an FP8 step casts, `elements` is its passes over them (issue 37's count:
    the cast's kernels, the amax, the GEMMs' upcasts and output scaling, and the model's own ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.gemms = 0
        self.elements = 0
        self.ops: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls += 1
        self.ops[name] += 1
        if name in GEMM_OPS:
            self.gemms += 1
        elif not func.is_view and name not in _ALLOCATIONS:
            largest = max((t.numel() for t in _tensors([*args, *(kwargs or {}).values(), out])), default=0)
            self.elements += largest
            self.by_op[name] += largest
        return out


def linear_operand_elements(model: torch.nn.Module, tokens: int) -> int:
    """The elements of the operands an FP8 training step of `model`'s linear layers casts: per layer
    its input (tokens x in), weight (out x in) and output gradient (tokens x out)."""
    return sum(
        tokens * m.in_features + m.out_features * m.in_features + tokens * m.out_features
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    )


class PackageCalls:
    """fp8train's own Python calls inside the `with` block (`sys.setprofile`): the calls of its
    functions and the builtins its code calls (torch's Python and the standard library are not
    counted, nor what they call). `calls` in all, `by_function` per (file, function)."""

    def __init__(self) -> None:
        self.root = os.path.dirname(os.path.abspath(ft.__file__))
        self.calls = 0
        self.by_function: collections.Counter = collections.Counter()

    def _profile(self, frame, event, arg) -> None:
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(self.root):
            self.calls += 1
            name = frame.f_code.co_name if event == "call" else f"{frame.f_code.co_name}->{arg.__name__}"
            self.by_function[(os.path.relpath(frame.f_code.co_filename, self.root), name)] += 1

    def __enter__(self) -> PackageCalls:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)
