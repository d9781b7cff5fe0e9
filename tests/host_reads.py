"""Count what fp8train's own code does that would make a GPU host wait: a CPU proxy for synchronisations.

On a GPU the host waits for the stream to drain at every host read of a device value (`.item()`,
`.tolist()`, `bool(t)`, `float(t)`, `.cpu()`, ...) and at every blocking host-to-device copy: a
tensor made from host data on the device, a Python number written into one element of a device
tensor (`t[1] = 5`: torch copies a 0-dim host tensor into it), a host tensor moved onto the device.
On the CPU nothing waits, but the same calls happen in the same code, so counting them is how the
tests check "zero host synchronisations" without a GPU.

What the counter sees:
- reads: the Tensor methods in READS, on tensors that are not host-resident by design
  (`_fp8train_host_mirror`: the failure flag's host copy, the region tokens);
- tensors made from host data: every `aten.lift_fresh` (what `torch.tensor`, `torch.as_tensor` of
  Python data and `t[i] = number` dispatch), and `torch.tensor`/`torch.as_tensor` with `device=`;
- a Python number written into an element (`Tensor.__setitem__` with a number and integer indices);
- host tensors moved onto the device (`.to(device)`, `.cuda()`, `copy_`). On the CPU the host and
  the device are one, so the counter tracks which tensors would be on the host on a GPU: those made
  from host data, by a factory without `device=` in the package, the package's module-level tensor
  constants, and whatever is computed from host tensors only. On a GPU it also sees real CPU-to-device
  copies.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fp8train

__all__ = ["HostReadCounter"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(fp8train.__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
FACTORIES = {torch.tensor, torch.as_tensor}  # host data copied to `device=` on the spot
HOST_FACTORIES = {  # without `device=`, these make a tensor in host memory
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}

# The sites that make a tensor from host data on purpose, host-resident by design: (what, file,
# function). Counted apart (`host_resident`), not as synchronisations.
HOST_RESIDENT = {
    # The region token: a CPU int64 scalar each forward call hands its backward node to name its
    # region (it passes through compiled graphs). It stays in host memory, is never copied to a
    # device, and the backward reads it there.
    ("lift_fresh", "amax/calls.py", "_forward_scales"),
}


def _caller_in_package() -> Optional[tuple[str, int, str]]:
    """(file, line, function) of the first caller outside torch and this file, if it is fp8train's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(TORCH_DIR) and path != os.path.abspath(__file__):
            if path.startswith(PACKAGE_DIR):
                return os.path.relpath(path, PACKAGE_DIR), frame.f_lineno, frame.f_code.co_name
            return None
        frame = frame.f_back
    return None


def _is_element_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, int) for i in items)


def _target_device(func, args, kwargs) -> Optional[torch.device]:
    """The device a `.to`/`.cuda`/`copy_` call writes to (None: a dtype change only)."""
    if func is torch.Tensor.copy_:
        return args[0].device
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    for value in (kwargs.get("device"), *args[1:]):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (torch.device, str)) or (isinstance(value, int) and not isinstance(value, bool)):
            return torch.device(value)
    return None


class _HostTensors(TorchDispatchMode):
    """Sees every op: notes tensors made from host data and propagates host residency."""

    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = self.counter
        if func is torch.ops.aten.lift_fresh.default:
            counter.note_host(out)
            counter.flag("lift_fresh (a tensor from host data)")
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(counter.is_host(t) for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    counter.note_host(t)
        return out


class _Calls(TorchFunctionMode):
    """Sees the Python-level calls: reads, device factories, element writes and moves."""

    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if func in READS and not getattr(args[0], "_fp8train_host_mirror", False):
            counter.flag(func.__name__)
        elif func in FACTORIES and kwargs.get("device") is not None:
            counter.flag(f"{func.__name__}(device=...)")
        elif (
            func is torch.Tensor.__setitem__
            and isinstance(args[2], (int, float))
            and _is_element_index(args[1])
        ):
            counter.flag("__setitem__ of a Python number into one element")
        elif func in MOVES:
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            target = _target_device(func, args, kwargs)
            into_host = func is torch.Tensor.copy_ and counter.is_host(args[0])
            if target is not None and isinstance(source, torch.Tensor) and not into_host:
                if counter.is_host(source) or (source.device.type == "cpu" and target.type != "cpu"):
                    counter.flag(f"{func.__name__} of a host tensor onto the device")
        out = func(*args, **kwargs)
        if func in HOST_FACTORIES and kwargs.get("device") is None and _caller_in_package() is not None:
            counter.note_host(out)
        return out


class HostReadCounter:
    """`with HostReadCounter() as reads:` ... `reads.sites` lists 'what at file:line (function)' for each
    read or host-to-device copy made by the package's code; `reads.host_resident` the HOST_RESIDENT
    sites it saw."""

    def __init__(self) -> None:
        self.sites: list[str] = []
        self.host_resident: list[str] = []
        self._host: dict[int, weakref.ref] = {}  # id -> tensor that lives on the host on a GPU
        for name, module in list(sys.modules.items()):
            if name == "fp8train" or name.startswith("fp8train."):
                for value in vars(module).values():
                    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                        self.note_host(value)  # constants made at import: host memory
        self._modes = (_Calls(self), _HostTensors(self))

    def note_host(self, tensor: torch.Tensor) -> None:
        self._host[id(tensor)] = weakref.ref(tensor)

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return (ref is not None and ref() is tensor) or getattr(tensor, "_fp8train_host_mirror", False)

    def flag(self, what: str) -> None:
        site = _caller_in_package()
        if site is not None:
            path, line, function = site
            allowed = any(what.startswith(w) and (path, function) == (p, f) for w, p, f in HOST_RESIDENT)
            (self.host_resident if allowed else self.sites).append(f"{what} at {path}:{line} ({function})")

    def __enter__(self) -> HostReadCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
