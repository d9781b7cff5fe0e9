"""Exposed cost of the amax reduction on 2 CPU ranks: no reduction vs blocking vs async.

The amax collective on one machine takes microseconds, so each mode also runs with a latency added
to every amax collective (the same wrapper in both modes: the value is ready `latency` after the
launch), standing in for a slow interconnect. Modes are interleaved in rounds so that machine noise
hits all of them alike.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8train as ft

from ..demo import _free_port

MODES = ("none", "blocking", "async")
SIZES = {"tiny": (64, 128, 2, 64), "small": (256, 1024, 6, 1024)}  # hidden, ffn, blocks, tokens


class _Delayed:
    """A Work whose result is usable only `latency` seconds after launch."""

    def __init__(self, work, ready_at: float) -> None:
        self.work, self.ready_at = work, ready_at

    def wait(self, timeout=None):
        remaining = self.ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return self.work.wait()


def add_latency(latency: float, real=dist.all_reduce) -> None:
    """Make each torch.distributed.all_reduce here complete `latency` s after `real` launched it."""

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = _Delayed(real(tensor, op=op, group=group, async_op=True), time.perf_counter() + latency)
        if async_op:
            return work
        work.wait()
        return None

    dist.all_reduce = all_reduce


def build_model(size: str) -> torch.nn.Module:
    hidden, ffn, blocks, _ = SIZES[size]
    layers = []
    for _ in range(blocks):
        layers += [ft.LayerNormLinear(hidden, hidden), ft.LayerNormMLP(hidden, ffn)]
    return torch.nn.Sequential(*layers, ft.LayerNorm(hidden))


def _rank(rank: int, world: int, port: int, latencies, steps: int, rounds: int, size: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    hidden, _, _, tokens = SIZES[size]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(tokens, hidden, generator=gen) * (1 + rank) for _ in range(8)]
    results = {}
    for latency in latencies:
        add_latency(latency)
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
        dist.barrier()
    queue.put((rank, results))
    dist.destroy_process_group()


def run(
    latencies=(0.0, 0.005, 0.02, 0.05),
    steps: int = 30,
    rounds: int = 3,
    model_size: str = "small",
    world: int = 2,
) -> dict:
    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    per_round = max(1, steps // rounds)
    procs = [
        ctx.Process(
            target=_rank, args=(r, world, port, list(latencies), per_round, rounds, model_size, queue)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    by_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join(60)
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
