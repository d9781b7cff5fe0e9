"""FP8 gradient communication (`fp8train.comm`) side by side with DDP's fp32 all-reduce and torch's
bf16_compress_hook, on W gloo ranks, all in one run.

Per configuration: bytes sent per gradient element (counted by wrapping the collectives, scales
included), the reduction error of one real gradient of the demo GPT against the exact mean of every
rank's gradient (float64), whether every rank holds the same bits, the median time of a DDP
forward + backward with the hook and of the reduction alone (round-robin, so load noise hits all
alike). The fp32 row's bytes are counted through `allreduce_hook` (the all-reduce DDP runs without a
hook, issued from Python where the wrapper sees it); its times are DDP without a hook. torch refuses
bf16_compress_hook by name without NCCL, so it is registered under a wrapper that calls it.

`wire_model` is arithmetic, not a measurement: bytes per element and per-peer message sizes at 8 to
4,096 ranks under NCCL's bus-bandwidth accounting.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from fp8train.comm import FP8CommState, fp8_allreduce_hook, wire

from ..data import MarkovTask
from ..models import GPT, MODEL_SIZES, next_token_loss
from ..ranks import run_ranks

__all__ = ["CONFIGS", "run", "wire_model"]

# name: FP8CommState options, or None for the baselines
CONFIGS: dict[str, Optional[dict]] = {
    "fp32 (DDP default)": None,
    "bf16_compress_hook": None,
    "fp8 e4m3": {},
    "fp8 e5m2": {"fp8_format": "e5m2"},
    "fp8 e4m3, bf16 return": {"return_format": "bf16"},
    "fp8 e4m3, stochastic": {"stochastic_rounding": True},
    "fp8 e4m3, chunk 32": {"chunk_size": 32},
    "fp8 e4m3, chunk 512": {"chunk_size": 512},
}
_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor")


class _Wire:
    """Bytes this rank sends, per collective by the usual per-rank volumes: all_reduce 2(W-1)/W of
    the buffer, all_to_all (W-1)/W of the input, all_gather (W-1)/W of the output."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self.real: dict[str, Callable] = {}

    def __enter__(self) -> _Wire:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self.real[name] = real = getattr(dist, name)
                setattr(dist, name, self._counted(name, real))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self.real.items():
            setattr(dist, name, real)

    def _counted(self, name: str, real: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            factor = 2 if name == "all_reduce" else 1
            self.bytes += factor * tensor.numel() * tensor.element_size() * (world - 1) / world
            return real(tensor, *args, **kwargs)

        return counted


def _bf16_hook(state, bucket):  # bf16_compress_hook under another name (see the module docstring)
    return default_hooks.bf16_compress_hook(state, bucket)


def _ddp(model: torch.nn.Module, name: str, counting: bool) -> DDP:
    ddp = DDP(copy.deepcopy(model))
    options = CONFIGS[name]
    if options is not None:
        ddp.register_comm_hook(FP8CommState(**options), fp8_allreduce_hook)
    elif name.startswith("bf16"):
        ddp.register_comm_hook(None, _bf16_hook)
    elif counting:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def _grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _reduce_alone(name: str, flat: torch.Tensor, state: Optional[FP8CommState]) -> Callable[[], None]:
    """The reduction of one flat gradient buffer, as the hook or DDP would run it."""
    world = dist.get_world_size()

    def fp32() -> None:
        dist.all_reduce(flat.clone().div_(world))

    def bf16() -> None:
        dist.all_reduce(flat.to(torch.bfloat16).div_(world))

    def fp8() -> None:
        state.all_reduce(flat.clone(), key=0).wait()

    return fp32 if name.startswith("fp32") else bf16 if name.startswith("bf16") else fp8


def _rank(rank: int, world: int, size: str, batch: int, rounds: int) -> dict:
    cfg = MODEL_SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=0).sample(batch, seed=1 + rank)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return next_token_loss(m(tokens[:, :-1]), tokens)

    local = copy.deepcopy(model)
    loss_of(local).backward()
    gathered = [torch.empty_like(_grad(local)) for _ in range(world)]
    dist.all_gather(gathered, _grad(local))
    exact = torch.stack(gathered).double().mean(0)
    rows = {}
    for name in CONFIGS:
        ddp = _ddp(model, name, counting=True)
        with _Wire() as spy:
            loss_of(ddp).backward()
        grad = _grad(ddp.module)
        error = (grad.double() - exact).norm() / exact.norm()
        digests = [None] * world
        dist.all_gather_object(digests, hashlib.sha256(grad.numpy().tobytes()).hexdigest())
        rows[name] = {
            "bytes_per_element": spy.bytes / grad.numel(),
            "rel_l2_error": float(error),
            "max_error_vs_max": float((grad.double() - exact).abs().max() / exact.abs().max()),
            "identical_on_ranks": len(set(digests)) == 1,
        }
    # times, round-robin: a DDP forward + backward, and the reduction of the whole gradient alone
    ddps = {name: _ddp(model, name, counting=False) for name in CONFIGS}
    flat = _grad(local)
    alone = {
        name: _reduce_alone(name, flat, None if o is None else FP8CommState(**o))
        for name, o in CONFIGS.items()
    }
    step_times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    reduce_times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(rounds + 1):
        for name in CONFIGS:
            dist.barrier()
            t0 = time.perf_counter()
            loss_of(ddps[name]).backward()
            t1 = time.perf_counter()
            alone[name]()
            t2 = time.perf_counter()
            ddps[name].zero_grad(set_to_none=True)
            if r:  # the first round warms up
                step_times[name].append(t1 - t0)
                reduce_times[name].append(t2 - t1)
    for name in CONFIGS:
        rows[name]["step_ms"] = 1e3 * statistics.median(step_times[name])
        rows[name]["reduce_ms"] = 1e3 * statistics.median(reduce_times[name])
    return {"rows": rows, "elements": flat.numel()}


def wire_model(worlds=(8, 64, 512, 4096), bucket_mb: float = 25.0, chunk: int = 128) -> list[dict]:
    """Bytes sent per gradient element and rank, by NCCL's bus-bandwidth accounting (all-reduce
    2(W-1)/W of the buffer, ring or tree; all-to-all and all-gather (W-1)/W), for one fp32 bucket of
    `bucket_mb` MB: in the bandwidth-bound regime time is these bytes over the bus bandwidth. Also the
    bytes of one message: the ring all-reduce's per-step chunk and the FP8 all-to-all's per-peer shard
    (at thousands of ranks these are kilobytes and latency, not bandwidth, bounds both)."""
    n = int(bucket_mb * 2**20 / 4)
    rows = []
    for world in worlds:
        shard = -(-n // world)
        fp8_bytes = 2 * (world - 1) * (shard + wire.chunks_per_row(shard, chunk))
        fp32 = 8 * (world - 1) / world
        rows.append({
            "ranks": world,
            "fp32_bytes_per_element": fp32,
            "bf16_bytes_per_element": fp32 / 2,
            "fp8_bytes_per_element": fp8_bytes / n,
            "fp8_vs_fp32": fp8_bytes / n / fp32,
            "fp8_vs_bf16": fp8_bytes / n / (fp32 / 2),
            "fp32_ring_message_bytes": 4 * shard,
            "fp8_message_bytes": shard + wire.chunks_per_row(shard, chunk),
        })  # fmt: skip
    return rows


def run(worlds=(2, 4), size: str = "small", batch: int = 8, rounds: int = 10) -> dict:
    rows = []
    for world in worlds:
        per_rank = run_ranks(_rank, world, size, batch, rounds, timeout_s=1800, pg_timeout_s=600)
        measured = per_rank[0]["rows"]
        base = measured["fp32 (DDP default)"]
        for name, r in measured.items():
            step = statistics.median(p["rows"][name]["step_ms"] for p in per_rank)
            reduce = statistics.median(p["rows"][name]["reduce_ms"] for p in per_rank)
            rows.append({
                "ranks": world,
                "config": name,
                "bytes_per_element": round(r["bytes_per_element"], 4),
                "bytes_vs_fp32": round(r["bytes_per_element"] / base["bytes_per_element"], 4),
                "rel_l2_error": float(f"{r['rel_l2_error']:.3g}"),
                "max_error_vs_max": float(f"{r['max_error_vs_max']:.3g}"),
                "identical_on_ranks": r["identical_on_ranks"],
                "step_ms": round(step, 2),
                "reduce_ms": round(reduce, 2),
                "reduce_vs_fp32": round(reduce / statistics.median(
                    p["rows"]["fp32 (DDP default)"]["reduce_ms"] for p in per_rank), 2),
            })  # fmt: skip
    model = wire_model()
    print("\nmodelled (arithmetic, not measured): one 25 MB fp32 bucket, chunk 128")
    from .common import table

    print(table(model, list(model[0].keys())))
    return {
        "config": {"worlds": list(worlds), "model": size, "batch": batch, "rounds": rounds,
                   "elements": per_rank[0]["elements"]},
        "rows": rows,
        "model": model,
    }  # fmt: skip
