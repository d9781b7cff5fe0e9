"""MXFP8BlockScaling and NVFP4BlockScaling through the same modules.

The formats' arithmetic is checked bit for bit against torchao and naive references in
test_microscaling.py; here, that each recipe quantizes each GEMM's operands along that GEMM's
reduction dimension with the format it says, that the layer's outputs and gradients are exactly
dequantize-then-multiply of those operands, where the Hadamard transform and stochastic rounding
apply, edge values, recomputation, torch.compile, checkpoints, and training.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train.numerics.microscaling import (
    RHT_SIGNS,
    e8m0_to_float,
    mx_quantize,
    nvfp4_quantize,
    random_hadamard_transform,
)
from fp8train.quantization import quantization_of
from inverses import mx_dequantize, nvfp4_dequantize

MX = fp8train.MXFP8BlockScaling()
MX_HYBRID_2D = fp8train.MXFP8BlockScaling(fp8_format=fp8train.Format.HYBRID, enable_2d_quantization=True)
NV = fp8train.NVFP4BlockScaling()
NV_PLAIN = fp8train.NVFP4BlockScaling(
    disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
)
NV_DETERMINISTIC = fp8train.NVFP4BlockScaling(disable_stochastic_rounding=True)
RECIPES = {"mx": MX, "mx-hybrid-2d": MX_HYBRID_2D, "nv": NV_DETERMINISTIC, "nv-plain": NV_PLAIN}


def _inputs(seed: int, rows: int, cols: int) -> torch.Tensor:
    """Random values with outlier rows and columns, subnormal-range values and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[1] *= 2.0**12  # an outlier token
    x[:, 3] *= 2.0**-20  # a column far below the rest
    x[2, : cols // 2] = 0.0
    return x


def _mx_ref(x, dim, encoding="e4m3", two_d=False):
    values, scales = mx_quantize(x, dim, 32, encoding, two_d)
    return mx_dequantize(values, scales, dim, 32, two_d)


def _nv_ref(x, dim, two_d=False, rotate=False):
    if rotate:
        x = random_hadamard_transform(x.float(), RHT_SIGNS, dim)
    values, block_scales, tensor_scale = nvfp4_quantize(x, dim, two_d=two_d)
    return nvfp4_dequantize(values, block_scales, tensor_scale, dim, two_d)


def _operands(recipe, x, w, g):
    q = quantization_of(recipe)
    return q.quantize_input(x, None), q.quantize_weight(w, None), q.quantize_grad(g, None, (True, True))


@pytest.mark.parametrize("shape", [(64, 96, 64), (96, 160, 32)], ids=["square-ish", "wide"])
def test_mxfp8_quantizes_each_operand_along_its_gemms_reduction_dimension(shape) -> None:
    tokens, k, n = shape
    x, w, g = _inputs(0, tokens, k), _inputs(1, n, k), _inputs(2, tokens, n)
    for recipe in (MX, MX_HYBRID_2D):
        inputs, weights, grads = _operands(recipe, x, w, g)
        grad_encoding = recipe.fp8_format.bwd
        assert torch.equal(inputs.forward.dequantize(), _mx_ref(x, 1))  # along in_features
        assert torch.equal(inputs.wgrad.dequantize(), _mx_ref(x, 0))  # along the tokens
        assert torch.equal(grads.dgrad.dequantize(), _mx_ref(g, 1, grad_encoding))  # along out_features
        assert torch.equal(grads.wgrad.dequantize(), _mx_ref(g, 0, grad_encoding))
        if recipe.enable_2d_quantization:  # one 32x32-block copy serves w and w.T
            assert weights.forward is weights.dgrad
            assert torch.equal(weights.forward.dequantize(), _mx_ref(w, 0, two_d=True))
        else:
            assert torch.equal(weights.forward.dequantize(), _mx_ref(w, 1))
            assert torch.equal(weights.dgrad.dequantize(), _mx_ref(w, 0))
        # the scales are E8M0 powers of two: dequantizing is exact
        frac, _ = torch.frexp(inputs.forward.scale_inv)
        assert bool((frac == 0.5).all())
        assert grads.dgrad.values.dtype == (
            torch.float8_e5m2 if grad_encoding == "e5m2" else torch.float8_e4m3fn
        )


def test_nvfp4_quantizes_each_operand_along_its_gemms_reduction_dimension() -> None:
    x, w, g = _inputs(0, 64, 96), _inputs(1, 48, 96), _inputs(2, 64, 48)
    inputs, weights, grads = _operands(NV_DETERMINISTIC, x, w, g)
    assert torch.equal(inputs.forward.dequantize(), _nv_ref(x, 1))
    assert torch.equal(weights.forward.dequantize(), _nv_ref(w, 0, two_d=True))  # 16x16 blocks
    assert weights.forward is weights.dgrad
    assert torch.equal(grads.dgrad.dequantize(), _nv_ref(g, 1))
    # the weight gradient's operands: Hadamard-transformed along the tokens, then quantized
    assert torch.equal(inputs.wgrad.dequantize(), _nv_ref(x, 0, rotate=True))
    assert torch.equal(grads.wgrad.dequantize(), _nv_ref(g, 0, rotate=True))
    assert inputs.wgrad.rotated and grads.wgrad.rotated
    assert not (inputs.forward.rotated or grads.dgrad.rotated or weights.forward.rotated)
    inputs, weights, grads = _operands(NV_PLAIN, x, w, g)
    assert not (inputs.wgrad.rotated or grads.wgrad.rotated)
    assert torch.equal(weights.forward.dequantize(), _nv_ref(w, 1))
    assert torch.equal(weights.dgrad.dequantize(), _nv_ref(w, 0))
    assert torch.equal(inputs.wgrad.dequantize(), _nv_ref(x, 0))
    # a token count that is not a whole number of 16-blocks is refused (TE refuses it too)
    with pytest.raises(ValueError, match="blocks of 16.*tokens = 40"):
        _operands(NV_DETERMINISTIC, x[:40], w, g[:40])


@pytest.mark.parametrize("name", list(RECIPES))
def test_outputs_and_gradients_are_dequantize_then_multiply(name: str) -> None:
    recipe = RECIPES[name]
    torch.manual_seed(0)
    layer = fp8train.Linear(96, 64)
    x = _inputs(3, 64, 96).requires_grad_()
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    g = _inputs(4, 64, 64)
    y.backward(g)
    q = quantization_of(recipe)
    inputs, weights = q.quantize_input(x.detach(), None), q.quantize_weight(layer.weight.detach(), None)
    grads = q.quantize_grad(g, None, (True, True))
    expected_y = inputs.forward.dequantize() @ weights.forward.dequantize().t() + layer.bias.detach()
    assert torch.equal(y.detach(), expected_y)
    assert torch.equal(x.grad, grads.dgrad.dequantize() @ weights.dgrad.dequantize())
    assert torch.equal(layer.weight.grad, grads.wgrad.dequantize().t() @ inputs.wgrad.dequantize())


def test_the_hadamard_transform_leaves_the_weight_gradient_unbiased_and_only_rotates_its_operands() -> None:
    """An orthogonal transform on both operands of a product leaves the product unchanged: with and
    without it, the weight gradient approximates the exact one equally well (the test compares
    errors against the exact gradient) but not with the same bits (it was applied)."""
    torch.manual_seed(0)
    x, g = _inputs(5, 64, 96), _inputs(6, 64, 48)
    exact = g.t() @ x
    grads = {}
    for recipe in (
        NV_DETERMINISTIC,
        fp8train.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    ):
        q = quantization_of(recipe)
        grads[recipe.disable_rht] = (
            q.quantize_grad(g, None, (False, True)).wgrad.dequantize().t()
            @ q.quantize_input(x, None).wgrad.dequantize()
        )
    assert not torch.equal(grads[True], grads[False])
    for grad in grads.values():
        assert float((grad - exact).norm() / exact.norm()) < 0.3


def test_stochastic_rounding_rounds_gradients_only_reproducibly_and_without_bias() -> None:
    torch.manual_seed(0)
    layer = fp8train.Linear(64, 32, bias=False)
    x = _inputs(7, 32, 64)
    g = torch.randn(32, 32, generator=torch.Generator().manual_seed(8))

    def step(seed: int):
        torch.manual_seed(seed)
        xx = x.clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=fp8train.NVFP4BlockScaling(disable_rht=True)):
            y = layer(xx)
        (dx,) = torch.autograd.grad(y, xx, g)
        return y.detach(), dx

    (y1, d1), (y2, d2), (_, d1_again) = step(1), step(2), step(1)
    assert torch.equal(y1, y2)  # the forward is rounded to nearest: no randomness
    assert not torch.equal(d1, d2) and torch.equal(d1, d1_again)  # gradients: random, reproducible
    # unbiased: the mean over N draws of the stochastically rounded gradient's dequantized values
    # approaches the values themselves. Each element's draws are independent and bounded by its
    # rounding step s, so |mean - x| > 6 s / sqrt(N) has probability below 2 exp(-72) (Hoeffding), and
    # below 1e-27 for any of the 1024 elements: the test fails by chance essentially never
    q = quantization_of(fp8train.NVFP4BlockScaling(disable_rht=True))
    draws = 400
    mean = sum(q.quantize_grad(g, None, (True, False)).dgrad.dequantize() for _ in range(draws)) / draws
    nearest = quantization_of(NV_PLAIN).quantize_grad(g, None, (True, False)).dgrad
    step_size = nearest.scale_inv.repeat_interleave(16, 1) / nearest.tensor_scale * 2  # at most 2 at scale 1
    assert bool(((mean - g).abs() <= 6 * step_size / draws**0.5).all())
    assert float((mean - g).abs().mean()) < float((nearest.dequantize() - g).abs().mean())


def test_zeros_infinities_and_nan_stay_in_their_blocks_or_reach_the_whole_tensor() -> None:
    """MXFP8 has no per-tensor scale: a zero token gives the bias, a non-finite value reaches only the
    outputs of its own block's token. NVFP4 takes its per-tensor scale from the tensor's amax
    (TransformerEngine's rule): a NaN makes that scale NaN for every block, an infinity makes it 1."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    x[0] = 0.0
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    for recipe in (MX, NV_PLAIN):
        layer = fp8train.Linear(64, 32)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
            clean = layer(x[32:])
        if recipe is MX:
            assert torch.equal(y[0], layer.bias.detach())
            assert not torch.isfinite(y[1]).all() and torch.isnan(y[2]).all()
            assert torch.equal(y[32:], clean)  # other tokens' blocks are untouched
        else:
            assert torch.isnan(y).all()
        assert torch.isfinite(clean).all()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            zeros = layer(torch.zeros(32, 64))
        assert torch.equal(zeros, layer.bias.detach().expand(32, 32))


@pytest.mark.parametrize("name", ["mx", "nv"])
def test_recomputation_is_bitwise_with_both_kinds_of_checkpointing(name: str) -> None:
    recipe = fp8train.NVFP4BlockScaling() if name == "nv" else MX  # stochastic rounding included
    torch.manual_seed(0)
    base = torch.nn.Sequential(fp8train.LayerNormMLP(64, 128), fp8train.Linear(64, 32))
    x = torch.randn(2, 16, 64)
    grads = []
    for how in ("none", "torch", "fp8train"):
        model = copy.deepcopy(base)
        torch.manual_seed(1)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            if how == "torch":
                h = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=False)
            elif how == "fp8train":
                h = fp8train.checkpoint(model[0], x)
            else:
                h = model[0](x)
            y = model[1](h)
        y.square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mx", "nv"])
def test_compiled_fullgraph_equals_eager(name: str) -> None:
    recipe = RECIPES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = torch.nn.Sequential(fp8train.LayerNormLinear(64, 96), torch.nn.GELU(), fp8train.Linear(96, 32))
    x = torch.randn(32, 64)
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = run(x)
        y.square().mean().backward()
        results.append([y.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_checkpoints_record_the_recipe_kind() -> None:
    trained = fp8train.Linear(32, 32)
    with fp8train.fp8_autocast(fp8_recipe=NV):
        trained(torch.randn(16, 32)).sum().backward()
    fresh = fp8train.Linear(32, 32)
    fresh.load_state_dict(trained.state_dict())
    with pytest.raises(RuntimeError, match="trained with nvfp4 scaling .* now trained with mxfp8 scaling"):
        with fp8train.fp8_autocast(fp8_recipe=MX):
            fresh(torch.randn(16, 32))


def test_recipe_fields_are_validated_by_name() -> None:
    with pytest.raises(ValueError, match="MXFP8BlockScaling.fp8_format"):
        fp8train.MXFP8BlockScaling(fp8_format=fp8train.Format.E5M2)
    with pytest.raises(ValueError, match="MXFP8BlockScaling.margin"):
        fp8train.MXFP8BlockScaling(margin=-1)
    with pytest.raises(ValueError, match="NVFP4BlockScaling.disable_rht"):
        fp8train.NVFP4BlockScaling(disable_rht="yes")
    assert e8m0_to_float(torch.tensor([127], dtype=torch.uint8)).item() == 1.0


def _fsdp_runs(rank: int, world: int) -> dict:
    """FSDP2 training with and without fsdp_fp8_all_gather: these recipes take each per-tensor or
    per-block scale where the tensor is whole, so the option gathers the weight in its parameter
    dtype and changes nothing."""
    from torch.distributed.fsdp import fully_shard

    from helpers import digest, sgd

    out = {}
    for name, recipe in (("mx", MX), ("nv", NV_PLAIN)):
        for option in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                fp8train.LayerNormMLP(64, 128, fsdp_fp8_all_gather=option),
                fp8train.Linear(64, 32, fsdp_fp8_all_gather=option),
            )
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            losses = []
            for step in range(3):
                x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * rank + step))
                with fp8train.fp8_autocast(fp8_recipe=recipe):
                    loss = model(x).square().mean()
                loss.backward()
                sgd(model, 0.1)
                losses.append(loss.item())
            full = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
            out[(name, option)] = (losses, digest(full))
    return out


@pytest.mark.multirank
def test_fsdp2_gathers_in_high_precision_under_these_recipes_and_trains_alike() -> None:
    from multirank import run_ranks

    for out in run_ranks(_fsdp_runs, 2, timeout_s=120, pg_timeout_s=30):
        for name in ("mx", "nv"):
            assert out[(name, True)] == out[(name, False)]


def test_block_scaled_recipes_say_once_on_cuda_that_their_gemm_is_emulated(monkeypatch) -> None:
    """MXFP8, NVFP4 and block scaling call the warning with their own name when quantizing an input
    (it fires for CUDA tensors only); the per-tensor recipes, whose GEMM is torch._scaled_mm on GPUs,
    do not. It is given once per recipe and process (tests/modules/test_compile.py: also under
    torch.compile)."""
    import warnings

    from fp8train.quantization import base, block_scaling, mxfp8, nvfp4
    from fp8train.runtime import Call

    seen = []
    for module in (block_scaling, mxfp8, nvfp4):  # spies: which recipes ask (the warning: below, by its seam)
        monkeypatch.setattr(module, "warn_emulated_on_cuda", lambda x, name, kernel: seen.append(name))
    x = torch.randn(32, 64)
    for recipe in (
        fp8train.Float8BlockScaling(),
        MX,
        NV,
        fp8train.DelayedScaling(),
        fp8train.Float8CurrentScaling(),
    ):
        q = quantization_of(recipe)
        scales = torch.ones(2, 2) if isinstance(recipe, fp8train.DelayedScaling) else None
        q.quantize_input(x, Call.outside_module(q, scales))
    assert seen == ["Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"]
    base._warn_emulated.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base.warn_emulated_on_cuda(x, "NVFP4BlockScaling", "nvfp4")  # a CPU tensor: nothing to say
        # the warning's seam (its device type): the CUDA branch, on the CPU
        monkeypatch.setattr(base, "EMULATION_NOTED_ON", "cpu")
        for _ in range(3):
            base.warn_emulated_on_cuda(x, "NVFP4BlockScaling", "nvfp4")
    assert len(caught) == 1 and "fp8train.NVFP4BlockScaling on this GPU runs an emulated GEMM" in str(
        caught[0].message
    )
