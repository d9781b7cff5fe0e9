"""FP8 regions, under TransformerEngine's names: `fp8_autocast` and `autocast`.

What a region entry and exit do (which amax groups launch, and when they finish) is decided in
protocol.py; this file is the public surface.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .protocol import RegionSettings, enter_region, exit_region
from .recipe import DelayedScaling

__all__ = ["fp8_autocast", "autocast"]


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[DelayedScaling] = None,
    fp8_group=None,
) -> Iterator[None]:
    """Run FP8 modules inside in FP8 (or record amaxes only, with `calibrating`).

    `fp8_group` is the amax group: the ranks that share scales (default: the world)."""
    if fp8_recipe is not None and not isinstance(fp8_recipe, DelayedScaling):
        raise ValueError(f"fp8_recipe must be a fp8train.DelayedScaling, got {type(fp8_recipe).__name__}")
    settings = RegionSettings(bool(enabled), bool(calibrating), fp8_recipe or DelayedScaling(), fp8_group)
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
    recipe: Optional[DelayedScaling] = None,
    amax_reduction_group=None,
):
    """`fp8_autocast` under TransformerEngine's newer argument names."""
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group)
