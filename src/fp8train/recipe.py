"""The recipes (TransformerEngine's names): frozen dataclasses that validate themselves, and nothing else.

This is the vocabulary at the bottom of the package (it imports `formats` only): the amax protocol
(`amax/`) reads `DelayedScaling`'s fields, and each recipe's behaviour lives in one file of
`quantization/`, whose registry maps every recipe type to its `Quantization`, the record of its kind
(`quantization.RECIPES`; `check_recipe` there accepts what is registered). A recipe of fp8train is its
dataclass here (and its name in `Recipe`), its file there and one `register_recipe` line; a user's is
its dataclass and its `Quantization` anywhere, registered with `fp8train.register_recipe`, with no
edit of the library (docs/design.md, section 9). Data before code, as torchao's `float8/config.py` and
TransformerEngine's `common/recipe`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union, get_args

import torch

from .numerics.formats import Format, fp8_dtype, fp8_max

__all__ = [
    "Format",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "RECIPE_TYPES",
    "fp8_dtype",
    "fp8_max",
]

AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each step's scale comes from the amax history of earlier steps.

    Callables are applied once to the whole contiguous storage of a group (one column per tensor
    role), so they must work column-wise: ``amax_compute_algo(history[H, N]) -> amax[N]`` and
    ``scaling_factor_compute_algo(amax[N], scale[N], fp8_max, recipe) -> scale[N]``.

    `amax_reduction`: "region" (TransformerEngine's behaviour: every FP8 region's amaxes are reduced
    and rolled into the history when it ends, and its backward's when that ends) or "step": the
    amaxes of all regions of an optimizer step are MAX-accumulated locally and reduced once per
    direction at the step boundary (`fp8train.end_step()`), so scales are constant within a step
    (docs/design.md, section 14).

    Args:
        margin: scales leave 2**margin of headroom: scale = fp8_max / amax / 2**margin (an integer >= 0).
        fp8_format: `Format.HYBRID` (E4M3 forward, E5M2 gradients; the default) or `Format.E4M3`.
        amax_history_len: how many steps of amaxes each tensor role keeps (>= 1).
        amax_compute_algo: "max" (of the history), "most_recent", or a callable as above.
        scaling_factor_compute_algo: None (fp8_max / amax / 2**margin) or a callable as above.
        reduce_amax: reduce amaxes over the amax group (the ranks share scales); False: each rank its own.
        amax_reduction: "region" or "step", as above.

    Raises:
        ValueError: a field out of its range (the message names the field and what it takes).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[ScaleAlgo] = None
    reduce_amax: bool = True
    amax_reduction: str = "region"

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an integer >= 0, got {self.margin!r}")
        if not isinstance(self.fp8_format, Format) or self.fp8_format is Format.E5M2:
            raise ValueError(
                f"DelayedScaling.fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format!r} "
                "(pure E5M2 has too little precision for forward activations and weights)"
            )
        h = self.amax_history_len
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an integer >= 1, got {h!r}")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable "
                f"(amax_history) -> amax, got {algo!r}"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(
                "DelayedScaling.scaling_factor_compute_algo must be None or a callable "
                f"(amax, scale, fp8_max, recipe) -> scale, got {sf!r}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling.reduce_amax must be True or False, got {self.reduce_amax!r}")
        if self.amax_reduction not in ("region", "step"):
            raise ValueError(
                f"DelayedScaling.amax_reduction must be 'region' (per FP8 region) or 'step' (once per "
                f"optimizer step, at fp8train.end_step()), got {self.amax_reduction!r}"
            )

    @property
    def per_step(self) -> bool:
        """Whether amaxes are reduced once per optimizer step (`amax_reduction="step"`)."""
        return self.amax_reduction == "step"

    def key(self) -> str:
        """The fields every rank of an amax group must agree on, as text that is the same in every
        process (the reduction header's fingerprint; equal keys share an amax group)."""

        def name(algo) -> str:
            return repr(algo) if algo is None or isinstance(algo, str) else _callable_key(algo)

        return (
            f"margin={self.margin}, fp8_format={self.fp8_format.name}, "
            f"amax_history_len={self.amax_history_len}, amax_compute_algo={name(self.amax_compute_algo)}, "
            f"scaling_factor_compute_algo={name(self.scaling_factor_compute_algo)}"
            + (", amax_reduction=step" if self.per_step else "")
        )


def _callable_key(fn) -> str:
    """Text that is the same in every process for the same callable, and differs for different ones.

    Functions (lambdas and closures included) are known by their code, constants and the values they
    close over; `functools.partial` by its function and arguments; other callables by their type.
    Memory addresses, which differ between processes, are left out."""
    if isinstance(fn, functools.partial):
        return f"partial({_callable_key(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    closure = [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]
    details = repr((code.co_consts, code.co_names, getattr(fn, "__defaults__", None), closure))
    details = re.sub(r"0x[0-9a-fA-F]+", "0x", details)
    digest = hashlib.blake2b(code.co_code + details.encode(), digest_size=6).hexdigest()
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}#{digest}"


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor current scaling: each tensor's scale from its own amax just before its cast
    (`scale_from_amax`), no history. No amax reduction: every tensor is cast where it is whole, so
    sequence-parallel inputs and FSDP2 weights are gathered in high precision first.

    Args:
        fp8_format: `Format.HYBRID` (E4M3 forward, E5M2 gradients; the default) or `Format.E4M3`.

    Raises:
        ValueError: `fp8_format` is `Format.E5M2` or not a Format.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format) or self.fp8_format is Format.E5M2:
            raise ValueError(
                "Float8CurrentScaling.fp8_format must be Format.E4M3 or Format.HYBRID, "
                f"got {self.fp8_format!r}"
            )


@dataclass(frozen=True)
class Float8BlockScaling:
    """Block scaling (DeepSeek-V3's): E4M3 everywhere, one scale per 1x128 tile (128 consecutive
    elements along the GEMM's reduction dimension) of inputs and gradients and per 128x128 block of
    weights, each from its own amax.

    Args:
        power_2_scale: round every scale down to a power of 2 (the default, as DeepSeek-V3).
        fp8_format: `Format.E4M3` (the only one: block scaling uses E4M3 everywhere).

    Raises:
        ValueError: another format, or a `power_2_scale` that is not a bool.
    """

    power_2_scale: bool = True
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"Float8BlockScaling uses Format.E4M3 everywhere, got {self.fp8_format!r}")
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(
                f"Float8BlockScaling.power_2_scale must be True or False, got {self.power_2_scale!r}"
            )


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """MXFP8: one E8M0 scale per 32 consecutive values along the reduction dimension.

    `fp8_format`: E4M3 everywhere, or HYBRID (E5M2 gradients). `enable_2d_quantization`: weights in
    32x32 blocks (one copy serves w and w.T). `margin` is accepted for TransformerEngine's signature
    and, as there, does not change MX scales (each is rounded up to the next power of two).
    Every GEMM dimension must be whole 32-blocks (convert_to_fp8 keeps other layers in high precision).

    Raises:
        ValueError: a field out of its range.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"MXFP8BlockScaling.margin must be an integer >= 0, got {self.margin!r}")
        if self.fp8_format not in (Format.E4M3, Format.HYBRID):
            raise ValueError(
                f"MXFP8BlockScaling.fp8_format must be Format.E4M3 or Format.HYBRID, got {self.fp8_format!r}"
            )
        if not isinstance(self.enable_2d_quantization, bool):
            raise ValueError(
                "MXFP8BlockScaling.enable_2d_quantization must be True or False, "
                f"got {self.enable_2d_quantization!r}"
            )


@dataclass(frozen=True)
class NVFP4BlockScaling:
    """NVFP4: E2M1 values, an E4M3 scale per 16 values and an FP32 scale per tensor.

    `disable_rht`: no Hadamard transform of the weight-gradient operands; `disable_stochastic_rounding`:
    gradients rounded to nearest even like everything else; `disable_2d_quantization`: weights in
    1x16 blocks along each GEMM's reduction dimension (two copies) instead of 16x16 blocks.

    Raises:
        ValueError: a field that is not a bool.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"NVFP4BlockScaling.{name} must be True or False, got {getattr(self, name)!r}"
                )


Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling]
RECIPE_TYPES: tuple[type, ...] = get_args(Recipe)  # fp8train's own, each named once, in `Recipe`
