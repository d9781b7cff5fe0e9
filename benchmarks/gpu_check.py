"""What only a CUDA machine can show, as JSON: run by scripts/gpu_check.sh on a GPU, dry-run on the CPU.

    python3 benchmarks/gpu_check.py SECTION [--device cuda|cpu] [--quick] [--out DIR] [--limit-s N]

Every section writes its result into DIR/gpu-check.json ({"sections": {SECTION: result}}, a stub
when it starts, the result as soon as it ends; one file, because a device machine hands back only a
few files), appends its figure line to DIR/summary.txt and prints that line. DIR: --out, else
$GPU_RESULTS, else $OUT/gpu-results where $OUT is set, else gpu-results. Exit status: 0 if the
section's checks held, 1 if not, 2 without CUDA (unless --device cpu, the dry run).

Sections (scripts/gpu_check.sh runs them in this order, each with its own time limit):
- env: torch, CUDA, cuBLASLt, NCCL versions, the GPU and its capability, TF32 settings.
- contract: fp8train.numerics.gemm in the three layouts of a linear layer (fprop, dgrad, wgrad) against fp64,
  and raw torch._scaled_mm with fast accumulation off and on; _scaled_mm calls per layer.
- syncs: steady steps with the amax reduction running (a one-rank group forced to reduce): every site
  that makes the host wait or copies host data (sync-debug "warn" with a stack per site on CUDA, and a
  dispatch-level detector on any device), then sync-debug "error"; a host run-ahead test; whether the
  reduction's timing events stay bounded and `reduction_stats(complete=False)` waits for none.
- te_table: TransformerEngine's GEMM table (src/fp8train/tools/bench/gpu.py): bf16 vs fp8train delayed
  vs pre-quantized torch._scaled_mm at its 5B model's shapes, beside TE's H200 figures.
- compile: fullgraph compile (one graph, close to eager), blocks compiled one by one (compiles
  independent of their number), the block recipes' emulation warning under fullgraph, and
  mode="reduce-overhead" (CUDA graphs: 2 launches per step, scales follow the data).
- recipes: one step of each recipe (delayed, current, block, MXFP8, NVFP4) at M = 1024.
- kernels: the fused FP8 casts (fp8train.numerics.kernels) in GB/s against the device's peak, beside the torch
  path and the compiled cast; fused against torch and compiled against eager, bit for bit, transposed
  copies included (benchmarks/gpu_check_kernels.py).
- grouped: a mixture-of-experts layer's expert MLP (DeepSeek-V3-like: hidden 7168, intermediate 2048,
  16 experts, 8192 rows) forward+backward in bf16 grouped_mm against FP8 grouped (torch._scaled_grouped_mm)
  and one FP8 GEMM per expert (benchmarks/gpu_check_grouped.py).
- emulation: the device's training against the CPU's exact emulation.
- overlap: the asynchronous reduction against a collective of 0, 2 and 10 ms simulated on a side stream.
- idle: the share of a steady step's wall time in which the GPU ran no kernel (torch.profiler).
- train: a Linear forward+backward per shape of that table, eager and compiled, with peak memory.
With `--device cpu` (`--quick`: smaller sizes) each section runs its code on the CPU: what can go wrong
before a GPU is lent (tests/tools/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import io
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from gpu_check_grouped import grouped_section
from gpu_check_kernels import kernels_section
from gpu_check_probes import (
    DelayedCollective,
    StandInEvents,
    SyncDebugSites,
    env_set,
    format_exception,
    live_cuda_events,
    sleep_cycles_per_ms,
)

import fp8train as ft
from fp8train.numerics import gemm as ft_gemm
from fp8train.numerics.gemm import Operand, choose_path, has_scaled_mm
from fp8train.telemetry import Telemetry
from fp8train.tools.bench import gpu as gpu_bench
from fp8train.tools.bench.common import GraphCounter, OpCounter
from fp8train.tools.host_syncs import HostSyncCounter

DELAYED = ft.DelayedScaling(amax_history_len=16)
RECIPES = {
    "delayed": DELAYED,
    "current": ft.Float8CurrentScaling(),
    "block": ft.Float8BlockScaling(),
    "mxfp8": ft.MXFP8BlockScaling(),
    "nvfp4": ft.NVFP4BlockScaling(),
}
BLOCK_RECIPES = ("block", "mxfp8", "nvfp4")
RESULTS_FILE, SUMMARY_FILE = "gpu-check.json", "summary.txt"


# ---- the settings the check changes, in one place ---------------------------------------------------------
@contextlib.contextmanager
def check_settings(
    *,
    async_reduction: Optional[bool] = None,
    gemm_path: Optional[str] = None,
    fast_accum: Optional[bool] = None,
    reduce_on_one_rank: Optional[torch.device] = None,
    all_reduce: Optional[Callable] = None,
    standin_events: Optional[StandInEvents] = None,
    cuda_emulation_warning: bool = False,
) -> Iterator[dict]:
    """Every fp8train setting the check changes, set on entry and restored on exit. Public switches
    (environment variables) where fp8train has them; module attributes otherwise, each one marked
    below, so that a switch fp8train gains replaces one line here. Yields what was set, or why not.

    - reduce_on_one_rank (a device): a one-rank process group (NCCL on CUDA, gloo on the CPU) whose
      amax groups reduce anyway, so that every part of the reduction (header, check, collective,
      update) runs [sets fp8train.amax.settings.reduce_single_rank].
    - all_reduce: what torch.distributed.all_reduce becomes (a simulated collective).
    - standin_events: the reduction's CUDA timing branch, forced on the CPU with stand-in events
      [sets fp8train.amax.settings.timing_events].
    - cuda_emulation_warning: the block recipes' "emulated on CUDA" warning, forced on the CPU (the
      device type it is given on) [sets fp8train.quantization.base.EMULATION_NOTED_ON]."""
    applied: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if async_reduction is not None:
            stack.enter_context(env_set("NVTE_ASYNC_AMAX_REDUCTION", "1" if async_reduction else "0"))
            applied["async_reduction"] = str(async_reduction)
        if gemm_path is not None:
            stack.enter_context(env_set(ft_gemm.ENV_PATH, gemm_path))
            applied["gemm_path"] = gemm_path
        if fast_accum is not None:
            name = getattr(ft_gemm, "ENV_FAST_ACCUM", None)
            if name is None:
                applied["fast_accum"] = "not available (fp8train.numerics.gemm has no ENV_FAST_ACCUM switch)"
            else:
                value = "all" if fast_accum else "none"  # fp8train.numerics.gemm.FAST_ACCUM's choices
                stack.enter_context(env_set(name, value))
                applied["fast_accum"] = f"{name}={value}"
        if reduce_on_one_rank is not None:
            _one_rank_group(reduce_on_one_rank)  # kept: main() destroys it at the end
            stack.enter_context(ft.amax.settings.override(reduce_single_rank=True))
            applied["reduce_on_one_rank"] = "fp8train.amax.settings.reduce_single_rank"
        if all_reduce is not None:
            stack.enter_context(_attr(dist, "all_reduce", all_reduce))
            applied["all_reduce"] = "torch.distributed.all_reduce"
        if standin_events is not None:
            applied["standin_events"] = _force_cuda_timing(stack, standin_events)
        if cuda_emulation_warning:
            applied["cuda_emulation_warning"] = _force_cuda_warning(stack)
        yield applied


@contextlib.contextmanager
def _attr(owner, name: str, value) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _one_rank_group(device: torch.device) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _force_cuda_timing(stack: contextlib.ExitStack, events: StandInEvents) -> str:
    stack.enter_context(ft.amax.settings.override(timing_events=events.recorded_event))
    return "fp8train.amax.settings.timing_events"


def _force_cuda_warning(stack: contextlib.ExitStack) -> str:
    """The warning's test of the device type, pointed at the CPU (the tests' seam, quantization/base.py)."""
    from fp8train.quantization import base

    if not hasattr(base, "EMULATION_NOTED_ON"):
        return "not available (fp8train.quantization.base.EMULATION_NOTED_ON is gone)"
    stack.enter_context(_attr(base, "EMULATION_NOTED_ON", "cpu"))
    return "warn_emulated_on_cuda in every module: fp8train.quantization.base.EMULATION_NOTED_ON = 'cpu'"


# ---- models and steps -------------------------------------------------------------------------------------
def _mlp(hidden: int, ffn: int, device: torch.device, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        ft.LayerNormLinear(hidden, hidden, device=device, params_dtype=dtype),
        ft.LayerNormMLP(hidden, ffn, device=device, params_dtype=dtype),
        ft.Linear(hidden, hidden, device=device, params_dtype=dtype),
    )


def _step(model: torch.nn.Module, x: torch.Tensor, recipe=DELAYED, evaluate: bool = False) -> torch.Tensor:
    """One training step's FP8 work (forward, backward, gradients dropped), optionally an evaluation."""
    with ft.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    loss = y.float().square().mean()
    loss.backward()
    for p in model.parameters():
        p.grad = None
    if evaluate:
        with torch.no_grad(), ft.fp8_autocast(fp8_recipe=recipe):
            model(x)
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@dataclass
class Context:
    device: torch.device
    quick: bool
    progress: Callable[[dict], None]  # writes a partial result (long sections, row by row)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ---- sections -------------------------------------------------------------------------------------------
def env(ctx: Context) -> dict:
    out = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda_build": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "scaled_mm": has_scaled_mm(ctx.device.type),
        "gemm_path_4096": choose_path(ctx.device, 4096, 4096, 4096),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=props.name,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            multiprocessors=props.multi_processor_count,
            memory_gib=props.total_memory / 2**30,
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
            cublaslt=_cublaslt_version(ctx.device),
        )
    out["fp8train_info"] = _fp8train_info()
    out["ok"] = not ctx.cuda or tuple(out["capability"]) >= (8, 9)
    gpu = f"{out.get('gpu')} sm{''.join(map(str, out.get('capability', [])))}" if ctx.cuda else "cpu"
    out["figure"] = (
        f"torch {out['torch']} cuda {out['cuda_build']} cublasLt {out.get('cublaslt')} "
        f"nccl {out.get('nccl')} "
        f"{gpu} tf32 {'on' if out['allow_tf32_matmul'] else 'off'} _scaled_mm {out['scaled_mm']}"
    )
    return out


def _fp8train_info() -> list[str]:
    """What `fp8train info` prints here (versions, the GEMM path chosen and why, settings in effect)."""
    from fp8train.tools.cli import main as cli

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        status = cli(["info"])
    return text.getvalue().splitlines() + ([] if status == 0 else [f"(exit status {status})"])


def _nccl_version():
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # a build without NCCL
        return f"not available ({exc})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else version


def _cublaslt_version(device: torch.device):
    """cuBLASLt's own version, from the library torch loaded (it reports none itself)."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
        lib = ctypes.CDLL(paths[0])
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return f"{lib.cublasLtGetVersion()} ({os.path.basename(paths[0])})"
    except (OSError, IndexError, AttributeError) as exc:
        return f"not available ({type(exc).__name__}: {exc})"


# The three GEMMs of y = x @ w.T as fp8train's linear layer builds them (modules/fp8_linear.py):
# (operand a, operand b, transpose a, transpose b) with x: M x K, w: N x K, g: M x N.
LAYOUTS = {
    "fprop": ("x", "w", False, True),
    "dgrad": ("g", "w", False, False),
    "wgrad": ("g", "x", True, False),
}
EXACT_BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 4e-3}  # fp32 accumulation; plus one bf16 rounding


def contract(ctx: Context) -> dict:
    """Random FP8 operands with non-power-of-2 scales, in each layout; fp64 of the same operands as
    the reference. Where torch has no `_scaled_mm` on the device the same FP8 values are given in
    bf16 (fp8train's emulated path)."""
    m, k, n = 512, 1024, 768
    native = has_scaled_mm(ctx.device.type)
    fast_switch = _fast_accum_switch()
    gen = torch.Generator().manual_seed(0)
    shapes = {"x": (m, k), "w": (n, k), "g": (m, n)}
    rows = []
    for layout, (a_name, b_name, t_a, t_b) in LAYOUTS.items():
        for grad_dtype in (
            (torch.float8_e4m3fn, torch.float8_e5m2) if a_name == "g" else (torch.float8_e4m3fn,)
        ):
            dtypes = {"x": torch.float8_e4m3fn, "w": torch.float8_e4m3fn, "g": grad_dtype}
            ops = {}
            for name in (a_name, b_name):
                values = (torch.randn(shapes[name], generator=gen) * 40).clamp(-448, 448).to(dtypes[name])
                scale_inv = torch.tensor(1.37 / 64 if name == "g" else 0.73 / 16, device=ctx.device)
                ops[name] = Operand(
                    (values if native else values.to(torch.bfloat16)).to(ctx.device), scale_inv
                )
            a = ops[a_name].t() if t_a else ops[a_name]
            b = ops[b_name].t() if t_b else ops[b_name]
            exact = a.dequantize().double() @ b.dequantize().double()
            for out_dtype in (torch.bfloat16, torch.float32):
                row = {
                    "layout": layout,
                    "a": _name(dtypes[a_name]),
                    "b": _name(dtypes[b_name]),
                    "out": _name(out_dtype),
                }
                row.update(_contract_errors(a, b, exact, out_dtype, fast_switch))
                bound = EXACT_BOUNDS[out_dtype]
                # fp8train's default may use fast accumulation (as TE and torchao do for fprop): then it
                # equals _scaled_mm's fast-accumulation output; every exact variant is within the bound
                default_ok = _within(row["fp8train_rel_err"], bound) or row.get(
                    "fp8train_equals_scaled_mm_fast_accum_on"
                )
                exact_ok = all(
                    _within(row[c], bound)
                    for c in ("fp8train_fast_accum_off_rel_err", "scaled_mm_fast_accum_off_rel_err")
                    if c in row and not str(row[c]).startswith("not available")
                )
                row["ok"] = bool(default_ok) and exact_ok
                rows.append(row)
    calls = _scaled_mm_calls_per_layer(ctx.device)
    columns = {"fp8train": "fp8train_rel_err", "off": "scaled_mm_fast_accum_off_rel_err"}
    columns["on"] = "scaled_mm_fast_accum_on_rel_err"
    worst = {  # per output dtype, the worst over layouts and operand dtypes
        out: {
            name: max((r[c] for r in rows if r["out"] == out and isinstance(r.get(c), float)), default=None)
            for name, c in columns.items()
        }
        for out in ("float32", "bfloat16")
    }
    return {
        "ok": all(r["ok"] for r in rows) and all(c["calls"] == c["expected"] for c in calls.values()),
        "bounds": {str(k): v for k, v in EXACT_BOUNDS.items()},
        "rows": rows,
        "scaled_mm_calls_per_layer": calls,
        "worst": worst,
        "figure": "worst rel err vs fp64 (fp8train / _scaled_mm fast accum off / on): "
        + ", ".join(f"{out} out {' / '.join(_fmt(v) for v in w.values())}" for out, w in worst.items())
        + "; _scaled_mm calls per layer "
        + ", ".join(f"{k} {v['calls']}/{v['expected']}" for k, v in calls.items()),
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _fast_accum_switch() -> Optional[str]:
    """The keyword of fp8train.numerics.gemm.matmul that chooses fast accumulation, where it has one."""
    parameters = inspect.signature(ft_gemm.matmul).parameters
    return next((name for name in ("use_fast_accum", "fast_accum") if name in parameters), None)


def _contract_errors(
    a: Operand, b: Operand, exact: torch.Tensor, out_dtype, fast_switch: Optional[str]
) -> dict:
    """Relative errors against `exact` of fp8train's GEMM (its default, and fast accumulation off and
    on where it has the switch) and of raw torch._scaled_mm (fast accumulation off and on)."""
    row: dict = {}
    variants = {"fp8train": {}}
    if fast_switch is None:
        row["fp8train_fast_accum_switch"] = (
            "not available (fp8train.numerics.gemm.matmul takes no fast-accumulation switch)"
        )
    else:
        variants.update({f"fp8train_fast_accum_{s}": {fast_switch: s == "on"} for s in ("off", "on")})
    outputs = {}
    for label, kwargs in variants.items():
        try:
            outputs[label] = ft_gemm.matmul(a, b, out_dtype, **kwargs)
            row[f"{label}_rel_err"] = _rel(outputs[label], exact)
        except Exception as exc:
            row[f"{label}_rel_err"] = f"failed: {_summary(exc)}"
    for fast in (False, True):
        key = f"scaled_mm_fast_accum_{'on' if fast else 'off'}"
        raw = _raw_scaled_mm(a, b, out_dtype, fast)
        row[f"{key}_rel_err"] = raw if isinstance(raw, str) else _rel(raw, exact)
        if "fp8train" in outputs and not isinstance(raw, str):
            row[f"fp8train_equals_{key}"] = torch.equal(outputs["fp8train"], raw)
    return row


def _within(value, bound: float) -> bool:
    return isinstance(value, float) and value <= bound


def _fmt(v) -> str:
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def _raw_scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype, fast: bool):
    """torch._scaled_mm of the same operands, laid out as it requires (a row-major, b column-major)."""
    if a.values.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"not available (no torch._scaled_mm on {a.values.device.type} in torch {torch.__version__})"
    try:
        return torch._scaled_mm(
            a.oriented().contiguous(),
            b.oriented().t().contiguous().t(),
            scale_a=a.scale_inv.float(),
            scale_b=b.scale_inv.float(),
            out_dtype=out_dtype,
            use_fast_accum=fast,
        )
    except (RuntimeError, NotImplementedError) as exc:
        return f"failed: {exc}"


def _scaled_mm_calls_per_layer(device: torch.device) -> dict:
    """torch._scaled_mm calls of one Linear forward+backward: 3 where the layer takes that path."""
    out = {}
    forced = "scaled_mm" if device.type == "cpu" and has_scaled_mm("cpu") else None  # the dry run
    for name in ("delayed", "current"):
        with check_settings(gemm_path=forced):
            out[name] = _scaled_mm_calls(device, RECIPES[name])
    return out


def _scaled_mm_calls(device: torch.device, recipe) -> dict:
    ft.inspection.reset()
    layer = ft.Linear(256, 256, device=device, params_dtype=torch.bfloat16)
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    with OpCounter() as count:
        with ft.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.float().square().mean().backward()
    return {
        "calls": count.ops["aten._scaled_mm"],
        "expected": 3 if choose_path(device, 256, 256, 256) == "scaled_mm" else 0,
    }


def syncs(ctx: Context) -> dict:
    hidden = 64 if ctx.quick else 1024
    out: dict = {
        "allowed_by_design": "reads of tensors marked _fp8train_host_mirror (the failure flag's pinned "
        "host copy, region tokens); the region token made from host data (host_syncs.HOST_RESIDENT)"
    }
    # the GEMM path the GPU takes; on the CPU its _scaled_mm kernel where torch has one, else the emulation
    paths = ("auto",) if ctx.cuda else ("scaled_mm" if has_scaled_mm("cpu") else "bf16",)
    configs = [
        ("delayed", p, mode, tel) for p in paths for mode in ("async", "blocking") for tel in (True, False)
    ]
    configs += [(recipe, paths[0], "async", False) for recipe in RECIPES if recipe != "delayed"]
    sites: dict = {}
    for recipe, path, mode, telemetry in configs:
        name = f"{recipe} {path} {mode}{' telemetry' if telemetry else ''}"
        with check_settings(reduce_on_one_rank=ctx.device, async_reduction=mode == "async", gemm_path=path):
            found = _steady_sites(ctx, hidden, RECIPES[recipe], telemetry, steady=3 if ctx.quick else 5)
        sites[name] = found
        ctx.progress({"sites": sites})
    out["sites"] = sites
    out["detector_sees_state_dict_reads"] = _state_dict_reads(ctx)
    total = sum(f["count"] for found in sites.values() for f in found.values())
    parts = {"error_mode": (_error_mode, hidden), "run_ahead": (_run_ahead,), "timing": (_timing_events,)}
    for part, (fn, *args) in parts.items():
        out[part] = _guarded(fn, ctx, *args)
    out["ok"] = total == 0 and all(out[part]["ok"] for part in parts)
    unique = sorted({s for found in sites.values() for s in found})
    out["figure"] = (
        f"{total} host waits/copies in steady steps at {len(unique)} sites"
        f"{': ' + '; '.join(unique) if unique else ''}; "
        + "; ".join(f"{part.replace('_', ' ')}: {out[part]['figure']}" for part in parts)
    )
    return out


def _first_line(message) -> str:
    lines = str(message).strip().splitlines()
    return lines[0][:200] if lines else ""


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _guarded(fn: Callable[..., dict], *args) -> dict:
    """One part of a section: its result, or what it raised (the section's other parts still run)."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"ok": False, "error": format_exception(exc), "figure": f"raised {_summary(exc)}"}


def _state_dict_reads(ctx: Context) -> int:
    """The detector can fail: `state_dict()` is a host point that reads the FP8 state on the host."""
    ft.inspection.reset()
    model = _mlp(64, 128, ctx.device)
    _step(model, torch.randn(64, 64, device=ctx.device, dtype=torch.bfloat16))
    with HostSyncCounter(ctx.device) as found:
        model.state_dict()
    return sum(site["count"] for site in found.report().values())


def _steady_sites(ctx: Context, hidden: int, recipe, telemetry: bool, steady: int) -> dict:
    """3 warm-up steps (modules join, sizes settle), then `steady` watched ones: the sites found."""
    ft.inspection.reset()
    model = _mlp(hidden, 2 * hidden, ctx.device)
    tel = Telemetry(model) if telemetry else None
    x = torch.randn(hidden, hidden, device=ctx.device, dtype=torch.bfloat16)

    def step(i: int) -> None:
        loss = _step(model, x, recipe, evaluate=True)
        if tel is not None:
            tel.log_step(i, loss=loss)

    for i in range(3):
        step(i)
    _sync(ctx.device)
    with SyncDebugSites(ctx.cuda) as warned, HostSyncCounter(ctx.device) as found:
        for i in range(3, 3 + steady):
            step(i)
    ft.reduction_stats()  # a host point after the watched steps
    return {**found.report(), **warned.report()}


def _error_mode(ctx: Context, hidden: int) -> dict:
    """Steady steps under torch.cuda.set_sync_debug_mode("error"): the full traceback of what raised."""
    if not ctx.cuda:
        return {"ok": True, "figure": "not on this device (CUDA only)"}
    errors = {}
    for mode in ("async", "blocking"):
        with check_settings(reduce_on_one_rank=ctx.device, async_reduction=mode == "async"):
            ft.inspection.reset()
            model = _mlp(hidden, 2 * hidden, ctx.device)
            tel = Telemetry(model)
            x = torch.randn(hidden, hidden, device=ctx.device, dtype=torch.bfloat16)
            for i in range(3):
                tel.log_step(i, loss=_step(model, x))
            _sync(ctx.device)
            errors[mode] = None
            torch.cuda.set_sync_debug_mode("error")
            try:
                for i in range(3, 8):
                    tel.log_step(i, loss=_step(model, x))
            except RuntimeError as exc:
                errors[mode] = format_exception(exc)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ft.reduction_stats()
    return {
        "ok": all(e is None for e in errors.values()),
        "raised": errors,
        "figure": ", ".join(f"{mode} {'clean' if e is None else 'RAISED'}" for mode, e in errors.items()),
    }


def _run_ahead(ctx: Context) -> dict:
    """While the GPU sleeps, the host should issue 3 steady steps in about the time they take to issue
    on an idle GPU: a host that waited anywhere (also `event.synchronize()`, which sync-debug mode does
    not see) takes as long as the sleep."""
    hidden = 64 if ctx.quick else 512
    with check_settings(reduce_on_one_rank=ctx.device, async_reduction=True):
        ft.inspection.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[ft.Linear(hidden, hidden, device=ctx.device, params_dtype=torch.bfloat16) for _ in range(2)]
        )
        x = torch.randn(hidden, hidden, device=ctx.device, dtype=torch.bfloat16)
        for _ in range(3):
            _step(model, x)
        _sync(ctx.device)

        def issue() -> float:
            start = time.perf_counter()
            for _ in range(3):
                _step(model, x)
            return 1e3 * (time.perf_counter() - start)

        idle_ms = issue()
        _sync(ctx.device)
        if not ctx.cuda:
            return {
                "ok": True,
                "issue_ms": idle_ms,
                "figure": f"not on this device (issue of 3 steps: {idle_ms:.1f} ms)",
            }
        sleep_ms = max(100.0, 4 * idle_ms)
        torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms(ctx.device)))
        busy_ms = issue()
        _sync(ctx.device)
        ft.reduction_stats()
    ok = busy_ms < sleep_ms / 2
    return {
        "ok": ok,
        "sleep_ms": sleep_ms,
        "issue_ms_idle_gpu": idle_ms,
        "issue_ms_busy_gpu": busy_ms,
        "figure": f"3 steps issued in {busy_ms:.1f} ms behind a {sleep_ms:.0f} ms GPU sleep "
        f"({idle_ms:.1f} ms on an idle GPU)",
    }


def _timing_events(ctx: Context) -> dict:
    """Without telemetry, the reduction's CUDA timing events held must not grow with the steps; and
    reduction_stats(complete=False) must wait for none of them. On the CPU the CUDA branch is forced
    with stand-in events that complete only some events later (a GPU behind the host)."""
    events = None if ctx.cuda else StandInEvents()
    hidden = 64 if ctx.quick else 512
    with check_settings(
        reduce_on_one_rank=ctx.device, async_reduction=True, standin_events=events
    ) as applied:
        ft.inspection.reset()
        model = _mlp(hidden, 2 * hidden, ctx.device)
        x = torch.randn(hidden, hidden, device=ctx.device, dtype=torch.bfloat16)
        live = events.live_count if events is not None else live_cuda_events
        counts = []
        for steps in (3, 10, 10):
            for _ in range(steps):
                _step(model, x)
            counts.append(live())
        with _counting_event_waits(events) as waits:
            ft.reduction_stats(complete=False)
        ft.reduction_stats()
    forced = applied.get("standin_events", "real CUDA events")
    if forced.startswith("not available"):
        return {"ok": True, "figure": forced}
    growth = counts[2] - counts[1]  # over 10 steps, after 10 that fill whatever is kept
    ok = growth < 10 and waits["count"] == 0  # fewer than one event kept per step
    return {
        "ok": ok,
        "events": forced,
        "forcing_took_effect": events is None or events.recorded > 0,
        "live_events_after_3_13_23_steps": counts,
        "growth_per_10_steps": growth,
        "waits_in_reduction_stats_complete_false": waits["count"],
        "figure": f"timing events held after 3/13/23 steps {counts}, "
        f"reduction_stats(complete=False) waited {waits['count']}x",
    }


@contextlib.contextmanager
def _counting_event_waits(events: Optional[StandInEvents]) -> Iterator[dict]:
    out = {"count": 0}
    if events is not None:
        before = events.waits
        yield out
        out["count"] = events.waits - before
        return
    real = torch.cuda.Event.synchronize

    def counted(self) -> None:
        out["count"] += 1
        real(self)

    with _attr(torch.cuda.Event, "synchronize", counted):
        yield out


def te_table(ctx: Context) -> dict:
    sizes = {"m": 64, "hidden": 64, "ffn": 128, "warmup": 2, "iters": 3} if ctx.quick else {}
    rows = _measured_rows(ctx, gpu_bench.te_gemm_table(ctx.device, **sizes))
    total = rows[-1]
    return {
        "ok": all(r["bf16_ms"] and r["fp8train_delayed_ms"] for r in rows),
        "timing": "a leading 4096^2 GEMM, 10 warm-ups, 50 back-to-back iterations, one CUDA event pair"
        if ctx.cuda
        else "host clock",
        "te_h200": gpu_bench.TE_H200,
        "rows": rows,
        "figure": f"layer of 12 GEMMs, M={total['m']}: bf16 {total['bf16_ms']:.3g} ms, fp8train delayed "
        f"{total['fp8train_delayed_ms']:.3g} ms = {_fmt2(total['fp8train_delayed_vs_bf16'])}x bf16 (TE H200 "
        f"1.69x); pre-quantized, fast accum on {_fmt2(total['scaled_mm_fast_accum_on_vs_bf16'])}x (TE "
        f"1.92x), off {_fmt2(total['scaled_mm_fast_accum_off_vs_bf16'])}x",
    }


def _measured_rows(ctx: Context, rows: Iterator[dict]) -> list[dict]:
    """The rows of a long measurement, each written into the results as soon as it is measured."""
    done: list[dict] = []
    for row in rows:
        done.append(row)
        ctx.progress({"rows": done})
    return done


def _fmt2(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else "n/a"


def train(ctx: Context) -> dict:
    backend = "inductor" if ctx.cuda else "aot_eager"
    sizes = {"m": 64, "hidden": 64, "ffn": 128, "warmup": 1, "iters": 2} if ctx.quick else {}
    rows = _measured_rows(ctx, gpu_bench.training_steps(ctx.device, compile_backend=backend, **sizes))
    return {
        "ok": len(rows) == 4,
        "compile_backend": backend,
        "rows": rows,
        "figure": "fwd+bwd vs bf16, eager/compiled: "
        + ", ".join(
            f"{r['layer']} {_fmt2(r['fp8train_eager_vs_bf16'])}/{_fmt2(r.get('fp8train_compiled_vs_bf16'))}"
            + (
                f" (peak {r['fp8train_eager_peak_gib']:.1f} vs {r['bf16_peak_gib']:.1f} GiB)"
                if "bf16_peak_gib" in r
                else ""
            )
            for r in rows
        ),
    }


def compiled(ctx: Context) -> dict:
    backend = "inductor" if ctx.cuda else "aot_eager"
    hidden = 64 if ctx.quick else 1024
    out: dict = {"backend": backend}
    parts = {
        "fullgraph": _fullgraph,
        "blocks": _blocks,
        "emulation_warning": _warning_under_fullgraph,
        "reduce_overhead": _reduce_overhead,
    }
    for part, fn in parts.items():
        out[part] = _guarded(fn, ctx, backend, hidden)
        ctx.progress(dict(out))
    out["ok"] = all(out[part]["ok"] for part in parts)
    out["figure"] = "; ".join(f"{part}: {out[part]['figure']}" for part in parts)
    return out


def _fullgraph(ctx: Context, backend: str, hidden: int) -> dict:
    """2 delayed-scaling layers, fullgraph=True: one graph over 4 steps, close to an eager twin."""
    ft.inspection.reset()
    torch._dynamo.reset()
    counter = GraphCounter(backend)
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        twins.append(
            torch.nn.Sequential(
                ft.LayerNormLinear(hidden, hidden, device=ctx.device),
                ft.Linear(hidden, hidden, device=ctx.device),
            )
        )
    eager, model = twins
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(64, hidden, generator=gen).to(ctx.device)
        ys = []
        for run in (eager, compiled):
            with ft.fp8_autocast(fp8_recipe=DELAYED):
                y = run(x)
            y.float().square().mean().backward()
            ys.append(y.detach().double())
    with torch.no_grad():
        high = eager(x).double()
    # compiled vs eager FP8, relative to FP8's own error (eager FP8 vs high precision): rounding flips only
    ratio = float((ys[1] - ys[0]).norm() / (ys[0] - high).norm())
    ok = counter.graphs == 1 and ratio <= 0.25
    return {
        "ok": ok,
        "graphs": counter.graphs,
        "distance_over_fp8_error": ratio,
        "figure": f"{counter.graphs} graph(s) over 4 steps, |compiled - eager| = {ratio:.2g} x FP8's error",
    }


def _blocks(ctx: Context, backend: str, hidden: int) -> dict:
    """Blocks compiled one by one (torchtitan's pattern): the graphs compiled must not grow with the
    number of blocks (dynamo guards on each block's attributes; past its recompile limit of 8, further
    blocks run eagerly)."""
    graphs = {}
    for n in (4, 12):
        ft.inspection.reset()
        torch._dynamo.reset()
        counter = GraphCounter("eager")  # a dynamo matter: no code generation needed
        torch.manual_seed(0)
        blocks = [
            torch.compile(ft.LayerNormLinear(hidden, hidden, device=ctx.device), backend=counter)
            for _ in range(n)
        ]
        x = torch.randn(64, hidden, device=ctx.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the recompile-limit warning: counted below instead
            for _ in range(2):
                h = x
                with ft.fp8_autocast(fp8_recipe=DELAYED):
                    for block in blocks:
                        h = block(h)
                h.square().mean().backward()
        graphs[n] = counter.graphs
    ok = graphs[12] <= graphs[4]
    return {
        "ok": ok,
        "graphs_by_blocks": graphs,
        "figure": f"{graphs[4]} graphs for 4 blocks, {graphs[12]} for 12",
    }


def _warning_under_fullgraph(ctx: Context, backend: str, hidden: int) -> dict:
    """The block recipes on CUDA warn where their GEMM is emulated: that must not break a fullgraph
    compile (dynamo's matter: its "eager" backend suffices). On the CPU the warning's CUDA branch is
    forced, and an eager step shows whether forcing it took effect."""
    results = {}
    with check_settings(cuda_emulation_warning=not ctx.cuda) as applied:
        for name in BLOCK_RECIPES:
            ft.inspection.reset()
            torch._dynamo.reset()
            torch.manual_seed(0)
            eager = ft.Linear(hidden, hidden, device=ctx.device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with ft.fp8_autocast(fp8_recipe=RECIPES[name]):
                    eager(torch.randn(64, hidden, device=ctx.device))
            eager_warnings = sum("emulated" in str(w.message) for w in caught)
            layer = torch.compile(
                ft.Linear(hidden, hidden, device=ctx.device), backend="eager", fullgraph=True
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    for _ in range(2):
                        with ft.fp8_autocast(fp8_recipe=RECIPES[name]):
                            y = layer(torch.randn(64, hidden, device=ctx.device))
                        y.square().mean().backward()
                    results[name] = {"ok": True}
                except Exception as exc:
                    results[name] = {
                        "ok": False,
                        "error": _summary(exc),
                    }
            results[name]["emulation_warnings"] = sum("emulated" in str(w.message) for w in caught)
            results[name]["eager_emulation_warnings"] = eager_warnings
    forced = applied.get("cuda_emulation_warning", "real CUDA")
    return {
        "ok": all(r["ok"] for r in results.values()),
        "forced": forced,
        "forcing_took_effect": all(r["eager_emulation_warnings"] > 0 for r in results.values()),
        "recipes": results,
        "figure": ", ".join(
            f"{k} {'compiles' if r['ok'] else 'BREAKS'} ({r['emulation_warnings']} warnings)"
            for k, r in results.items()
        ),
    }


def _reduce_overhead(ctx: Context, backend: str, hidden: int) -> dict:
    """mode="reduce-overhead" (CUDA graphs): the amax protocol still runs each step (2 launches per step
    with a reducing group) and the scales follow the data as in an eager twin. On the CPU (no CUDA
    graphs) the same steps run compiled with `backend`."""
    runs = {}
    with check_settings(reduce_on_one_rank=ctx.device, async_reduction=True):
        for name in ("eager", "reduce-overhead"):
            ft.inspection.reset()
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                ft.Linear(hidden, hidden, device=ctx.device), ft.Linear(hidden, hidden, device=ctx.device)
            )
            if name == "eager":
                run = model
            elif ctx.cuda:
                run = torch.compile(model, mode="reduce-overhead")
            else:
                run = torch.compile(model, backend=backend)
            launched, scales = [], []
            for step in range(6):
                x = torch.randn(64, hidden, device=ctx.device) * 2.0**step  # amaxes grow: scales must shrink
                with ft.fp8_autocast(fp8_recipe=DELAYED):
                    y = run(x)
                y.float().square().mean().backward()
                launched.append(ft.reduction_stats(complete=False)["launched"])
                scales.append(model[0].fp8_meta["scaling_fwd"].scale.clone())
            ft.synchronize()
            runs[name] = (launched, [s.cpu() for s in scales])
    (eager_launched, eager_scales), (launched, scales) = runs["eager"], runs["reduce-overhead"]
    per_step = [b - a for a, b in zip(launched, launched[1:])]
    follow = all(torch.equal(a, b) for a, b in zip(scales, eager_scales)) and not torch.equal(
        scales[1], scales[-1]
    )
    ok = per_step == [2] * len(per_step) and follow
    return {
        "ok": ok,
        "launched_per_step": per_step,
        "eager_launched_per_step": [b - a for a, b in zip(eager_launched, eager_launched[1:])],
        "scales_equal_eager": follow,
        "compiled_with": "mode=reduce-overhead" if ctx.cuda else f"backend={backend} (no CUDA graphs here)",
        "figure": f"launched per step {per_step}, scales {'follow' if follow else 'do NOT follow'} the eager "
        f"twin's{'' if ctx.cuda else f' (backend {backend}: no CUDA graphs here)'}",
    }


def recipes(ctx: Context) -> dict:
    m = hidden = 64 if ctx.quick else 1024
    rows = []
    for name, recipe in RECIPES.items():
        ft.inspection.reset()
        row: dict = {"recipe": name, "m": m, "hidden": hidden}
        try:
            model = _mlp(hidden, 4 * hidden, ctx.device)
            x = torch.randn(m, hidden, device=ctx.device, dtype=torch.bfloat16)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _step(model, x, recipe)  # first step: modules join, kernels load
                _sync(ctx.device)
                start = time.perf_counter()
                loss = _step(model, x, recipe)
                _sync(ctx.device)
            row.update(
                ms=1e3 * (time.perf_counter() - start), loss=float(loss), ok=bool(torch.isfinite(loss))
            )
            row["warnings"] = sorted({_first_line(w.message) for w in caught})
        except Exception as exc:
            row.update(ok=False, error=format_exception(exc))
        rows.append(row)
        ctx.progress({"rows": rows})
    return {
        "ok": all(r["ok"] for r in rows),
        "rows": rows,
        "figure": ", ".join(f"{r['recipe']} " + (f"{r['ms']:.1f} ms" if r["ok"] else "FAILED") for r in rows),
    }


def emulation(ctx: Context) -> dict:
    """The same 6 training steps on the device (its own GEMM path) and on the CPU's exact emulation
    (fp32 path: exact products, fp32 accumulation), and once in high precision.

    The first layer is a plain Linear fed the same input with the same weights, so its FP8 operands
    and scales are identical on both: its outputs may differ only by the order of fp32 accumulation
    (relative 1e-4 bounds K * 2**-24 for K = 512 several times over). Later layers see inputs that
    differ by that much, which flips the odd FP8 rounding, and flips compound through the layers; so
    the model's output and the input gradient are compared against FP8's own error (emulation vs
    high precision): at most 0.25 of it (flips move an element by one FP8 step, FP8's error is half
    a step on every element; a wrong scale or a GEMM in the wrong precision gives 1 or more). No
    optimizer step: the weights stay equal. The loss is a sum and every backward scale has seen an
    amax by the last step, so that E5M2 does not flush the gradients to zero."""
    n = 128 if ctx.quick else 512
    device_path = "auto" if ctx.cuda else ("scaled_mm" if has_scaled_mm("cpu") else "bf16")
    runs = {}
    cpu = torch.device("cpu")
    for name, where, path in (
        ("device", ctx.device, device_path),
        ("emulation", cpu, "fp32"),
        ("high", cpu, None),
    ):
        with check_settings(gemm_path=path, fast_accum=False) as applied:
            runs[name] = _emulation_run(where, n, fp8=path is not None)
            runs[name]["applied"] = applied
    dev, emu, high = runs["device"], runs["emulation"], runs["high"]
    grad_norms = (float(dev["grad"].norm()), float(emu["grad"].norm()))
    out = {
        "n": n,
        "device_path": device_path,
        "fast_accum": dev["applied"].get("fast_accum"),
        "first_layer_rel_err": _rel(dev["first"], emu["first"]),
        "first_layer_scales_equal": torch.equal(dev["scales"][0], emu["scales"][0]),
        "y_rel_err": _rel(dev["y"], emu["y"]),
        "y_fp8_rel_err": _rel(emu["y"], high["y"]),
        "grad_norms": grad_norms,
        "bounds": {"first_layer_rel_err": 1e-4, "distance_over_fp8_error": 0.25},
    }
    out["y_over_fp8_error"] = out["y_rel_err"] / out["y_fp8_rel_err"]
    ok = (
        out["first_layer_rel_err"] < 1e-4
        and out["first_layer_scales_equal"]
        and out["y_over_fp8_error"] <= 0.25
    )
    if min(grad_norms) > 0:
        out["grad_rel_err"] = _rel(dev["grad"], emu["grad"])
        out["grad_fp8_rel_err"] = _rel(emu["grad"], high["grad"])
        out["grad_over_fp8_error"] = out["grad_rel_err"] / out["grad_fp8_rel_err"]
        ok = ok and out["grad_over_fp8_error"] <= 0.25
    else:
        out["grad_rel_err"] = "not compared: x.grad is zero"
    out["ok"] = ok
    out["figure"] = (
        f"first layer {out['first_layer_rel_err']:.2e} (< 1e-4); device vs emulation, over FP8's own error "
        f"(<= 0.25): y {out['y_over_fp8_error']:.3f}, x.grad {_fmt(out.get('grad_over_fp8_error'))}; "
        f"path {device_path}, n {n}"
    )
    return out


def _emulation_run(where: torch.device, n: int, fp8: bool) -> dict:
    ft.inspection.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        ft.Linear(n, n, device=where), ft.LayerNormMLP(n, 2 * n, device=where), ft.Linear(n, n, device=where)
    )
    first: dict = {}
    model[0].register_forward_hook(lambda module, args, y: first.update(y=y.detach()))
    x = torch.randn(2 * n, n, generator=torch.Generator().manual_seed(1)).to(where).requires_grad_()
    for _ in range(6):  # every backward scale has seen an amax by the last step
        x.grad = None
        with ft.fp8_autocast(enabled=fp8, fp8_recipe=DELAYED):
            y = model(x)
        y.square().sum().backward()
    scales = [m.fp8_meta["scaling_fwd"].scale.cpu() for m in model]
    return {"first": first["y"].cpu(), "y": y.detach().cpu(), "grad": x.grad.cpu(), "scales": scales}


def overlap(ctx: Context) -> dict:
    hidden, tokens = (64, 64) if ctx.quick else (2048, 4096)
    latencies = (0.0, 2.0) if ctx.quick else (0.0, 2.0, 10.0)
    out: dict = {"hidden": hidden, "tokens": tokens}
    with check_settings(reduce_on_one_rank=ctx.device):
        out["real_all_reduce_floor_ms"] = _all_reduce_floor(ctx.device)
    rows = []
    steps = 5 if ctx.quick else 10
    for latency in latencies:
        for mode in ("async", "blocking"):
            collective = DelayedCollective(latency, ctx.device)
            with check_settings(
                reduce_on_one_rank=ctx.device,
                async_reduction=mode == "async",
                all_reduce=collective.all_reduce,
            ):
                ft.inspection.reset()
                model = _mlp(hidden, 4 * hidden, ctx.device)
                x = torch.randn(tokens, hidden, device=ctx.device, dtype=torch.bfloat16)
                for _ in range(3):
                    _step(model, x)
                ft.synchronize()
                ft.reset_reduction_stats()
                _sync(ctx.device)
                start = time.perf_counter()
                for _ in range(steps):
                    _step(model, x)
                ft.synchronize()
                _sync(ctx.device)
                step_ms = 1e3 * (time.perf_counter() - start) / steps
                stats = ft.reduction_stats()
            launched = max(stats["launched"], 1)
            rows.append(
                {
                    "latency_ms": latency,
                    "mode": mode,
                    "step_ms": step_ms,
                    "launched_per_step": stats["launched"] / steps,
                    "exposed_ms_per_launch": 1e3 * stats["exposed_wait_s"] / launched,
                    "hidden_ms_per_launch": 1e3 * stats["hidden_s"] / launched,
                }
            )
            ctx.progress({"rows": rows})
    out["rows"] = rows
    out["ok"] = all(r["launched_per_step"] == 2 for r in rows)
    out["expected"] = (
        "blocking exposes about the latency per launch; "
        "async about max(0, latency - compute between launch and use)"
    )
    out["figure"] = (
        f"all-reduce floor {_fmt(out['real_all_reduce_floor_ms'])} ms; step ms async/blocking: "
        + ", ".join(
            f"L={r['latency_ms']:g} {r['step_ms']:.2f}/{b['step_ms']:.2f}"
            for r, b in zip(rows[0::2], rows[1::2])
        )
    )
    return out


def _all_reduce_floor(device: torch.device) -> float:
    buffer = torch.zeros(4096, device=device)  # 16 KiB, about an amax wire
    for _ in range(3):
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    _sync(device)
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / 20


def idle(ctx: Context) -> dict:
    from torch.profiler import ProfilerActivity, profile

    n = 64 if ctx.quick else 2048
    model = _mlp(n, 4 * n, ctx.device)
    x = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(3):
        _step(model, x)
    _sync(ctx.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    steps = 5
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            _step(model, x)
        _sync(ctx.device)
        wall_us = 1e6 * (time.perf_counter() - start)
    out = {"ok": True, "wall_ms_per_step": wall_us / 1e3 / steps}
    if not ctx.cuda:
        out["figure"] = f"not on this device ({out['wall_ms_per_step']:.1f} ms per step)"
        return out
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"
    )
    busy, end = 0.0, -1.0
    for start, stop in kernels:  # the union of kernel intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = (kernels[-1][1] - kernels[0][0]) if kernels else wall_us
    out.update(gpu_busy_share=busy / span, gpu_idle_share=1 - busy / span)
    out["figure"] = (
        f"GPU idle {100 * out['gpu_idle_share']:.1f}% of a {out['wall_ms_per_step']:.1f} ms step (n={n})"
    )
    return out


SECTIONS: dict[str, Callable[[Context], dict]] = {
    "env": env,
    "contract": contract,
    "syncs": syncs,
    "te_table": te_table,
    "compile": compiled,
    "recipes": recipes,
    "kernels": lambda ctx: kernels_section(ctx.device, ctx.quick, ctx.progress),
    "grouped": lambda ctx: grouped_section(ctx.device, ctx.quick, ctx.progress),
    "emulation": emulation,
    "overlap": overlap,
    "idle": idle,
    "train": train,
}


# ---- results ----------------------------------------------------------------------------------------------
class Results:
    """DIR/gpu-check.json, rewritten whole (atomically) at every change, and DIR/summary.txt."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, RESULTS_FILE)
        self.summary = os.path.join(directory, SUMMARY_FILE)

    def write(self, section: str, result: dict) -> None:
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {"sections": {}}
        doc["sections"][section] = result
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str, allow_nan=False)
        os.replace(tmp, self.path)

    def line(self, text: str) -> None:
        print(text, flush=True)
        with open(self.summary, "a") as f:
            f.write(text + "\n")


def _clean(value):
    """JSON without NaN or infinity (written as null; the figure line says what was measured)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def default_out_dir() -> str:
    if os.environ.get("GPU_RESULTS"):
        return os.environ["GPU_RESULTS"]
    return os.path.join(os.environ["OUT"], "gpu-results") if os.environ.get("OUT") else "gpu-results"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: the dry run")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (the CPU dry run)")
    parser.add_argument(
        "--out", default=None, help="results folder (default: $GPU_RESULTS, $OUT/gpu-results, gpu-results)"
    )
    parser.add_argument(
        "--limit-s", type=float, default=None, help="the time limit the caller gives this section"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "run on a GPU machine, or pass --device cpu for the dry run",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = Results(args.out or default_out_dir())
    limit = f" at its limit of {args.limit_s:g} s" if args.limit_s else ""
    results.write(
        args.section,
        {"ok": False, "status": f"started; if this stays, the section was killed{limit} or crashed"},
    )
    start = time.perf_counter()

    def progress(partial: dict) -> None:
        status = f"running: if this stays, the section was killed{limit} or crashed after these parts"
        results.write(args.section, _clean({"ok": False, "status": status, **partial}))

    try:
        result = SECTIONS[args.section](Context(device, args.quick, progress))
    except Exception as exc:
        result = {
            "ok": False,
            "error": format_exception(exc),
            "figure": f"raised {_summary(exc)}",
        }
    result = _clean(result)
    result.update(
        section=args.section, device=str(device), seconds=time.perf_counter() - start, status="done"
    )
    results.write(args.section, result)
    results.line(
        f"{args.section}: {'ok' if result['ok'] else 'FAIL'}: {result.get('figure', '')} "
        f"({result['seconds']:.0f} s)"
    )
    if "error" in result:
        print(result["error"], file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
