"""FP8 gradient communication: the wire format, the launch order, and the DDP hook on real
gloo ranks: every element within a bound derived from the format, the same bits on every rank, the
bytes on the wire, non-finite values, error feedback, DDP's no_sync / find_unused_parameters / join,
a tiny GPT trained with it, and bad configurations.

The bound (docs/design.md, section 15). Each sender's shard is cut into chunks; a chunk with amax A
has the scale d = 2**ceil(log2(A / fp8_max)). Element x of that chunk arrives with an error of at most
half an FP8 ulp of |x| / d, times d (one ulp with stochastic rounding): ulp(v) = 2**(max(floor(log2
v), e_min) - m) for m mantissa bits and e_min the smallest normal exponent. The owner sums the W
decoded contributions in float32 (at most 2**-24 * sum |q_r| for the sum and the division by W), and
the mean goes back in FP8 with its own chunk scales (the same half-ulp rule, on a value at most
|exact mean| + the first trip's bound) or in bf16 (half a bf16 ulp). The test recomputes every scale
from the inputs in float64 and checks every element.
"""

from __future__ import annotations

import copy
import datetime
import math
import threading
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fp8train
from fp8train.comm import FP8CommState, FP8ReduceScatter, fp8_allreduce_hook, wire
from fp8train.comm.ordered import OrderedLauncher
from fp8train.numerics.microscaling import mx_quantize
from fp8train.tools.bench import grad_comm
from helpers import digest
from inverses import mx_dequantize
from multirank import run_ranks, run_scenarios, scenario_outcome

FP8 = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}
CHUNK = 128
SIZES = (5003, 7)  # partial chunks and padding; a tensor smaller than one chunk per rank
CONFIGS = [
    {"fp8_format": f, "stochastic_rounding": sr, "return_format": rf}
    for f in ("e4m3", "e5m2")
    for sr in (False, True)
    for rf in ("fp8", "bf16")
]


# ---- the reference: inputs and the bound ---------------------------------------------------------------
def rank_input(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like values whose magnitude changes every 16 elements over 2**-30..2**8 (so within a
    chunk too: values below the FP8 subnormals of their chunk), zeros, and chunks that are zero on
    odd ranks."""
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + n)
    x = torch.randn(n, generator=g)
    exponents = torch.randint(-30, 9, (-(-n // 16),), generator=g).repeat_interleave(16)[:n]
    x = x * torch.exp2(exponents.float())
    x[n // 3 : n // 3 + 40] = 0.0
    if rank % 2:  # chunks that are zero on some ranks only
        x[2 * n // 3 : 2 * n // 3 + 2 * CHUNK] = 0.0
    return x


def _rows(x: torch.Tensor, world: int) -> torch.Tensor:
    shard = -(-x.numel() // world)
    return torch.nn.functional.pad(x.double(), (0, world * shard - x.numel())).view(world, shard)


def _chunk_scale(rows: torch.Tensor, chunk: int, fp8_max: float) -> torch.Tensor:
    """Per element: its chunk's power-of-two scale, amax / fp8_max rounded up (float64; a zero chunk
    gets 2**-127)."""
    n = rows.shape[1]
    blocks = torch.nn.functional.pad(rows.abs(), (0, -n % chunk)).view(rows.shape[0], -1, chunk)
    amax = blocks.amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / fp8_max))), 2.0**-127)
    return scale.expand_as(blocks).reshape(rows.shape[0], -1)[:, :n]


def _ulp(v: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """The FP8 spacing at |v| / scale, times scale (subnormal spacing below the normals)."""
    m, e_min, _ = FP8[encoding]
    exponent = torch.floor(torch.log2(v.abs() / scale)).clamp(min=e_min)  # log2(0) = -inf
    return torch.exp2(exponent - m) * scale


def reduction_bound(
    inputs: list[torch.Tensor],
    encoding: str,
    return_format: Optional[str],
    stochastic: bool,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact mean in float64, per-element bound on |result - exact|) for these ranks' inputs."""
    world, n = len(inputs), inputs[0].numel()
    fp8_max = FP8[encoding][2]
    rounding = 1.0 if stochastic else 0.5
    rows = [_rows(x, world) for x in inputs]
    first_trip = [rounding * _ulp(r, _chunk_scale(r, chunk, fp8_max), encoding) for r in rows]
    exact = sum(rows) / world
    sum_rounding = 2.0**-24 * sum(r.abs() + e for r, e in zip(rows, first_trip)) * 1.01
    first = sum(first_trip) / world + sum_rounding
    mean_bound = exact.abs() + first  # |the owner's float32 mean| is at most this
    if return_format is None:  # no return trip (FSDP2's reduce-scatter)
        back = torch.zeros_like(first)
    elif return_format == "bf16":
        exponent = torch.floor(torch.log2(mean_bound))
        back = torch.where(mean_bound > 0, torch.exp2(exponent - 8), 0.0)
    else:  # the scale from the mean's chunk amax is at most the one from mean_bound's (monotone)
        back = rounding * _ulp(mean_bound, _chunk_scale(mean_bound, chunk, fp8_max), encoding)
    return exact.reshape(-1)[:n], (first + back).reshape(-1)[:n]


def bit_identical(tensors: list[torch.Tensor]) -> bool:
    """The same bytes (NaN included)."""
    return len({digest(t) for t in tensors}) == 1


# ---- the wire format and the launch order (one process) --------------------------------------------------
@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_wire_is_the_mxfp8_rule_with_a_chunk_sized_block(encoding: str) -> None:
    """Round to nearest: the bytes are torch's FP8 values and the E8M0 scales of microscaling.mx_quantize
    with block = chunk (where no scale is 0, which MXFP8 treats differently), decoded exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-20, 20, (1000,), generator=g).float())
    data = wire.encode(x.view(2, 500), 64, encoding)
    for row in range(2):
        values, scales = mx_quantize(x.view(2, 500)[row], 0, block=64, encoding=encoding)
        assert bool((scales > 0).all())
        assert torch.equal(data[row, :500], values.view(torch.uint8))
        assert torch.equal(data[row, 500:], scales)
        decoded = wire.decode(data, 500, 64, encoding)[row]
        assert torch.equal(decoded, mx_dequantize(values, scales, 0, block=64))


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_wire_non_finite_chunks(encoding: str) -> None:
    """A NaN makes its chunk NaN; an infinity comes back as an infinity of its sign (its chunk's finite
    values flush to 0); other chunks are untouched."""
    x = torch.linspace(-3.0, 5.0, 4 * 32)
    y = x.clone()
    y[5], y[40], y[41], y[100] = math.nan, math.inf, 1e30, -math.inf
    clean = wire.decode(wire.encode(x.view(1, -1), 32, encoding), 128, 32, encoding)[0]
    out = wire.decode(wire.encode(y.view(1, -1), 32, encoding), 128, 32, encoding)[0]
    assert bool(out[:32].isnan().all())
    assert out[40] == math.inf and out[100] == -math.inf and out[41] == 0.0
    assert bool(torch.isfinite(out[32:40]).all())
    assert torch.equal(out[64:96], clean[64:96])


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(encoding: str) -> None:
    """The NVFP4 rule on the FP8 grid: every draw is one of the two neighbours (so the result casts to
    FP8 exactly), and the mean of N draws is within 6 standard errors of the value."""
    m, e_min, fp8_max = FP8[encoding]
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.rand(200, generator=g) * fp8_max, torch.rand(56, generator=g) * 2.0**e_min])
    draws = 4000
    out = wire.stochastic_fp8_round(values.repeat(draws, 1), encoding, g)
    dtype = torch.float8_e4m3fn if encoding == "e4m3" else torch.float8_e5m2
    assert torch.equal(out.to(dtype).float(), out)  # on the grid
    step = _ulp(values.double(), torch.ones(()), encoding).float()
    low = torch.floor(values / step) * step
    assert bool(((out == low) | (out == low + step)).all())
    error = (out.double().mean(0) - values.double()).abs()
    assert bool((error <= 6 * step.double() / 2 / math.sqrt(draws)).all()), float((error / step).max())
    on_grid = torch.tensor([0.0, 1.0, 1.125 if encoding == "e4m3" else 1.25, fp8_max])
    assert torch.equal(wire.stochastic_fp8_round(on_grid.repeat(50, 1), encoding, g), on_grid.repeat(50, 1))


def test_ordered_launcher_runs_launches_in_sequence_whichever_thread_is_first() -> None:
    launcher, order = OrderedLauncher(), []
    threads = [
        threading.Thread(target=launcher.submit, args=(s, lambda s=s: order.append(s))) for s in (3, 1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == [] and launcher.waiting() == 3  # 0 is not ready: nothing may run ahead of it
    # a launch that submits the next one (NCCL runs completion callbacks inline): filed, then run
    launcher.submit(0, lambda: (order.append(0), launcher.submit(4, lambda: order.append(4))))
    assert order == [0, 1, 2, 3, 4] and launcher.waiting() == 0
    with pytest.raises(RuntimeError, match="submitted twice"):
        launcher.submit(2, lambda: None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fp8_format": "bf16"}, "not an FP8 format.*bf16_compress_hook"),
        ({"fp8_format": torch.bfloat16}, "not an FP8 format"),
        ({"fp8_format": fp8train.Format.HYBRID}, "names two encodings.*Format.E4M3 or Format.E5M2"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"return_format": "fp16"}, "return_format must be one of"),
    ],
)
def test_bad_configuration_is_a_clear_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FP8CommState(**kwargs)


def test_state_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        FP8CommState()


def _one_rank(rank: int, world: int) -> dict:
    """World size 1: the documented pass-through (no collective, no rounding)."""
    calls = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        x = rank_input(0, 1000)
        out = FP8CommState(error_feedback=True).all_reduce(x.clone(), key=0).wait()
        model = DDP(torch.nn.Linear(8, 8))
        model.register_comm_hook(FP8CommState(), fp8_allreduce_hook)
        model(torch.randn(4, 8)).sum().backward()
    finally:
        dist.all_to_all_single = real
    return {"same": torch.equal(out, x), "calls": len(calls), "grad": model.module.weight.grad is not None}


@pytest.mark.multirank
def test_world_size_one_is_a_pass_through() -> None:
    assert run_ranks(_one_rank, 1, timeout_s=60) == [{"same": True, "calls": 0, "grad": True}]


# ---- on real ranks ------------------------------------------------------------------------------------
class WireSpy:
    """Wraps the collectives (module attributes, where the hooks look them up) and counts the bytes
    each rank sends, by the usual per-rank volumes: all_reduce 2(W-1)/W of the buffer (ring or tree),
    all_to_all (W-1)/W of the input, all_gather (W-1)/W of the output."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor")

    def __init__(self, names: tuple = NAMES) -> None:
        self.names = names
        self.bytes = 0.0
        self.real = {}

    def __enter__(self) -> WireSpy:
        for name in self.names:
            if hasattr(dist, name):
                self.real[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.real[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
            size = tensor.numel() * tensor.element_size()
            self.bytes += size * (world - 1) / world * (2 if name == "all_reduce" else 1)
            return fn(*args, **kwargs)

        return wrapped


def _scenario_bound(rank: int, world: int) -> dict:
    out = {}
    for i, config in enumerate(CONFIGS):
        state = FP8CommState(chunk_size=CHUNK, seed=3, **config)
        futures = [state.all_reduce(rank_input(rank, n)) for n in SIZES]
        out[i] = [f.wait() for f in futures]
    for seed in (3, 4):  # stochastic rounding repeats under its seed, and only under it
        state = FP8CommState(chunk_size=CHUNK, seed=seed, stochastic_rounding=True)
        out[f"seed {seed}"] = [state.all_reduce(rank_input(rank, n)).wait() for n in SIZES]
    state, x = FP8CommState(chunk_size=CHUNK), rank_input(rank, 5003).bfloat16()  # bf16 parameters
    out["bf16"] = (state.all_reduce(x.clone()).wait(), state.all_reduce(x.float()).wait())
    return out


def _scenario_error_feedback(rank: int, world: int, steps: int = 16) -> dict:
    x = rank_input(rank, 1000)
    out = {}
    for feedback in (False, True):
        state = FP8CommState(chunk_size=CHUNK, error_feedback=feedback)
        out[feedback] = sum(state.all_reduce(x.clone(), key="g").wait().double() for _ in range(steps))
    return out


NONFINITE = {0: {10: math.nan, 600: math.inf}, 1: {300: math.inf, 600: -math.inf}}


def _scenario_non_finite(rank: int, world: int) -> dict:
    out = {}
    for return_format in ("fp8", "bf16"):
        state = FP8CommState(chunk_size=CHUNK, return_format=return_format)
        x = rank_input(rank, 1000)
        clean = state.all_reduce(x.clone()).wait()
        for i, value in NONFINITE.get(rank, {}).items():
            x[i] = value
        out[return_format] = (clean, state.all_reduce(x).wait())
    return out


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.Linear(64, 8)
    )


def _scenario_bytes(rank: int, world: int) -> dict:
    """Bytes per gradient element of DDP's fp32 all-reduce (allreduce_hook: the all-reduce DDP runs
    without a hook, issued from Python so the spy sees it), bf16_compress_hook and the FP8 hook."""
    hooks = {
        "fp32": (None, default_hooks.allreduce_hook),
        "bf16": (None, default_hooks.bf16_compress_hook),
        "fp8": (FP8CommState(chunk_size=CHUNK), fp8_allreduce_hook),
    }
    out = {}
    for name, (state, hook) in hooks.items():
        model = DDP(_net(), bucket_cap_mb=0.02)
        buckets = []

        def counting(state, bucket, hook=hook, buckets=buckets):
            buckets.append(bucket.buffer().numel())
            return hook(state, bucket)

        model.register_comm_hook(state, counting)
        with WireSpy() as spy:
            for step in range(2):  # DDP rebuilds its buckets after the first
                model(
                    torch.randn(16, 32, generator=torch.Generator().manual_seed(rank + step))
                ).sum().backward()
        out[name] = {"bytes": spy.bytes, "elements": sum(buckets), "buckets": buckets}
    return out


def _recording_hook(records: list):
    """The FP8 hook, recording each call's input and output bucket (and its parameters, in order)."""

    def hook(state, bucket):
        entry = {"input": bucket.buffer().clone(), "params": list(bucket.parameters())}
        records.append(entry)

        def done(fut):
            entry["output"] = fut.value().clone()
            return fut.value()

        return fp8_allreduce_hook(state, bucket).then(done)

    return hook


def _grads_match_outputs(records: list, model: torch.nn.Module) -> bool:
    """p.grad is the hook's output for p, bit for bit (so DDP took the hook's result)."""
    for entry in records:
        offset = 0
        for p in entry["params"]:
            if not torch.equal(p.grad.reshape(-1), entry["output"][offset : offset + p.numel()]):
                return False
            offset += p.numel()
    return True


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


def _scenario_no_sync(rank: int, world: int) -> dict:
    """Two micro-batches under no_sync, one synchronised: the hook reduces the accumulated gradients."""
    model, records = DDP(_net()), []
    replica = copy.deepcopy(model.module)
    model.register_comm_hook(FP8CommState(chunk_size=CHUNK), _recording_hook(records))
    with model.no_sync():
        for step in range(2):
            model(_batch(rank, step)).square().mean().backward()
    model(_batch(rank, 2)).square().mean().backward()
    for step in range(3):
        replica(_batch(rank, step)).square().mean().backward()
    local = dict(zip(map(id, model.module.parameters()), replica.parameters()))
    accumulated = all(
        torch.equal(torch.cat([local[id(p)].grad.reshape(-1) for p in e["params"]]), e["input"])
        for e in records
    )
    return {"records": [(e["input"], e["output"]) for e in records], "accumulated": accumulated,
            "grads": _grads_match_outputs(records, model.module)}  # fmt: skip


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.heads = _net(), torch.nn.ModuleList(torch.nn.Linear(8, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.body(x))


def _scenario_unused(rank: int, world: int) -> dict:
    """find_unused_parameters: each rank uses one head; the other head's gradient is zero there."""
    model, records = DDP(TwoHeads(), find_unused_parameters=True), []
    model.register_comm_hook(FP8CommState(chunk_size=CHUNK), _recording_hook(records))
    for step in range(2):
        model.zero_grad()
        model(_batch(rank, step), head=rank % 2).square().mean().backward()
    return {"records": [(e["input"], e["output"]) for e in records[-len(records) // 2 :]],
            "grads": _grads_match_outputs(records[-len(records) // 2 :], model.module)}  # fmt: skip


def _scenario_join(rank: int, world: int) -> dict:
    """Uneven inputs under join(): rank r has 2 + r batches; joined ranks shadow the hook with zeros."""
    model, records = DDP(_net()), []
    model.register_comm_hook(FP8CommState(chunk_size=CHUNK), _recording_hook(records))
    with model.join():
        for step in range(2 + rank):
            model(_batch(rank, step)).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    return {"records": [(e["input"], e["output"]) for e in records],
            "params": [p.detach().clone() for p in model.parameters()]}  # fmt: skip


def _scenario_async(rank: int, world: int) -> dict:
    """Rank 0 reduces while the others have not started (they wait for rank 0 at a barrier on the
    default group): the call must return with its future pending, or rank 0 never reaches the barrier."""
    state = FP8CommState(chunk_size=CHUNK, timeout=datetime.timedelta(seconds=60))
    if rank == 0:
        future = state.all_reduce(rank_input(rank, 1000))
        pending = not future.done()
        dist.barrier()
    else:
        dist.barrier()
        future, pending = state.all_reduce(rank_input(rank, 1000)), None
    return {"pending": pending, "out": future.wait()}


SCENARIOS = {
    "async": _scenario_async,
    "bound": _scenario_bound,
    "error_feedback": _scenario_error_feedback,
    "non_finite": _scenario_non_finite,
    "bytes": _scenario_bytes,
    "no_sync": _scenario_no_sync,
    "unused": _scenario_unused,
    "join": _scenario_join,
}


def _all_scenarios(rank: int, world: int) -> dict:
    return run_scenarios(list(SCENARIOS), lambda name: SCENARIOS[name](rank, world))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_all_scenarios, world, timeout_s=240, pg_timeout_s=60)


def _check_within_bound(inputs, outputs, stochastic=False, encoding="e4m3", return_format="fp8") -> float:
    """Every output bit-identical on every rank and within the bound of the exact mean; returns the
    largest error / bound (how close to the bound the reduction came)."""
    assert bit_identical(outputs)
    exact, bound = reduction_bound(inputs, encoding, return_format, stochastic)
    error = (outputs[0].double() - exact).abs()
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        worst,
        float(error[worst]),
        float(bound[worst]),
        float(exact[worst]),
    )
    return float((error / bound.clamp(min=1e-300)).max())


@pytest.mark.multirank
def test_every_element_within_the_format_bound_and_bit_identical_on_every_rank(ranks) -> None:
    world, runs = ranks
    results = scenario_outcome(runs, "bound")
    for i, config in enumerate(CONFIGS):
        for k, n in enumerate(SIZES):
            inputs = [rank_input(r, n) for r in range(world)]
            outputs = [results[r][i][k] for r in range(world)]
            closeness = _check_within_bound(
                inputs, outputs, config["stochastic_rounding"], config["fp8_format"], config["return_format"]
            )
            if n > 1000:
                assert closeness > 0.5, (config, closeness)  # the bound is tight: it can fail
    stochastic = CONFIGS.index({"fp8_format": "e4m3", "stochastic_rounding": True, "return_format": "fp8"})
    assert torch.equal(results[0]["seed 3"][0], results[0][stochastic][0])
    assert not torch.equal(results[0]["seed 4"][0], results[0][stochastic][0])
    # a bf16 bucket: reduced from its exact float32 values, the result rounded once to bf16
    assert bit_identical([r["bf16"][0] for r in results]) and results[0]["bf16"][0].dtype == torch.bfloat16
    assert torch.equal(results[0]["bf16"][0], results[0]["bf16"][1].bfloat16())


@pytest.mark.multirank
def test_the_hook_returns_a_pending_future_and_completes_when_the_peers_join(ranks) -> None:
    world, runs = ranks
    results = scenario_outcome(runs, "async")
    assert results[0]["pending"] is True
    _check_within_bound([rank_input(r, 1000) for r in range(world)], [r["out"] for r in results])


@pytest.mark.multirank
def test_error_feedback_keeps_the_accumulated_error_to_one_steps(ranks) -> None:
    """16 steps of the same gradients: with error feedback the sum of the results is off by at most
    about one step's bound (the residuals telescope); without it the rounding error adds up."""
    world, runs = ranks
    results = scenario_outcome(runs, "error_feedback")
    inputs = [rank_input(r, 1000) for r in range(world)]
    exact, bound = reduction_bound(inputs, "e4m3", "fp8", False)
    steps = 16
    for feedback in (False, True):
        assert bit_identical([r[feedback] for r in results])
    with_feedback = (results[0][True] - steps * exact).abs()
    without = (results[0][False] - steps * exact).abs()
    assert bool((with_feedback <= 2.5 * bound).all()), float((with_feedback / bound).max())
    assert float((without / bound).max()) > 4.0


@pytest.mark.multirank
def test_a_nan_or_inf_on_one_rank_reaches_every_rank_as_non_finite(ranks) -> None:
    world, runs = ranks
    results = scenario_outcome(runs, "non_finite")
    shard = -(-1000 // world)
    chunk_of = lambda i: (i // shard, (i % shard) // CHUNK)  # noqa: E731
    hit = torch.tensor([chunk_of(i) in {chunk_of(j) for j in (10, 300, 600)} for i in range(1000)])
    for return_format in ("fp8", "bf16"):
        clean = [r[return_format][0] for r in results]
        dirty = [r[return_format][1] for r in results]
        assert bit_identical(dirty)
        out = dirty[0]
        assert math.isnan(out[10]) and out[300] == math.inf and math.isnan(out[600])
        assert bool(out[[chunk_of(i) == chunk_of(10) for i in range(1000)]].isnan().all())  # the NaN chunk
        assert torch.equal(out[~hit], clean[0][~hit])  # other chunks as without the non-finite values


@pytest.mark.multirank
def test_bytes_per_element_are_a_quarter_of_fp32_scales_included(ranks) -> None:
    """Counted by wrapping the collectives: per bucket of n elements, 2 (W-1) (S + ceil(S / chunk))
    bytes for S = ceil(n / W): 0.25 (1 + 1 / chunk) of fp32 and 0.5 (1 + 1 / chunk) of bf16, plus the
    padding of the last shard."""
    world, runs = ranks
    for result in scenario_outcome(runs, "bytes"):
        per_element = {name: r["bytes"] / r["elements"] for name, r in result.items()}
        assert per_element["fp32"] == pytest.approx(8 * (world - 1) / world)
        assert per_element["bf16"] == pytest.approx(4 * (world - 1) / world)
        expected = sum(
            2 * (world - 1) * (s + wire.chunks_per_row(s, CHUNK))
            for s in (-(-n // world) for n in result["fp8"]["buckets"])
        )
        assert result["fp8"]["bytes"] == pytest.approx(expected)
        assert len(result["fp8"]["buckets"]) > 2  # several buckets, each its own pair of collectives
        assert per_element["fp8"] / per_element["fp32"] < 0.25 * (1 + 1 / CHUNK) * 1.001
        assert per_element["fp8"] / per_element["bf16"] < 0.5 * (1 + 1 / CHUNK) * 1.001


def _check_records(runs: list[dict]) -> None:
    counts = {len(run["records"]) for run in runs}
    assert len(counts) == 1 and counts.pop() > 0
    for call in zip(*(run["records"] for run in runs)):
        _check_within_bound([inp for inp, _ in call], [out for _, out in call])


@pytest.mark.multirank
def test_no_sync_accumulation_reduces_the_accumulated_gradients(ranks) -> None:
    runs = scenario_outcome(ranks[1], "no_sync")
    assert all(run["accumulated"] and run["grads"] for run in runs)
    _check_records(runs)


@pytest.mark.multirank
def test_find_unused_parameters(ranks) -> None:
    runs = scenario_outcome(ranks[1], "unused")
    assert all(run["grads"] for run in runs)
    _check_records(runs)
    for run in runs:  # the zero gradients of the unused head are in the buckets
        assert any(bool((inp == 0).any()) for inp, _ in run["records"])


@pytest.mark.multirank
def test_uneven_inputs_under_join(ranks) -> None:
    world, runs = ranks
    runs = scenario_outcome(runs, "join")
    _check_records(runs)
    assert bit_identical([torch.cat([p.reshape(-1) for p in run["params"]]) for run in runs])
    last = [run["records"][-1][0] for run in runs]  # the last step: only the last rank had data
    assert all(not bool(inp.any()) for inp in last[:-1]) and bool(last[-1].any())


# ---- a tiny GPT trained with the hook --------------------------------------------------------------------
GPT_STEPS = 40
GPT_GAP = 0.02  # nats: the documented gap of the last 8 steps' mean loss to fp32 communication


def _train_gpt(rank: int, world: int) -> dict:
    from fp8train.tools.data import MarkovTask
    from fp8train.tools.models import GPT, MODEL_SIZES

    cfg = MODEL_SIZES["tiny"]
    data = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=0).sample(GPT_STEPS * 8, seed=1 + rank)
    losses = {}
    # the last run also computes in FP8: the hook's collectives beside fp8train's amax reductions
    for name in ("fp32", "fp8", "fp8_error_feedback", "fp8_compute"):
        torch.manual_seed(0)
        model = DDP(GPT(cfg))
        if name != "fp32":
            model.register_comm_hook(
                FP8CommState(error_feedback=name.endswith("feedback")), fp8_allreduce_hook
            )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[name] = []
        for step in range(GPT_STEPS if name != "fp8_compute" else 10):
            with fp8train.fp8_autocast(enabled=name == "fp8_compute"):
                loss = _gpt_loss(model, data, step)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        losses[name + "_params"] = digest(list(model.parameters()))
    return losses


def _gpt_loss(model, data: torch.Tensor, step: int) -> torch.Tensor:
    from fp8train.tools.models import next_token_loss

    tokens = data[8 * step : 8 * step + 8]
    return next_token_loss(model(tokens[:, :-1]), tokens)


@pytest.mark.multirank
def test_a_tiny_gpt_trains_with_fp8_communication_within_the_gap_of_fp32() -> None:
    runs = run_ranks(_train_gpt, 2, timeout_s=240)
    for name in ("fp32", "fp8", "fp8_error_feedback", "fp8_compute"):
        assert runs[0][name + "_params"] == runs[1][name + "_params"]  # replicas stay identical
    tail = {name: sum(runs[0][name][-8:]) / 8 for name in ("fp32", "fp8", "fp8_error_feedback")}
    assert tail["fp32"] < runs[0]["fp32"][0] - 0.5, tail  # it trained
    for name in ("fp8", "fp8_error_feedback"):
        assert abs(tail[name] - tail["fp32"]) <= GPT_GAP, tail
    assert runs[0]["fp8_compute"][-1] < runs[0]["fp8_compute"][0] - 0.2, runs[0]["fp8_compute"]


# ---- FSDP2's reduce-scatter --------------------------------------------------------------------------
class RecordingReduceScatter(FP8ReduceScatter):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.calls: list = []

    def __call__(self, output_tensor, input_tensor, group, op=dist.ReduceOp.SUM, async_op=False):
        inp = input_tensor.detach().clone()
        super().__call__(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((inp, output_tensor.detach().clone(), op == dist.ReduceOp.AVG))


def _fsdp(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    def sharded() -> torch.nn.Module:
        model = _net()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    model, reference = sharded(), sharded()
    comm = RecordingReduceScatter(chunk_size=CHUNK)
    with WireSpy(names=("all_to_all_single",)) as spy:  # not FSDP2's parameter all-gathers
        for module in model.modules():
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(comm)
        for m in (model, reference):
            m(_batch(rank, 0)).square().mean().backward()
    full = [torch.cat([p.grad.full_tensor().reshape(-1) for p in m.parameters()]) for m in (model, reference)]
    errors = []
    for bad in ({"fp8_format": "bf16"}, {}):
        try:
            fp8train.comm.use_fp8_reduce_scatter(torch.nn.Linear(2, 2), **bad)
        except ValueError as error:
            errors.append(str(error))
    error = float((full[0] - full[1]).norm() / full[1].norm())
    return {"calls": comm.calls, "bytes": spy.bytes, "errors": errors, "vs_default": error}


@pytest.mark.multirank
def test_fsdp2_reduce_scatter_in_fp8_within_the_format_bound() -> None:
    """Each rank's shard within the first trip's bound (no return trip) of the exact sum or mean."""
    world = 2
    runs = run_ranks(_fsdp, world, timeout_s=120)
    calls = [run["calls"] for run in runs]
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) >= 3
    expected_bytes = 0
    for call in zip(*calls):
        inputs = [inp for inp, _, _ in call]
        assert all(torch.equal(torch.tensor(avg), torch.tensor(call[0][2])) for _, _, avg in call)
        exact, bound = reduction_bound(inputs, "e4m3", None, False)
        if not call[0][2]:  # SUM
            exact, bound = exact * world, bound * world
        output = torch.cat([out for _, out, _ in call]).double()
        assert bool(((output - exact).abs() <= bound).all())
        shard = inputs[0].numel() // world
        expected_bytes += (world - 1) * (shard + wire.chunks_per_row(shard, CHUNK))  # 1 byte + scales
    assert runs[0]["bytes"] == expected_bytes
    # FSDP2 used the FP8 result: its gradients differ from the default reduce-scatter's by FP8 rounding
    assert all(0 < run["vs_default"] < 0.1 for run in runs), [run["vs_default"] for run in runs]
    assert "not an FP8 format" in runs[0]["errors"][0] and "no fully_shard-ed module" in runs[0]["errors"][1]


# ---- the benchmark ---------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_bench_comm_reports_bytes_error_and_time_side_by_side(tmp_path) -> None:
    import json

    from fp8train.tools.bench import main

    assert main(["comm", "--quick", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "comm.json").read_text())
    rows = {r["config"]: r for r in saved["rows"]}
    assert set(rows) == set(grad_comm.CONFIGS)
    assert all(r["identical_on_ranks"] and r["step_ms"] > 0 and r["reduce_ms"] > 0 for r in rows.values())
    assert rows["bf16_compress_hook"]["bytes_vs_fp32"] == 0.5
    assert rows["fp8 e4m3"]["bytes_vs_fp32"] < 0.25 * (1 + 1 / CHUNK) * 1.01
    error = {name: r["rel_l2_error"] for name, r in rows.items()}
    assert error["fp32 (DDP default)"] < 1e-6 < error["bf16_compress_hook"] < error["fp8 e4m3"]
    assert error["fp8 e4m3"] < error["fp8 e5m2"] < 0.2  # E4M3: the default, from this measurement
    assert [m["ranks"] for m in saved["model"]] == [8, 64, 512, 4096]


# ---- a rank that stops -------------------------------------------------------------------------------
def _dies_mid_step(rank: int, world: int) -> str:
    """Rank 1 exits before its backward; rank 0's hook collectives fail: backward raises, no hang."""
    import os

    model = DDP(_net())
    state = FP8CommState(chunk_size=CHUNK, timeout=datetime.timedelta(seconds=10))
    model.register_comm_hook(state, fp8_allreduce_hook)
    model(_batch(rank, 0)).square().mean().backward()  # one good step
    loss = model(_batch(rank, 1)).square().mean()
    if rank == 1:
        os._exit(3)
    try:
        loss.backward()
    except Exception as error:  # noqa: BLE001 (the verdict is the message)
        return f"{type(error).__name__}: {error}"
    return "backward returned"


@pytest.mark.multirank
def test_a_rank_that_stops_is_an_error_on_the_others_never_a_hang() -> None:
    from multirank import run_ranks_outcomes

    (ok, message), (ok1, _) = run_ranks_outcomes(_dies_mid_step, 2, timeout_s=120, pg_timeout_s=10)
    assert ok and not ok1
    assert message.startswith("RuntimeError") and "peer" in message, message  # gloo's cause, via DDP


# ---- a rank that stalls past the timeout ---------------------------------------------------------------
STALL_TIMEOUT = datetime.timedelta(seconds=3)


def _stalls_past_the_timeout(rank: int, world: int, directory: str, where: str) -> str:
    """Rank 1 stops, alive, outside any collective (it polls for a file rank 0 writes once its step
    returned or raised, for up to 600 s, then exits without joining): rank 0's verdict is what it
    raised while rank 1 slept. "backward": after two steps (DDP's bucket rebuild done), rank 1 stalls
    before its backward: the hook's own timeout ends rank 0's backward. "forward": rank 1 stalls
    before the second forward, where DDP rebuilds its buckets on DDP's process group: bounded by that
    group's timeout, here one created with it (what the guide says to do)."""
    import os
    import time

    ddp_group = dist.new_group(timeout=STALL_TIMEOUT) if where == "forward" else None
    model = DDP(_net(), process_group=ddp_group)
    state = FP8CommState(chunk_size=CHUNK, timeout=STALL_TIMEOUT)
    try:  # the timeout of a group passed in is that group's: one given here too is refused
        FP8CommState(process_group=state.group, timeout=STALL_TIMEOUT)
        refused = "not refused"
    except ValueError as error:
        refused = str(error)
    model.register_comm_hook(state, fp8_allreduce_hook)
    for step in range(2 if where == "backward" else 1):
        model(_batch(rank, step)).square().mean().backward()
    release = os.path.join(directory, "release")
    if rank == 1:
        deadline = time.monotonic() + 600
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:
        model(_batch(rank, 2)).square().mean().backward()
        verdict = "step returned"
    except Exception as error:  # noqa: BLE001 (the verdict is the message)
        verdict = f"{type(error).__name__}: {error}"
    finally:
        open(release, "w").close()
    return f"{refused}\n{verdict}"


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["backward", "forward"])
def test_a_peer_that_stalls_past_the_timeout_is_an_error_within_it(tmp_path, where) -> None:
    """The world group's timeout is 300 s and the stalled rank sleeps up to 600 s: only the bounds
    under test (3 s) can end rank 0's step before the harness gives up (150 s, a TimeoutError)."""
    from multirank import run_ranks_outcomes

    (ok, message), (ok1, _) = run_ranks_outcomes(
        _stalls_past_the_timeout, 2, str(tmp_path), where, timeout_s=150, pg_timeout_s=300
    )
    assert ok and not ok1, message
    refused, verdict = message.split("\n", 1)
    assert "a group passed in keeps its own" in refused, refused
    assert "Timed out" in verdict, verdict  # gloo's cause: the 3 s bound, not the peer leaving
    if where == "backward":
        assert "fp8_allreduce_hook: the all_to_all of bucket" in verdict, verdict
        assert "timeout 0:00:03" in verdict, verdict
