"""What the FP8 linear function keeps for backward: its operands as FP8 bytes (docs/design.md, section 17).

On the hardware path (`torch._scaled_mm`) and for block-scaled recipes an operand's values are an FP8
dtype already: 1 byte per element, kept as they are. The emulated per-tensor path multiplies FP8 values
held in bf16 or fp32 (2 or 4 bytes); with `FP8TRAIN_SAVE_FP8=1` they are kept as FP8 bytes instead and
decoded for the backward GEMM, and NVFP4's E2M1 values are packed two to a byte (their E4M3 block
scales, held in fp32, as E4M3 bytes; MXFP8's E8M0 scales, held in fp32, as their bytes). Both conversions are
exact (the values are FP8 values), so backward multiplies the same values bit for bit. The cost: one
conversion per saved operand in forward, one gather from a 256-entry table per operand in backward
(about a fifth of torch's own FP8 conversion on a CPU, which decodes each element in scalar code).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .numerics.gemm import Operand
from .numerics.microscaling import e8m0_to_float

__all__ = ["ENV_SAVE_FP8", "saves_fp8_bytes", "pack", "unpack", "decode_fp8"]

ENV_SAVE_FP8 = "FP8TRAIN_SAVE_FP8"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E2M1 = "e2m1"  # the form of NVFP4 values packed two to a byte
E8M0 = "e8m0"  # the form of MX operands whose power-of-2 scales are kept as their E8M0 bytes


def saves_fp8_bytes() -> bool:
    """Whether emulated operands are kept as FP8 bytes for backward (`FP8TRAIN_SAVE_FP8`, default 0)."""
    value = os.environ.get(ENV_SAVE_FP8)
    if value is None:  # the default, without a string method's call (asked twice per FP8 call)
        return False
    value = value.strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(
            f"{ENV_SAVE_FP8}={value!r} is not valid: 1 keeps FP8 operands for backward as FP8 bytes "
            "on every GEMM path, 0 (the default) as the GEMM takes them"
        )
    return value == "1"


def _table(dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 256 values of `dtype`'s byte codes in `out_dtype`, built on `device` (no host transfer)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(out_dtype)


def decode_fp8(values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 `values` as `out_dtype`: one gather of each byte's value (exact: FP8 values are bf16 and
    fp32 values), the same bits as `values.to(out_dtype)`."""
    codes = values.view(torch.uint8).reshape(-1).int()
    return torch.index_select(_table(values.dtype, out_dtype, values.device), 0, codes).view(values.shape)


# E2M1 in float8_e4m3fn: code c (sign << 3 | magnitude index) <-> its E4M3 byte
_E2M1_E4M3_BYTES = torch.tensor(
    [0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C], dtype=torch.uint8
)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of E2M1 values held as float8_e4m3fn (sign bit, then the magnitude's index):
    a 256-entry table of every byte's code, built on the device, then one gather."""
    byte = torch.arange(256, dtype=torch.uint8, device=values.device)
    index = torch.bucketize(byte & 0x7F, _E2M1_E4M3_BYTES.to(values.device))  # exact bytes: a search
    table = index.to(torch.uint8) | ((byte >> 7) << 3)
    codes = torch.index_select(table, 0, values.view(torch.uint8).reshape(-1).int())
    return codes.view(values.shape)


def _e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    table = torch.cat([_E2M1_E4M3_BYTES, _E2M1_E4M3_BYTES | 0x80]).to(packed.device)
    return torch.index_select(table, 0, codes.reshape(-1).int()).view(codes.shape).view(torch.float8_e4m3fn)


def _e8m0_codes(scale_inv: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes of MX scales 2**(byte - 127) in float32 (NaN: 255), exactly (frexp reads the
    exponent of subnormals too: 2**-127 is 0.5 * 2**-126)."""
    _, exponent = torch.frexp(scale_inv)
    return torch.where(torch.isnan(scale_inv), 255, exponent + 126).to(torch.uint8)


def pack(operand: Operand, e2m1: bool = False, e8m0: bool = False) -> tuple[Operand, Optional[object]]:
    """The operand as backward keeps it, and its form for `unpack`: None (kept as it is), the dtype to
    decode FP8 bytes to, E2M1 (NVFP4 values packed two to a byte; `e2m1`: the values are E2M1) or E8M0
    (`e8m0`: the scales are MX scales, kept as their bytes)."""
    values = operand.values
    if ENV_SAVE_FP8 not in os.environ or not saves_fp8_bytes():  # (unset: the default, no call)
        return operand, None
    if e8m0 and operand.block is not None:
        return _with_values(operand, values, _e8m0_codes(operand.scale_inv)), E8M0
    if e2m1 and values.dtype == torch.float8_e4m3fn and values.dim() == 2 and values.shape[-1] % 2 == 0:
        codes = _e2m1_codes(values)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scale_inv = operand.scale_inv.to(torch.float8_e4m3fn)  # exact: E4M3 block scales in fp32
        return _with_values(operand, packed, scale_inv), E2M1
    if values.dtype in _FP8_DTYPES:
        return operand, None
    # per-tensor operands hold E4M3 values (inputs and weights) in bf16/fp32: exact as E4M3 bytes
    return _with_values(operand, values.to(torch.float8_e4m3fn)), values.dtype


def unpack(operand: Operand, form: Optional[object]) -> Operand:
    """`pack`'s operand with the values the GEMM takes: the same values, bit for bit."""
    if form is None:
        return operand
    if form == E2M1:
        return _with_values(operand, _e2m1_values(operand.values), operand.scale_inv.float())
    if form == E8M0:
        return _with_values(operand, operand.values, e8m0_to_float(operand.scale_inv))
    return _with_values(operand, decode_fp8(operand.values, form))


def _with_values(operand: Operand, values: torch.Tensor, scale_inv: Optional[torch.Tensor] = None) -> Operand:
    scale_inv = operand.scale_inv if scale_inv is None else scale_inv
    return Operand(
        values, scale_inv, operand.block, operand.transposed, operand.tensor_scale, operand.rotated
    )
