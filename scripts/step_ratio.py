"""FP8 (delayed scaling, eager) over fp32 step time, side by side in one process: the 12-layer tiny GPT
or the MLP block 1024-4096-1024 on 256 tokens; one thread, thread CPU time, fp32 and FP8 round-robin
(`fp8train.tools.timing.interleaved_times`), medians (and minima: `min_ratio`, `min_overhead_ms`, FP8's
time beyond fp32's). Prints one JSON line.

    PYTHONPATH=<tree>/src python scripts/step_ratio.py gpt 16     # model, rounds
    PYTHONPATH=<tree>/src python scripts/step_ratio.py block 8

Compare two source trees by alternating them, a fresh process per run (docs/benchmarks.md, "The lean
eager path")."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fp8train as ft
from fp8train.tools.bench.common import train_step
from fp8train.tools.bench.step_time import _mlp, gpt_steps
from fp8train.tools.timing import interleaved_times


def _block_steps() -> dict:
    fp32, fp8 = _mlp(torch.nn.Linear, 1024, 4096), _mlp(ft.Linear, 1024, 4096)
    fp8.load_state_dict(fp32.state_dict(), strict=False)
    x = torch.randn(256, 1024, requires_grad=True)

    def backward(y: torch.Tensor) -> None:
        y.float().square().mean().backward()

    recipe = ft.DelayedScaling(amax_history_len=16)
    return {
        "fp32": train_step(fp32, x, None, False, backward),
        "fp8": train_step(fp8, x, recipe, True, backward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("gpt", "block"))
    parser.add_argument("rounds", type=int, nargs="?", default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fns = gpt_steps(12, 8) if args.model == "gpt" else _block_steps()
    times = interleaved_times(fns, args.rounds, warmup_blocks=3, clock=time.thread_time)
    median = {k: statistics.median(v) for k, v in times.items()}
    fp32_ms, fp8_ms = 1e3 * median["fp32"], 1e3 * median["fp8"]
    row = {"model": args.model, "fp32_ms": round(fp32_ms, 2), "fp8_ms": round(fp8_ms, 2)}
    # minima too: other jobs on a shared machine only ever add time, so a minimum moves less
    least = {k: 1e3 * min(v) for k, v in times.items()}
    extra = {
        "min_ratio": round(least["fp8"] / least["fp32"], 3),
        "min_overhead_ms": round(least["fp8"] - least["fp32"], 2),
    }
    print(json.dumps({**row, "ratio": round(fp8_ms / fp32_ms, 3), **extra}))


if __name__ == "__main__":
    main()
