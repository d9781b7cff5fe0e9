"""FP8 GEMM: `torch._scaled_mm` where the device and shape allow it, else an exact emulation.

Paths, all computing round_out((a @ b) * a_scale_inv * b_scale_inv) from FP8-valued operands:
- "scaled_mm": the hardware FP8 GEMM (Hopper and newer; also runs, slowly, on CPU).
- "bf16": FP8 values are exact in bf16, so a bf16 GEMM multiplies them exactly and accumulates in
  fp32; the scale is applied to the fp32 accumulator (addmm's alpha) and the result is rounded once
  to bf16, as an FP8 GEMM with bf16 output does. Several times faster than fp32 on CPU: the CPU default.
- "fp32": the same in fp32: exact products, fp32 accumulation, fp32 output.
`FP8TRAIN_GEMM` = auto (default) | scaled_mm | bf16 | fp32 overrides the choice; a shape the forced
path cannot take falls back to emulation.

Operands are kept in the dtype their GEMMs consume (`operand`), so an FP8 tensor that feeds a forward
and a backward GEMM is converted once.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

__all__ = ["gemm", "choose_path", "operand", "PATHS"]

PATHS = ("scaled_mm", "bf16", "fp32")
ENV_PATH = "FP8TRAIN_GEMM"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _forced() -> str:
    forced = os.environ.get(ENV_PATH, "auto").strip() or "auto"
    if forced not in PATHS + ("auto",):
        raise ValueError(f"{ENV_PATH}={forced!r} is not valid: use auto, scaled_mm, bf16 or fp32")
    return forced


def _scaled_mm_fits(device: torch.device, m: int, k: int, n: int) -> bool:
    if not hasattr(torch, "_scaled_mm") or any(d % 16 for d in (m, k, n)):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def choose_path(device: torch.device, m: int, k: int, n: int) -> str:
    """The GEMM path for an (m x k) @ (k x n) product on `device`."""
    forced = _forced()
    if forced == "scaled_mm" or (forced == "auto" and device.type == "cuda"):
        return "scaled_mm" if _scaled_mm_fits(device, m, k, n) else "bf16"
    return "bf16" if forced == "auto" else forced


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """addmm's ignored input (beta=0), made once per dtype and device."""
    return torch.zeros((), dtype=dtype, device=device)


def operand(q: torch.Tensor) -> torch.Tensor:
    """`q` (FP8) in the dtype this device's GEMMs consume: FP8 for scaled_mm, else bf16/fp32 (exact)."""
    path = choose_path(q.device, 16, 16, 16)
    if path == "scaled_mm":
        return q
    return q.to(torch.bfloat16 if path == "bf16" else torch.float32)


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    path: str = "auto",
) -> torch.Tensor:
    """(a @ b) * a_scale_inv * b_scale_inv (+ bias) for FP8-valued `a` (m x k) and `b` (k x n)."""
    if path == "auto":
        path = choose_path(a.device, a.shape[0], a.shape[1], b.shape[1])
    if path == "scaled_mm" and a.dtype in _FP8_DTYPES and b.dtype in _FP8_DTYPES:
        y = torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            scale_a=a_scale_inv.reshape(()).float(),
            scale_b=b_scale_inv.reshape(()).float(),
            out_dtype=out_dtype,
        )
        return y if bias is None else y + bias.to(out_dtype)
    compute = torch.float32 if path == "fp32" else torch.bfloat16
    alpha = float(a_scale_inv.float() * b_scale_inv.float())
    y = torch.addmm(_zero(compute, a.device), a.to(compute), b.to(compute), beta=0, alpha=alpha)
    if bias is not None:
        y = torch.add(y, bias)  # in the wider of the two dtypes
    return y.to(out_dtype)
