"""How each recipe quantizes a linear layer: one file per recipe family, and the registry from recipe
type (a dataclass of data only: recipe.py for fp8train's own) to its `Quantization`, the record of
every fact about its kind. Every table of recipe kinds is read from this registry, and a recipe is
accepted where its type is registered (`check_recipe`, the door). docs/design.md, section 9."""

from __future__ import annotations

import dataclasses

from ..recipe import (
    RECIPE_TYPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ..torch_internals import SCALED_MM_KERNELS
from .base import Quantization
from .block_scaling import BlockQuantization
from .current import CurrentQuantization
from .delayed import DelayedQuantization
from .mxfp8 import MXFP8Quantization
from .nvfp4 import NVFP4Quantization

__all__ = ["RECIPES", "register_recipe", "check_recipe", "quantization_of", "recipe_kind", "record_of_kind"]

# The one registry of recipes: recipe type -> its Quantization (written by `register_recipe` only).
RECIPES: dict[type, type[Quantization]] = {}

_OPERAND_METHODS = ("quantize_weight", "quantize_input", "quantize_grad")


def register_recipe(config_type: type, quantization_type: type[Quantization]) -> None:
    """Make `config_type` a recipe of fp8train: `fp8_autocast`, `prepare`, `convert_to_fp8`, `coverage`,
    checkpoints, torch.compile and `fp8train info` accept it, and quantize with `quantization_type`.

    A stateless recipe (each tensor scaled from itself, or from blocks of itself) needs no edit of
    fp8train: its frozen dataclass and its `Quantization` subclass, registered once (docs/guide.md,
    "Your own recipe"). The record is checked here, so that a missing fact is an error now, naming it.

    Args:
        config_type: the recipe's frozen dataclass (its fields are the recipe's settings).
        quantization_type: a subclass of `fp8train.quantization.base.Quantization` that sets `kind`
            (a name no other registered recipe has), `kernel` (one of
            torch_internals.SCALED_MM_KERNELS), `block` (None or a positive int), `whole_blocks` (a
            positive int) and overrides `quantize_weight`, `quantize_input` and `quantize_grad`.

    Raises:
        ValueError: `config_type` is not a frozen dataclass or is registered already, or the record is
            incomplete or wrong (the message names the attribute); a stateful recipe (`reduces_amax`).
    """
    name = getattr(config_type, "__name__", repr(config_type))
    if not isinstance(config_type, type) or not dataclasses.is_dataclass(config_type):
        raise ValueError(
            f"register_recipe: the recipe {name} must be a dataclass type (@dataclass(frozen=True))"
        )
    if not config_type.__dataclass_params__.frozen:  # recipes are values: a region cannot see them change
        raise ValueError(f"register_recipe: the recipe {name} must be frozen: @dataclass(frozen=True)")
    if config_type in RECIPES:
        raise ValueError(
            f"register_recipe: {name} is registered already (with {RECIPES[config_type].__name__})"
        )
    _check_record(name, quantization_type, config_type)
    RECIPES[config_type] = quantization_type


def _check_record(name: str, q: type, config_type: type) -> None:
    """Refuse a `Quantization` whose record misses a fact or holds a wrong one, naming it."""
    where = f"register_recipe({name}, {getattr(q, '__name__', repr(q))})"
    if not (isinstance(q, type) and issubclass(q, Quantization)):
        raise ValueError(
            f"{where}: the quantization must be a subclass of fp8train.quantization.base.Quantization"
        )
    kind = getattr(q, "kind", None)
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"{where}: set the class attribute `kind` to a name (an identifier), got {kind!r}")
    taken = [t.__name__ for t, other in RECIPES.items() if other.kind == kind]
    if taken:
        raise ValueError(
            f"{where}: kind {kind!r} is taken by {taken[0]}; a kind names one recipe in checkpoints"
        )
    kernel = getattr(q, "kernel", None)
    if kernel not in SCALED_MM_KERNELS:
        raise ValueError(
            f"{where}: set the class attribute `kernel` to the torch._scaled_mm kernel of its GEMMs, one of "
            f"{', '.join(SCALED_MM_KERNELS)} (tensorwise: one scale per tensor); got {kernel!r}"
        )
    for attribute in ("block", "whole_blocks"):
        value = getattr(q, attribute)
        if not (value is None and attribute == "block") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            allowed = "a positive int or None" if attribute == "block" else "a positive int"
            raise ValueError(f"{where}: set the class attribute `{attribute}` to {allowed}, got {value!r}")
    if q.reduces_amax and not issubclass(config_type, DelayedScaling):  # amax/ reads DelayedScaling's fields
        raise ValueError(
            f"{where}: a recipe that reduces amaxes (`reduces_amax`: delayed scaling's state and reduction) "
            "must be a subclass of fp8train.DelayedScaling, whose fields are the hooks amax/ reads "
            "(amax_compute_algo, scaling_factor_compute_algo, margin, amax_history_len; docs/design.md, 9.1)"
        )
    missing = [m for m in _OPERAND_METHODS if getattr(q, m) is getattr(Quantization, m)]
    if missing:
        raise ValueError(
            f"{where}: override {', '.join(missing)} (how the recipe makes each GEMM's operands)"
        )


register_recipe(DelayedScaling, DelayedQuantization)
register_recipe(Float8CurrentScaling, CurrentQuantization)
register_recipe(Float8BlockScaling, BlockQuantization)
register_recipe(MXFP8BlockScaling, MXFP8Quantization)
register_recipe(NVFP4BlockScaling, NVFP4Quantization)


def check_recipe(recipe, where: str) -> Recipe:
    """`recipe` if its type is a registered recipe (the door: checked once, where it comes in); a clear
    error naming the registered ones otherwise."""
    if type(recipe) not in RECIPES:
        own = [cls.__name__ for cls in RECIPE_TYPES]
        users = ", ".join(cls.__qualname__ for cls in RECIPES if cls not in RECIPE_TYPES)
        raise ValueError(
            f"{where} must be a fp8train.{', '.join(own[:-1])} or {own[-1]}, or a recipe registered with "
            f"fp8train.register_recipe{f' ({users})' if users else ''}, got {type(recipe).__name__}"
        )
    return recipe


def quantization_of(recipe: Recipe, where: str = "recipe") -> Quantization:
    """The recipe's quantization object, the recipe checked at the door (`check_recipe`): a new one,
    which holds nothing but the recipe, so it is passed on rather than made again."""
    return RECIPES[type(check_recipe(recipe, where))](recipe)


def recipe_kind(recipe: Recipe) -> str:
    """'delayed', 'current', 'block', ...: what a checkpoint records of the recipe a module trained with."""
    return RECIPES[type(recipe)].kind


def record_of_kind(kind: str) -> type[Quantization]:
    """The registered `Quantization` of a recipe kind (a checkpoint's, a module's `recipe_kind`)."""
    for quantization in RECIPES.values():
        if quantization.kind == kind:
            return quantization
    kinds = ", ".join(q.kind for q in RECIPES.values())
    raise ValueError(
        f"no registered recipe has kind {kind!r} (registered: {kinds}); "
        "register the recipe (fp8train.register_recipe) before loading or inspecting a model trained with it"
    )
