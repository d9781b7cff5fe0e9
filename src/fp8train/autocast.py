"""FP8 regions, under TransformerEngine's names: `fp8_autocast` and `autocast`.

What a region entry and exit do (which amax groups launch, and when they finish) is decided in
regions.py; this file is the public surface.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .quantization import quantization_of
from .recipe import DelayedScaling, Recipe
from .runtime import RegionSettings, enter_region, exit_region

__all__ = ["fp8_autocast", "autocast"]


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group=None,
) -> Iterator[None]:
    """Run the FP8 modules called inside in FP8 (TransformerEngine's `fp8_autocast`, its names).

    Every FP8 module (`Linear`, `LayerNormLinear`, `LayerNormMLP`, the layers `convert_to_fp8` made)
    called inside computes its GEMMs in FP8 under `fp8_recipe`; outside every region they compute in
    high precision. Regions nest (the outermost one launches delayed scaling's amax reduction when
    it exits; the backward pass launches its own when it ends: docs/design.md, section 3).

    Args:
        enabled: False runs the modules inside in high precision (no FP8, no amax recorded).
        calibrating: record amaxes (delayed scaling) while computing in high precision: with
            `enabled=False`, a calibration pass that sets the scales before FP8 training starts.
        fp8_recipe: the recipe, one of the five: `DelayedScaling` (the default, `DelayedScaling()`),
            `Float8CurrentScaling`, `Float8BlockScaling`, `MXFP8BlockScaling` or `NVFP4BlockScaling`.
        fp8_group: delayed scaling's amax group: the process group whose ranks share scales (default
            None: the world). The same group for every training region of a module.

    Yields:
        None; the region lasts for the `with` block.

    Raises:
        ValueError: `fp8_recipe` is not one of the recipes.
        ValueError (on entry): this rank is not in `fp8_group`.
        fp8train.LayoutMismatchError, StateMismatchError, AmaxReductionError: an amax reduction found
            the ranks disagreeing, or failed (docs/design.md, section 4); every rank raises alike.
    """
    quantization = quantization_of(DelayedScaling() if fp8_recipe is None else fp8_recipe, "fp8_recipe")
    settings = RegionSettings(bool(enabled), bool(calibrating), quantization.recipe, quantization)
    region = enter_region(settings, fp8_group)
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
    """`fp8_autocast` under TransformerEngine's newer names (`transformer_engine.pytorch.autocast`).

    Args:
        enabled: False runs the modules inside in high precision.
        calibrating: record amaxes while computing in high precision (see `fp8_autocast`).
        recipe: the recipe: `DelayedScaling` (default), `Float8CurrentScaling`, `Float8BlockScaling`,
            `MXFP8BlockScaling` or `NVFP4BlockScaling`.
        amax_reduction_group: the process group whose ranks share delayed scaling's scales (default
            None: the world).

    Returns:
        The `fp8_autocast` context manager. Raises as `fp8_autocast` does.
    """
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group)
