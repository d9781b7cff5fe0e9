"""GroupedLinear: a loop of fp8train.Linear calls bit for bit under every recipe, against an independent
reference under delayed scaling, empty experts, groups off the block, one collective per region and
direction across ranks with uneven routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp8train
from helpers import fp8_state
from multirank import AllReduceSpy, assert_fp8_gathers_bit_for_bit, run_ranks, train_fsdp_gathers
from reference import E4M3_MAX, E5M2_MAX, RefScaling, amax_of, quantize_ref

RECIPES = {
    "delayed": lambda: fp8train.DelayedScaling(amax_history_len=4),
    "current": fp8train.Float8CurrentScaling,
    "block": fp8train.Float8BlockScaling,
    "mxfp8": fp8train.MXFP8BlockScaling,
    "nvfp4": fp8train.NVFP4BlockScaling,
}
# tokens per expert: an empty expert and counts off 128 (block scaling's tiles along the tokens);
# MXFP8 and NVFP4 take whole blocks of 32 and 16 only
SPLITS = {"mxfp8": [32, 0, 64, 32], "nvfp4": [16, 0, 48, 32]}
DEFAULT_SPLITS = [10, 0, 45, 25]


def _grouped_and_linears(experts: int, k: int, n: int, seed: int = 0):
    """A GroupedLinear and `experts` fp8train.Linear holding copies of its weights and biases."""
    torch.manual_seed(seed)
    grouped = fp8train.GroupedLinear(experts, k, n)
    linears = [fp8train.Linear(k, n) for _ in range(experts)]
    with torch.no_grad():
        for i, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
    return grouped, linears


def _step_grouped(grouped, x, g, splits, recipe):
    grouped.zero_grad()
    x = x.clone().requires_grad_()
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = grouped(x, splits)
    (y * g).sum().backward()
    params = [p.grad.clone() for p in grouped.parameters()]
    return [y.detach(), x.grad] + params


def _step_linears(linears, x, g, splits, recipe):
    x = x.clone().requires_grad_()
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = torch.cat([lin(part) for lin, part in zip(linears, x.split(splits))])
    (y * g).sum().backward()
    params = []
    for lin in linears:
        params += [lin.weight.grad.clone(), lin.bias.grad.clone()]
        lin.zero_grad()
    return [y.detach(), x.grad] + params


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_equals_a_loop_of_linears_bit_for_bit(name: str) -> None:
    """Forward, dgrad, wgrad and bias gradients, and (delayed) every expert's amax history and scales,
    over steps with changing data, an empty expert and counts off the block scaling tile."""
    torch.set_num_threads(1)
    splits = SPLITS.get(name, DEFAULT_SPLITS)
    grouped, linears = _grouped_and_linears(4, 64, 32)
    recipe = RECIPES[name]()
    for step in range(3):
        torch.manual_seed(10 + step)
        x = torch.randn(sum(splits), 64) * (1 + step)
        g = torch.randn(sum(splits), 32) * 10.0**-step
        torch.manual_seed(step)  # NVFP4 rounds gradients stochastically, from the global generator
        got = _step_grouped(grouped, x, g, splits, recipe)
        torch.manual_seed(step)
        want = _step_linears(linears, x, g, splits, recipe)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step} tensor {i}"
            assert not a.isnan().any()
        assert not torch.equal(got[0], F.linear(x[:10], grouped.weight0, grouped.bias0)), "not FP8"
    if name == "delayed":
        state = fp8_state(grouped)
        for i, lin in enumerate(linears):  # GEMM i's columns: 3 forward roles, 2 backward roles
            mine = fp8_state(lin)
            for t, width in enumerate([3, 3, 3, 2, 2, 2]):
                cols = slice(width * i, width * (i + 1))
                assert torch.equal(state[t][..., cols], mine[t]), (i, t)


def test_grouped_matches_an_independent_fp8_reference(monkeypatch) -> None:
    """Each expert quantizes with its own delayed scales (its own history), from a reference that
    knows nothing of the module: E4M3 x and w, E5M2 grad_output, fp32 accumulation; the empty expert
    records nothing for its input and gradient, so those columns never roll."""
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")
    torch.set_num_threads(1)
    experts, k, n = 3, 32, 16
    torch.manual_seed(5)
    grouped = fp8train.GroupedLinear(experts, k, n)
    recipe = fp8train.DelayedScaling(amax_history_len=2)
    fwd_ref, bwd_ref = RefScaling(3 * experts, 2), RefScaling(2 * experts, 2)
    routes = [[6, 0, 10], [3, 0, 13], [0, 0, 16], [7, 0, 9]]
    for step, splits in enumerate(routes):
        x = (
            torch.randn(sum(splits), k)
            * (step + 1)
            * torch.tensor([1.0, 3.0, 0.5]).repeat_interleave(torch.tensor(splits), dim=0)[:, None]
        )
        g = torch.randn(sum(splits), n) * 10.0**-step
        got = _step_grouped(grouped, x, g, splits, recipe)
        y, gx, grads = got[0], got[1], got[2:]
        fwd_last, bwd_last = [], []
        for e, (xe, ge, ye, gxe) in enumerate(
            zip(x.split(splits), g.split(splits), y.split(splits), gx.split(splits))
        ):
            w, b = getattr(grouped, f"weight{e}").detach(), getattr(grouped, f"bias{e}").detach()
            sx, sw, sg = fwd_ref.scale[3 * e], fwd_ref.scale[3 * e + 1], bwd_ref.scale[2 * e]
            dx, dw, dg = fwd_ref.scale_inv[3 * e], fwd_ref.scale_inv[3 * e + 1], bwd_ref.scale_inv[2 * e]
            qx = quantize_ref(xe, sx, torch.float8_e4m3fn, E4M3_MAX)
            qw = quantize_ref(w, sw, torch.float8_e4m3fn, E4M3_MAX)
            qg = quantize_ref(ge, sg, torch.float8_e5m2, E5M2_MAX)
            checks = [
                (ye, (qx @ qw.T) * dx * dw + b.double(), qx.abs() @ qw.abs().T * dx * dw, k),
                (gxe, (qg @ qw) * dg * dw, qg.abs() @ qw.abs() * dg * dw, n),
                (grads[2 * e], (qg.T @ qx) * dg * dx, qg.abs().T @ qx.abs() * dg * dx, len(xe)),
            ]
            for c, (a, want, magnitude, depth) in enumerate(checks):
                bound = (depth + 4) * 2.0**-24 * (magnitude + b.double().abs().max())
                assert ((a.double() - want).abs() <= bound).all(), f"step {step} expert {e} check {c}"
            assert torch.equal(grads[2 * e + 1], ge.sum(0)) or len(ge) == 0
            fwd_last += [amax_of(xe) if len(xe) else 0.0, amax_of(w), 0.0]
            bwd_last += [amax_of(ge) if len(ge) else 0.0, 0.0]
        fwd_ref.update(fwd_last, recipe, E4M3_MAX)
        bwd_ref.update(bwd_last, recipe, E5M2_MAX)
        fwd, bwd = grouped.fp8_meta["scaling_fwd"], grouped.fp8_meta["scaling_bwd"]
        assert torch.equal(fwd.amax_history, fwd_ref.history_tensor()), step
        assert torch.equal(bwd.scale, bwd_ref.scale_tensor()), step
    # expert 1 never had a token: its input and gradient columns never rolled, their scales stayed 1
    fwd, bwd = grouped.fp8_meta["scaling_fwd"], grouped.fp8_meta["scaling_bwd"]
    assert not fwd.amax_history[:, 3].any() and fwd.scale[3] == 1 and not bwd.amax_history[:, 2].any()
    assert fwd.amax_history[0, 4] > 0  # its weight was cast, as a Linear called with 0 rows casts it
    assert torch.equal(grads[2], torch.zeros_like(grads[2]))  # its weight gradient: 0, not NaN


def test_an_expert_empty_in_a_step_keeps_its_history() -> None:
    """Expert 0 has tokens at step 0 and none at step 1: its input column does not roll at step 1."""
    grouped = fp8train.GroupedLinear(2, 16, 16)
    recipe = fp8train.DelayedScaling(amax_history_len=3)
    for splits in ([4, 4], [0, 8]):
        x = torch.randn(8, 16)
        _step_grouped(grouped, x, torch.randn(8, 16), splits, recipe)
    hist = grouped.fp8_meta["scaling_fwd"].amax_history
    assert hist[0, 0] > 0 and hist[1, 0] == 0  # one roll only: step 0's amax is still the newest
    assert hist[0, 3] > 0 and hist[1, 3] > 0  # expert 1 had tokens both steps


def test_outside_fp8_equals_a_loop_of_torch_linear() -> None:
    torch.manual_seed(1)
    grouped = fp8train.GroupedLinear(3, 24, 8, bias=False)
    x, splits = torch.randn(2, 5, 24), [4, 0, 6]
    want = torch.cat(
        [F.linear(p, getattr(grouped, f"weight{i}")) for i, p in enumerate(x.reshape(10, 24).split(splits))]
    )
    assert torch.equal(grouped(x, splits), want.view(2, 5, 8))
    assert torch.equal(grouped(x, torch.tensor(splits)), want.view(2, 5, 8))


@pytest.mark.parametrize(
    "splits, match",
    [([4, 4], "3 token counts"), ([4, 4, -1], "non-negative"), ([4, 4, 4], "sum to 12 but the input has 10"),
     ([4.0, 4, 2], "non-negative ints")],
)  # fmt: skip
def test_bad_splits_are_refused_with_the_fix(splits, match) -> None:
    grouped = fp8train.GroupedLinear(3, 16, 16)
    with pytest.raises(ValueError, match=match):
        grouped(torch.randn(10, 16), splits)


@pytest.mark.parametrize("name, block", [("mxfp8", 32), ("nvfp4", 16)])
def test_groups_off_the_mx_block_are_refused_and_pad_groups_fits_them(name: str, block: int) -> None:
    """MXFP8 and NVFP4 take whole blocks along the tokens (the weight gradient's reduction): a group
    off the block is refused, naming it and the fix; padded with pad_groups it trains, and the rows of
    the real tokens come back by unpad_groups with the gradients of the zero rows dropped."""
    torch.manual_seed(2)
    grouped = fp8train.GroupedLinear(3, 64, 32)
    recipe = RECIPES[name]()
    splits = [block + 3, 0, 2 * block - 1]
    x = torch.randn(sum(splits), 64, requires_grad=True)
    with pytest.raises(ValueError, match=rf"groups \{{0: {block + 3}, 2: {2 * block - 1}\}}.*pad_groups"):
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            grouped(x, splits)
    xp, padded = fp8train.pad_groups(x, splits, block)
    assert padded == [2 * block, 0, 2 * block] and xp.shape[0] == 4 * block
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = fp8train.unpad_groups(grouped(xp, padded), splits, padded)
    assert y.shape == (sum(splits), 32)
    y.square().sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    ref = torch.cat([F.linear(p, getattr(grouped, f"weight{i}"), getattr(grouped, f"bias{i}"))
                     for i, p in enumerate(x.detach().split(splits))])  # fmt: skip
    rel = ((y.detach() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.3  # FP8 (E2M1 for NVFP4) error, not garbage
    # the same padded rows without FP8: unpadding gives exactly the unpadded result
    assert torch.equal(fp8train.unpad_groups(grouped(xp.detach(), padded), splits, padded), ref)


# ---- on real ranks: uneven routing, one collective per region and direction ----------------------------
EXPERTS = 64


def _uneven_ranks(rank: int, world: int) -> dict:
    """The same training with the asynchronous and with the blocking amax reduction."""
    import os

    out = {}
    for mode in ("1", "0"):
        os.environ["NVTE_ASYNC_AMAX_REDUCTION"] = mode
        fp8train.inspection.reset()
        out[mode] = _uneven_run(rank)
    os.environ.pop("NVTE_ASYNC_AMAX_REDUCTION")
    return out


def _uneven_run(rank: int) -> dict:
    torch.manual_seed(0)
    grouped = fp8train.GroupedLinear(EXPERTS, 16, 16)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    out = {"collectives": [], "local_x_amax": []}
    with AllReduceSpy() as spy:
        for step in range(3):
            # rank 0 routes to the even experts, rank 1 to the odd ones (expert 7 never on rank 0 nor 1
            # at step 0); token counts and magnitudes differ by rank
            gen = torch.Generator().manual_seed(100 * rank + step)
            splits = [
                (3 + e + step) if e % 2 == rank and not (e == 7 and step == 0) else 0 for e in range(EXPERTS)
            ]
            x = torch.randn(sum(splits), 16, generator=gen) * (1 + rank + step)
            before = spy.calls
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                y = grouped(x, splits)
            y.square().mean().backward()
            fp8train.synchronize()
            out["collectives"].append(spy.calls - before)
            out["local_x_amax"].append([amax_of(p) if len(p) else 0.0 for p in x.split(splits)])
            with torch.no_grad():
                for p in grouped.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    out["state"] = [t.tolist() for t in fp8_state(grouped)]
    out["params"] = [p.tolist() for p in grouped.parameters()]
    return out


@pytest.mark.multirank
def test_two_ranks_uneven_routing_one_collective_per_direction_same_scales() -> None:
    both = run_ranks(_uneven_ranks, 2, timeout_s=180, pg_timeout_s=60)
    for out in both:  # asynchronous and blocking reduction: bit for bit
        assert out["1"]["state"] == out["0"]["state"] and out["1"]["params"] == out["0"]["params"]
    runs = [out["1"] for out in both]
    for out in runs:  # 64 experts: 192 forward and 128 backward roles, one collective per direction
        assert out["collectives"] == [2, 2, 2]
    assert runs[0]["state"] == runs[1]["state"]  # every rank's histories and scales: identical
    history = torch.tensor(runs[0]["state"][0])  # forward amax history (newest first)
    for e in range(EXPERTS):  # each expert's input column: the MAX over ranks, one rank had no token
        maxes = [max(r["local_x_amax"][s][e] for r in runs) for s in range(3)]
        rolled = [m for m in maxes if m > 0][::-1]  # steps with a token somewhere, newest first
        assert history[: len(rolled), 3 * e].tolist() == pytest.approx(rolled, rel=0, abs=0), e
        assert not history[len(rolled) :, 3 * e].any(), e
    assert history[1, 3 * 7] > 0 and history[2, 3 * 7] == 0  # expert 7: no token at step 0 anywhere: 2 rolls


def test_recomputed_grouped_equals_the_plain_run_bit_for_bit() -> None:
    """fp8train.checkpoint replays every expert's GEMM with the scales of the original forward."""
    torch.set_num_threads(1)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    runs = []
    for recompute in (False, True):
        torch.manual_seed(3)
        grouped = fp8train.GroupedLinear(3, 32, 32)
        grads = []
        for step in range(3):
            x = (torch.randn(20, 32) * (step + 1)).requires_grad_()
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                splits = [7, 0, 13]
                y = fp8train.checkpoint(grouped, x, splits) if recompute else grouped(x, splits)
            y.square().sum().backward()
            grads += [x.grad.clone()] + [p.grad.clone() for p in grouped.parameters()]
            grouped.zero_grad()
        runs.append(grads + fp8_state(grouped))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), i


def test_first_microbatch_caches_every_experts_weight() -> None:
    """is_first_microbatch=False reuses each expert's FP8 weight of the first microbatch: a call after
    the weights changed equals the first call bit for bit (same input, so the same delayed scales)."""
    grouped = fp8train.GroupedLinear(2, 16, 16, bias=False)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    x = torch.randn(6, 16)
    outs = []
    for flag in (None, True, False):  # a warm-up step: the scales of the next two are those of x and w
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            outs.append(grouped(x, [2, 4], is_first_microbatch=flag))
        if flag:  # after the first microbatch only
            with torch.no_grad():
                for p in grouped.parameters():
                    p.mul_(1.5)
    assert torch.equal(outs[1], outs[2])  # the cached FP8 weights, not the changed ones
    assert len(grouped._weight_cache) == 2
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        assert not torch.equal(grouped(x, [2, 4]), outs[1])  # None: the current weights


# ---- FSDP2 gathers every expert's weight in FP8 ----------------------------------------------------------
class _Experts(torch.nn.Module):
    def __init__(self, option: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = fp8train.GroupedLinear(4, 32, 24, fsdp_fp8_all_gather=option)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, [3, 0, 4, 1])


def _fsdp_ranks(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    def shard(option: bool) -> torch.nn.Module:
        model = _Experts(option)
        fully_shard(model.experts)
        fully_shard(model)
        return model

    def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + step)) * (1 + rank)
        return model(x).square().mean()

    return train_fsdp_gathers(shard, loss_of)


@pytest.mark.multirank
def test_two_ranks_fsdp2_gathers_every_expert_in_fp8_bit_for_bit() -> None:
    assert_fp8_gathers_bit_for_bit(run_ranks(_fsdp_ranks, 2, timeout_s=120, pg_timeout_s=60))


def test_compiled_grouped_equals_eager_bit_for_bit() -> None:
    """torch.compile (aot_eager) of a GroupedLinear call: the same outputs, gradients and FP8 state."""
    import copy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager = fp8train.GroupedLinear(3, 32, 32)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(lambda x, splits: compiled_module(x, splits), backend="aot_eager")
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    for step in range(3):
        x = torch.randn(20, 32) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            ya, yb = compiled(xa, [7, 0, 13]), eager(xb, [7, 0, 13])
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad), step
    for a, b in zip(fp8_state(compiled_module), fp8_state(eager)):
        assert torch.equal(a, b)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(compiled_module.parameters(), eager.parameters()))
