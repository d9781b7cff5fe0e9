"""`fp8train demo`: launch the demo workers through torchrun, then render the report and summarise.

The workers (fp8train.tools.demo_worker) do the training; this process only builds the torchrun command
line (a free port, one thread per rank, NVTE_ASYNC_AMAX_REDUCTION as asked), waits, and reads back
what rank 0 wrote.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from typing import Optional

from .ranks import free_port

__all__ = ["add_arguments", "run", "launch_command", "format_summary", "RECIPES"]

# the demo's recipes (fp8train.tools.demo_worker.DEMO_RECIPES; named here so the parser needs no torch)
RECIPES = ("delayed", "current", "block", "mxfp8", "nvfp4")
RECIPE_TEXT = {
    "delayed": "delayed scaling",
    "current": "current scaling",
    "block": "block scaling",
    "mxfp8": "MXFP8",
    "nvfp4": "NVFP4",
}


def int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`, anything else refused with a message saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (shared by `fp8train demo` and its tests)."""
    p.add_argument("--world-size", type=positive_int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=positive_int, default=150, help="training steps per run (default 150)")
    p.add_argument(
        "--model-size",
        choices=("tiny", "small"),
        default="small",
        help="tiny: 2 layers, hidden 64; small: 4 layers, hidden 128 (default)",
    )
    p.add_argument(
        "--model", choices=("gpt", "moe"), default="gpt",
        help="gpt: dense MLPs (the default); moe: each MLP a mixture of 4 experts, top-2 routing "
        "(GroupedLinear: one FP8 GEMM and delayed-scaling roles per expert)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per rank and step (default 8)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--async", dest="async_mode", action="store_true", default=True,
        help="asynchronous amax reduction (the default; NVTE_ASYNC_AMAX_REDUCTION=1)",
    )  # fmt: skip
    mode.add_argument(
        "--no-async", dest="async_mode", action="store_false",
        help="blocking amax reduction (NVTE_ASYNC_AMAX_REDUCTION=0)",
    )  # fmt: skip
    p.add_argument(
        "--compare-modes", action=argparse.BooleanOptionalAction, default=True,
        help="also train in the other reduction mode and check that the results are bit-identical "
        "(default on; --no-compare-modes skips it)",
    )  # fmt: skip
    p.add_argument(
        "--recipe", choices=(*RECIPES, "all"), default="delayed",
        help="FP8 recipe: delayed scaling (the default, with the amax reduction), per-tensor current "
        "scaling, 1x128/128x128 block scaling, MXFP8 (1x32 blocks, E8M0 scales), NVFP4 (E2M1 in 16-blocks, "
        "E4M3 block scales), or all five side by side on the same model and data",
    )  # fmt: skip
    p.add_argument(
        "--data", choices=("text", "markov"), default="text",
        help="text: the Python standard library's own source, byte-level (the default, real text, "
        "offline); markov: a synthetic language whose entropy is a known loss floor",
    )  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--run-dir", default=None, help="output directory (default runs/demo-<timestamp>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the language and the data")
    p.add_argument(
        "--log-every", type=positive_int, default=1, help="telemetry interval in steps (default 1)"
    )
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard logs (if installed)")
    p.add_argument(
        "--quant-error-every", type=non_negative_int, default=10, metavar="N",
        help="measure each recipe's quantization error on sampled GEMMs' tensors every N steps and at the "
        "last (default 10; 0: never)",
    )  # fmt: skip
    p.add_argument(
        "--timing-rounds", type=non_negative_int, default=10, metavar="R",
        help="after training, time every configuration in R rounds of interleaved blocks (default 10; "
        "0: no timed pass, the report shows the training runs' sequential medians)",
    )  # fmt: skip
    p.add_argument(
        "--timing-block", type=positive_int, default=2, metavar="STEPS",
        help="steps per block of the timed pass (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=positive_int, default=None, metavar="SECONDS",
        help="stop the workers and fail after this many seconds (default: no limit)",
    )  # fmt: skip


def launch_command(args: argparse.Namespace, run_dir: str) -> list[str]:
    """The torchrun command line that starts the workers."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc_per_node", str(args.world_size),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "fp8train.tools.demo_worker",
        "--steps", str(args.steps), "--model-size", args.model_size, "--batch-size", str(args.batch_size),
        "--seed", str(args.seed), "--device", args.device, "--run-dir", run_dir,
        "--log-every", str(args.log_every), "--recipe", args.recipe, "--data", args.data,
        "--quant-error-every", str(args.quant_error_every), "--timing-rounds", str(args.timing_rounds),
        "--timing-block", str(args.timing_block), "--model", args.model,
    ]  # fmt: skip
    if args.compare_modes:
        cmd.append("--compare-modes")
    if args.tensorboard:
        cmd.append("--tensorboard")
    return cmd


def _launch(cmd: list[str], env: dict, timeout: Optional[int]) -> Optional[int]:
    """Run torchrun; on timeout ask it to stop its workers (SIGTERM), then kill it. None = timed out."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun forwards the signal to the workers it started
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def check_device(args: argparse.Namespace) -> Optional[str]:
    """A message if the requested device cannot host `world_size` ranks, else None."""
    if args.device != "cuda":
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "--device cuda: CUDA is not available on this machine; use --device cpu"
    if args.world_size > count:
        return f"--device cuda: --world-size {args.world_size} needs {args.world_size} GPUs, found {count}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success, 1 when a worker failed."""
    run_dir = args.run_dir or os.path.join(
        "runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    from fp8train.telemetry import METRICS_FILE

    from .report import load_run, render

    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.exists(metrics):
        os.remove(metrics)  # telemetry appends; a reused run directory starts afresh
    env = dict(os.environ)
    env["NVTE_ASYNC_AMAX_REDUCTION"] = "1" if args.async_mode else "0"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    mode = "asynchronous" if args.async_mode else "blocking"
    backend = "nccl" if args.device == "cuda" else "gloo"
    recipes = ", ".join(RECIPE_TEXT.values()) if args.recipe == "all" else RECIPE_TEXT[args.recipe]
    print(
        f"fp8train demo: {_ranks(args.world_size)} ({backend}, {args.device}), {args.model_size} "
        f"{'MoE ' if args.model == 'moe' else ''}GPT on "
        f"{'real text' if args.data == 'text' else 'a synthetic language'}, {args.steps} steps, {recipes}, "
        f"{mode} amax reduction -> {run_dir}",
        flush=True,
    )
    returncode = _launch(launch_command(args, run_dir), env, args.timeout)
    summary_path = os.path.join(run_dir, "summary.json")
    if returncode != 0 or not os.path.exists(summary_path):
        why = (
            f"timed out after {args.timeout} s" if returncode is None else f"torchrun exit code {returncode}"
        )
        print(f"fp8train demo: the workers failed ({why})", file=sys.stderr)
        return 1
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    outputs = render(run_dir)
    clipping = {name: run.clipping() for name, run in load_run(run_dir).items()}
    print(format_summary(summary, outputs, clipping))
    return 0


def format_summary(summary: dict, outputs: dict, clipping: Optional[dict] = None) -> str:
    """The end-of-demo text: losses vs the reference, reductions (their cost, their time in flight), files.
    `clipping`: RunData.clipping() by run name (the report's), for the clipped casts' shares."""
    phases = summary["phases"]
    fp8 = [p for p in phases.values() if p["fp8"]]
    ref = phases.get("reference")
    lines = [
        "",
        f"Summary: {_ranks(summary['world_size'])} ({summary['backend']} on {summary['device']}), "
        f"{summary['model_size']} GPT ({summary['params']:,} params), {summary['steps']} steps",
        f"  data: {summary['data']}",
        "  final loss (mean of the last 10% of steps), step time, quantization error (mean relative error "
        "on sampled GEMMs' input / weight / grad_output), saturated casts:",
    ]
    timing = summary.get("step_timing")
    times = timing["median_ms"] if timing else {}
    ref_ms = times.get("reference", 1e3 * ref["median_step_s"] if ref else None)
    for p in fp8:
        line = f"    {p['run']:<13} {p['final_loss']:.4f}"
        if ref:
            rel = 100 * (p["final_loss"] - ref["final_loss"]) / ref["final_loss"]
            line += f" ({rel:+.2f}% vs fp32)"
        line += "  " + _step_text(times.get(p["run"], None if timing else 1e3 * p["median_step_s"]), ref_ms)
        errors = p.get("quant_error_mean")
        if errors:
            line += "  error " + " / ".join(f"{errors[r]:.4f}" for r in ("input", "weight", "grad_output"))
        lines.append(line + f"  {_saturation(p, (clipping or {}).get(p['run']))}")
    if ref:
        lines.append(
            f"    {'reference':<13} {ref['final_loss']:.4f}{'':17}  {_step_text(ref_ms, None)}  "
            "(same model and data, FP8 off, fp32)"
        )
    if "bf16-autocast" in times:
        bf16 = _step_text(times["bf16-autocast"], ref_ms)
        lines.append(f"    {'bf16-autocast':<13} {'':23}  {bf16}  (bf16 autocast, FP8 off: timing only)")
    if summary.get("loss_floor") is not None:
        lines.append(
            f"    {'loss floor':<13} {summary['loss_floor']:.4f}  (entropy of the synthetic language)"
        )
    if timing:
        lines.append(
            f"  step times: medians of a separate pass after training that alternates the configurations "
            f"in blocks of {timing['block']} steps ({timing['rounds']} rounds after one warm-up block each; "
            "a step's time is its slowest rank's; quartiles in report.md), so that every configuration "
            "sees the same machine load; the training runs' own medians (sequential, in report.md) are not "
            "comparable on a shared machine"
        )
    else:
        lines.append(
            "  step times: medians of the training runs, which ran one after another (sequential): with "
            "other jobs on the machine they are not comparable (--timing-rounds > 0 interleaves them)"
        )
    delayed = [p for p in fp8 if p.get("recipe_kind", "delayed") == "delayed"]
    if len(delayed) == 2:
        same = all(delayed[0][k] == delayed[1][k] for k in ("loss_digest", "fp8_state_digest"))
        verdict = "yes" if same else "NO"
        lines.append(f"  async and blocking bit-identical (every loss, scales, amax histories): {verdict}")
    if delayed:
        first = delayed[0]["reduction_per_rank"][0]
        lines.append(
            f"  amax reductions per rank and delayed-scaling run: {first['launched']} launched "
            f"({first['bytes_reduced'] / 1024:.1f} KiB); time per step (worst rank):"
        )
        for p in delayed:
            per_rank, steps = p["reduction_per_rank"], p["steps"]
            exposed = max(s["exposed_wait_s"] for s in per_rank) * 1e3 / steps
            launched = max(1, per_rank[0]["launched"])
            window = min(s["hidden_s"] for s in per_rank) * 1e3 / launched
            lines.append(
                f"    {p['run']:<13} exposed {exposed:.3f} ms (what the step pays); each reduction in flight "
                f"{window:.3f} ms, overlapped (not a cost)"
            )
        lines.append(
            "  saturated casts: role-steps whose amax x scale used > fp8_max (delayed scaling casts with "
            "earlier steps' amaxes; the other recipes scale each tensor or block by its own amax); the "
            "share of the largest value clipped is 1 - 1/utilisation: if it matters (a loss that drifts "
            "from the reference), DelayedScaling(margin=1) leaves 2x headroom"
        )
    if summary["device"] == "cpu":
        lines.append(
            "  (on CPU the FP8 GEMMs are emulated: the demo shows numerics and the protocol, not speed)"
        )
    for key, label in (("png", "report"), ("markdown", "summary"), ("metrics", "metrics")):
        if key in outputs:
            lines.append(f"  {label:<8} {outputs[key]}")
    return "\n".join(lines)


def _step_text(ms: Optional[float], ref_ms: Optional[float]) -> str:
    if ms is None:  # not in the timed pass (delayed scaling's second reduction mode)
        return f"step {'-':>7}    {'':12}"
    ratio = f"({ms / ref_ms:.2f}x fp32)" if ref_ms else ""
    return f"step {ms:7.1f} ms {ratio:<12}"


def _saturation(phase: dict, clip: Optional[dict] = None) -> str:
    if phase.get("recipe_kind", "delayed") != "delayed":
        return "saturated: none by construction"
    ev = phase["events"]
    text = f"saturated: {ev['overflow']} role-steps"
    if clip and clip["clipped"]:
        text += f" (clipped {100 * clip['median_share']:.1f}% median, {100 * clip['max_share']:.1f}% max)"
    return text + (f", non-finite amaxes {ev['nonfinite']}" if ev["nonfinite"] else "")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")
