"""Activation recomputation that replays FP8 forwards with their original scales."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.utils.checkpoint

from .autocast import REGISTRY

__all__ = ["checkpoint"]


@contextlib.contextmanager
def _replaying(region, stack):
    previous = REGISTRY.recompute
    REGISTRY.recompute = (region, stack)
    try:
        yield
    finally:
        REGISTRY.recompute = previous


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`, FP8-aware.

    The recomputed forward uses exactly the scales of the original one, records no amax and
    registers nothing, so gradients equal those of the run without recomputation bit for bit.
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("fp8train.checkpoint supports use_reentrant=False only")
    region, stack = REGISTRY.region, tuple(REGISTRY.stack)

    def context_fn():
        return contextlib.nullcontext(), _replaying(region, stack)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
    )
