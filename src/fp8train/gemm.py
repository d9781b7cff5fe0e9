"""FP8 GEMM: `torch._scaled_mm` where the device and shape allow it, else an exact emulation.

Paths, all computing (a @ b) * a_scale_inv * b_scale_inv (+ bias) from FP8-valued operands:
- "scaled_mm": the hardware FP8 GEMM (Ada, Hopper and newer), scales applied on the device.
- "bf16": FP8 values are exact in bf16, so a GEMM multiplies them exactly and accumulates in fp32;
  its output is rounded once to bf16, then scaled in fp32. The CPU default. Its kernel is a bf16
  GEMM where the CPU has bf16 instructions (AVX512-BF16, AMX, Arm BF16), else an fp32 GEMM of the
  same values whose output is rounded to bf16 (`bf16_kernel`): the same numerics up to the order of
  fp32 accumulation, and never the slowdown (two orders of magnitude) of bf16 GEMMs on CPUs without them.
- "fp32": exact products, fp32 accumulation, fp32 output.
`FP8TRAIN_GEMM` = auto (default) | scaled_mm | bf16 | fp32 overrides the choice (bf16: the bf16
kernel itself, whatever the CPU); a shape the forced path cannot take falls back to emulation. The
scales stay tensors on the device throughout: no host read (a Python float alpha would wait for the
GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .torch_internals import has_scaled_mm, scaled_mm

__all__ = [
    "gemm",
    "matmul",
    "Operand",
    "choose_path",
    "bf16_kernel",
    "cpu_bf16_instructions",
    "has_scaled_mm",
    "PATHS",
]

PATHS = ("scaled_mm", "bf16", "fp32")
ENV_PATH = "FP8TRAIN_GEMM"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _forced() -> str:
    forced = os.environ.get(ENV_PATH, "auto").strip() or "auto"
    if forced not in PATHS + ("auto",):
        raise ValueError(f"{ENV_PATH}={forced!r} is not valid: use auto, scaled_mm, bf16 or fp32")
    return forced


def _scaled_mm_fits(device: torch.device, m: int, k: int, n: int) -> bool:
    if not has_scaled_mm(device.type) or any(d % 16 or d == 0 for d in (m, k, n)):
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


def cpu_bf16_instructions(cpuinfo: str = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively (a fact of the machine, read once), and why. Not a
    timing, so every process of a job makes the same choice. oneDNN, which runs torch's bf16 GEMMs
    on the CPU, can be limited below the CPU (ONEDNN_MAX_CPU_ISA): then it has no bf16 either."""
    try:
        with open(cpuinfo) as f:
            flags = {w for line in f if line.startswith(("flags", "Features")) for w in line.split()}
    except OSError:
        return False, f"the CPU's instructions are unknown here (no {cpuinfo})"
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if not found:
        return False, "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or bf16 flag)"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if isa not in ("ALL", "DEFAULT") and "BF16" not in isa and "AMX" not in isa:
        return False, f"ONEDNN_MAX_CPU_ISA={isa} keeps oneDNN below this CPU's {', '.join(found)}"
    return True, f"this CPU has {', '.join(found)}"


_CPU_BF16 = cpu_bf16_instructions()  # read at import: traced code (torch.compile) only looks it up


def bf16_kernel(device: torch.device) -> tuple[str, str]:
    """The kernel that computes the "bf16" path on `device` ("bf16" or "fp32"), and why."""
    if device.type != "cpu":
        return "bf16", f"{device.type} GEMMs multiply bf16 natively"
    if _forced() == "bf16":
        return "bf16", f"{ENV_PATH}=bf16 asks for the bf16 kernel"
    native, why = _CPU_BF16
    return ("bf16" if native else "fp32"), why


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(a @ b) * a_scale_inv * b_scale_inv (+ bias) for FP8-valued `a` (m x k) and `b` (k x n)."""
    if a.dtype in _FP8_DTYPES:
        if not _scaled_mm_fits(a.device, a.shape[0], a.shape[1], b.shape[1]):
            why = (
                "every dimension must be a multiple of 16"
                if has_scaled_mm(a.device.type)
                else f"torch {torch.__version__} has no such kernel on {a.device.type}"
            )
            raise ValueError(
                f"FP8 operands of shape {tuple(a.shape)} x {tuple(b.shape)} on {a.device} cannot take "
                f"torch._scaled_mm ({why}); set FP8TRAIN_GEMM=bf16"
            )
        y = scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            a_scale_inv.reshape(()).float(),
            b_scale_inv.reshape(()).float(),
            out_dtype,
        )
        return y if bias is None else y + bias.to(out_dtype)
    if a.dtype == torch.bfloat16 and bf16_kernel(a.device)[0] == "fp32":
        y = torch.mm(a.float(), b.float()).to(torch.bfloat16)  # the bf16 path's rounding, fp32 speed
    else:
        y = torch.mm(a, b.to(a.dtype))
    # The scale as a 1-element tensor takes part in type promotion (a 0-dim one would not): the
    # product is computed in fp32 and written in one pass, with the bias added in the same one.
    scale = (a_scale_inv * b_scale_inv).reshape(1)
    y = torch.mul(y, scale) if bias is None else torch.addcmul(bias.to(torch.float32), y, scale)
    return y.to(out_dtype)


@dataclass(frozen=True)
class Operand:
    """A GEMM operand quantized to a low-precision format: its values (an FP8 dtype, or bf16/fp32
    holding FP8 values exactly) and the inverse scale that dequantizes them, one for the whole tensor
    (`block` None) or one per `block` = (rows, columns) of the values as stored; a two-level format
    (NVFP4) also divides the whole tensor by `tensor_scale`. `transposed` operands are used as the
    transpose of what is stored (a view: nothing is copied or requantized). `rotated` operands hold a
    tensor after a random Hadamard transform along their reduction dimension: only a product with
    another operand rotated alike is the product of the original tensors."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block: Optional[tuple[int, int]] = None
    transposed: bool = False
    tensor_scale: Optional[torch.Tensor] = None
    rotated: bool = False

    def t(self) -> Operand:
        # built field by field: dataclasses.replace is not traceable by dynamo in every torch
        return Operand(
            self.values, self.scale_inv, self.block, not self.transposed, self.tensor_scale, self.rotated
        )

    def oriented(self) -> torch.Tensor:
        return self.values.t() if self.transposed else self.values

    def dequantize(self) -> torch.Tensor:
        """The values times their scale_inv (divided by the tensor scale), in fp32: exact where the
        scales are powers of 2, one correctly rounded division for a two-level format."""
        values = self.values.float()
        if self.block is None:
            values = values * self.scale_inv
        else:
            rows, cols = self.block
            r, c = values.shape
            values = values * self.scale_inv.repeat_interleave(rows, 0)[:r].repeat_interleave(cols, 1)[:, :c]
        if self.tensor_scale is not None:
            values = values / self.tensor_scale
        return values.t() if self.transposed else values

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return self.values, self.scale_inv, self.tensor_scale

    @property
    def layout(self) -> tuple:
        """What makes the operand again with its `tensors()` (`Operand.rebuild`)."""
        return self.block, self.transposed, self.rotated

    @staticmethod
    def rebuild(tensors: tuple, layout: tuple) -> Operand:
        values, scale_inv, tensor_scale = tensors
        block, transposed, rotated = layout
        return Operand(values, scale_inv, block, transposed, tensor_scale, rotated)


def matmul(
    a: Operand, b: Operand, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """a @ b (+ bias) for quantized operands: `gemm` when both have one scale each (the hardware FP8
    GEMM where it applies), else both dequantized block by block and multiplied in fp32."""
    if a.block is None and b.block is None:
        return gemm(a.oriented(), a.scale_inv, b.oriented(), b.scale_inv, out_dtype, bias)
    y = a.dequantize() @ b.dequantize()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
