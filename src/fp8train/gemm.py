"""FP8 GEMM: `torch._scaled_mm` where the device and shape allow it, else an exact emulation.

Paths, all computing (a @ b) * a_scale_inv * b_scale_inv from FP8 operands:
- "scaled_mm": the hardware FP8 GEMM (Hopper and newer; also runs, slowly, on CPU).
- "bf16": FP8 values are exact in bf16, so a bf16 GEMM multiplies them exactly and accumulates in
  fp32; its output is rounded to bf16 (relative error <= 2**-9) as with an FP8 GEMM whose output
  dtype is bf16. Several times faster than fp32 on CPU, so it is the CPU default.
- "fp32": dequantize-free fp32 GEMM of the FP8 values: exact products, fp32 accumulation.
`FP8TRAIN_GEMM` = auto (default) | scaled_mm | bf16 | fp32 overrides the choice; a shape the forced
path cannot take falls back to "fp32".
"""

from __future__ import annotations

import os

import torch

__all__ = ["gemm", "choose_path", "PATHS"]

PATHS = ("scaled_mm", "bf16", "fp32")
ENV_PATH = "FP8TRAIN_GEMM"


def _scaled_mm_fits(device: torch.device, m: int, k: int, n: int) -> bool:
    if not hasattr(torch, "_scaled_mm") or any(d % 16 for d in (m, k, n)):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def choose_path(device: torch.device, m: int, k: int, n: int) -> str:
    """The GEMM path for an (m x k) @ (k x n) product on `device`."""
    forced = os.environ.get(ENV_PATH, "auto").strip() or "auto"
    if forced not in PATHS + ("auto",):
        raise ValueError(f"{ENV_PATH}={forced!r} is not valid: use auto, scaled_mm, bf16 or fp32")
    if forced == "scaled_mm":
        return "scaled_mm" if _scaled_mm_fits(device, m, k, n) else "fp32"
    if forced != "auto":
        return forced
    if device.type == "cuda" and _scaled_mm_fits(device, m, k, n):
        return "scaled_mm"
    return "bf16"


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    path: str = "auto",
) -> torch.Tensor:
    """(a @ b) * a_scale_inv * b_scale_inv for FP8 `a` (m x k) and `b` (k x n)."""
    if path == "auto":
        path = choose_path(a.device, a.shape[0], a.shape[1], b.shape[1])
    if path == "scaled_mm":
        return torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            scale_a=a_scale_inv.reshape(()).float(),
            scale_b=b_scale_inv.reshape(()).float(),
            out_dtype=out_dtype,
        )
    compute = torch.bfloat16 if path == "bf16" else torch.float32
    product = torch.mm(a.to(compute), b.to(compute)).float()
    return product.mul_(a_scale_inv * b_scale_inv).to(out_dtype)
