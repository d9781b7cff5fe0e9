"""Benchmarks behind `fp8train bench` (and the scripts in benchmarks/). Each prints and saves JSON.

Bad arguments (a count below its minimum, a latency that is not a number, a --from file that is
missing or not a saved scale run) print a usage message and exit with code 2, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from ..demo import int_at_least
from .common import save, table

SUITES = (
    "fused",
    "step",
    "cast",
    "reduction",
    "fsdp",
    "gpu",
    "scale",
    "comm",
    "checkpoint",
    "optim",
    "memory",
    "grouped",
    "startup",
    "gpumodel",
)


def default_out() -> str:
    """Where figures go without --out: a fresh run directory under ./runs (as the demo's), never a
    folder of the repository; `--out benchmarks/results` updates the committed figures (from a checkout)."""
    import datetime

    return os.path.join("runs", "bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8train bench", description=__doc__)
    parser.add_argument(
        "suites",
        nargs="*",
        choices=SUITES + ("all",),
        default=["all"],
        help="which benchmarks to run (default: all that fit this machine)",
    )
    parser.add_argument(
        "--out", default=None,
        help="folder for the JSON figures (default: runs/bench-<timestamp>; from a checkout, "
        "--out benchmarks/results updates the committed figures)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests and smoke runs")
    parser.add_argument(
        "--latencies-ms", type=latencies_ms, default=latencies_ms("0,5,20,50"),
        help="reduction: injected amax-collective latencies, comma-separated milliseconds >= 0",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int_at_least(1), default=None, help="reduction, scale: steps per configuration"
    )
    parser.add_argument("--no-compile", action="store_true", help="step: leave out the torch.compile runs")
    parser.add_argument(
        "--ranks", type=rank_counts, default=None,
        help="scale and comm: rank counts, comma-separated, at least two different ones, each >= 2 (scale: "
        "default 2,4,8, --quick 2,4; comm: default 2,4)",
    )  # fmt: skip
    parser.add_argument(
        "--from", dest="from_json", type=saved_scale_run, default=None,
        help="scale: analyse the measurements saved in this JSON (by `fp8train bench scale`) again (the "
        "model, its check, the plot) instead of measuring",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.out = args.out or default_out()
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as err:
        parser.error(f"--out {args.out!r}: cannot be a folder for the figures ({err.strerror})")
    suites = SUITES if "all" in args.suites else tuple(args.suites)
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    for suite in suites:
        try:
            result = _run_suite(suite, args)
        except SavedRunError as err:
            parser.error(str(err))
        if result is None:
            continue
        path = save(args.out, suite, result)
        print(f"\n== {suite} ({path})")
        print(table(result["rows"], list(result["rows"][0].keys())))
    return 0


def _run_suite(suite: str, args) -> Optional[dict]:
    import torch

    if suite == "fused":
        from . import fused_update

        return fused_update.run(
            (4, 16) if args.quick else (4, 64, 512),
            16 if args.quick else 1024,
            repeats=3 if args.quick else 30,
        )
    if suite == "step":
        from . import step_time

        if args.quick:
            return step_time.run(64, 128, 64, repeats=2, threads=1, compiled=False)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        kernel, why = step_time.bf16_kernel(torch.device(device))
        print(f"bf16 path's GEMM kernel: {kernel} ({why})")
        native_bf16 = kernel == "bf16"
        runs = [  # 1 thread: stabler timings
            step_time.run(device=device, threads=t, compiled=not args.no_compile, bf16_baselines=native_bf16)
            for t in (2, 1)
        ]
        rows = [{"threads": r["threads"], **row} for r in runs for row in r["rows"]]
        gpt = [{"threads": 1, **row} for row in step_time.gpt_rows(threads=1)]
        print(table(gpt, list(gpt[0].keys())))
        return {**runs[0], "threads": [2, 1], "rows": rows, "tiny_gpt": gpt}
    if suite == "cast":
        from . import cast_passes

        if args.quick:
            result = cast_passes.run(shapes=((64, 128),), step=(64, 128, 64), repeats=2, threads=1)
        else:
            result = cast_passes.run()
        print(f"\n== cast: the MLP step with either cast ({result['cpu']}, {result['threads']} threads)")
        print(table(result["step"], list(result["step"][0].keys())))
        print("\n== cast: the eager FP8 step in counts (lean_path), compiled cast and output on and off")
        print(table(result["census"], list(result["census"][0].keys())))
        return result
    if suite == "gpumodel":
        from . import gpu_model

        result = gpu_model.run(**gpu_model.QUICK) if args.quick else gpu_model.run()
        print(f"\n== gpumodel: a model, not a measurement: {result['model']}")
        return result
    if suite == "reduction":
        from . import amax_reduction

        latencies = [v / 1e3 for v in args.latencies_ms]
        if args.quick:
            return amax_reduction.run(latencies=[0.0, 0.005], steps=args.steps or 4, model_size="tiny")
        return amax_reduction.run(latencies=latencies, steps=args.steps or 30)
    if suite == "fsdp":
        from . import fsdp_gather

        if args.quick:
            return fsdp_gather.run(hidden=32, ffn=64, blocks=1, tokens=16, steps=2)
        return fsdp_gather.run()
    if suite == "scale":
        return _scale(args)
    if suite == "comm":
        from . import grad_comm

        worlds = args.ranks or (2, 4)
        if args.quick:
            return grad_comm.run(worlds=worlds[:1], size="tiny", batch=2, rounds=1)
        return grad_comm.run(worlds=worlds, rounds=args.steps or 10)
    if suite == "checkpoint":
        from . import fp8_checkpoint

        if args.quick:
            return fp8_checkpoint.run(hidden=128, intermediate=256, layers=1, batch=2, seq=16, repeats=2)
        return fp8_checkpoint.run()
    if suite == "optim":
        from . import optim_states

        if args.quick:
            return optim_states.run(elements=512, moment_steps=5, gpt_steps=3, seeds=1)
        result = optim_states.run()
        print(table(result["moment_errors"], list(result["moment_errors"][0].keys())))
        return result
    if suite == "memory":
        from . import memory

        if args.quick:
            return memory.run(size="tiny", batch=2, recipes=("delayed", "nvfp4"))
        result = memory.run()
        for part in ("mlp_block", "option_cost"):
            print(table(result[part], list(result[part][0].keys())))
        return result
    if suite == "grouped":
        from . import grouped

        if args.quick:
            return grouped.run(shapes=((4, 64, 64, 256),), repeats=2)
        if torch.cuda.is_available():  # 8 local experts of DeepSeek-V3's shape (7168 -> 2048)
            return grouped.run(shapes=((8, 7168, 2048, 16384),), device="cuda")
        return grouped.run()
    if suite == "startup":
        from . import startup

        return startup.run(repeats=1 if args.quick else 5)
    if suite == "gpu":
        from . import gpu

        if torch.cuda.is_available():
            return gpu.run(sizes=(4096, 8192), device="cuda")
        if args.quick:
            return gpu.run(sizes=(32,), device="cpu", repeats=2)
        print("\n== gpu: skipped (no CUDA device); `fp8train bench gpu --quick` runs a tiny CPU check")
        return None
    raise AssertionError(suite)


def _scale(args) -> dict:
    """Saves scale.png beside the JSON; the printed table is the measured one, then the model's."""
    import os

    from . import scale

    if args.quick:
        ranks = (2, 4)
        cfg = scale.Config(micro=(1, 4), latencies_s=(0.003,), steps=args.steps or 2, rounds=1)
        fit = {"ranks": (2, 4), "micro": 4, "latency_ms": 3.0}
    else:
        ranks, cfg, fit = (2, 4, 8), scale.Config(steps=args.steps or scale.Config.steps), scale.FIT
    if args.ranks:
        ranks = args.ranks
        fit = {**fit, "ranks": (min(ranks), max(ranks))}  # calibrated on the smallest and largest
    plot_path = os.path.join(args.out, "scale.png")
    if args.from_json:
        path, saved = args.from_json
        cfg = scale.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"].items()})
        fit = {**saved["fit_points"], "ranks": tuple(saved["fit_points"]["ranks"])}
        try:
            result = scale.analyse(saved["measured"], cfg, fit, plot_path)
        except ValueError as err:  # e.g. no calibration points among the measurements
            raise SavedRunError(f"--from {path}: cannot analyse its measurements: {err}") from None
        result["measured_at"] = (
            saved["measured_at"] if "measured_at" in saved else saved["environment"]["when"]
        )
    else:
        result = scale.run(ranks, cfg, fit, plot_path=plot_path)
    print(scale.report(result))
    return result


# ---- argument types (argparse turns their ArgumentTypeError into a usage message) --------------------
def latencies_ms(text: str) -> list[float]:
    """Comma-separated milliseconds, each a finite number >= 0."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {item!r}") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(
                f"a latency is a finite number of milliseconds >= 0, got {item!r}"
            )
        values.append(value)
    return values


def rank_counts(text: str) -> tuple[int, ...]:
    """Comma-separated rank counts, each >= 2 (an amax reduction across ranks is what is measured), at
    least two different ones (the model is calibrated on the smallest and the largest)."""
    parse = int_at_least(2)
    counts = tuple(parse(item) for item in text.split(","))
    if len(set(counts)) < 2:
        raise argparse.ArgumentTypeError(
            f"the scale model is calibrated on two rank counts: give two different ones or more, got {text!r}"
        )
    return counts


class SavedRunError(ValueError):
    """A --from file whose measurements cannot be analysed."""


def saved_scale_run(path: str) -> tuple[str, dict]:
    """(path, contents) of a JSON that `fp8train bench scale` saved, checked for what the analysis reads."""
    from . import scale

    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{path!r} is not JSON ({err})") from None
    problem = scale.saved_run_problem(saved)
    if problem:
        raise argparse.ArgumentTypeError(
            f"{path!r} is not a run saved by `fp8train bench scale` ({problem}): pass its scale.json"
        )
    return path, saved


if __name__ == "__main__":
    sys.exit(main())
