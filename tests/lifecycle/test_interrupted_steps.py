"""Interrupted steps in one process: an exception or KeyboardInterrupt inside the FP8 region or the
backward leaves the run as if the step never happened (or as if only its forward ran), and a
checkpoint saved right after resumes exactly."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

import fp8train
from fp8train import DelayedScaling, fp8_autocast, load_checkpoint, save_checkpoint
from helpers import fp8_state, rank_batch, train_step

RECIPE = DelayedScaling(amax_history_len=4)


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a failure in the middle of the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exc: type) -> torch.Tensor:
        ctx.exc = exc
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise ctx.exc("injected failure in backward")


class TwoLayer(torch.nn.Module):
    """Linear -> GELU -> (failure point) -> Linear. A backward failure hits after layer 2's FP8 backward
    recorded its grad_output amax and before layer 1's ran: the half-recorded state to get rid of."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = fp8train.Linear(16, 16), fp8train.Linear(16, 16)
        self.fail: Optional[tuple[str, type]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.l1(x))
        if self.fail is not None:
            where, exc = self.fail
            if where == "forward":
                raise exc("injected failure in forward")
            if where == "backward_op":
                h = _RaiseInBackward.apply(h, exc)
            else:  # "backward_hook"

                def hook(grad: torch.Tensor) -> torch.Tensor:
                    raise exc("injected failure in a backward hook")

                h.register_hook(hook)
        return self.l2(h)


def _clean_registry() -> None:
    assert fp8train.inspection.open_regions() == 0, "a failed region stayed on the stack"
    for fwd in (group.fwd for group in fp8train.inspection.amax_groups()):
        assert fwd.recorded_roles == () and not bool(fwd.storage.recording.any()), "stale forward amaxes"


def _train_with_interruption(
    fail_at: Optional[int], where: str, exc: type, steps: int = 6, resume_dir=None
) -> tuple[list[float], list[torch.Tensor]]:
    """Train `steps` steps; at `fail_at` first attempt a step on an extreme batch that fails `where`.

    where="reference_forward_only": instead of failing, run that batch's forward and drop the graph
    (what a backward failure leaves behind, minus the half-run backward). With `resume_dir`, save a
    checkpoint right after the failure and continue with a fresh model and optimizer loaded from it.
    """
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        if step == fail_at:
            bad = rank_batch(7, step, scale=10.0)  # large amaxes: a leak into the next step would show
            if where == "reference_forward_only":
                with fp8_autocast(fp8_recipe=RECIPE):
                    model(bad)
            else:
                model.fail = (where, exc)
                with pytest.raises(exc, match="injected failure"):
                    train_step(model, opt, bad, RECIPE)
                model.fail = None
                opt.zero_grad(set_to_none=True)  # a failed backward may have left partial gradients
            _clean_registry()
            if resume_dir is not None:
                path = os.path.join(resume_dir, "ckpt.pt")
                save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()}, path)
                ckpt = load_checkpoint(path)
                model = TwoLayer()
                model.load_state_dict(ckpt["model"])
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt.load_state_dict(ckpt["opt"])
        losses.append(train_step(model, opt, rank_batch(0, step), RECIPE))
    return losses, [p.detach().clone() for p in model.parameters()] + fp8_state(model)


def _assert_same_run(a, b) -> None:
    assert a[0] == b[0], "losses differ"
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "state differs"


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_inside_fp8_region_is_as_if_the_step_never_happened(exc: type) -> None:
    reference = _train_with_interruption(None, "", exc)
    _assert_same_run(_train_with_interruption(2, "forward", exc), reference)


@pytest.mark.parametrize("where,exc", [("backward_op", RuntimeError), ("backward_hook", KeyboardInterrupt)])
def test_failure_inside_backward_leaks_no_amax_into_the_next_step(where: str, exc: type) -> None:
    """The failed step's forward completed (its amaxes were reduced, as on every rank), its backward
    did not: the run must equal one where that forward ran and no backward followed."""
    reference = _train_with_interruption(2, "reference_forward_only", exc)
    _assert_same_run(_train_with_interruption(2, where, exc), reference)


def test_checkpoint_saved_after_interrupted_backward_resumes_exactly(tmp_path) -> None:
    reference = _train_with_interruption(2, "reference_forward_only", KeyboardInterrupt)
    resumed = _train_with_interruption(2, "backward_hook", KeyboardInterrupt, resume_dir=str(tmp_path))
    _assert_same_run(resumed, reference)
