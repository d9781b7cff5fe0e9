"""How each recipe quantizes a linear layer: one file per recipe family, and the table from recipe
type (recipe.py, data only) to its `Quantization`."""

from __future__ import annotations

from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_recipe,
)
from .base import Quantization
from .block import BlockQuantization
from .current import CurrentQuantization
from .delayed import DelayedQuantization
from .mxfp8 import MXFP8Quantization
from .nvfp4 import NVFP4Quantization

__all__ = ["RECIPES", "quantization_of", "recipe_kind"]

RECIPES: dict[type, type[Quantization]] = {
    DelayedScaling: DelayedQuantization,
    Float8CurrentScaling: CurrentQuantization,
    Float8BlockScaling: BlockQuantization,
    MXFP8BlockScaling: MXFP8Quantization,
    NVFP4BlockScaling: NVFP4Quantization,
}


def quantization_of(recipe: Recipe) -> Quantization:
    """The recipe's quantization object (a new one: it holds nothing but the recipe)."""
    return RECIPES[type(check_recipe(recipe, "recipe"))](recipe)


def recipe_kind(recipe: Recipe) -> str:
    """'delayed', 'current', 'block', ...: what a checkpoint records of the recipe a module trained with."""
    return RECIPES[type(recipe)].kind
