"""The recipes (TransformerEngine's names) and the registry that maps each to its quantization.

A recipe is a frozen dataclass that validates itself; its behaviour lives in one file of
`quantization/` (delayed.py, current.py, block.py, mxfp8.py, nvfp4.py). Adding a recipe is that one
file plus one line in RECIPES (and its export in `fp8train/__init__.py`).
"""

from __future__ import annotations

from typing import Union

from .formats import Format, fp8_dtype, fp8_max
from .quantization.base import Quantization
from .quantization.block import BlockQuantization, Float8BlockScaling
from .quantization.current import CurrentQuantization, Float8CurrentScaling
from .quantization.delayed import DelayedQuantization, DelayedScaling
from .quantization.mxfp8 import MXFP8BlockScaling, MXFP8Quantization
from .quantization.nvfp4 import NVFP4BlockScaling, NVFP4Quantization

__all__ = [
    "Format",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "RECIPES",
    "check_recipe",
    "quantization_of",
    "recipe_kind",
    "fp8_dtype",
    "fp8_max",
]

RECIPES: dict[type, type[Quantization]] = {
    DelayedScaling: DelayedQuantization,
    Float8CurrentScaling: CurrentQuantization,
    Float8BlockScaling: BlockQuantization,
    MXFP8BlockScaling: MXFP8Quantization,
    NVFP4BlockScaling: NVFP4Quantization,
}
Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling]


def check_recipe(recipe, where: str) -> Recipe:
    if type(recipe) not in RECIPES:
        *others, last = [cls.__name__ for cls in RECIPES]
        raise ValueError(
            f"{where} must be a fp8train.{', '.join(others)} or {last}, got {type(recipe).__name__}"
        )
    return recipe


def quantization_of(recipe: Recipe) -> Quantization:
    """The recipe's quantization object (a new one: it holds nothing but the recipe)."""
    return RECIPES[type(check_recipe(recipe, "recipe"))](recipe)


def recipe_kind(recipe: Recipe) -> str:
    """'delayed', 'current', 'block', ...: what a checkpoint records of the recipe a module trained with."""
    return RECIPES[type(recipe)].kind
