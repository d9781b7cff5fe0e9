"""Count host reads of tensor values made by fp8train's own code: a CPU proxy for GPU synchronisations.

On a GPU every host read of a device value (`.item()`, `.tolist()`, `bool(t)`, `float(t)`, `.cpu()`,
...) waits for the stream to drain, and a host-to-device copy of host data made on the spot waits
too. On the CPU nothing waits, but the same reads happen in the same code, so counting them is how
the tests check "zero host synchronisations" without a GPU. Tensors that live in host memory by
design (`_fp8train_host_mirror`: the failure flag's host copy, the region tokens) are not counted:
reading them never waits for a device.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

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


def _caller_in_package() -> Optional[str]:
    """'file:line' of the first caller outside torch and this file, if it is fp8train's code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(TORCH_DIR) and path != os.path.abspath(__file__):
            if path.startswith(PACKAGE_DIR):
                return f"{os.path.relpath(path, PACKAGE_DIR)}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


class HostReadCounter(TorchFunctionMode):
    """`with HostReadCounter() as reads:` ... `reads.sites` lists 'what at file:line' for each read."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS and not getattr(args[0], "_fp8train_host_mirror", False):
            site = _caller_in_package()
            if site is not None:
                self.sites.append(f"{func.__name__} at {site}")
        elif func in FACTORIES and kwargs.get("device") is not None:
            site = _caller_in_package()
            if site is not None:
                self.sites.append(f"{func.__name__}(device=...) at {site}")
        return func(*args, **kwargs)
