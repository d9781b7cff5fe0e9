"""The optimizer step's boundary for per-step amax reduction (`DelayedScaling(amax_reduction="step")`,
docs/design.md, section 14).

Per-step groups MAX-accumulate the amaxes of every region and backward pass of a step locally;
`end_step()` launches each group's forward and backward reduction once (asynchronously by default),
and the next step's first FP8 call waits for it. So a step of M microbatches costs 2 collectives per
group whatever M, and every microbatch of a step uses the same scales.

Every boundary launches every per-step group this rank has trained in, also when the rank trained
nothing in the step (its contribution is then all zeros, neutral for MAX): the collectives of a step
do not depend on its microbatches, so a rank may run none in a step (uneven data).

The boundary is marked by `end_step()` in the loop, or by the optimizer (`end_step_on(optimizer)`):
before the step (so the reductions overlap the optimizer's update), or, when the step is given a
closure (LBFGS, Lightning's automatic optimization), after each call of the closure, which runs the
step's last forward and backward. A missing boundary is detected: a module whose parameters changed
(the optimizer stepped) while its step is still open raises on every rank at its next training call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from ..torch_internals import managed_by_fsdp2, version_counter
from .reduction import StepBoundary
from .settings import settings
from .state import AMAX

__all__ = ["end_step", "end_step_on", "ending_step", "check_step_open", "parameters_loaded"]


def end_step() -> None:
    """Launch the step's amax reductions of every per-step amax group this rank has trained in (with
    zeros where it trained nothing since the last boundary); per-region groups are not affected.
    Collective over each group's ranks, which must all call it at the same point (after the step's
    last backward)."""
    async_op = settings.asynchronous()
    for group in AMAX.step.take():  # in the order they first trained: the same on every rank
        index = group.next_region_index()
        group.fwd.launch_step(async_op, index)
        group.bwd.launch_step(async_op, index)


def ending_step(
    closure: Callable[..., Any], marked_itself: Optional[Callable[[], None]] = None
) -> Callable[..., Any]:
    """`closure` followed by the step boundary (`end_step()`), unless the closure marked one itself
    (then `marked_itself()` is called, if given): for an optimizer step whose closure runs the step's
    last forward and backward."""

    @functools.wraps(closure)
    def closure_then_boundary(*args: Any, **kwargs: Any) -> Any:
        boundaries = AMAX.step.taken
        result = closure(*args, **kwargs)
        if AMAX.step.taken == boundaries:
            end_step()
        elif marked_itself is not None:
            marked_itself()
        return result

    return closure_then_boundary


def _boundary_hook(optimizer, args: tuple, kwargs: dict):
    """The step pre-hook of `end_step_on`: the boundary now, or after the closure if one is given."""
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": ending_step(kwargs["closure"])}
    if len(args) > 1 and args[1] is not None:  # args[0] is the optimizer
        return (args[0], ending_step(args[1]), *args[2:]), kwargs
    end_step()
    return None


def end_step_on(optimizer: torch.optim.Optimizer):
    """Mark the step boundary whenever `optimizer` steps: before the step (the reductions run while
    the optimizer updates the parameters), or after each call of the step's closure when it is given
    one. Returns the hook's handle (`.remove()` undoes it)."""
    return optimizer.register_step_pre_hook(_boundary_hook)


def _versions(module: torch.nn.Module) -> tuple:
    return tuple(version_counter(p) for p in module.parameters(recurse=False) if p.requires_grad)


def check_step_open(module: torch.nn.Module, step: StepBoundary) -> None:
    """A training call of `module` in a per-step group: raise if its parameters changed since its first
    call of the step (the optimizer stepped without `end_step()`: every later step would train with
    the first step's scales). Modules FSDP2 manages refill their gathered parameters between
    microbatches, so for them the boundary is the user's to get right (documented)."""
    if managed_by_fsdp2(module):
        return
    if not step.same_parameters(id(module), _versions(module)):
        raise RuntimeError(
            f"{module.signature}: DelayedScaling(amax_reduction='step') needs the optimizer step's boundary: "
            "its parameters changed (the optimizer stepped) but fp8train.end_step() was not called, so the "
            "amax reductions of the step were never launched. Call fp8train.end_step() after the step's "
            "last backward (or fp8train.end_step_on(optimizer) once)"
        )


def parameters_loaded(module: torch.nn.Module) -> None:
    """`module`'s parameters were loaded from a checkpoint (`load_state_dict`): a change that is not
    an optimizer step, so the open step goes on from the loaded values."""
    AMAX.step.parameters_loaded(id(module))
