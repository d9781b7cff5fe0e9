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

Checkpoints: Lightning restores a checkpoint's weights into the LightningModule *before* the
strategy calls `convert_module`, so a fresh LightningModule (plain linear layers) would refuse the
FP8 layers' `_extra_state` entries. The plugin therefore keeps the FP8 state out of the weights:
`on_save_checkpoint` moves it from `checkpoint["state_dict"]` to `checkpoint[FP8_STATE_KEY]`, and
`on_load_checkpoint`, which Lightning calls after `convert_module`, loads it into the converted
layers. A module converted before the restore (trained earlier in the process, or converted by
hand) accepts weights without FP8 entries through a load hook, and gets its FP8 state the same way.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Union

import torch

from ..amax import steps
from ..autocast import autocast
from ..convert import FilterFn, convert_to_fp8
from ..modules.base import FP8Module
from ..quantization import check_recipe
from ..recipe import DelayedScaling, Recipe
from ..user_warnings import UNSET, renamed_argument
from . import require

_precision = require("lightning.pytorch.plugins.precision", "lightning", "fp8train.integrations.lightning")
_utilities = require("lightning.pytorch.utilities", "lightning", "fp8train.integrations.lightning")

__all__ = ["FP8Precision", "FP8_STATE_KEY"]

FP8_STATE_KEY = "fp8train_state"  # the checkpoint entry: {"<layer>._extra_state": FP8 state}
EXTRA_STATE = "._extra_state"


def _fp8_state_keys(module: torch.nn.Module) -> set[str]:
    return {f"{name}{EXTRA_STATE}" for name, m in module.named_modules() if isinstance(m, FP8Module)}


def _fp8_state_in_plugin_entry(module: torch.nn.Module, incompatible_keys) -> None:
    """Load hook of a converted LightningModule: weights saved by `FP8Precision` carry no FP8 entry
    (they are in the checkpoint's FP8_STATE_KEY entry, loaded after conversion), so a state dict
    that lacks every FP8 entry is complete; one that lacks some stays an error."""
    expected = _fp8_state_keys(module)
    if expected and expected <= set(incompatible_keys.missing_keys):
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in expected]


class FP8Precision(_precision.Precision):
    """A Lightning precision plugin: FP8 linear layers and an FP8 region around every step (parameters
    stay in their dtype). `Trainer(plugins=[FP8Precision()])`; with `Fabric` too.

    Args:
        recipe: the recipe (default `DelayedScaling()`), as `fp8train.autocast`'s.
        amax_reduction_group: the ranks that share delayed scaling's scales (default None: the world),
            as `fp8train.autocast`'s.
        module_filter_fn: `module_filter_fn(module, fqn) -> bool`, False keeps a linear layer in high
            precision, as `fp8train.convert_to_fp8`'s.
        filter_fn: the deprecated name of `module_filter_fn` (a DeprecationWarning).

    Raises:
        ValueError: `recipe` is not a recipe.
        TypeError: both `module_filter_fn` and `filter_fn` were given.
    """

    precision = "32-true"  # what Lightning reports: parameters and other ops keep their dtype

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        amax_reduction_group: Any = None,
        module_filter_fn: Optional[FilterFn] = None,
        *,
        filter_fn: Any = UNSET,
    ) -> None:
        super().__init__()
        self.recipe = DelayedScaling() if recipe is None else check_recipe(recipe, "recipe")
        self.amax_reduction_group = amax_reduction_group
        self.module_filter_fn = renamed_argument(
            module_filter_fn, filter_fn, "module_filter_fn", "filter_fn", "FP8Precision"
        )
        self._module: Optional[torch.nn.Module] = None  # the LightningModule convert_module converted
        self._had_fp8_layers = False  # whether it was converted already (its FP8 state predates the run)
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._named_user_boundary = False  # whether a user's end_step() in the step was named (once)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Swap the module's linear layers for FP8 ones, in place (layers already converted are kept:
        calling it again, or on a model converted by hand, changes nothing)."""
        self._had_fp8_layers = bool(_fp8_state_keys(module))
        convert_to_fp8(module, self.module_filter_fn, self.recipe)
        if module not in self._hooked:
            module.register_load_state_dict_post_hook(_fp8_state_in_plugin_entry)
            self._hooked.add(module)
        self._module = module
        if not self._had_fp8_layers and _fp8_state_keys(module):
            _warn_if_evaluating_without_fp8_state(module)
        return module

    # ---- checkpoints (see the module's docstring) ---------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Move the FP8 layers' state out of the weights into `checkpoint[FP8_STATE_KEY]`."""
        if self._module is None:
            return
        weights = checkpoint["state_dict"]
        moved = {k: weights.pop(k) for k in sorted(_fp8_state_keys(self._module)) if k in weights}
        if moved:
            checkpoint[FP8_STATE_KEY] = moved

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Load `checkpoint[FP8_STATE_KEY]` into the converted module (Lightning calls this after
        `convert_module`). A checkpoint whose weights hold the FP8 entries (a weights-only one, or
        one written before the plugin kept them apart) was loaded with the weights already; one with
        no FP8 state at all starts a fresh module's FP8 state, and cannot go into a converted one."""
        if self._module is None:
            return
        if FP8_STATE_KEY in checkpoint:
            _load_fp8_state(self._module, checkpoint[FP8_STATE_KEY])
        elif self._had_fp8_layers and not any(k.endswith(EXTRA_STATE) for k in checkpoint["state_dict"]):
            raise ValueError(
                "the checkpoint holds no FP8 state (it was saved without FP8Precision), and this "
                "LightningModule's layers were converted before, with FP8 state of their own: restore it "
                "into a fresh LightningModule (its layers are converted after the weights load)"
            )

    def load_checkpoint(
        self, module: torch.nn.Module, checkpoint: Union[str, dict[str, Any]]
    ) -> torch.nn.Module:
        """Convert `module` and load the FP8 state of a checkpoint (a path or the loaded dict) into it:
        the line to add after `LitModel.load_from_checkpoint(path)`, which loads the weights only
        (Lightning calls no precision plugin there). Returns `module`."""
        if not isinstance(checkpoint, dict):
            checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=True)
        self.convert_module(module)
        self.on_load_checkpoint(checkpoint)
        return module

    def forward_context(self) -> AbstractContextManager:
        return autocast(recipe=self.recipe, amax_reduction_group=self.amax_reduction_group)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's optimizer step of `optimizer` for `model` (Lightning passes both, and `closure`:
        the step's forward and backward). Per-step amax reduction: the step boundary after Lightning's
        closure (the step's last forward and backward, also in manual optimization, then the
        `on_before_optimizer_step` hooks), before the optimizer's update, so no `end_step` is needed
        in the LightningModule. A hook that still marks the boundary itself (`fp8train.end_step()`
        in a callback's `on_before_optimizer_step`, as the guide once taught) makes the step's only
        boundary, and is named once as no longer needed: one boundary, 2 amax collectives per group
        and step. (`Precision.optimizer_step` with the boundary around its `_wrap_closure`,
        Lightning's closure-then-hooks, rather than inside it.) Returns the closure's result."""
        if not getattr(self.recipe, "per_step", False):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        wrapped = functools.partial(self._wrap_closure, model, optimizer, closure)
        closure = steps.ending_step(wrapped, self._marked)
        return optimizer.step(closure=closure, **kwargs)

    def _marked(self) -> None:
        """The step's closure or its hooks called `fp8train.end_step()` (the plugin then adds none)."""
        if not self._named_user_boundary:
            self._named_user_boundary = True
            warnings.warn(
                "FP8Precision marks the step boundary of DelayedScaling(amax_reduction='step') itself; "
                "the fp8train.end_step() called during the optimizer step's closure (e.g. in a callback's "
                "on_before_optimizer_step) is no longer needed: remove it (it now replaces the plugin's, "
                "so there is still one boundary per step)",
                UserWarning,
                stacklevel=2,
            )


def _warn_if_evaluating_without_fp8_state(module: torch.nn.Module) -> None:
    """Layers converted just now have no FP8 state; evaluating them without a checkpoint to restore
    is legitimate (a baseline before training) but is also what `LitModel.load_from_checkpoint`
    leads to, which loads the weights and, giving the plugin no hook, drops the FP8 state."""
    try:
        trainer = module.trainer
    except (AttributeError, RuntimeError):  # not a LightningModule, or not attached to a Trainer
        return
    stage = getattr(trainer.state.fn, "value", None) if trainer is not None else None
    if stage in (None, "fit") or trainer.ckpt_path is not None:
        return
    _utilities.rank_zero_warn(
        f"FP8Precision: {stage} runs FP8 layers that have no FP8 state yet (no amax history, initial scales) "
        "and restores no checkpoint. If this LightningModule comes from LitModel.load_from_checkpoint(path), "
        "which loads the weights only, add `FP8Precision().load_checkpoint(model, path)` after it "
        f"(or pass ckpt_path=path to trainer.{stage}) to load the checkpoint's FP8 state"
    )


def _load_fp8_state(module: torch.nn.Module, entries: dict[str, Any]) -> None:
    """Load saved FP8 states ({"<layer>._extra_state": state}) into `module`'s FP8 layers: every FP8
    layer must find its entry and every entry its layer."""
    expected = _fp8_state_keys(module)
    missing, extra = sorted(expected - set(entries)), sorted(set(entries) - expected)
    problems = [f"no saved state for {', '.join(missing[:4])}"] if missing else []
    problems += [f"saved state for {', '.join(extra[:4])}, which are not FP8 layers here"] if extra else []
    if problems:
        raise ValueError(
            f"the checkpoint's FP8 state does not fit this module ({'; '.join(problems)}): it was "
            "saved from a module converted differently; use the FP8Precision(module_filter_fn=...) of the "
            "run that saved it"
        )
    module.load_state_dict(entries, strict=False)
