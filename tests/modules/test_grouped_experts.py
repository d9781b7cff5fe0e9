"""Experts with 3-D weights: ExpertsLinear (grouped_mm's offsets) equals GroupedLinear bit for bit;
transformers' fused MoE experts (tiny Qwen3-MoE and Mixtral built from their configs) convert, compute
exactly as before outside FP8 and train in FP8 with a role per expert; coverage counts grouped GEMMs."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fp8train
from fp8train.layer_coverage import StepCoverage
from fp8train.modules.grouped_experts import FusedExperts, grouped_linear
from helpers import fp8_state
from multirank import assert_fp8_gathers_bit_for_bit, run_ranks, train_fsdp_gathers

transformers = pytest.importorskip("transformers")


def _pair(experts: int, k: int, n: int):
    torch.manual_seed(0)
    three_d = fp8train.ExpertsLinear(experts, k, n, bias=True)
    grouped = fp8train.GroupedLinear(experts, k, n)
    with torch.no_grad():
        for e in range(experts):
            getattr(grouped, f"weight{e}").copy_(three_d.weight[e])
            getattr(grouped, f"bias{e}").copy_(three_d.bias[e])
    return three_d, grouped


@pytest.mark.parametrize(
    "recipe", [fp8train.DelayedScaling(), fp8train.Float8BlockScaling()], ids=["delayed", "block"]
)
def test_experts_linear_equals_grouped_linear_bit_for_bit(recipe) -> None:
    """Same values, gradients and FP8 state; rows after offs[-1] belong to no expert: output 0, grad 0."""
    torch.set_num_threads(1)
    three_d, grouped = _pair(4, 32, 16)
    splits, trailing = [5, 0, 20, 7], 4
    offs = torch.tensor(splits, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    for step in range(3):
        x = torch.randn(sum(splits) + trailing, 32) * (step + 1)
        g = torch.randn(sum(splits) + trailing, 16)
        xa, xb = x.clone().requires_grad_(), x[: sum(splits)].clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            ya, yb = three_d(xa, offs), grouped(xb, splits)
        (ya * g).sum().backward()
        (yb * g[: sum(splits)]).sum().backward()
        assert torch.equal(ya[: sum(splits)], yb) and not ya[sum(splits) :].any()
        assert torch.equal(xa.grad[: sum(splits)], xb.grad) and not xa.grad[sum(splits) :].any()
        for e in range(4):
            assert torch.equal(three_d.weight.grad[e], getattr(grouped, f"weight{e}").grad), e
            assert torch.equal(three_d.bias.grad[e], getattr(grouped, f"bias{e}").grad), e
        three_d.zero_grad()
        grouped.zero_grad()
    for a, b in zip(fp8_state(three_d), fp8_state(grouped)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "offs, match",
    [(torch.tensor([2.0, 4.0, 6.0]), "int32"),
     (torch.tensor([2, 4], dtype=torch.int32), "2 end offsets for 3"),
     (torch.tensor([4, 2, 6], dtype=torch.int32), "non-decreasing"),
     (torch.tensor([2, 4, 11], dtype=torch.int32), "10 rows")],
)  # fmt: skip
def test_bad_offsets_are_refused(offs, match) -> None:
    layer = fp8train.ExpertsLinear(3, 16, 16)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(10, 16), offs)


def test_grouped_linear_refuses_a_module_without_the_gemms() -> None:
    layer = fp8train.ExpertsLinear(3, 16, 16)
    with pytest.raises(ValueError, match="GEMMs 2..4 are not all GEMMs of the module"):
        grouped_linear(
            layer, torch.randn(4, 16), layer.weight, torch.tensor([1, 2, 4], dtype=torch.int32), None, 2
        )


def test_grouped_state_dict_round_trip() -> None:
    """Each expert's FP8 state comes back with the module's state (extra state of num_gemms GEMMs)."""
    layer = fp8train.GroupedLinear(3, 16, 16)
    for _ in range(2):
        with fp8train.fp8_autocast():
            layer(torch.randn(9, 16), [2, 0, 7]).sum().backward()
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    fresh = fp8train.GroupedLinear(3, 16, 16)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for a, b in zip(fp8_state(layer), fp8_state(fresh)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="has 6 roles"):  # the state of another number of experts
        fp8train.GroupedLinear(2, 16, 16).load_state_dict(layer.state_dict())


# ---- transformers' fused experts -------------------------------------------------------------------
def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=4,
            decoder_sparse_step=1,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    model.config._experts_implementation = "eager"  # the reference: transformers' loop over experts
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_fused_experts_convert_exactly_and_train_in_fp8(family: str) -> None:
    torch.set_num_threads(1)
    model = _tiny(family)
    ref = copy.deepcopy(model)
    fp8train.convert_to_fp8(model, log=False)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 2 and all(e.num_gemms == 8 for e in experts)
    ref_experts = [m for m in ref.modules() if type(m).__name__.endswith("Experts")]
    assert experts[0].gate_up_proj.shape == ref_experts[0].gate_up_proj.shape  # the same parameters
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in ref.named_parameters()}
    ids = torch.randint(0, 96, (2, 16))
    assert torch.equal(model(ids).logits, ref(ids).logits)  # outside FP8: transformers' computation
    report = fp8train.coverage(model)
    names = [layer.name for layer in report.layers if "experts" in layer.name]
    assert len(names) == 16 and names[0].endswith("experts/gate_up0") and names[-1].endswith("experts/down3")
    assert report.fp8_share == 1.0 or "lm_head" in [x.name for x in report.layers if not x.fp8]
    # FP8 training steps: every expert's roles have their own history; losses close to high precision
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counter = StepCoverage(model)
    losses = []
    for _ in range(3):
        with fp8train.fp8_autocast():
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref_loss = ref(ids, labels=ids).loss.item()
    assert abs(losses[0] - ref_loss) / ref_loss < 0.02
    assert all(torch.isfinite(torch.tensor(losses)))
    hist = experts[0].fp8_meta["scaling_fwd"].amax_history
    assert hist.shape[1] == 3 * 8
    inputs = hist[0, 0::3]  # newest input amax of each GEMM (the last step)
    weights = hist[0, 1::3]
    assert (weights > 0).all() and len(set(weights.tolist())) == 8  # each expert's own weight amax
    assert (inputs > 0).all()  # 32 routed rows over 4 experts: each had tokens in the last step
    flops = counter.take()["flops"]  # every linear GEMM in FP8 (the routers are not linear layers)
    assert flops["fp8"] > 0 and flops["high_precision"] == 0
    counter.remove()


def test_step_coverage_counts_each_group_its_own_tokens() -> None:
    layer = fp8train.GroupedLinear(3, 32, 16, bias=False)
    counter = StepCoverage(layer)
    x = torch.randn(12, 32, requires_grad=True)
    with fp8train.fp8_autocast():
        layer(x, [5, 0, 7]).sum().backward()
    out = counter.take()
    # forward, dgrad and wgrad of each group: 2 * tokens * in * out each, 12 tokens in all
    assert out["flops"] == {"fp8": 3 * 2 * 12 * 32 * 16, "high_precision": 0}
    assert sum(out["gemms"].values()) == 9
    assert len(fp8train.coverage(layer).layers) == 3


def test_hf_experts_off_the_gemm_multiple_stay_in_high_precision() -> None:
    model = _tiny("mixtral")
    for layer in model.model.layers:  # an intermediate size off 16: not an FP8 GEMM shape
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:, :40].clone())
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:, :, :20].clone())
    fp8train.convert_to_fp8(model, log=False)
    assert not any(isinstance(m, FusedExperts) for m in model.modules())
    assert sum(isinstance(m, fp8train.Linear) for m in model.modules()) > 0  # the attention converted


def test_prepare_trains_hf_experts_in_fp8_one_region_per_call() -> None:
    model = _tiny("qwen3_moe")
    fp8train.prepare(model)
    ids = torch.randint(0, 96, (2, 16))
    model(ids, labels=ids).loss.backward()
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(fp8train.runtime.current_call(e).fp8 for e in experts)
    assert all(e.fp8_meta["scaling_fwd"].amax_history[0, 1::3].gt(0).all() for e in experts)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_pad_to_blocks_equals_explicitly_padded_groups(name: str) -> None:
    """grouped_linear(pad_to_blocks=True) under MXFP8/NVFP4: the rows of a GroupedLinear fed groups
    padded by pad_groups, bit for bit (values and gradients); without it the groups are refused."""
    torch.set_num_threads(1)
    recipe = fp8train.MXFP8BlockScaling() if name == "mxfp8" else fp8train.NVFP4BlockScaling()
    three_d, grouped = _pair(3, 64, 32)
    splits, trailing = [5, 0, 40], 3
    offs = torch.tensor(splits).cumsum(0).to(torch.int32)
    x = torch.randn(sum(splits) + trailing, 64)
    xa, xb = x.clone().requires_grad_(), x[: sum(splits)].clone().requires_grad_()
    with pytest.raises(ValueError, match="pad_groups"), fp8train.fp8_autocast(fp8_recipe=recipe):
        three_d(xa, offs)
    torch.manual_seed(1)  # NVFP4 rounds gradients stochastically
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        ya = grouped_linear(three_d, xa, three_d.weight, offs, three_d.bias, pad_to_blocks=True)
    ya.square().sum().backward()
    block = 32 if name == "mxfp8" else 16
    torch.manual_seed(1)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        xp, padded = fp8train.pad_groups(xb, splits, block)
        yb = fp8train.unpad_groups(grouped(xp, padded), splits, padded)
    yb.square().sum().backward()
    assert torch.equal(ya[: sum(splits)], yb) and not ya[sum(splits) :].any()
    assert torch.equal(xa.grad[: sum(splits)], xb.grad)
    for e in range(3):
        assert torch.equal(three_d.weight.grad[e], getattr(grouped, f"weight{e}").grad), e


@pytest.mark.parametrize(
    "recipe", [fp8train.MXFP8BlockScaling(), fp8train.NVFP4BlockScaling()], ids=["mxfp8", "nvfp4"]
)
def test_hf_experts_train_under_mx_recipes_whatever_the_routing(recipe) -> None:
    """FusedExperts pads each expert's rows to the recipe's block: any routing trains, close to fp32."""
    torch.set_num_threads(1)
    model = _tiny("qwen3_moe")
    ref = copy.deepcopy(model)
    fp8train.convert_to_fp8(model, recipe=recipe, log=False)
    ids = torch.randint(0, 96, (2, 16))
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        loss = model(ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    assert abs(loss.item() / ref_loss.item() - 1) < 0.05
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert all(torch.isfinite(e.gate_up_proj.grad).all() and e.gate_up_proj.grad.any() for e in experts)


def test_hf_experts_fp8_state_round_trips_through_the_state_dict() -> None:
    """The converted model's state_dict has the experts' FP8 state; a fresh converted model loads it."""
    model = _tiny("mixtral")
    fp8train.convert_to_fp8(model, log=False)
    ids = torch.randint(0, 96, (2, 16))
    for _ in range(2):
        with fp8train.fp8_autocast():
            model(ids, labels=ids).loss.backward()
    state = model.state_dict()
    assert sum(k.endswith("experts._extra_state") for k in state) == 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fresh = fp8train.convert_to_fp8(_tiny("mixtral"), log=False)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for a, b in zip(fp8_state(model), fp8_state(fresh)):
        assert torch.equal(a, b)
    assert any(t.any() for t in fp8_state(fresh))


# ---- FSDP2 gathers 3-D expert weights in FP8 ------------------------------------------------------------
class _ShardedExperts(torch.nn.Module):
    """An ExpertsLinear of 3 experts (uneven over 2 ranks: 2 and 1) feeding transformers' Qwen3-MoE
    fused experts (4 experts) converted to FusedExperts: 3-D weights of both kinds."""

    def __init__(self, option: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = fp8train.ExpertsLinear(3, 32, 48, fsdp_fp8_all_gather=option)
        config = transformers.Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=32, num_experts=4)
        self.experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_(0, 0.1)
        fp8train.convert_to_fp8(self, fsdp_fp8_all_gather=option, log=False)

    def forward(self, x, offs, top_k_index, top_k_weights) -> torch.Tensor:
        return self.experts(self.up(x, offs), top_k_index, top_k_weights)


def _fsdp_experts_ranks(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)

    def shard(option: bool) -> torch.nn.Module:
        model = _ShardedExperts(option)
        assert isinstance(model.experts, FusedExperts)
        fully_shard(model.up)
        fully_shard(model.experts)
        fully_shard(model)
        return model

    def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(8, 32, generator=g) * (1 + rank)
        offs = torch.tensor([3, 3, 8] if rank == 0 else [2, 6, 7], dtype=torch.int32)  # an empty expert
        top_k_index = torch.randint(0, 3 if rank == 0 else 4, (8, 2), generator=g)  # uneven routing
        return model(x, offs, top_k_index, torch.rand(8, 2, generator=g)).square().mean()

    return train_fsdp_gathers(shard, loss_of)


@pytest.mark.multirank
def test_two_ranks_fsdp2_gathers_3d_expert_weights_in_fp8_bit_for_bit() -> None:
    """ExpertsLinear and FusedExperts with fsdp_fp8_all_gather: FSDP2 shards the experts (dim 0, uneven),
    each rank casts its experts with their own GEMMs' delayed scales and gathers bytes; training equals
    the run with high-precision gathers bit for bit (losses, gradients, FP8 state), on both ranks."""
    assert_fp8_gathers_bit_for_bit(run_ranks(_fsdp_experts_ranks, 2, timeout_s=180, pg_timeout_s=60))


# ---- what real jobs do around the loop: meta builds, copies, EMA, double backward, in-place ops ----------
REAL_JOB_RECIPES = {
    "delayed": fp8train.DelayedScaling(amax_history_len=4),
    "current": fp8train.Float8CurrentScaling(),
    "block": fp8train.Float8BlockScaling(),
}


class _GroupedPair(torch.nn.Module):
    """GroupedLinear (3 experts, bias) -> tanh -> ExpertsLinear (3 experts, bias), expert 1 empty."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = fp8train.GroupedLinear(3, 16, 32)
        self.experts = fp8train.ExpertsLinear(3, 32, 16, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([3, 3, 8], dtype=torch.int32)
        return self.experts(torch.tanh(self.grouped(x, [3, 0, 5])), offs)


def _pair_steps(model: torch.nn.Module, recipe, steps: int = 3) -> list[float]:
    from helpers import sgd_step

    return [
        sgd_step(model, torch.randn(8, 16, generator=torch.Generator().manual_seed(s)), recipe, 0.1)
        for s in range(steps)
    ]


@pytest.mark.parametrize("name", ["delayed", "block"])
def test_grouped_meta_build_then_to_empty_and_reset_trains_like_a_build_on_the_device(name: str) -> None:
    from helpers import digest

    torch.manual_seed(0)
    built = _GroupedPair()
    with torch.device("meta"):
        meta = _GroupedPair()
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(0)  # reset_parameters draws what construction drew from the same seed
    meta.grouped.reset_parameters()
    meta.experts.reset_parameters()
    assert digest(meta.state_dict()) == digest(built.state_dict())
    recipe = REAL_JOB_RECIPES[name]
    assert _pair_steps(meta, recipe) == _pair_steps(built, recipe)
    assert digest(fp8_state(meta)) == digest(fp8_state(built))


@pytest.mark.parametrize("name", list(REAL_JOB_RECIPES))
def test_grouped_copies_and_an_ema_of_a_trained_model(name: str) -> None:
    """deepcopy and pickle of a trained pair hold its FP8 state and train on as it does; an EMA model
    (torch's AveragedModel) averages the experts' weights and runs in an FP8 region with its own state."""
    import pickle

    from helpers import digest

    recipe = REAL_JOB_RECIPES[name]
    torch.manual_seed(0)
    model = _GroupedPair()
    twin = copy.deepcopy(model)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    expected = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        _pair_steps(model, recipe, steps=1)
        _pair_steps(twin, recipe, steps=1)
        ema.update_parameters(model)
        if step:  # the first update copies; later ones are p_ema + 0.1 (p - p_ema), torch's lerp
            expected = [e.lerp(p.detach(), 0.1) for e, p in zip(expected, model.parameters())]
        else:
            expected = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(e, p) for e, p in zip(expected, ema.module.parameters()))
    for made in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert digest(fp8_state(made)) == digest(fp8_state(twin))
        assert digest(made.state_dict()) == digest(twin.state_dict())
        assert _pair_steps(made, recipe, steps=2) == _pair_steps(copy.deepcopy(twin), recipe, steps=2)
    with fp8train.fp8_autocast(fp8_recipe=recipe), torch.no_grad():
        out = ema(torch.randn(8, 16))
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    assert _pair_steps(model, recipe, steps=1) == _pair_steps(twin, recipe, steps=1)  # the original trains on


@pytest.mark.parametrize("name", list(REAL_JOB_RECIPES))
def test_grouped_gradient_penalty_and_create_graph(name: str) -> None:
    """create_graph=True through both grouped forms: the first-order FP8 gradients are the same values
    as without it, and a gradient penalty (WGAN-GP) reaches every expert's weight, as close to high
    precision as the first derivative is (4x its deviation + 2%, the Linear rule); an expert with no
    token gets a zero second-order gradient."""
    recipe = REAL_JOB_RECIPES[name]

    def first_order(create_graph: bool):
        torch.manual_seed(0)
        model = _GroupedPair()
        x = torch.randn(8, 16, requires_grad=True)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = model(x)
        return torch.autograd.grad(y.square().sum(), [x, *model.parameters()], create_graph=create_graph)

    for plain, differentiable in zip(first_order(False), first_order(True)):
        assert torch.equal(plain, differentiable.detach())

    def penalty(enabled: bool, seed: int):
        torch.manual_seed(seed)
        model = _GroupedPair()
        x = torch.randn(8, 16, requires_grad=True)
        with fp8train.fp8_autocast(enabled=enabled, fp8_recipe=recipe):
            y = model(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        return g.detach(), [model.grouped.weight0, model.grouped.weight2, model.experts.weight]

    for seed in range(2):
        g_hp, hp = penalty(False, seed)
        g_fp8, fp8 = penalty(True, seed)
        floor = float((g_fp8 - g_hp).norm() / g_hp.norm())
        assert 0 < floor < 0.1
        for p, reference in zip(fp8, hp):
            assert p.grad is not None
            assert float((p.grad - reference.grad).norm() / reference.grad.norm()) < 4 * floor + 0.02
        assert torch.equal(fp8[2].grad[1], torch.zeros_like(fp8[2].grad[1]))  # expert 1: no token


@pytest.mark.parametrize("name", list(REAL_JOB_RECIPES))
def test_grouped_in_place_ops_on_outputs_work_as_out_of_place(name: str) -> None:
    """relu_ on GroupedLinear's output, mul_/add_ on ExpertsLinear's: the same values and input gradient
    as the out-of-place ops."""
    torch.manual_seed(0)
    model = _GroupedPair()
    x = torch.randn(8, 16, requires_grad=True)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    results = []
    for in_place in (False, True):
        pair = copy.deepcopy(model)  # the same FP8 state for both
        with fp8train.fp8_autocast(fp8_recipe=REAL_JOB_RECIPES[name]):
            h = pair.grouped(x, [3, 0, 5])
            h = torch.relu_(h) if in_place else torch.relu(h)
            y = pair.experts(h, offs)
            y = y.mul_(2.0).add_(1.0) if in_place else y * 2.0 + 1.0
        (grad,) = torch.autograd.grad(y.square().sum(), x)
        results.append((y.detach(), grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_grouped_weight_gradient_that_would_miss_a_term_is_refused_by_name() -> None:
    """As for Linear: differentiating an expert's weight gradient whose input requires grad needs that
    input, which FP8 does not keep: an error naming create_graph, never a number without the term; the
    first layer's input is data, so its experts' weight gradients are complete and differentiable."""
    torch.manual_seed(0)
    model = _GroupedPair()
    with fp8train.fp8_autocast():
        y = model(torch.randn(8, 16))
    y.sum().backward(create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        model.experts.weight.grad.square().sum().backward()  # its input (tanh of grouped) requires grad
    (second,) = torch.autograd.grad(model.grouped.weight2.grad.square().sum(), model.grouped.weight2)
    assert torch.isfinite(second).all() and second.abs().sum() > 0
