"""A GPU step model (issue 37, item 5): the step of an MLP block at TransformerEngine's 5B shapes on an
H200, predicted from counts made on the CPU. A model, not a measurement.

Counted (a dispatch mode, `ByteCounter`) on the same block scaled down by `SCALE` in every dimension
(tokens, hidden, ffn): the FLOPs of each GEMM (2 m n k) and the bytes every other kernel reads and
writes (each tensor argument read whole, each output written whole). At full size every 2-D tensor
is SCALE**2 times larger and every GEMM SCALE**3, so those factors scale the counts exactly. The FP8
steps are fp8train's eager path as it runs on a GPU with FP8 GEMMs (`FP8TRAIN_GEMM=scaled_mm`, which
the CPU's torch also runs): with the torch-op cast (an amax, the product, saturation, the FP8
conversion, and the transposed FP8 copies torch._scaled_mm needs, made in gemm.py), and with the fused
Triton kernels (`FP8TRAIN_FUSED_KERNELS`), run in Triton's interpreter in a fresh process
(`fused_counts`): each kernel launch counted as the GPU runs it, its input read whole and its
outputs (the FP8 values, the transposed copy where a later GEMM takes it, the amax) written whole,
the other kernels by the dispatch mode as before.

    step = sum(GEMM FLOPs) / peak(dtype) + sum(other kernels' bytes) / bandwidth

(no overlap between kernels; GEMMs at the dense tensor-core peak; memory-bound kernels at the
published bandwidth; both optimistic, alike for every row). Rows: bf16 torch.nn; fp8train eager, torch
ops (counted); fp8train with the fused cast kernels (counted; modelled where triton or numpy is
missing: each cast reads its bf16 operand once and writes its FP8 values and transposed copy, 4 bytes
per element, the other kernels as bf16's); compiled (torch.compile, modelled so: inductor fuses the
cast, and its transposes, into one kernel per operand); and TransformerEngine's published
delayed-scaling speedup (1.69x bf16, H200) applied to the bf16 row.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train as ft

from ...numerics import cast
from .common import GEMM_OPS, _tensors

H200 = {"bandwidth_TBps": 4.8, "bf16_TFLOPS": 989.0, "fp8_TFLOPS": 1979.0}  # dense, published
TE_5B = {"tokens": 15872, "hidden": 4096, "ffn": 16384}
TE_DELAYED_SPEEDUP = 1.69  # TransformerEngine's GEMM guide: delayed scaling vs bf16, H200
SCALE = 16
QUICK = {"scale": 64, "shapes": {**TE_5B, "tokens": 16384}}  # tests: every dimension still whole 16s
# allocations, and _unsafe_view (a view that autograd does not track as one): no bytes moved
_MOVE_NOTHING = ("empty", "empty_like", "empty_strided", "_unsafe_view")


class ByteCounter(TorchDispatchMode):
    """GEMM FLOPs and the bytes of every other kernel (views and allocations move nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.cast_elements = 0
        self.paused = 0  # inside a fused kernel's launch, counted whole by `count_launches`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in GEMM_OPS:
            a, b = args[0], args[1]
            if name == "addmm":
                a, b = args[1], args[2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif not func.is_view and name not in _MOVE_NOTHING:
            tensors = _tensors([*args, *(kwargs or {}).values()]) + _tensors([out])
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _block(linear, hidden: int, ffn: int) -> torch.nn.Module:
    return torch.nn.Sequential(linear(hidden, ffn), torch.nn.GELU(approximate="tanh"), linear(ffn, hidden))


@contextlib.contextmanager
def _gemm_path(path: str):
    saved_env, saved_fused = os.environ.get("FP8TRAIN_GEMM"), cast.COMPILED_KERNELS.enabled
    os.environ["FP8TRAIN_GEMM"] = path
    cast.COMPILED_KERNELS.set_enabled(False)
    try:
        yield
    finally:
        cast.COMPILED_KERNELS.set_enabled(saved_fused)
        if saved_env is None:
            del os.environ["FP8TRAIN_GEMM"]
        else:
            os.environ["FP8TRAIN_GEMM"] = saved_env


def count_launches(counter: ByteCounter) -> None:
    """Count each per-tensor fused kernel launch (`triton_cast._launch_tensor`, for the rest of the
    process) as the GPU runs it: its tensors read or written whole (x, the values, the transposed copy,
    the scalars); what Triton's interpreter does on the host to run it is not counted."""
    from ...numerics.kernels import triton_cast

    launch = triton_cast._launch_tensor

    def counted(x, out, out_t, scale, amax, scale_inv, *rest) -> None:
        counter.paused += 1
        try:
            launch(x, out, out_t, scale, amax, scale_inv, *rest)
        finally:
            counter.paused -= 1
        tensors = (x, out, out_t, scale, amax, scale_inv)
        counter.bytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)

    triton_cast._launch_tensor = counted


def _count(model: torch.nn.Module, x: torch.Tensor, recipe, kernels: bool = False) -> ByteCounter:
    def step() -> None:
        with ft.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = model(x)
        y.backward(torch.ones_like(y))

    step()
    counter = ByteCounter()
    if kernels:
        count_launches(counter)
    with counter:
        step()
    return counter


def _models(scale: int, shapes: dict):
    m, h, f = (shapes[k] // scale for k in ("tokens", "hidden", "ffn"))
    torch.manual_seed(0)
    bf16 = _block(torch.nn.Linear, h, f).bfloat16()
    fp8 = _block(ft.Linear, h, f).bfloat16()
    x = torch.randn(m, h, dtype=torch.bfloat16, requires_grad=True)
    return (m, h, f), bf16, fp8, x


def count_fused(scale: int, shapes: dict) -> dict:
    """The FP8 step's counts with the fused kernels (this process: Triton's interpreter on, forced)."""
    _, _, fp8, x = _models(scale, shapes)
    with _gemm_path("scaled_mm"):
        counter = _count(fp8, x, ft.DelayedScaling(amax_history_len=16), kernels=True)
    return {"flops": counter.flops, "bytes": counter.bytes}


def fused_counts(scale: int, shapes: dict) -> Optional[dict]:
    """`count_fused` in a fresh process whose kernels run in Triton's interpreter (chosen when they are
    first imported); None where triton or numpy is not installed."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None:
        return None
    src = str(Path(ft.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "FP8TRAIN_FUSED_KERNELS": "interpret",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    code = (
        "import json, torch; torch.set_num_threads(1)\n"
        "from fp8train.tools.bench import gpu_model\n"
        f"print('COUNTS' + json.dumps(gpu_model.count_fused({scale}, {shapes!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"counting the fused kernels' step failed:\n{result.stderr[-3000:]}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("COUNTS"))
    return json.loads(line[len("COUNTS") :])


def run(scale: int = SCALE, device: dict = H200, shapes: dict = TE_5B) -> dict:
    (m, h, f), bf16, fp8, x = _models(scale, shapes)
    counts = {"bf16": _count(bf16, x, None)}
    with _gemm_path("scaled_mm"):
        counts["fp8"] = _count(fp8, x, ft.DelayedScaling(amax_history_len=16))
    fused = fused_counts(scale, shapes)
    area, volume = scale**2, scale**3
    cast_elements = (m * h + h * f + m * f) * 2 * area  # per linear: input, weight, output gradient
    bw, peak = (
        device["bandwidth_TBps"] * 1e12,
        {"bf16": device["bf16_TFLOPS"] * 1e12, "fp8": device["fp8_TFLOPS"] * 1e12},
    )

    def ms(flops: float, nbytes: float, dtype: str) -> float:
        return 1e3 * (flops / peak[dtype] + nbytes / bw)

    bf16_flops, bf16_bytes = counts["bf16"].flops * volume, counts["bf16"].bytes * area
    fp8_flops, fp8_bytes = counts["fp8"].flops * volume, counts["fp8"].bytes * area
    # modelled (compiled; the fused kernels where they cannot be counted): read bf16 (2 B), write FP8
    # and its transposed copy (1 + 1 B) per cast element; the other kernels as the bf16 step's
    # (activation, gradient sums), the GEMM outputs' scaling in torch._scaled_mm's epilogue
    modelled_bytes = bf16_bytes + 4 * cast_elements
    bf16_ms = ms(bf16_flops, bf16_bytes, "bf16")
    if fused is not None:
        fused_row = {"config": "fp8 fp8train, fused cast kernels (counted)",
                     "gemm_TFLOP": fused["flops"] * volume / 1e12, "other_GB": fused["bytes"] * area / 1e9,
                     "ms": ms(fused["flops"] * volume, fused["bytes"] * area, "fp8")}  # fmt: skip
    else:
        fused_row = {"config": "fp8 fp8train, fused cast kernels (modelled: no triton here)",
                     "gemm_TFLOP": fp8_flops / 1e12, "other_GB": modelled_bytes / 1e9,
                     "ms": ms(fp8_flops, modelled_bytes, "fp8")}  # fmt: skip
    rows = [
        {"config": "bf16 torch.nn", "gemm_TFLOP": bf16_flops / 1e12, "other_GB": bf16_bytes / 1e9,
         "ms": bf16_ms},
        {"config": "fp8 fp8train eager, torch ops (counted)", "gemm_TFLOP": fp8_flops / 1e12,
         "other_GB": fp8_bytes / 1e9, "ms": ms(fp8_flops, fp8_bytes, "fp8")},
        fused_row,
        {"config": "fp8 fp8train compiled (modelled)", "gemm_TFLOP": fp8_flops / 1e12,
         "other_GB": modelled_bytes / 1e9, "ms": ms(fp8_flops, modelled_bytes, "fp8")},
        {"config": "TransformerEngine delayed scaling (published 1.69x)", "gemm_TFLOP": fp8_flops / 1e12,
         "other_GB": None, "ms": bf16_ms / TE_DELAYED_SPEEDUP},
    ]  # fmt: skip
    for row in rows:
        row["speedup_vs_bf16"] = bf16_ms / row["ms"]
    return {
        "model": "step = GEMM FLOPs / peak + other kernels' bytes / bandwidth (no overlap)",
        "device": device,
        "shapes": shapes,
        "counted_at": {"tokens": m, "hidden": h, "ffn": f, "scale": scale},
        "cast_operand_elements": cast_elements,
        "rows": rows,
    }
