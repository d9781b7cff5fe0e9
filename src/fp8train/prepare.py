"""`fp8train.prepare`: one call that makes any model train in FP8 wherever it is called.

It converts the linear layers (`convert_to_fp8`) and replaces `model.forward`, on the instance, by
`FP8Forward`: the class's forward run inside one FP8 region (`fp8_autocast`) with the given recipe
and amax group. Every loop, trainer or wrapper calls `model(...)`, hence `model.forward`, so each
call is one region: one amax reduction per direction per call (per microbatch), launched when the
region exits and when its backward pass ends, exactly as a hand-written `fp8_autocast` around the
call gives (docs/design.md, section 3). Evaluation without grad trains no group and launches
nothing.

Why an instance attribute and not forward hooks: a pre/post hook pair cannot tell a forward that
raised from one that returned (the post hook is not called, or called with `None`), and a region
must know whether it failed. Why not a wrapper module: it would change every `state_dict` key and
hide the model's own attributes from the trainers that read them. `FP8Forward` is an ordinary
object holding the model and the settings, so the model still pickles and deep-copies (the copy
gets its own `FP8Forward`, bound to the copy), and `inspect.signature(model.forward)` still shows
the model's parameters (Hugging Face's Trainer drops dataset columns the forward does not take).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .convert import FilterFn, convert_checked
from .layer_coverage import model_coverage
from .modules.base import FP8Module
from .quantization import quantization_of
from .quantization.base import Quantization
from .recipe import DelayedScaling, Recipe
from .runtime import Region, RegionSettings, enter_region, exit_region
from .user_warnings import UNSET, renamed_argument

__all__ = ["prepare", "is_prepared", "FP8Forward", "first_and_last_linear_filter"]


class FP8Forward:
    """`model.forward` of a prepared model: the model class's forward inside one FP8 region.
    `quantization`: the recipe's, made once where `prepare` checked the recipe (every region uses it)."""

    def __init__(self, module: torch.nn.Module, quantization: Quantization, group: Any) -> None:
        self.module = module
        self.quantization = quantization
        self.group = group
        _skipped_by_compile()

    @property
    def recipe(self) -> Recipe:
        return self.quantization.recipe

    @property
    def __wrapped__(self) -> Callable:
        """The model's own forward, bound: what `inspect.signature` and `functools` report. A property
        (not stored), so that copies never hold a method bound to the original."""
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] is self.module:  # rebound as a method of its model: accelerate's
            args = args[1:]  # unwrap_model(keep_fp32_wrapper=False) sets MethodType(forward, model)
        return _SKIPPED_BY_COMPILE["forward_in_region"](self, args, kwargs)

    def __getstate__(self) -> dict:
        # A process group does not pickle and means nothing in another process; the default group
        # (None: the world) does. deepcopy keeps the group (same process): __deepcopy__.
        if self.group is not None:
            raise TypeError(
                f"a {type(self.module).__name__} prepared with an explicit amax_reduction_group cannot be "
                "pickled (a process group does not pickle): save its state_dict() instead, or deepcopy it "
                "in this process"
            )
        return {"module": self.module, "quantization": self.quantization, "group": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _skipped_by_compile()  # unpickled in a process that has prepared nothing

    def __deepcopy__(self, memo: dict) -> FP8Forward:
        module = copy.deepcopy(self.module, memo)
        return FP8Forward(module, copy.deepcopy(self.quantization, memo), self.group)

    def __repr__(self) -> str:
        return f"FP8Forward({type(self.module).__name__}.forward, recipe={self.recipe!r})"


def _forward_in_region(forward: FP8Forward, args: tuple, kwargs: dict) -> Any:
    """`fp8_autocast` around the model's forward, written out so that under `torch.compile(model)`
    the region's entry and exit run eagerly (they are not traceable) while the forward between them
    is compiled as usual (this frame is skipped, not what it calls: `_skipped_by_compile`)."""
    region = _SKIPPED_BY_COMPILE["enter"](forward.quantization, forward.group)
    try:
        out = forward.__wrapped__(*args, **kwargs)
    except BaseException:
        _SKIPPED_BY_COMPILE["exit"](region, True)
        raise
    _SKIPPED_BY_COMPILE["exit"](region, False)
    return out


def _enter(quantization: Quantization, group: Any) -> Optional[Region]:
    return enter_region(RegionSettings(True, False, quantization.recipe, quantization), group)


def _exit(region: Optional[Region], failed: bool) -> None:
    exit_region(region, failed)


# The region's steps as torch.compile skips them: made by the first FP8Forward, not at import
# (torch.compiler.disable imports torch._dynamo, which would double `import fp8train`'s time).
_SKIPPED_BY_COMPILE: dict[str, Callable] = {}


def _skipped_by_compile() -> None:
    if not _SKIPPED_BY_COMPILE:
        _SKIPPED_BY_COMPILE.update(
            forward_in_region=torch.compiler.disable(_forward_in_region, recursive=False),
            enter=torch.compiler.disable(_enter),
            exit=torch.compiler.disable(_exit),
        )


def is_prepared(model: torch.nn.Module) -> bool:
    """Whether `fp8train.prepare` has been applied to this very `model` (not to a submodule of it)."""
    return isinstance(getattr(model, "__dict__", {}).get("forward"), FP8Forward)


def prepare(
    model: torch.nn.Module,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Any = None,
    module_filter_fn: Optional[FilterFn] = None,
    fsdp_fp8_all_gather: bool = False,
    verbose: bool = True,
    *,
    filter_fn: Any = UNSET,
) -> torch.nn.Module:
    """Convert `model`'s linear layers to FP8 modules and make every call of `model` one FP8 region.

    After `model = fp8train.prepare(model)`, any loop, trainer or wrapper (DDP, FSDP2, torch.compile,
    Hugging Face's Trainer, accelerate) that calls the model trains in FP8.

    Args:
        model: the model to train in FP8 (changed in place).
        recipe: the recipe (default `DelayedScaling()`): `DelayedScaling`, `Float8CurrentScaling`,
            `Float8BlockScaling`, `MXFP8BlockScaling` or `NVFP4BlockScaling`.
        amax_reduction_group: the process group whose ranks share delayed scaling's scales (default
            None: the world).
        module_filter_fn: `module_filter_fn(module, fqn) -> bool`, False keeps a linear layer in high
            precision at your request (`first_and_last_linear_filter` keeps the first and last, as
            accelerate's torchao backend does); as in `convert_to_fp8`.
        fsdp_fp8_all_gather: FSDP2 gathers the converted weights in FP8 (`convert_to_fp8`).
        verbose: print the coverage summary (`fp8train.coverage(model).summary()`: how many linear
            GEMMs run in FP8, their FLOP share, why the others do not) to stderr, on rank 0 only (the
            process whose torch.distributed rank, or else whose `RANK` variable, is 0). It is also
            logged at INFO (logger "fp8train") on every rank, whatever `verbose` says.
        filter_fn: the deprecated name of `module_filter_fn` (a DeprecationWarning).

    Layers whose shape FP8 GEMMs cannot take (a weight dimension off 16, on every device) stay in high
    precision, with one UserWarning naming them and why unless `module_filter_fn` kept them
    (`convert_to_fp8`). A `transformers.PreTrainedModel` gives its FP8 state as a uint8 tensor
    (`FP8Module.extra_state_as_tensor`), because `save_pretrained` writes safetensors.

    Returns:
        `model`, prepared in place (as `convert_to_fp8`, a bare `torch.nn.Linear` is returned converted).

    Raises:
        TypeError: `model` is not a `torch.nn.Module`, or both `module_filter_fn` and `filter_fn` were given.
        ValueError: the model was prepared already (a second region and conversion would change nothing
            but the recipe, silently), has its own `forward` set on the instance, has no layer to train in
            FP8, or `recipe` is not a recipe.
    """
    module_filter_fn = renamed_argument(
        module_filter_fn, filter_fn, "module_filter_fn", "filter_fn", "prepare"
    )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fp8train.prepare takes a torch.nn.Module, got {type(model).__name__}")
    if is_prepared(model):
        raise ValueError(
            f"this {type(model).__name__} has already been prepared by fp8train.prepare (its forward runs in "
            "an FP8 region); prepare a model once, with the recipe and group it trains with"
        )
    if "forward" in model.__dict__:
        raise ValueError(
            f"this {type(model).__name__} has its own `forward` set on the instance (by a wrapper or a "
            "patch); call fp8train.prepare before whatever replaced it"
        )
    quantization = quantization_of(DelayedScaling() if recipe is None else recipe)  # the one check
    model = convert_checked(model, module_filter_fn, quantization, fsdp_fp8_all_gather, True)
    if not any(isinstance(m, FP8Module) for m in model.modules()):
        raise ValueError(
            f"fp8train.prepare found no layer to train in FP8 in this {type(model).__name__}: no "
            "torch.nn.Linear "
            "(or transformers Conv1D) whose dimensions are multiples of 16 (and whole blocks of the recipe) "
            "passed the filter"
        )
    if _is_transformers_model(model):
        # save_pretrained (and so the Trainer's save_model and checkpoints) writes safetensors, which
        # hold tensors only: FP8 state goes there as the same bytes in a uint8 tensor.
        for module in model.modules():
            if isinstance(module, FP8Module):
                module.extra_state_as_tensor = True
    model.forward = FP8Forward(model, quantization, amax_reduction_group)
    if verbose and _rank() == 0:
        print(model_coverage(model, type(quantization)).summary(), file=sys.stderr)
    return model


def _rank() -> int:
    """This process's rank: torch.distributed's once it is initialized, else torchrun's RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _is_transformers_model(model: torch.nn.Module) -> bool:
    """A Hugging Face `transformers.PreTrainedModel`, told without importing transformers."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(model).__mro__
    )


def first_and_last_linear_filter(model: torch.nn.Module) -> FilterFn:
    """A `module_filter_fn` (for `prepare`, `convert_to_fp8`) that keeps the first and the last
    `torch.nn.Linear` of `model` (in module order) in high precision: the usual choice for the layers
    nearest the data and the loss (accelerate's torchao backend's default).

    Args:
        model: the model as it will be converted (its layers' names are what the filter matches).

    Returns:
        A picklable callable `(module, fqn) -> bool`, False for those two layers."""
    names = [fqn for fqn, m in model.named_modules() if type(m) is torch.nn.Linear]
    ends = {names[0], names[-1]} if names else set()
    return _SkipNames(frozenset(ends))


class _SkipNames:
    """module_filter_fn(module, fqn) -> fqn not in names; a class so that it pickles."""

    def __init__(self, names: frozenset) -> None:
        self.names = names

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        return fqn not in self.names
