"""PyTorch Lightning: `Trainer(..., plugins=[FP8Precision()])` trains the LightningModule in FP8.

A precision plugin is Lightning's place for this: the strategy calls `convert_module` once on the
LightningModule before the strategy wraps it (DDP; Lightning's FSDPStrategy refuses any plugin but its
own), and enters `forward_context` around every
`training_step`, `validation_step`, `test_step` and `predict_step` call, i.e. once per microbatch.
So each microbatch is one FP8 region (its forward amaxes are reduced when the step's forward ends,
its backward amaxes when its backward pass ends), and validation, run by Lightning under no_grad,
launches no reduction. With `DelayedScaling(amax_reduction="step")` the plugin marks the step
boundary too (`optimizer_step`: after the closure that runs the step's last microbatch, before the
optimizer's update). Nothing in the user's LightningModule changes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch

from ..autocast import autocast
from ..convert import FilterFn, convert_to_fp8
from ..recipe import DelayedScaling, Recipe, check_recipe
from ..steps import ending_step
from . import require

_precision = require("lightning.pytorch.plugins.precision", "lightning", "fp8train.integrations.lightning")

__all__ = ["FP8Precision"]


class FP8Precision(_precision.Precision):
    """FP8 linear layers and an FP8 region around every step (parameters stay in their dtype).

    `recipe` (default `DelayedScaling()`) and `amax_reduction_group` (default: the world) are those
    of `fp8train.autocast`; `filter_fn(module, fqn) -> bool` keeps layers in high precision (False),
    as `fp8train.convert_to_fp8`'s `module_filter_fn`.
    """

    precision = "32-true"  # what Lightning reports: parameters and other ops keep their dtype

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        amax_reduction_group: Any = None,
        filter_fn: Optional[FilterFn] = None,
    ) -> None:
        super().__init__()
        self.recipe = DelayedScaling() if recipe is None else check_recipe(recipe, "recipe")
        self.amax_reduction_group = amax_reduction_group
        self.filter_fn = filter_fn

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Swap the module's linear layers for FP8 ones, in place (layers already converted are kept:
        calling it again, or on a model converted by hand, changes nothing)."""
        return convert_to_fp8(module, self.filter_fn, self.recipe)

    def forward_context(self) -> AbstractContextManager:
        return autocast(recipe=self.recipe, amax_reduction_group=self.amax_reduction_group)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Per-step amax reduction: the step boundary after the closure (the step's last forward and
        backward, also in manual optimization), so no `end_step` is needed in the LightningModule."""
        if getattr(self.recipe, "per_step", False):
            closure = ending_step(closure)
        return super().optimizer_step(optimizer, model, closure, **kwargs)
