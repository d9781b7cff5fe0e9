"""The GPU check's `kernels` section (benchmarks/gpu_check.py): the fused FP8 casts
(fp8train.numerics.kernels) timed against the device's memory bandwidth, beside the torch path and
inductor's compiled cast, and
checked bit for bit: fused against the torch path on the device, compiled against eager (values and
transposed copies: triton issue 11111, where compiled FP8 code wrote garbage bytes into transposed
FP8 stores on recent builds).

Each cast is what one recipe makes of one bf16 operand of M x K elements (docs/design.md, section 6,
"Fused quantization kernels"): delayed scaling, the E4M3 values, their transposed copy and the amax
(one read); current scaling, the same after its amax (two reads); block scaling, 1x128 tiles of x and
of x.t() (one read), and 128x128 blocks of a K x K weight. GB/s counts the bytes the fused kernel must
move (its reads and writes), for every path alike, so the paths' figures compare as speeds; the share
of the device's peak says how close the kernel is to the memory's limit.

On the CPU (the dry run) the Triton kernels are skipped unless interpreted (TRITON_INTERPRET=1 in the
environment), and the compiled cast is aot_eager's (inductor's C++ compile would take minutes here).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from gpu_check_probes import median_seconds

from fp8train.numerics import kernels as ft_kernels
from fp8train.numerics.cast import amax, cast_operand
from fp8train.quantization.block_scaling import quantize_tiles
from fp8train.quantization.current import current_scales

__all__ = ["kernels_section", "PUBLISHED_PEAK_BYTES_S"]

# published HBM bandwidth (bytes/s) by a piece of the device's name; else the measured copy stands in
PUBLISHED_PEAK_BYTES_S = {
    "H200": 4.8e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H800": 3.35e12,
    "B200": 8.0e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100": 1.56e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "MI300X": 5.3e12,
}

# bytes per element of a bf16 operand that each fused cast moves (E4M3 outputs; scales ignored, <0.1%)
BYTES_PER_ELEMENT = {
    "delayed": 2 + 1 + 1,  # read x; values, transposed values
    "current": 2 + 2 + 1 + 1,  # read x twice (amax, then cast)
    "tiles_1x128": 2 + 1 + 1,  # read x; tiles of x and of x.t()
    "blocks_128x128": 2 + 1,  # read w; values
}


def _peak(device: torch.device, quick: bool) -> tuple[float, str]:
    """(bytes/s, where from): the published figure for the device, else a measured copy's."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PUBLISHED_PEAK_BYTES_S.items():
            if key in name:
                return value, f"published ({name})"
    n = (1 << 20) if quick else (1 << 28)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    seconds = median_seconds(lambda: b.copy_(a), device, 5)
    return 2 * a.nbytes / seconds, "measured copy"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN in float outputs equal to NaN: payloads are not the casts' values)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.contiguous().view(bits) == b.contiguous().view(bits)
    if a.element_size() > 1:
        same |= a.float().isnan() & b.float().isnan()
    return bool(same.all())


def _input(m: int, k: int, device: torch.device) -> torch.Tensor:
    """bf16 activations with outliers, +-0, an inf, exact ties of the E4M3 grid and subnormal-sized
    values (NaN is left out: its byte is the conversion's, not the cast's, on CUDA)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0625, -1.0625, 3.25, 2.0**-10, -(2.0**-9) * 1.5, 7.0e3])
    x[1, 3] = float("inf")
    x[2] *= 2.0**12
    return x.to(device=device, dtype=torch.bfloat16)


# ---- the torch path: what the recipes make of an operand today --------------------------------------------
def _torch_delayed(x, scale, amax_out):
    amax_out.copy_(torch.maximum(amax_out, amax(x)))
    values = cast_operand(x, scale, "e4m3", torch.float8_e4m3fn)
    return values, values.t().contiguous()


def _torch_current(x):
    scale, scale_inv = current_scales(x, "e4m3")
    values = cast_operand(x, scale, "e4m3", torch.float8_e4m3fn)
    return values, values.t().contiguous(), scale_inv


def _torch_tiles(x):
    fp8 = torch.float8_e4m3fn
    return (*quantize_tiles(x, 1, True, dtype=fp8), *quantize_tiles(x.t(), 1, True, dtype=fp8))


def _torch_blocks(w):
    return quantize_tiles(w, 128, True, dtype=torch.float8_e4m3fn)


# ---- the fused kernels, returning the torch path's tuples -------------------------------------------------
def _fused_delayed(x, scale, amax_out):
    return ft_kernels.cast_with_amax(
        x, scale, "e4m3", torch.float8_e4m3fn, transposed=True, amax_out=amax_out
    )


def _fused_current(x):
    cast = ft_kernels.amax_then_cast(x, "e4m3", torch.float8_e4m3fn, transposed=True)
    return cast.values, cast.values_t, cast.scale_inv


def _fused_tiles(x):
    forward, wgrad = ft_kernels.cast_tiles_1x128(
        x, True, torch.float8_e4m3fn, transposed_dtype=torch.float8_e4m3fn
    )
    return forward.values, forward.scale_inv, wgrad.values, wgrad.scale_inv


def _fused_blocks(w):
    operand = ft_kernels.cast_blocks_128x128(w, True)
    return operand.values, operand.scale_inv


def _all_same(got, want) -> bool:
    return all(_same(a, b) for a, b in zip(got, want))


def kernels_section(device: torch.device, quick: bool, progress: Callable[[dict], None]) -> dict:
    m, k = (256, 384) if quick else (16384, 4096)
    reps = 3 if quick else 20
    x = _input(m, k, device)
    w = _input(k, k, device)
    scale = torch.tensor(0.75, device=device)
    fused = ft_kernels.fused_cast_available(device, allow_interpreter=True)
    peak, peak_from = _peak(device, quick)
    out: dict = {
        "m": m,
        "k": k,
        "peak_gb_s": peak / 1e9,
        "peak_from": peak_from,
        "fused": fused or "skipped: " + _why_not_fused(device),
        "bytes_per_element": BYTES_PER_ELEMENT,
    }
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    out["compile_backend"] = backend
    operands = {"delayed": x, "current": x, "tiles_1x128": x, "blocks_128x128": w}
    paths: dict[str, dict[str, Optional[Callable]]] = {
        "delayed": {
            "torch": lambda: _torch_delayed(x, scale, torch.zeros((), device=device)),
            "fused": (lambda: _fused_delayed(x, scale, torch.zeros((), device=device))) if fused else None,
        },
        "current": {
            "torch": lambda: _torch_current(x),
            "fused": (lambda: _fused_current(x)) if fused else None,
        },
        "tiles_1x128": {
            "torch": lambda: _torch_tiles(x),
            "fused": (lambda: _fused_tiles(x)) if fused else None,
        },
        "blocks_128x128": {
            "torch": lambda: _torch_blocks(w),
            "fused": (lambda: _fused_blocks(w)) if fused else None,
        },
    }
    # the two casts with transposed FP8 stores (triton issue 11111); each compile is ~10-20 s of the budget
    compiled = {
        "delayed": torch.compile(_torch_delayed, backend=backend, dynamic=False),
        "tiles_1x128": torch.compile(_torch_tiles, backend=backend, dynamic=False),
    }
    compiled_args = {
        "delayed": lambda f: f(x, scale, torch.zeros((), device=device)),
        "current": lambda f: f(x),
        "tiles_1x128": lambda f: f(x),
        "blocks_128x128": lambda f: f(w),
    }
    rows = []
    for cast, by_path in paths.items():
        row: dict = {"cast": cast}
        elements = operands[cast].numel()
        useful = BYTES_PER_ELEMENT[cast] * elements
        eager = by_path["torch"]()
        checks = {}
        timed = {"torch": by_path["torch"]}
        if by_path["fused"] is not None:
            checks["fused_equals_torch"] = _all_same(by_path["fused"](), eager)
            timed["fused"] = by_path["fused"]
        if cast in compiled:
            fn = compiled[cast]
            try:
                checks["compiled_equals_eager"] = _all_same(compiled_args[cast](fn), eager)
                timed["compiled"] = lambda fn=fn, cast=cast: compiled_args[cast](fn)
            except Exception as exc:  # a compile failure is a finding, not the section's end
                checks["compiled_equals_eager"] = False
                row["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        for name, fn in timed.items():
            seconds = median_seconds(fn, device, reps)
            row[f"{name}_us"] = 1e6 * seconds
            row[f"{name}_gb_s"] = useful / seconds / 1e9
            row[f"{name}_share_of_peak"] = useful / seconds / peak
        row.update(checks)
        row["ok"] = all(checks.values())
        rows.append(row)
        progress({"rows": rows})
    out["rows"] = rows
    out["ok"] = all(r["ok"] for r in rows)
    out["figure"] = "; ".join(_figure(r) for r in rows) + f" (peak {peak / 1e9:.3g} GB/s, {peak_from})"
    return out


def _figure(row: dict) -> str:
    parts = [
        f"{path} {row[path + '_gb_s']:.3g}"
        for path in ("fused", "torch", "compiled")
        if path + "_gb_s" in row
    ]
    bad = [name for name in ("fused_equals_torch", "compiled_equals_eager") if row.get(name) is False]
    return f"{row['cast']}: " + " / ".join(parts) + " GB/s" + (f" DIFFERS: {', '.join(bad)}" if bad else "")


def _why_not_fused(device: torch.device) -> str:
    if device.type != "cuda":
        return "Triton kernels run on CUDA devices, or on the CPU where TRITON_INTERPRET=1"
    return "triton is not installed (or interpreted: TRITON_INTERPRET=1 on a GPU)"
