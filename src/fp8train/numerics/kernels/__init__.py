"""Fused FP8 quantization kernels (Triton): one read of the high-precision tensor per operand, writing
the FP8 values, their transposed copy, the scales and the amax in the same pass (docs/design.md,
section 6, "Fused quantization kernels"). Equal bit for bit to the torch path (cast.py,
quantization/block_scaling.py), which runs wherever these do not: CPUs, GPUs without Triton, and code under
torch.compile, where inductor fuses the torch path's cast with its neighbours (design.md says why).

Triton is optional: this module imports it only when a kernel is asked for
(`fused_cast_available` says whether one can run). The kernels run on CUDA (and ROCm) tensors, or on
CPU tensors where triton_cast.py was first imported with TRITON_INTERPRET=1 (Triton's interpreter,
the tests' way) and the caller allows it explicitly.

- `cast_with_amax`: delayed scaling's cast with the scale in force, recording max|x| (one read): the
  torch path's seam, `cast.cast_with_amax`, in one kernel;
- `amax_then_cast`: current scaling's amax, then the cast with its scale (two reads);
  (both triton_cast.py's functions themselves, imported where first asked for: `__getattr__`)
- `cast_tiles_1x128`, `cast_blocks_128x128`: block scaling's operands, as quantization/block_scaling.py
  makes them;
- `microscaling()`: the module of the MXFP8 and NVFP4 kernels (triton_microscaling.py).

`use_fused_kernels(x)` is the recipes' one dispatch rule, read at each call from the environment:
`FP8TRAIN_FUSED_KERNELS` = auto (default: the kernels wherever `fused_cast_available`) | off (the
torch path everywhere) | interpret (the kernels on CPU tensors in Triton's interpreter too, for
tests: TRITON_INTERPRET=1 must be set before the kernels are first imported).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable, Optional

import torch

from ..operand import Operand

__all__ = [
    "ENV_FUSED_KERNELS",
    "use_fused_kernels",
    "microscaling",
    "fused_cast_available",
    "interpreted",
    "cast_with_amax",
    "amax_then_cast",
    "cast_tiles_1x128",
    "cast_blocks_128x128",
]


@functools.cache
def _triton_installed() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (hidden)
        return False


def _kernels():
    from . import triton_cast  # imports triton: only here, on first use

    return triton_cast


# the per-tensor casts, triton_cast.py's own functions, looked up where they are first asked for
# (a module attribute, PEP 562: triton is imported then, not with this package)
_PER_TENSOR = ("cast_with_amax", "amax_then_cast")


def __getattr__(name: str) -> Callable:
    """`cast_with_amax` and `amax_then_cast`: triton_cast.py's (imported here, on first use). Without
    triton an AttributeError, as for any missing attribute (`hasattr` and `getattr` with a default
    answer, not raise ImportError)."""
    if name in _PER_TENSOR:
        if not _triton_installed():
            raise AttributeError(
                f"{__name__}.{name} is a Triton kernel and triton is not installed: install triton (a "
                "CUDA machine's torch brings it), or cast with fp8train.numerics.cast (the torch path)"
            )
        return getattr(_kernels(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def microscaling():
    """triton_microscaling.py, the MXFP8 and NVFP4 kernels (imports triton: only on first use)."""
    from . import triton_microscaling

    return triton_microscaling


ENV_FUSED_KERNELS = "FP8TRAIN_FUSED_KERNELS"
_FUSED_MODES = ("auto", "off", "interpret")


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the recipes quantize `x` with the fused kernels (`FP8TRAIN_FUSED_KERNELS`, read at each
    call): never under torch.compile (inductor fuses the torch path) nor with `off`; with `auto`
    (default) where `fused_cast_available(x.device)`; with `interpret` also on CPU tensors, in
    Triton's interpreter, which must then be on (else an error: a forced kernel never silently falls
    back to the torch path)."""
    mode = os.environ.get(ENV_FUSED_KERNELS, "auto")
    if (mode == "auto" and not x.is_cuda) or torch.compiler.is_compiling():  # the CPU's case, cheaply
        return False
    mode = mode.strip().lower() or "auto"
    if mode not in _FUSED_MODES:
        raise ValueError(
            f"{ENV_FUSED_KERNELS}={mode!r} is not valid: auto (the default: the fused Triton kernels on "
            "CUDA devices), off (the torch path everywhere) or interpret (tests: the kernels also on CPU "
            "tensors, with TRITON_INTERPRET=1 set before they are imported)"
        )
    if mode == "off" or (mode == "auto" and not x.is_cuda):
        return False
    if mode == "interpret" and x.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            f"{ENV_FUSED_KERNELS}=interpret runs the kernels on CPU tensors in Triton's interpreter, "
            "which is off: set TRITON_INTERPRET=1 (and install triton and numpy) before fp8train's kernels "
            f"are first imported, e.g. in the environment of the process, or unset {ENV_FUSED_KERNELS}"
        )
    return fused_cast_available(x.device, allow_interpreter=mode == "interpret")


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when they were first
    imported); imports them. False without triton."""
    return _triton_installed() and _kernels().INTERPRETED


def fused_cast_available(device: torch.device | str, *, allow_interpreter: bool = False) -> bool:
    """Whether the fused kernels cast tensors on `device`: triton installed and a CUDA device of
    capability 8.0 or later (or a ROCm device) with compiled kernels; or, with `allow_interpreter`
    (tests), kernels interpreted on the CPU. False under torch.compile: there inductor's own fusion of
    the torch path is in charge (docs/design.md, section 6)."""
    device_type = torch.device(device).type
    if torch.compiler.is_compiling() or not (device_type == "cuda" or allow_interpreter):
        return False
    if not _triton_installed():
        return False
    if device_type == "cuda":
        return torch.cuda.is_available() and not interpreted() and _triton_runs_on(torch.device(device))
    return device_type == "cpu" and interpreted()


def _triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for NVIDIA GPUs of compute capability 8.0 and later (and for ROCm's)."""
    if torch.version.hip is not None:
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cast_tiles_1x128(
    x2d: torch.Tensor,
    power_2: bool,
    dtype: torch.dtype = torch.float32,
    *,
    transposed_dtype: Optional[torch.dtype] = None,
    encoding: str = "e4m3",
    block_m: Optional[int] = None,
) -> tuple[Operand, Optional[Operand]]:
    """x2d in 1x128 tiles along its last dimension, as quantization/block_scaling.py's `_tiles(x2d, power_2)`
    (values as `dtype`), and with `transposed_dtype` also `_tiles(x2d, power_2, transposed=True)`
    (x2d.t() in 1x128 tiles along the tokens, values as that dtype): both in one read of x2d."""
    values, scale_inv, values_t, scale_inv_t = _kernels().cast_tiles(
        x2d, 1, encoding, dtype, power_2, transposed_dtype=transposed_dtype, block_m=block_m
    )
    tile = (1, _kernels().TILE)
    transposed = None if values_t is None else Operand(values_t, scale_inv_t, tile, True)
    return Operand(values, scale_inv, tile), transposed


def cast_blocks_128x128(
    weight: torch.Tensor, power_2: bool, dtype: torch.dtype = torch.float8_e4m3fn, *, encoding: str = "e4m3"
) -> Operand:
    """The weight in 128x128 blocks, as `BlockQuantization.quantize_weight` makes its operand (values
    as `dtype`), in one read."""
    values, scale_inv, _, _ = _kernels().cast_tiles(weight, 128, encoding, dtype, power_2)
    return Operand(values, scale_inv, (128, 128))
