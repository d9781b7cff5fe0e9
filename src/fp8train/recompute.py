"""Activation recomputation that replays FP8 forwards with their original scales.

`fp8train.checkpoint` is *activation checkpointing* (TransformerEngine's name, after
`torch.utils.checkpoint`): it saves no file. Checkpoint files are `fp8train.save_checkpoint` /
`load_checkpoint` (checkpoint_files.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.utils.checkpoint

from .amax import REGISTRY, RegionSettings

__all__ = ["checkpoint", "CallRecord"]


class CallRecord:
    """One fp8train.checkpoint call: the regions active at the call and each FP8 module's plans in order.

    The plans are noted during the original forward; every recomputation replays them from the
    start, so a recomputation (or a second one, with retain_graph) uses exactly the original scales.
    """

    def __init__(self, stack: tuple[RegionSettings, ...]) -> None:
        self.stack = stack
        self.plans: dict[int, list] = {}
        self.cursor: dict[int, int] = {}

    def add(self, module_id: int, plan) -> None:
        self.plans.setdefault(module_id, []).append(plan)

    def next(self, module_id: int) -> Optional[Any]:
        """The plan of this module's next call in the original forward, or None if it ran no more."""
        index = self.cursor.get(module_id, 0)
        plans = self.plans.get(module_id, [])
        if index >= len(plans):
            return None
        self.cursor[module_id] = index + 1
        return plans[index]


class _Replaying:
    """Context of every recomputation of one checkpoint call (torch enters it again for each one, e.g.
    with retain_graph): replay under the regions that were active at the original call."""

    def __init__(self, call: CallRecord) -> None:
        self.call = call
        self.active: list = []

    def __enter__(self) -> None:
        replaying = REGISTRY.replaying(self.call, list(self.call.stack))
        replaying.__enter__()
        self.active.append(replaying)
        self.call.cursor = {}

    def __exit__(self, *exc) -> None:
        self.active.pop().__exit__(*exc)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Activation recomputation (not a file: see `save_checkpoint`):
    `torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`, FP8-aware.

    The recomputed forward uses exactly the scales of the original one, records no amax and
    registers nothing, so gradients equal those of the run without recomputation bit for bit. It
    works for several regions whose backwards are pending (pipeline style) and for nested calls.
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("fp8train.checkpoint supports use_reentrant=False only")
    if "context_fn" in kwargs:
        raise ValueError("fp8train.checkpoint sets its own context_fn; it cannot take another")
    if torch.compiler.is_compiling():
        # A compiled graph recomputes inside the graph (AOTAutograd), without running this module's
        # Python again: the protocol's ops are not replayed, and there is nothing to note.
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    call = CallRecord(tuple(REGISTRY.stack))

    def context_fn():
        return REGISTRY.noting(call), _Replaying(call)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
    )
