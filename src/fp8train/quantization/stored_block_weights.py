"""Checkpoints' block-FP8 weights: checks, scale formats, export (not block scaling's quantization of
operands: block_scaling.py; not the block-scaled GEMM: numerics/block_scaled_mm.py).

Block-FP8 weights as published checkpoints store them (DeepSeek-V3, Qwen3-FP8: Hugging Face's
`quant_method: "fp8"`): `weight` float8_e4m3fn [out, in] and `weight_scale_inv` [ceil(out/128),
ceil(in/128)], the weight being `weight[i, j] * weight_scale_inv[i // 128, j // 128]`; the last row
and column of blocks may be partial. That is `Float8BlockScaling`'s weight operand (128x128 blocks,
`gemm.Operand`), so a stored weight is used as the operand it is, never requantized (docs/design.md,
section 9, "Stored block-FP8 weights").

Scales are float32 (`scale_fmt` "float") or E8M0 (`scale_fmt` "ue8m0": powers of 2, stored as
torch.float8_e8m0fnu or as their raw uint8 exponent bytes); in memory they are float32, exactly.
"""

from __future__ import annotations

import torch

from ..numerics.gemm import Operand
from ..recipe import Float8BlockScaling
from .block_scaling import TILE, quantize_tiles

__all__ = [
    "BLOCK",
    "DEFAULT_RECIPE",
    "BlockFormatError",
    "scale_grid",
    "stored_operand",
    "check_stored_weight",
    "scales_to_float32",
    "check_scale_values",
    "scales_to_format",
    "quantize_block_weight",
    "dequantize_block_weight",
]

BLOCK = (TILE, TILE)
DEFAULT_RECIPE = Float8BlockScaling()  # its power_2_scale=True: exported scales are powers of 2
SCALE_FORMATS = ("float", "ue8m0")


class BlockFormatError(ValueError):
    """A checkpoint's block-FP8 tensors do not make a weight of the format: names the tensor."""


def scale_grid(out_features: int, in_features: int) -> tuple[int, int]:
    """The shape of a weight's scale_inv: one per 128x128 block, the last ones partial."""
    return -(-out_features // TILE), -(-in_features // TILE)


def scales_to_float32(scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """A stored scale_inv as float32: float32 as is; E8M0 (float8_e8m0fnu, or its uint8 exponent
    bytes, 2**(byte - 127)) exactly; any other dtype is refused."""
    if scale_inv.dtype == torch.float32:
        return scale_inv
    if scale_inv.dtype == torch.float8_e8m0fnu:
        return scale_inv.float()
    if scale_inv.dtype == torch.uint8:
        return torch.ldexp(
            torch.ones(scale_inv.shape, device=scale_inv.device), scale_inv.to(torch.int32) - 127
        )
    raise BlockFormatError(
        f"{name} is {scale_inv.dtype}: block-FP8 scales are float32 or E8M0 (float8_e8m0fnu / uint8)"
    )


def check_scale_values(scale_inv: torch.Tensor, name: str) -> None:
    """Raise a BlockFormatError naming `name` and the first bad block unless every scale (float32)
    is finite and positive: a NaN, infinite, zero or negative scale makes its whole block of the
    weight (and every output it reaches) wrong, found otherwise only at the loss. A tensor on the
    meta device has no values to check (its values are checked where they are loaded)."""
    if scale_inv.is_meta:
        return
    bad = ~(torch.isfinite(scale_inv) & (scale_inv > 0))
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise BlockFormatError(
            f"{name} has a scale of {float(scale_inv[first])} in block {first} ({int(bad.sum())} of "
            f"{bad.numel()} blocks are not finite and positive): the checkpoint is corrupt; a "
            "block's scale_inv is its amax / 448, a finite positive number"
        )


def scales_to_format(scale_inv: torch.Tensor, scale_fmt: str, name: str) -> torch.Tensor:
    """float32 scales as `scale_fmt` stores them; E8M0 takes powers of 2 only (the recipe's
    `power_2_scale=True`), anything else would be rounded: refused."""
    if scale_fmt == "float":
        return scale_inv
    if scale_fmt != "ue8m0":
        raise BlockFormatError(f"scale_fmt {scale_fmt!r} is not one of {SCALE_FORMATS}")
    mantissa, _ = torch.frexp(scale_inv)
    if not bool((mantissa == 0.5).all()):
        raise BlockFormatError(
            f"{name} has scales that are not powers of 2, which scale_fmt 'ue8m0' cannot store: "
            "quantize with Float8BlockScaling(power_2_scale=True) or export with scale_fmt='float'"
        )
    return scale_inv.to(torch.float8_e8m0fnu)


def check_stored_weight(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None, block_size=BLOCK
) -> None:
    """Raise a BlockFormatError naming `name` unless `weight` and `scale_inv` make a stored weight."""
    if tuple(block_size) != BLOCK:
        raise BlockFormatError(
            f"weight_block_size {list(block_size)} is not Float8BlockScaling's {list(BLOCK)}: fp8train "
            "trains 128x128 weight blocks only, so this checkpoint's operands cannot be used as stored"
        )
    if weight.dtype != torch.float8_e4m3fn:
        raise BlockFormatError(f"{name} is {weight.dtype}, a block-FP8 weight is torch.float8_e4m3fn")
    if weight.dim() != 2:
        raise BlockFormatError(
            f"{name} has shape {tuple(weight.shape)}: a stored linear weight is 2-D [out, in] (fused "
            "experts load from per-expert 2-D tensors, DeepSeek-V3's layout: StoredFP8Experts)"
        )
    if scale_inv is None:
        raise BlockFormatError(f"{name} is FP8 but the checkpoint has no {name}_scale_inv for it")
    expected = scale_grid(*weight.shape)
    if tuple(scale_inv.shape) != expected:
        raise BlockFormatError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, but {name} {tuple(weight.shape)} in "
            f"128x128 blocks needs {expected} (ceil(out/128), ceil(in/128))"
        )


def stored_operand(weight: torch.Tensor, scale_inv: torch.Tensor) -> Operand:
    """The stored weight as the GEMM operand it is (views of the two tensors, nothing copied)."""
    return Operand(weight, scale_inv, BLOCK)


def dequantize_block_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight[i, j] * scale_inv[i // 128, j // 128] in float32 (one rounding, the product's)."""
    return stored_operand(weight, scale_inv).dequantize()


def quantize_block_weight(
    weight: torch.Tensor, recipe: Float8BlockScaling = DEFAULT_RECIPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) by the recipe's own weight quantizer: what
    `BlockQuantization.quantize_weight` gives the training forward, bit for bit."""
    values, scale_inv = quantize_tiles(weight.detach(), TILE, recipe.power_2_scale)
    return values.to(torch.float8_e4m3fn), scale_inv
