"""FP8 GEMM: `torch._scaled_mm` where the device and shape allow it, else an exact emulation.

Paths of a per-tensor-scaled GEMM, all computing (a @ b) * a_scale_inv * b_scale_inv (+ bias) from
FP8-valued operands:
- "scaled_mm": the hardware FP8 GEMM (Ada, Hopper and newer), scales applied on the device.
- "bf16": FP8 values are exact in bf16, so a GEMM multiplies them exactly and accumulates in fp32;
  its output is rounded once to bf16, then scaled in fp32. The CPU default. Its kernel is a bf16
  GEMM where the CPU has bf16 instructions (AVX512-BF16, AMX, Arm BF16), else an fp32 GEMM of the
  same values whose output is rounded to bf16 (`bf16_kernel`): the same numerics up to the order of
  fp32 accumulation, and never the slowdown (two orders of magnitude) of bf16 GEMMs on CPUs without them.
- "fp32": exact products, fp32 accumulation, fp32 output.
`FP8TRAIN_GEMM` = auto (default) | scaled_mm | bf16 | fp32 overrides the choice (bf16: the bf16
kernel itself, whatever the CPU); a shape the forced path cannot take falls back to emulation.
`FP8TRAIN_CPU_BF16` = auto (default) | yes | no forces the answer of the CPU probe that picks the bf16
path's kernel, so that either kernel, and its numerics, can be run on any CPU (the test suite runs
both). The
scales stay tensors on the device throughout: no host read (a Python float alpha would wait for the
GPU).

Block-scaled operands (block scaling, MXFP8, NVFP4) take torch._scaled_mm's block-scaled kernel of
their format where the device has it (`kernel_choice`: SM90 for 1x128/128x128 blocks, SM100+ for MX
and NVFP4; block_scaled_mm.py builds the layouts), else the exact emulation: dequantized block by block
and multiplied in fp32. `FP8TRAIN_GEMM=scaled_mm` also tries the kernels on the CPU, bf16/fp32 turn
them off. Each kernel is probed once per device before it is trusted (torch_internals.py).

Fast accumulation (`FP8TRAIN_FAST_ACCUM`): the forward GEMM accumulates without Hopper's periodic
promotion to fp32 (`use_fast_accum=True`, TransformerEngine's and torchao's choice for fprop), the
gradient GEMMs with it (their sums over K = out_features or tokens are long, and gradients carry
small differences of large terms). forward (default) | all | none.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..torch_internals import cuda_capability, device_index, has_scaled_mm, scaled_mm, scaled_mm_problem
from . import block_scaled_mm, cast
from .cast import FUSED_MIN_ELEMENTS
from .gemm_output import fused_output_applies, scaled_output
from .microscaling import float32_matmul
from .operand import Operand

__all__ = [
    "gemm",
    "matmul",
    "Operand",
    "choose_path",
    "kernel_choice",
    "kernel_runs",
    "recipe_gemm",
    "fast_accumulation",
    "bf16_kernel",
    "cpu_bf16_instructions",
    "has_scaled_mm",
    "operand_dtype",
    "PATHS",
    "ROLES",
]

PATHS = ("scaled_mm", "bf16", "fp32")
ENV_PATH = "FP8TRAIN_GEMM"
ENV_FAST_ACCUM = "FP8TRAIN_FAST_ACCUM"
ENV_CPU_BF16 = "FP8TRAIN_CPU_BF16"
FAST_ACCUM = {"forward": ("forward",), "all": ("forward", "dgrad", "wgrad"), "none": ()}
ROLES = ("forward", "dgrad", "wgrad")  # y = x @ w.T, dx = g @ w, dw = g.T @ x
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_CHOICES = PATHS + ("auto",)


def _forced() -> str:
    forced = os.environ.get(ENV_PATH) or "auto"
    if forced not in _CHOICES:
        forced = forced.strip() or "auto"
    if forced not in _CHOICES:
        raise ValueError(f"{ENV_PATH}={forced!r} is not valid: use auto, scaled_mm, bf16 or fp32")
    return forced


def fast_accumulation(role: str) -> bool:
    """Whether the `role` GEMM ("forward", "dgrad", "wgrad") asks torch._scaled_mm for fast
    accumulation (`FP8TRAIN_FAST_ACCUM`; FP4 GEMMs never take it)."""
    choice = os.environ.get(ENV_FAST_ACCUM) or "forward"
    if choice not in FAST_ACCUM:
        choice = choice.strip() or "forward"
        if choice not in FAST_ACCUM:
            raise ValueError(f"{ENV_FAST_ACCUM}={choice!r} is not valid: use forward, all or none")
    return role in FAST_ACCUM[choice]


# the compute capabilities each torch._scaled_mm kernel needs (cuBLASLt's), checked before its probe
_NEEDS = {
    "tensorwise": (lambda cap: cap >= (8, 9), "8.9 or newer (Ada, Hopper, Blackwell)"),
    "block": (lambda cap: cap[0] == 9, "9.x (Hopper; cuBLASLt has 1x128/128x128 block scales there only)"),
    "mxfp8": (lambda cap: cap[0] >= 10, "10.0 or newer (Blackwell)"),
    "nvfp4": (lambda cap: cap[0] >= 10, "10.0 or newer (Blackwell)"),
}


def kernel_runs(kernel: str, device: torch.device) -> tuple[bool, str]:
    """Whether torch._scaled_mm's `kernel` (torch_internals.SCALED_MM_KERNELS) runs on `device`, and
    why: the GPU's compute capability, then one probe of the kernel per device."""
    if device.type == "cuda":
        cap = cuda_capability(device_index(device))
        needs, what = _NEEDS[kernel]
        if not needs(cap):
            return (
                False,
                f"the {kernel} kernel needs compute capability {what}; this GPU has {cap[0]}.{cap[1]}",
            )
    problem = scaled_mm_problem(device.type, device_index(device), kernel)
    if problem:
        return False, problem
    return True, f"torch._scaled_mm runs its {kernel} kernel on {device.type} (probed)"


def kernel_choice(kernel: str, device: torch.device) -> tuple[bool, str]:
    """Whether GEMMs on `device` use torch._scaled_mm's `kernel`, and why: the setting
    (`FP8TRAIN_GEMM`; auto uses the kernels on CUDA only), then `kernel_runs`."""
    forced = _forced()
    if forced in ("bf16", "fp32"):
        return False, f"{ENV_PATH}={forced} asks for the emulation"
    if device.type != "cuda" and (device.type != "cpu" or forced != "scaled_mm"):
        return False, f"{device.type} GEMMs are emulated (unless {ENV_PATH}=scaled_mm on the CPU)"
    return kernel_runs(kernel, device)


def _scaled_mm_fits(device: torch.device, m: int, k: int, n: int) -> bool:
    return all(d % 16 == 0 and d > 0 for d in (m, k, n)) and kernel_runs("tensorwise", device)[0]


def recipe_gemm(kernel: str, device: torch.device) -> tuple[str, str]:
    """Which GEMM a recipe whose torch._scaled_mm kernel is `kernel` (its `Quantization.kernel`) runs
    on `device` for shapes its kernel takes, and why (what `fp8train info` prints):
    "torch._scaled_mm (<kernel>)" or the emulation that replaces it."""
    native, why = kernel_choice(kernel, device)
    if kernel == "tensorwise" and device.type == "cpu" and _forced() == "auto":
        why = "the CPU default is the exact emulation"
    if native:
        return f"torch._scaled_mm ({kernel} scales)", why
    if kernel == "tensorwise":
        path = choose_path(device, 1024, 1024, 1024)
        return f"the {path} emulation (FP8 values exact, fp32 accumulation)", why
    return "the emulation (block-dequantized operands, an fp32 matmul)", why


def choose_path(device: torch.device, m: int, k: int, n: int) -> str:
    """The GEMM path for an (m x k) @ (k x n) per-tensor-scaled product on `device`."""
    forced = _forced()
    if forced == "scaled_mm" or (forced == "auto" and device.type == "cuda"):
        return "scaled_mm" if device.type in ("cuda", "cpu") and _scaled_mm_fits(device, m, k, n) else "bf16"
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


def _cpu_bf16_probe() -> tuple[bool, str]:
    """The CPU's bf16 instructions as probed at import, unless `FP8TRAIN_CPU_BF16` forces the answer."""
    forced = os.environ.get(ENV_CPU_BF16, "auto").strip().lower() or "auto"
    if forced == "auto":
        return _CPU_BF16
    if forced not in ("yes", "no"):
        raise ValueError(f"{ENV_CPU_BF16}={forced!r} is not valid: use auto, yes or no")
    machine = "has" if _CPU_BF16[0] else "has no"
    return forced == "yes", f"{ENV_CPU_BF16}={forced} forces the probe (this CPU {machine} bf16 instructions)"


def bf16_kernel(device: torch.device) -> tuple[str, str]:
    """The kernel that computes the "bf16" path on `device` ("bf16" or "fp32"), and why."""
    if device.type != "cpu":
        return "bf16", f"{device.type} GEMMs multiply bf16 natively"
    if _forced() == "bf16":
        return "bf16", f"{ENV_PATH}=bf16 asks for the bf16 kernel"
    native, why = _cpu_bf16_probe()
    return ("bf16" if native else "fp32"), why


_PATH_DTYPES = {"scaled_mm": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def operand_dtype(path: str, device: torch.device) -> torch.dtype:
    """The dtype that holds the operands of a `path` GEMM (PATHS) on `device`: FP8 for scaled_mm;
    float32 for the fp32 path and for the bf16 path where its kernel is fp32 (`bf16_kernel`: a CPU
    without bf16 instructions), which then multiplies them as they are (no upcast per GEMM) and rounds
    its output to bf16 (`gemm`'s `bf16_output`); else bf16. FP8 values are exact in each."""
    if path == "bf16" and bf16_kernel(device)[0] == "fp32":
        return torch.float32
    return _PATH_DTYPES[path]


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    fast_accum: bool = False,
    bf16_output: bool = False,
) -> torch.Tensor:
    """(a @ b) * a_scale_inv * b_scale_inv (+ bias) for FP8-valued `a` (m x k) and `b` (k x n).
    Emulated, the product is rounded to bf16 before it is scaled where the operands are bf16 or
    `bf16_output` (the bf16 path with float32 operands, `operand_dtype`): the bf16 path's numerics."""
    if a.dtype in _FP8_DTYPES:
        if not _scaled_mm_fits(a.device, a.shape[0], a.shape[1], b.shape[1]):
            ok, why = kernel_runs("tensorwise", a.device)
            raise ValueError(
                f"FP8 operands of shape {tuple(a.shape)} x {tuple(b.shape)} on {a.device} cannot take "
                f"torch._scaled_mm ({'every dimension must be a multiple of 16' if ok else why}); "
                "set FP8TRAIN_GEMM=bf16"
            )
        fused = block_scaled_mm.kernel_adds_bias(out_dtype, bias)
        # torch._scaled_mm takes a row-major, b column-major: the forward's x and w.t() are so; the
        # backward's w (dgrad), g.t() and x (wgrad) are so where the fused kernels cast them (their
        # transposed copies, quantization/per_tensor.py: these calls then copy nothing); the torch
        # path's (and FSDP2-gathered weights) are copied here, one 1-byte pass each
        y = scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            a_scale_inv.reshape(()).float(),
            b_scale_inv.reshape(()).float(),
            out_dtype,
            bias if fused else None,
            fast_accum,
        )
        return y if bias is None or fused else y + bias.to(out_dtype)
    if bf16_output and a.dtype == torch.float32 and b.dtype == torch.float32:
        y = torch.mm(a, b)  # fp32 operands of the bf16 path: its rounding in the output's one pass
        if (
            cast.COMPILED_KERNELS.running  # (fused_output_applies's first condition, inline)
            and y.shape[0] * y.shape[1] >= FUSED_MIN_ELEMENTS
            and fused_output_applies(y, a_scale_inv, bias)
        ):
            # (y is this call's own, outside autograd: written over where the output dtype is y's and
            # no dispatch mode may hold it, gemm_output.py; cast operands never require grad, the
            # check is the proof)
            out = scaled_output(y, a_scale_inv, b_scale_inv, bias, out_dtype, overwrite=not y.requires_grad)
            if out is not None:
                return out
            y = torch.mm(a, b)  # (the kernel failed, once per process: y may be written over)
        y = y.to(torch.bfloat16)
    elif (bf16_output and a.dtype == torch.float32) or (
        a.dtype == torch.bfloat16 and bf16_kernel(a.device)[0] == "fp32"
    ):
        y = torch.mm(a.float(), b.float()).to(torch.bfloat16)
    else:
        y = torch.mm(a, b if b.dtype == a.dtype else b.to(a.dtype))
    scale = a_scale_inv * b_scale_inv
    scale = scale[None] if not scale.shape else scale.reshape(1)  # (0-dim scales: a view, no call)
    # The scale as a 1-element tensor takes part in type promotion (a 0-dim one would not): the
    # product is computed in fp32 and written in one pass. The bias is added after it, a rounding of
    # its own (torch's addcmul would round once where the CPU kernel is built with fused multiply-adds,
    # and inductor's C++, gemm_output.py, rounds twice: the same bits either way this way).
    y = torch.mul(y, scale)
    if bias is not None:
        y = y.add_(bias)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def matmul(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    role: str = "forward",
    path: Optional[str] = None,
) -> torch.Tensor:
    """a @ b (+ bias) for quantized operands, the `role` GEMM of a layer (ROLES): `gemm` when both
    have one scale each (the hardware FP8 GEMM where it applies; `path`, the call's GEMM path, says
    whether float32 operands take the bf16 path's rounding); block-scaled operands through
    torch._scaled_mm's kernel of their format where the device has it (`kernel_choice`) and the
    shape fits (`block_scaled_mm.fits`), else both dequantized block by block and multiplied in fp32."""
    if a.block is None and b.block is None:
        a_values = a.values.t() if a.transposed else a.values
        b_values = b.values.t() if b.transposed else b.values
        fast_accum = a_values.dtype in _FP8_DTYPES and fast_accumulation(role)  # only scaled_mm takes it
        return gemm(a_values, a.scale_inv, b_values, b.scale_inv, out_dtype, bias, fast_accum, path == "bf16")
    fast_accum = fast_accumulation(role)
    (m, k), n = a.oriented().shape, b.oriented().shape[1]
    fmt = block_scaled_mm.block_format(a, b)
    if (
        fmt is not None
        and block_scaled_mm.fits(fmt, a, b, m, k, n)
        and kernel_choice(fmt, a.values.device)[0]
    ):
        return block_scaled_mm.block_scaled_mm(fmt, a, b, out_dtype, bias, fast_accum)
    y = float32_matmul(a.dequantize(), b.dequantize())
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
