"""The optimizer step's boundary for per-step amax reduction (`DelayedScaling(amax_reduction="step")`,
docs/design.md, section 14).

Per-step groups MAX-accumulate the amaxes of every region and backward pass of a step locally;
`end_step()` launches each group's forward and backward reduction once (asynchronously by default),
and the next step's first FP8 call waits for it. So a step of M microbatches costs 2 collectives per
group whatever M, and every microbatch of a step uses the same scales.

The boundary is marked by `end_step()` in the loop, or by the optimizer (`end_step_on(optimizer)`: a
step pre-hook, so the reductions overlap the optimizer step). A missing boundary is detected: a
module whose parameters changed (the optimizer stepped) while its step is still open raises on every
rank at its next training call. A second `end_step()` with nothing trained since does nothing.
"""

from __future__ import annotations

import torch

from .regions import async_amax_reduction
from .registry import REGISTRY

__all__ = ["end_step", "end_step_on", "check_step_open"]


def end_step() -> None:
    """Launch the step's amax reductions of every per-step amax group that trained since the last
    boundary; per-region groups are not affected. Collective over each group's ranks, which must all
    call it at the same point (after the step's last backward)."""
    async_op = async_amax_reduction()
    # in training order; then groups holding amaxes restored from a checkpoint saved mid-step
    restored = [g for g in REGISTRY.groups.values() if g.fwd.accumulated_columns or g.bwd.accumulated_columns]
    groups = list(dict.fromkeys([*REGISTRY.step_groups, *restored]))
    REGISTRY.step_groups.clear()
    REGISTRY.step_parameters.clear()
    for group in groups:
        index = group.next_region_index()
        group.fwd.launch_step(async_op, index)
        group.bwd.launch_step(async_op, index)


def end_step_on(optimizer: torch.optim.Optimizer):
    """Mark the step boundary whenever `optimizer` steps (a step pre-hook: the reductions run while
    the optimizer updates the parameters). Returns the hook's handle (`.remove()` undoes it)."""
    return optimizer.register_step_pre_hook(lambda *_: end_step())


def _versions(module: torch.nn.Module) -> tuple:
    return tuple(p._version for p in module.parameters(recurse=False) if p.requires_grad)


def check_step_open(module: torch.nn.Module) -> None:
    """A training call of `module` in a per-step group: raise if its parameters changed since its first
    call of the step (the optimizer stepped without `end_step()`: every later step would train with
    the first step's scales). Modules FSDP2 manages refill their gathered parameters between
    microbatches, so for them the boundary is the user's to get right (documented)."""
    if type(module).__name__.startswith("FSDP"):
        return
    versions = _versions(module)
    seen = REGISTRY.step_parameters.setdefault(id(module), versions)
    if seen != versions:
        raise RuntimeError(
            f"{module.signature}: DelayedScaling(amax_reduction='step') needs the optimizer step's boundary: "
            "its parameters changed (the optimizer stepped) but fp8train.end_step() was not called, so the "
            "amax reductions of the step were never launched. Call fp8train.end_step() after the step's "
            "last backward (or fp8train.end_step_on(optimizer) once)"
        )
