"""FP8 regions, under TransformerEngine's names: `fp8_autocast` and `autocast`.

What a region entry and exit do (which amax groups launch, and when they finish) is decided in
regions.py; this file is the public surface.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .amax import RegionSettings, enter_region, exit_region
from .quantization import quantization_of
from .recipe import DelayedScaling, Recipe, check_recipe

__all__ = ["fp8_autocast", "autocast"]


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group=None,
) -> Iterator[None]:
    """Run FP8 modules inside in FP8 (or record amaxes only, with `calibrating`).

    `fp8_recipe`: `DelayedScaling` (the default), `Float8CurrentScaling` or `Float8BlockScaling`.
    `fp8_group` is the amax group of delayed scaling: the ranks that share scales (default: the world)."""
    recipe = DelayedScaling() if fp8_recipe is None else check_recipe(fp8_recipe, "fp8_recipe")
    settings = RegionSettings(bool(enabled), bool(calibrating), recipe, quantization_of(recipe), fp8_group)
    region = enter_region(settings)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        exit_region(region, failed)


def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Optional[Recipe] = None,
    amax_reduction_group=None,
):
    """`fp8_autocast` under TransformerEngine's newer argument names."""
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group)
