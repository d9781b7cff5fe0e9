"""Count what fp8train's own code does that would make a GPU host wait: a CPU proxy for synchronisations.

One detector for the tests (tests/device/test_host_syncs.py) and the GPU check (benchmarks/gpu_check.py).
On a GPU the host waits for the stream to drain at every host read of a device value (`.item()`,
`.tolist()`, `bool(t)`, `float(t)`, `.cpu()`, ...) and at every blocking host-to-device copy: a
tensor made from host data on the device, a Python number written into one element of a device
tensor (`t[1] = 5`: torch copies a 0-dim host tensor into it), a host tensor moved onto the device.
On the CPU nothing waits, but the same calls happen in the same code, so counting them is how the
tests check "zero host synchronisations" without a GPU.

What the counter sees:
- reads: the Tensor methods in READS, on tensors on the watched device that are not host-resident by
  design (`_fp8train_host_mirror`: the failure flag's host copy, the region tokens);
- tensors made from host data: every `aten.lift_fresh` (what `torch.tensor`, `torch.as_tensor` of
  Python data and `t[i] = number` dispatch), and `torch.tensor`/`torch.as_tensor` with `device=`;
- a Python number written into an element (`Tensor.__setitem__` with a number and integer indices);
- host tensors moved onto the device (`.to(device)`, `.cuda()`, `copy_`). On the CPU the host and
  the device are one, so the counter tracks which tensors would be on the host on a GPU: those made
  from host data, by a factory without `device=` in the package, the package's module-level tensor
  constants, and whatever is computed from host tensors only. Watching a GPU (the GPU check), it sees
  the real copies from the CPU onto it (`aten.copy_`, `aten._to_copy`), and reads only of its tensors.
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

__all__ = ["HostSyncCounter", "HOST_RESIDENT", "PACKAGE_DIR"]

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
COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)

# The sites that make a tensor from host data on purpose, host-resident by design: (what, file,
# function). Counted apart (`host_resident`), not as synchronisations.
HOST_RESIDENT = {
    # The region token: a CPU int64 scalar each forward call hands its backward node to name its
    # region (it passes through compiled graphs), made once per region (`Region.token`), and for
    # replays and compiled calls at the call (amax/hooks.py), all by `host_scalar`. It stays in host
    # memory, is never copied to a device, and the backward reads it there.
    ("lift_fresh", "runtime/state.py", "host_scalar"),
}

Frame = tuple[str, int, str]  # (file relative to the package or its base name, line, function)


def _package_frames() -> Optional[list[Frame]]:
    """The call stack from the first caller outside torch and this file, if that caller is fp8train's
    code: innermost first, up to and with the first frame outside fp8train and torch."""
    here = os.path.abspath(__file__)
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(TORCH_DIR) and path != here:
            break
        frame = frame.f_back
    if frame is None or not os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE_DIR):
        return None
    frames = []
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        ours = path.startswith(PACKAGE_DIR)
        where = os.path.relpath(path, PACKAGE_DIR) if ours else os.path.basename(path)
        frames.append((where, frame.f_lineno, frame.f_code.co_name))
        if not ours and not path.startswith(TORCH_DIR):
            break
        frame = frame.f_back
    return frames


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
    """Sees every op: tensors made from host data, real host-to-device copies, host residency."""

    def __init__(self, counter: HostSyncCounter) -> None:
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
        if func in COPIES:
            src, dst = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            onto_the_device = dst.device.type == counter.device.type and counter.device.type != "cpu"
            if src.device.type == "cpu" and onto_the_device:
                counter.flag("host-to-device copy")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(counter.is_host(t) for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    counter.note_host(t)
        return out


class _Calls(TorchFunctionMode):
    """Sees the Python-level calls: reads, device factories, element writes and moves."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if func in READS:
            tensor = args[0]
            on_device = isinstance(tensor, torch.Tensor) and tensor.device.type == counter.device.type
            if on_device and not getattr(tensor, "_fp8train_host_mirror", False):
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
                # on the CPU, a would-be host tensor onto the device (a real copy: _HostTensors')
                simulated = source.device.type == target.type == counter.device.type
                if simulated and counter.is_host(source):
                    counter.flag(f"{func.__name__} of a host tensor onto the device")
        out = func(*args, **kwargs)
        if func in HOST_FACTORIES and kwargs.get("device") is None and _package_frames() is not None:
            counter.note_host(out)
        return out


class HostSyncCounter:
    """`with HostSyncCounter(device) as counted:` ... `counted.sites` lists 'what at file:line
    (function)' for each read or host-to-device copy made by the package's code (reads of tensors on
    `device`, the CPU by default); `counted.host_resident` the HOST_RESIDENT sites it saw;
    `counted.report()` each site once, with its count and call stack."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.sites: list[str] = []
        self.host_resident: list[str] = []
        self._stacks: dict[str, list[str]] = {}  # site -> the call stack that first led there
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
        frames = _package_frames()
        if frames is None:
            return
        path, line, function = frames[0]
        site = f"{what} at {path}:{line} ({function})"
        if any(what.startswith(w) and (path, function) == (p, f) for w, p, f in HOST_RESIDENT):
            self.host_resident.append(site)
            return
        self.sites.append(site)
        self._stacks.setdefault(site, [f"{p}:{n} in {f}" for p, n, f in frames])

    def report(self) -> dict[str, dict]:
        """Each site once: {'count': how often, 'traceback': the fp8train call stack, innermost first}."""
        return {
            site: {"count": self.sites.count(site), "traceback": stack}
            for site, stack in self._stacks.items()
        }

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
