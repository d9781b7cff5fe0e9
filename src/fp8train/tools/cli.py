"""The `fp8train` command: demo, report, bench, info.

Bad input (unknown option, a world size < 1, a missing run directory) prints a usage message and
exits with code 2, as argparse does.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from . import demo

    parser = argparse.ArgumentParser(
        prog="fp8train", description="FP8 training with delayed scaling and an asynchronous amax reduction."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="train a small GPT in FP8 on CPU ranks (torchrun) and write a report",
        description="Train a small GPT built from fp8train modules on real text (the Python standard "
        "library's source, byte-level; --data markov: a synthetic language), on --world-size ranks "
        "launched through torchrun: in FP8 with --recipe (delayed scaling also again with the other "
        "amax-reduction mode, --compare-modes), then with FP8 off as the reference, measuring each "
        "recipe's quantization error on sampled GEMMs' tensors; then times every configuration again in "
        "interleaved blocks of steps. Writes metrics.jsonl, summary.json, report.png and report.md to "
        "--run-dir and prints a summary.",
    )
    demo.add_arguments(p)
    p.add_argument(
        "--overhead", action="store_true",
        help="instead of the demo: measure the telemetry overhead on the demo model (one process) and exit",
    )  # fmt: skip
    p = sub.add_parser("report", help="render report.png and report.md from a run directory")
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="a directory holding metrics.jsonl (e.g. runs/demo-...)"
    )
    sub.add_parser("bench", help="run the benchmarks (arguments are passed on; see `fp8train bench --help`)")
    info_help = "versions, device, the FP8 GEMM path and the environment settings in effect"
    add_coverage_arguments(sub.add_parser("info", help=info_help))
    return parser


def add_coverage_arguments(p: argparse.ArgumentParser) -> None:
    """`info --model module:attr [--recipe KIND]`: the FP8 coverage of a model the user names."""
    from . import demo

    p.add_argument(
        "--model", metavar="MODULE:ATTR", default=None,
        help="also print which linear layers of this model run in FP8 and why not (fp8train.coverage): "
        "ATTR is a torch.nn.Module, or a callable that builds one without arguments; a model without FP8 "
        "layers is shown as fp8train.convert_to_fp8 converts it (a copy)",
    )  # fmt: skip
    p.add_argument(
        "--recipe", choices=demo.RECIPES, default=None,
        help="the recipe the model trains with (its block and GEMM path; default: the model's, or delayed)",
    )  # fmt: skip


# what each command needs beyond torch, and the extra that installs it
NEEDS = {"demo": ("matplotlib", "demo"), "report": ("matplotlib", "demo")}


def missing_extra(command: str) -> Optional[str]:
    """A message naming the extra to install if `command` needs a package that is missing, else None."""
    if command not in NEEDS:
        return None
    package, extra = NEEDS[command]
    if importlib.util.find_spec(package) is not None:
        return None
    return (
        f"fp8train {command} needs {package}, which is not installed: "
        f'pip install "fp8train[{extra}]" (the core library needs only torch)'
    )


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = missing_extra(args.command)
    if problem and not getattr(args, "overhead", False):
        print(problem, file=sys.stderr)
        return 1
    if args.command == "demo":
        return _demo(args, parser)
    if args.command == "report":
        return _report(args, parser)
    if args.model is not None:
        return _info() or _model_coverage(args.model, args.recipe, parser)
    return _info()


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import demo

    if args.overhead:
        from .demo_worker import measure_telemetry_overhead

        r = measure_telemetry_overhead(args.model_size)
        print(
            f"telemetry overhead ({r['model_size']} demo model, 1 process, {r['steps']} steps, interleaved "
            f"blocks): median step {r['median_step_ms_off']:.2f} ms off, {r['median_step_ms_on']:.2f} ms on "
            f"({r['overhead_pct']:+.1f}%); log_step itself {r['median_log_step_ms']:.3f} ms "
            f"({r['log_step_pct_of_step']:.1f}% of a step, including the fused scale update it moves forward)"
        )
        return 0
    problem = demo.check_device(args)
    if problem:
        parser.error(problem)
    return demo.run(args)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fp8train.telemetry import METRICS_FILE

    from .report import render

    if not os.path.isdir(args.run_dir):
        parser.error(f"run directory {args.run_dir!r} does not exist")
    if not os.path.isfile(os.path.join(args.run_dir, METRICS_FILE)):
        parser.error(f"run directory {args.run_dir!r} has no {METRICS_FILE} (not an fp8train run directory)")
    try:
        outputs = render(args.run_dir)
    except ValueError as err:  # a record or the summary the report cannot read
        parser.error(f"cannot render {args.run_dir!r}: {err}")
    except OSError as err:  # the run directory not readable or writable
        parser.error(f"cannot render {args.run_dir!r}: {err.strerror}: {err.filename}")
    print(f"report: {outputs['png']}\nsummary: {outputs['markdown']}")
    return 0


def _bench(argv: list[str]) -> int:
    try:
        from .bench import main as bench_main
    except ImportError as err:
        print(f"fp8train bench: the benchmarks are not available ({err})", file=sys.stderr)
        return 1
    return int(bench_main(argv) or 0)


def _info() -> int:
    import torch

    from fp8train import __version__
    from fp8train.amax import settings

    ENV_ASYNC = settings.ENV_ASYNC
    from fp8train.modules.grouped_gemm import grouped_kernel_choice
    from fp8train.numerics.gemm import (
        ENV_FAST_ACCUM,
        ENV_PATH,
        bf16_kernel,
        choose_path,
        fast_accumulation,
        recipe_gemm,
    )
    from fp8train.quantization import RECIPES

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"fp8train {__version__}")
    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    if cuda:
        cap = torch.cuda.get_device_capability(device)
        print(f"device: cuda ({torch.cuda.get_device_name(device)}, compute capability {cap[0]}.{cap[1]})")
    else:
        print("device: cpu (no CUDA device available)")
    status = 0
    try:
        path = choose_path(device, 1024, 1024, 1024)
        print(f"FP8 GEMM path for a 1024x1024x1024 GEMM on {device.type}: {path}")
        if path == "bf16":
            kernel, why = bf16_kernel(device)
            print(f"  computed by the {kernel} GEMM kernel: {why}")
        print(f"GEMM of each recipe on {device} (where its kernel takes the shape; else the emulation):")
        for recipe, quantization in RECIPES.items():
            gemm, why = recipe_gemm(quantization.kernel, device)
            print(f"  {recipe.__name__}: {gemm}: {why}")
        for kernel, recipes in (("tensorwise", "delayed and current scaling"), ("mxfp8", "MXFP8")):
            native, why = grouped_kernel_choice(device, kernel)
            grouped = "torch._scaled_grouped_mm" if native else "one GEMM per expert"
            print(f"grouped GEMMs (mixture of experts; {recipes}, bf16): {grouped}: {why}")
        fast = [role for role in ("forward", "dgrad", "wgrad") if fast_accumulation(role)]
        print(
            f"{ENV_FAST_ACCUM}={_env(ENV_FAST_ACCUM)}: fast accumulation for {', '.join(fast) or 'no'} GEMMs"
        )
    except ValueError as err:
        print(f"FP8 GEMM path: invalid setting: {err}")
        status = 2
    print(f"{ENV_PATH}={_env(ENV_PATH)} (unset or 'auto': chosen per device and shape)")
    try:
        mode = "asynchronous" if settings.asynchronous() else "blocking"
        print(f"{ENV_ASYNC}={_env(ENV_ASYNC)}: {mode} amax reduction")
    except ValueError as err:
        print(f"{ENV_ASYNC}: invalid setting: {err}")
        status = 2
    return status


def load_model(spec: str):
    """The torch.nn.Module that "module:attr" names (an attribute, or a callable building one)."""
    import importlib

    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: write MODULE:ATTR, e.g. mypackage.models:build_model")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, torch.nn.Module) and callable(obj):
        obj = obj()
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"--model {spec!r} is a {type(obj).__name__}, not a torch.nn.Module or its builder")
    return obj


def _model_coverage(spec: str, recipe_name: Optional[str], parser: argparse.ArgumentParser) -> int:
    import copy

    import fp8train
    from fp8train.layer_coverage import coverage

    try:
        model = load_model(spec)
    except ValueError as err:
        parser.error(str(err))
    recipe = None
    if recipe_name is not None:
        from .demo_worker import DEMO_RECIPES

        recipe = DEMO_RECIPES[recipe_name]
    print(f"coverage of {spec}:")
    if not any(isinstance(m, fp8train.FP8Module) for m in model.modules()):
        print("  (no FP8 layers: shown as fp8train.convert_to_fp8 converts it)")
        model = fp8train.convert_to_fp8(copy.deepcopy(model), recipe=recipe, log=False)
    report = coverage(model, recipe)
    print(report.table())
    print(report.summary())
    return 0


def _env(name: str) -> str:
    value = os.environ.get(name)
    return "(unset)" if value is None else repr(value)
