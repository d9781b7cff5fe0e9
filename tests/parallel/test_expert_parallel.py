"""Expert parallelism on real gloo ranks (fp8train.ExpertParallel: all-to-all dispatch and combine).

The layer: E=4 experts (GroupedLinear up, gelu, GroupedLinear down), top-2 routing with uneven
counts (rank 1 never routes to expert 0; no rank routes to expert 3 in step 1, so it is empty
there). Verdicts by values:
- EP over 2 and 4 ranks (every rank expert-parallel, the experts' amax group the rank alone) equals,
  bit for bit, a single-process reference that runs all E experts on every rank's tokens (rows
  selected per expert with masks, not with the EP code's sort): outputs, token gradients, each
  expert's weight and bias gradients, and each expert's amax histories and scales, over 2 steps of
  delayed scaling (and outside any FP8 region, in high precision);
- with the FP8 dispatch the same holds against the reference fed the tokens rounded by an
  independent 1x128 E4M3/power-of-two quantization (straight-through gradient), that rounding stays
  within the E4M3 bound, and under Float8BlockScaling the forward equals the unrounded reference
  (outside any FP8 region, nothing is rounded);
  the dispatch's all-to-all bytes (counted by wrapping the collective) are <= 0.55x the bf16 ones;
- EP=2 x DP=2 (4 ranks) with the DP group as amax group: the replicas of an expert hold identical
  scales, its input amax is the MAX of the replicas' own rows, and the EP peers' amaxes differ;
- an amax group holding other EP ranks is a ValueError on every rank (at construction, at run time
  in the caller's region, at a marked module's join), also when only some ranks hold such a group.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8train
from fp8train.expert_parallel import combine, dispatch
from multirank import run_ranks, run_scenarios, scenario_outcome

pytestmark = pytest.mark.multirank

E, HIDDEN, FFN, TOKENS, TOP_K = 4, 128, 64, 16, 2
DELAYED = fp8train.DelayedScaling(amax_history_len=4)
E4M3_MAX = 448.0


class Experts(torch.nn.Module):
    """`n` experts: GroupedLinear up, gelu, GroupedLinear down; called (rows, m_splits)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.up = fp8train.GroupedLinear(n, HIDDEN, FFN)
        self.down = fp8train.GroupedLinear(n, FFN, HIDDEN)

    def forward(self, x, m_splits):
        return self.down(F.gelu(self.up(x, m_splits)), m_splits)


def _experts(first: int, n: int) -> Experts:
    """Experts first..first+n-1 of the layer every rank and the reference draw from seed 0."""
    torch.manual_seed(0)
    whole = Experts(E)
    if n == E:
        return whole
    part = Experts(n)
    with torch.no_grad():
        for name in ("up", "down"):
            for j in range(n):
                for p in ("weight", "bias"):
                    getattr(getattr(part, name), f"{p}{j}").copy_(
                        getattr(getattr(whole, name), f"{p}{first + j}")
                    )
    return part


def _batch(rank: int, step: int):
    """This rank's tokens, top-2 expert ids, gate weights and output gradient at `step`."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(TOKENS, HIDDEN, generator=g) * (1 + rank)
    scores = torch.randn(TOKENS, E, generator=g)
    if rank == 1:
        scores[:, 0] = -float("inf")  # expert 0 gets no token from rank 1
    if step == 1:
        scores[:, 3] = -float("inf")  # expert 3 gets no token at all in step 1
    top, ids = scores.topk(TOP_K, dim=1)
    gate = top.softmax(dim=1)
    gout = torch.randn(TOKENS, HIDDEN, generator=g)
    return x, ids, gate, gout


def _loss(y, gate, gout):
    return ((y * gate[..., None]).sum(1) * gout).sum()


def _grads(experts: Experts) -> list[torch.Tensor]:
    return [p.grad.clone() for p in experts.parameters()]


def _state(experts: Experts) -> list[torch.Tensor]:
    out = []
    for m in (experts.up, experts.down):
        for key in ("scaling_fwd", "scaling_bwd"):
            meta = m.fp8_meta[key]
            out += [meta.amax_history.clone(), meta.scale.clone()]
    return out


def quantize_1x128(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with one power-of-two scale per 128 values of a row (the scale: amax / 448 rounded up to a
    power of two, read from frexp), decoded: independent of fp8train's encoder."""
    rows, n = x.shape
    chunks = x.float().view(rows, n // 128, 128)
    mantissa, exponent = torch.frexp(chunks.abs().amax(-1, keepdim=True) / E4M3_MAX)
    k = exponent - (mantissa == 0.5).int()  # 2**k >= amax / 448, the smallest power of two
    q = torch.ldexp(torch.ldexp(chunks, -k).to(torch.float8_e4m3fn).float(), k)
    return q.view(rows, n).to(x.dtype), k.expand(-1, -1, 128).reshape(rows, n)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rounded):
        return rounded

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---- the workers ----------------------------------------------------------------------------------------


def _region(recipe, group=None):
    """An FP8 region of `recipe`, or none (high precision) for recipe None."""
    if recipe is None:
        return contextlib.nullcontext()
    return fp8train.fp8_autocast(fp8_recipe=recipe, fp8_group=group)


def _singles(world: int):
    return [dist.new_group([r]) for r in range(world)]


def _ep_run(rank, world, singles, recipe, steps, fp8_dispatch, first=0) -> dict:
    local = E // world
    experts = _experts(rank * local, local)
    layer = fp8train.ExpertParallel(experts, E, None, amax_group=singles[rank], fp8_dispatch=fp8_dispatch)
    out = {"y": [], "dx": [], "grads": [], "state": []}
    for step in range(first, first + steps):
        x, ids, gate, gout = _batch(rank, step)
        x.requires_grad_()
        with _region(recipe):
            y = layer(x, ids)
        _loss(y, gate, gout).backward()
        _record(out, y, x, experts)
    return out


def _record(out: dict, y: torch.Tensor, x: torch.Tensor, experts) -> None:
    """After a step's backward: its output, input gradient, expert gradients and FP8 state into `out`."""
    out["y"].append(y.detach())
    out["dx"].append(x.grad)
    out["grads"].append(_grads(experts))
    out["state"].append(_state(experts))
    experts.zero_grad()


def _reference(world, single, recipe, steps, fp8_dispatch, first=0) -> dict:
    """All E experts in one process on every rank's tokens (rows of expert e: a mask, in row order)."""
    experts = _experts(0, E)
    out = {"y": [], "dx": [], "grads": [], "state": [], "bound_ok": [], "rounded": []}
    for step in range(first, first + steps):
        batches = [_batch(r, step) for r in range(world)]
        x = torch.cat([b[0] for b in batches]).requires_grad_()
        ids, gate, gout = (torch.cat([b[i] for b in batches]) for i in (1, 2, 3))
        xin = x
        if fp8_dispatch:
            q, k = quantize_1x128(x.detach())
            bound = x.detach().abs() * 2.0**-4 + torch.ldexp(torch.ones_like(q), k - 10)
            out["bound_ok"].append(bool(((q - x.detach()).abs() <= bound).all()))
            out["rounded"].append(not torch.equal(q, x.detach()))
            xin = _StraightThrough.apply(x, q)
        flat = ids.reshape(-1)
        where = [(flat == e).nonzero().squeeze(1) for e in range(E)]
        rows = torch.cat([xin[w // TOP_K] for w in where])
        with _region(recipe, single):
            ys = experts(rows, [len(w) for w in where])
        y = ys.new_zeros(len(flat), HIDDEN).index_put((torch.cat(where),), ys).view(-1, TOP_K, HIDDEN)
        _loss(y, gate, gout).backward()
        _record(out, y, x, experts)
    return out


def _equal_to_reference_ranks(rank: int, world: int, scenarios: list[str]) -> dict:
    singles = _singles(world)

    def run_one(name: str):
        fp8_dispatch = name.startswith("fp8")
        recipes = {"fp8 block": fp8train.Float8BlockScaling(), "high precision": None, "fp8 outside": None}
        recipe = recipes.get(name, DELAYED)
        steps = 1 if name == "fp8 block" else 2
        got = _ep_run(rank, world, singles, recipe, steps, fp8_dispatch)
        if rank == 0:  # after every rank's EP run (the reference's region is rank 0's alone)
            got["ref"] = _reference(world, singles[0], recipe, steps, name == "fp8 delayed")
        return got

    return run_scenarios(scenarios, run_one)


def _column_slices(state: list[torch.Tensor], first: int, local: int) -> list[torch.Tensor]:
    """Experts first..first+local-1's columns of a whole layer's _state (fwd 3, bwd 2 per expert)."""
    out = []
    for i, t in enumerate(state):
        roles = 3 if (i // 2) % 2 == 0 else 2
        out.append(t[..., roles * first : roles * (first + local)])
    return out


def _expert_grads(grads: list[torch.Tensor], first: int, local: int) -> list[torch.Tensor]:
    """Experts first..first+local-1's grads of a whole layer (up w0, b0, w1, b1, ..., then down)."""
    per_module = 2 * E
    out = []
    for m in range(2):
        out += grads[m * per_module + 2 * first : m * per_module + 2 * (first + local)]
    return out


def _check_against_reference(runs: list[dict], world: int, exact_state: bool = True) -> None:
    ref = runs[0]["ref"]
    local = E // world
    for rank, run in enumerate(runs):
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        for step in range(len(run["y"])):
            where = f"rank {rank} step {step}"
            assert torch.equal(run["y"][step], ref["y"][step][rows]), where
            assert torch.equal(run["dx"][step], ref["dx"][step][rows]), where
            expected = _expert_grads(ref["grads"][step], rank * local, local)
            assert all(torch.equal(a, b) for a, b in zip(run["grads"][step], expected, strict=True)), where
            if exact_state:
                expected = _column_slices(ref["state"][step], rank * local, local)
                assert all(torch.equal(a, b) for a, b in zip(run["state"][step], expected, strict=True)), (
                    where
                )


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_a_single_process_reference_bit_for_bit(world: int) -> None:
    scenarios = ["delayed", "high precision"] if world == 2 else ["delayed"]
    both = run_ranks(_equal_to_reference_ranks, world, scenarios, timeout_s=90)
    for name in scenarios:
        _check_against_reference(scenario_outcome(both, name), world)
    ref = scenario_outcome(both, "delayed")[0]["ref"]
    # the uneven routing happened: expert 3 empty in step 1 (its input history did not roll there)
    up_fwd_history = ref["state"][1][0]
    assert torch.equal(up_fwd_history[0, 3 * 3], ref["state"][0][0][0, 3 * 3])
    assert not torch.equal(up_fwd_history[0, 0], ref["state"][0][0][0, 0])


def _fp8_bytes_ratio(rank: int, world: int) -> float:
    """All-to-all input bytes of one dispatch of bf16 tokens, FP8 over bf16 (counts exchange included)."""
    real, sent = dist.all_to_all_single, []

    def counted(out, inp, *args, **kwargs):
        sent.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    x, ids, _, _ = _batch(rank, 0)
    dist.all_to_all_single = counted
    try:
        totals = []
        for fp8 in (False, True):
            sent.clear()
            local, _, handle = dispatch(x.bfloat16(), ids, E, None, fp8=fp8)
            totals.append(sum(sent))
            combine(local, handle)  # the combine is not counted: it travels in the tokens' dtype
    finally:
        dist.all_to_all_single = real
    return totals[1] / totals[0]


def _fp8_ranks(rank: int, world: int) -> dict:
    out = _equal_to_reference_ranks(rank, world, ["fp8 delayed", "fp8 block", "fp8 outside"])
    out["bytes"] = ("ok", _fp8_bytes_ratio(rank, world))
    return out


def test_fp8_dispatch_is_exact_against_the_rounded_reference_and_halves_the_bytes() -> None:
    runs = run_ranks(_fp8_ranks, 2, timeout_s=90)
    delayed = scenario_outcome(runs, "fp8 delayed")
    _check_against_reference(delayed, 2)
    ref = delayed[0]["ref"]
    assert all(ref["bound_ok"]) and all(ref["rounded"]), (ref["bound_ok"], ref["rounded"])
    # Float8BlockScaling (power-of-two scales, 1x128 input tiles): the expert GEMMs' forward input is
    # the FP8 value they cast from the unrounded rows, so the forward equals the unrounded reference
    block = scenario_outcome(runs, "fp8 block")
    for rank, run in enumerate(block):
        assert torch.equal(run["y"][0], block[0]["ref"]["y"][0][rank * TOKENS : (rank + 1) * TOKENS])
    # outside every FP8 region the rows travel unrounded: the high-precision reference, bit for bit
    _check_against_reference(scenario_outcome(runs, "fp8 outside"), 2)
    ratios = scenario_outcome(runs, "bytes")
    print(f"FP8 dispatch bytes / bf16 dispatch bytes (hidden {HIDDEN}, scales and counts included): {ratios}")
    assert all(r <= 0.55 for r in ratios), ratios


# ---- EP x DP: the replicas of an expert share scales, EP peers do not --------------------------------------


def _ep_dp_ranks(rank: int, world: int) -> dict:
    """EP groups {0,1}, {2,3} (replicas 0 and 1 of the layer); DP groups {0,2}, {1,3}: the amax group."""
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_group, dp_group = ep_groups[rank // 2], dp_groups[rank % 2]
    ep_rank, local = rank % 2, E // 2
    experts = _experts(ep_rank * local, local)
    layer = fp8train.ExpertParallel(experts, E, ep_group, amax_group=dp_group)
    own_amax = []  # the input amax of each local expert's rows on this rank, per step
    original_up = experts.up.forward

    def spying_up(x, m_splits, *args, **kwargs):
        own_amax.append([part.abs().amax().item() if len(part) else 0.0 for part in x.split(m_splits)])
        return original_up(x, m_splits, *args, **kwargs)

    experts.up.forward = spying_up
    states = []
    for step in range(2):
        x, ids, gate, gout = _batch(rank, step)
        with fp8train.fp8_autocast(fp8_recipe=DELAYED):
            y = layer(x, ids)
        _loss(y, gate, gout).backward()
        states.append(_state(experts))
    return {"states": states, "own_amax": own_amax}


def test_ep_by_dp_replicas_share_scales_and_ep_peers_do_not() -> None:
    runs = run_ranks(_ep_dp_ranks, 4, timeout_s=90)
    for a, b in ((0, 2), (1, 3)):  # replicas of the same experts: the same bits
        for step in range(2):
            assert all(torch.equal(s, t) for s, t in zip(runs[a]["states"][step], runs[b]["states"][step]))
    for rank, run in enumerate(runs):
        replica = runs[rank ^ 2]
        for j in range(E // 2):
            newest = 0.0
            for step in range(2):
                history = run["states"][step][0]  # up's forward amax history, newest first
                mx = max(run["own_amax"][step][j], replica["own_amax"][step][j])
                newest = mx or newest  # an expert with no row on either replica: no roll
                assert history[0, 3 * j].item() == newest, (rank, step, j)
    assert not torch.equal(runs[0]["states"][0][0][0], runs[1]["states"][0][0][0])  # different experts


# ---- a wrong amax group: a clear error on every rank ------------------------------------------------------


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def _wrong_group_ranks(rank: int, world: int) -> dict:
    singles = _singles(world)
    local = E // world
    x, ids, _, _ = _batch(min(rank, 1), 0)
    out = {}
    # the EP group (here the world) named as the experts' amax group: refused at construction
    out["construction"] = _error_of(
        lambda: fp8train.ExpertParallel(_experts(rank * local, local), E, None, amax_group=dist.group.WORLD)
    )
    # no amax group named: the experts would run in the caller's region's group (the world)
    layer = fp8train.ExpertParallel(_experts(rank * local, local), E, None)

    def run_in(group):
        with fp8train.fp8_autocast(fp8_recipe=DELAYED, fp8_group=group):
            layer(x, ids)

    out["region"] = _error_of(lambda: run_in(None))
    # the marked experts called directly in a region of the world: refused when they join it
    out["join"] = _error_of(lambda: run_in_direct(layer.experts, x[: 2 * local], [2] * local))
    if world == 4:  # only ranks 0 and 1 hold a group with EP peers: every rank still raises
        pair = dist.new_group([0, 1])
        out["some ranks"] = _error_of(lambda: run_in(pair if rank < 2 else singles[rank]))
    out["fine"] = _error_of(lambda: run_in(singles[rank]))  # the rank alone: no error
    bad_ids = ids.clone()
    if rank == 0:
        bad_ids[0, 0] = E  # out of range on one rank: every rank stops before the rows move
    out["bad ids"] = _error_of(lambda: dispatch(x, bad_ids, E, None))
    return out


def run_in_direct(experts, x, m_splits) -> None:
    with fp8train.fp8_autocast(fp8_recipe=DELAYED):
        experts(x, m_splits)


@pytest.mark.parametrize("world", [2, 4])
def test_an_amax_group_holding_ep_peers_is_refused_on_every_rank(world: int) -> None:
    runs = run_ranks(_wrong_group_ranks, world, timeout_s=60, pg_timeout_s=30)
    for rank, out in enumerate(runs):
        assert out.pop("fine") == "no error", rank
        assert f"must lie in [0, {E}); ranks [0] gave others" in out.pop("bad ids"), rank
        for case, message in out.items():
            assert "ep_group" in message and "data-parallel replicas" in message, (rank, case, message)
            if case != "some ranks" or rank < 2:
                assert "amax group holds" in message, (rank, case, message)
    if world == 4:
        assert "ep_group ranks [0, 1]" in runs[3]["some ranks"], runs[3]["some ranks"]
