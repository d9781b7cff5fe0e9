"""Exposed cost of the amax reduction on 2 CPU ranks: no reduction vs blocking vs async.

The amax collective on one machine takes microseconds, so each mode also runs with a latency added
to every amax collective (the same wrapper in both modes: the value is ready `latency` after the
launch), standing in for a slow interconnect. Modes are interleaved in rounds so that machine noise
hits all of them alike.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

import fp8train as ft

from ..ranks import AllReduceSpy, run_ranks

MODES = ("none", "blocking", "async")
SIZES = {"tiny": (64, 128, 2, 64), "small": (256, 1024, 6, 1024)}  # hidden, ffn, blocks, tokens


def build_model(size: str) -> torch.nn.Module:
    hidden, ffn, blocks, _ = SIZES[size]
    layers = []
    for _ in range(blocks):
        layers += [ft.LayerNormLinear(hidden, hidden), ft.LayerNormMLP(hidden, ffn)]
    return torch.nn.Sequential(*layers, ft.LayerNorm(hidden))


def _rank(rank: int, world: int, latencies, steps: int, rounds: int, size: str) -> dict:
    hidden, _, _, tokens = SIZES[size]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(tokens, hidden, generator=gen) * (1 + rank) for _ in range(8)]
    results = {}
    for latency in latencies:
        spy = AllReduceSpy(latency_s=latency)  # the same added latency in every mode
        spy.install()
        runs = {}
        for mode in MODES:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(build_model(size))
            recipe = ft.DelayedScaling(amax_history_len=16, reduce_amax=mode != "none")
            runs[mode] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), recipe, [], {})
        for round_ in range(rounds + 1):  # round 0 warms up (and settles the layout)
            for mode, (model, opt, recipe, times, stats) in runs.items():
                os.environ["NVTE_ASYNC_AMAX_REDUCTION"] = "0" if mode == "blocking" else "1"
                ft.synchronize()
                ft.reset_reduction_stats()
                for i in range(steps):
                    start = time.perf_counter()
                    with ft.fp8_autocast(fp8_recipe=recipe):
                        out = model(batches[i % len(batches)])
                    out.square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if round_:
                        times.append(time.perf_counter() - start)
                ft.synchronize()  # completes the last reductions (their wait counts as exposed)
                if round_:
                    for k, v in ft.reduction_stats().items():
                        stats[k] = stats.get(k, 0) + v
        results[latency] = {
            mode: {
                "step_s": statistics.median(t),
                "exposed_s_per_step": s.get("exposed_wait_s", 0) / len(t),
                "hidden_s_per_step": s.get("hidden_s", 0) / len(t),
                "launched_per_step": s.get("launched", 0) / len(t),
            }
            for mode, (_, _, _, t, s) in runs.items()
        }
        spy.uninstall()
        dist.barrier()
    return results


def run(
    latencies=(0.0, 0.005, 0.02, 0.05),
    steps: int = 30,
    rounds: int = 3,
    model_size: str = "small",
    world: int = 2,
) -> dict:
    per_round = max(1, steps // rounds)
    by_rank = run_ranks(_rank, world, list(latencies), per_round, rounds, model_size, timeout_s=3600)
    rows = []
    for latency in latencies:
        res = by_rank[0][latency]
        base = res["none"]["step_s"]
        for mode in MODES:
            r = res[mode]
            rows.append(
                {
                    "latency_ms": 1e3 * latency,
                    "mode": mode,
                    "step_ms": 1e3 * r["step_s"],
                    "vs_none": r["step_s"] / base,
                    "exposed_ms_per_step": 1e3 * r["exposed_s_per_step"],
                    "exposed_share_of_latency": (r["exposed_s_per_step"] / (2 * latency))
                    if latency and mode != "none"
                    else None,
                    "collectives_per_step": r["launched_per_step"],
                }
            )
    return {"model_size": model_size, "world": world, "steps_per_mode": per_round * rounds, "rows": rows}
