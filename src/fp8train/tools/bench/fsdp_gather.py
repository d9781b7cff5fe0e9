"""FSDP2 weight all-gathers with and without `fsdp_fp8_all_gather`, on 2 gloo ranks side by side.

Per step (forward gathers and backward re-gathers): bytes all-gathered, the largest per-gather ratio
to the same gather without the option, amax collectives launched, and the median step time. The
four runs (fp32 or bf16 parameters x option off or on) take their steps in turn, so load noise hits
all alike. Bytes are counted by wrapping the collective FSDP2 gathers with.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import fp8train as ft

from ..ranks import run_ranks

RUNS = [(dtype, option) for dtype in ("fp32", "bf16") for option in (False, True)]


def _gather_name() -> str:
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _model(hidden: int, ffn: int, blocks: int, option: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [
            ft.LayerNormLinear(hidden, hidden, fsdp_fp8_all_gather=option),
            ft.LayerNormMLP(hidden, ffn, fsdp_fp8_all_gather=option),
        ]
    return torch.nn.Sequential(*layers)


def _rank(rank: int, world: int, sizes: tuple, steps: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    hidden, ffn, blocks, tokens = sizes
    gathered: list[int] = []
    name, real = _gather_name(), getattr(dist, _gather_name())

    def counted(*args, **kwargs):  # FSDP2 passes the tensors by keyword in some torch versions
        input = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
        gathered.append(input.numel() * input.element_size())
        return real(*args, **kwargs)

    setattr(dist, name, counted)
    runs = {}
    for dtype, option in RUNS:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None)
        model = _model(hidden, ffn, blocks, option)
        for layer in model:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        runs[(dtype, option)] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), [], [], [])
    recipe = ft.DelayedScaling(amax_history_len=16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    for step in range(steps + 1):  # step 0 warms up (and settles the amax layout)
        for model, opt, times, bytes_, launched in runs.values():
            ft.synchronize()
            ft.reset_reduction_stats()
            del gathered[:]
            start = time.perf_counter()
            with ft.fp8_autocast(fp8_recipe=recipe):
                y = model(x)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            ft.synchronize()
            if step:
                times.append(elapsed)
                bytes_.append(list(gathered))
                launched.append(ft.reduction_stats()["launched"])
    results = {
        key: {"step_s": statistics.median(t), "gathers": b[-1], "launched": statistics.mean(n)}
        for key, (_, _, t, b, n) in runs.items()
    }
    setattr(dist, name, real)
    return results


def run(hidden: int = 512, ffn: int = 2048, blocks: int = 2, tokens: int = 256, steps: int = 30) -> dict:
    world = 2
    res = run_ranks(_rank, world, (hidden, ffn, blocks, tokens), steps, timeout_s=3600)[0]
    rows = []
    for dtype, option in RUNS:
        r, base = res[(dtype, option)], res[(dtype, False)]
        rows.append(
            {
                "params": dtype,
                "fp8_all_gather": option,
                "gathers_per_step": len(r["gathers"]),
                "MB_gathered_per_step": sum(r["gathers"]) / 2**20,
                "vs_option_off": sum(r["gathers"]) / sum(base["gathers"]),
                "max_gather_ratio": max(a / b for a, b in zip(r["gathers"], base["gathers"])),
                "amax_collectives_per_step": r["launched"],
                "step_ms": 1e3 * r["step_s"],
                "step_vs_option_off": r["step_s"] / base["step_s"],
            }
        )
    return {"world": world, "hidden": hidden, "ffn": ffn, "blocks": blocks, "tokens": tokens, "rows": rows}
