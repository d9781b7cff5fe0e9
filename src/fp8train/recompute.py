"""Activation recomputation that replays FP8 forwards with their original scales.

`fp8train.checkpoint` is *activation checkpointing* (TransformerEngine's name, after
`torch.utils.checkpoint`): it saves no file. Checkpoint files are `fp8train.save_checkpoint` /
`load_checkpoint` (checkpoint_files.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.checkpoint

from .runtime import recomputation_context_fn

__all__ = ["checkpoint"]


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
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=recomputation_context_fn(), **kwargs
    )
