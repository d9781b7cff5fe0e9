"""Current scaling and block scaling against an independent reference.

The reference scales with numpy float32 arithmetic and Python loops over tiles, rounds with torch's
own FP8 dtype conversion (not fp8train's emulated rounding), and multiplies in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fp8train
from fp8train.quantization import recipe_kind
from fp8train.quantization.block_scaling import quantize_tiles
from fp8train.quantization.current import current_scales, scale_from_amax
from inverses import dequantize_tiles

F32_MAX = np.float32(np.finfo(np.float32).max)
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def ref_scale(amax: float, fp8_max: float, power_2: bool = False) -> np.float32:
    if not math.isfinite(amax) or amax <= 0:
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        scale = np.float32(fp8_max) / np.float32(amax)  # float32 division, as the rule says
    scale = min(scale, F32_MAX)
    if power_2:
        mantissa, exponent = math.frexp(float(scale))
        scale = np.float32(2.0 ** (exponent - 1))
    return np.float32(scale)


def ref_quantize(x: torch.Tensor, scale: float, encoding: str) -> torch.Tensor:
    """saturate(x * scale) rounded by torch's FP8 conversion, as float32."""
    dtype, fp8_max = FP8[encoding]
    scaled = x.float() * torch.tensor(scale, dtype=torch.float32)
    return scaled.clamp(-fp8_max, fp8_max).to(dtype).float()


def ref_tiles(x: torch.Tensor, rows: int, power_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over rows x 128 tiles: FP8 values and the dequantized tensor."""
    q, deq = torch.empty_like(x, dtype=torch.float32), torch.empty_like(x, dtype=torch.float32)
    for r0 in range(0, x.shape[0], rows):
        for c0 in range(0, x.shape[1], 128):
            tile = x[r0 : r0 + rows, c0 : c0 + 128]
            scale = ref_scale(float(tile.abs().max()), 448.0, power_2)
            qt = ref_quantize(tile, scale, "e4m3")
            q[r0 : r0 + rows, c0 : c0 + 128] = qt
            deq[r0 : r0 + rows, c0 : c0 + 128] = qt * torch.tensor(np.float32(1) / scale)
    return q, deq


def _with_outliers(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[3] *= 2.0**17  # a few outlier tokens, as activations of real models have
    x[rows // 2, 5] = 2.0**20
    return x


@pytest.mark.parametrize(
    "amax",
    [0.0, float("inf"), float("nan"), 1e-45, 1e-40, 3.0e-38, 1e-3, 1.0, 448.0, 3.0e38],
)
@pytest.mark.parametrize("power_2", [False, True])
def test_scale_rule_matches_the_reference(amax: float, power_2: bool) -> None:
    got = scale_from_amax(torch.tensor([amax], dtype=torch.float32), 448.0, power_2)
    assert got.item() == float(ref_scale(float(np.float32(amax)), 448.0, power_2)), (amax, got)


@pytest.mark.parametrize("encoding", ["e4m3", "e5m2"])
def test_per_tensor_current_scaling_quantizes_like_the_reference(encoding: str) -> None:
    from fp8train.numerics.cast import cast_operand

    x = _with_outliers(64, 96)
    scale, scale_inv = current_scales(x, encoding)
    want = ref_scale(float(x.abs().max()), FP8[encoding][1])
    assert scale.item() == float(want) and scale_inv.item() == float(np.float32(1) / want)
    got = cast_operand(x, scale, encoding, torch.float32)
    assert torch.equal(got, ref_quantize(x, want, encoding))


@pytest.mark.parametrize("shape", [(8, 256), (5, 200), (130, 300)], ids=["whole", "partial", "both"])
@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
@pytest.mark.parametrize("power_2", [True, False])
def test_tiles_and_blocks_quantize_like_the_reference(shape, rows: int, power_2: bool) -> None:
    """Outliers, a tile of zeros, partial last tiles (200 = 128 + 72 columns, 130 = 128 + 2 rows)."""
    x = _with_outliers(*shape)
    x[:, 128:] = 0 if shape[1] > 128 and shape[0] < 100 else x[:, 128:]  # an all-zero tile: scale 1
    q, scale_inv = quantize_tiles(x, rows, power_2)
    ref_q, ref_deq = ref_tiles(x, rows, power_2)
    assert scale_inv.shape == (-(-shape[0] // rows), -(-shape[1] // 128))
    assert torch.equal(q, ref_q)
    assert torch.equal(dequantize_tiles(q, scale_inv, rows), ref_deq)
    if power_2:  # power-of-2 scales: every scale_inv is 2**k
        mantissa, _ = torch.frexp(scale_inv)
        assert torch.all(mantissa == 0.5)


def _reference_linear(recipe, x, w, b, grad_y):
    """Output and input gradient in float64 from reference-quantized operands."""
    if isinstance(recipe, fp8train.Float8BlockScaling):
        p2 = recipe.power_2_scale
        xq, wq = ref_tiles(x, 1, p2)[1], ref_tiles(w, 128, p2)[1]
        gq = ref_tiles(grad_y, 1, p2)[1]
    else:
        bwd = recipe.fp8_format.bwd
        sx, sw = ref_scale(float(x.abs().max()), 448.0), ref_scale(float(w.abs().max()), 448.0)
        sg = ref_scale(float(grad_y.abs().max()), FP8[bwd][1])
        xq = ref_quantize(x, sx, "e4m3") / torch.tensor(sx)
        wq = ref_quantize(w, sw, "e4m3") / torch.tensor(sw)
        gq = ref_quantize(grad_y, sg, bwd) / torch.tensor(sg)
    y = xq.double() @ wq.double().t() + b.double()
    return y, gq.double() @ wq.double()


@pytest.mark.parametrize(
    "recipe",
    [
        fp8train.Float8CurrentScaling(),
        fp8train.Float8BlockScaling(),
        fp8train.Float8BlockScaling(power_2_scale=False),
    ],
    ids=["current", "block", "block-exact-scales"],
)
def test_module_output_and_input_gradient_match_the_reference(recipe, monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")
    torch.manual_seed(0)
    layer = fp8train.Linear(200, 48)  # 200 input features: a partial last tile
    x = _with_outliers(16, 200).div(1000).requires_grad_()
    grad_y = torch.randn(16, 48)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.backward(grad_y)
    ref_y, ref_gx = _reference_linear(recipe, x.detach(), layer.weight.detach(), layer.bias.detach(), grad_y)
    assert torch.allclose(y.double(), ref_y, rtol=1e-5, atol=1e-6 * ref_y.abs().max())
    assert torch.allclose(x.grad.double(), ref_gx, rtol=1e-5, atol=1e-6 * ref_gx.abs().max())


def _per_token_error(recipe, x: torch.Tensor, layer: torch.nn.Module) -> float:
    with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=recipe):
        y = layer(x).double()
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    return ((y - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()


def test_block_scaling_error_on_outlier_tokens_is_at_least_2x_below_per_tensor() -> None:
    """A few tokens at 2**17 times the bulk: one per-tensor scale crushes every other token into
    FP8's subnormals, 1x128 tiles give each token its own scale."""
    torch.manual_seed(0)
    layer = fp8train.Linear(256, 64)
    x = torch.randn(64, 256)
    x[[5, 40]] *= 2.0**17
    per_tensor = _per_token_error(fp8train.Float8CurrentScaling(), x, layer)
    block = _per_token_error(fp8train.Float8BlockScaling(), x, layer)
    assert block * 2 <= per_tensor, (block, per_tensor)


def test_a_checkpoint_records_its_recipe_and_refuses_another() -> None:
    model = fp8train.Linear(32, 32)
    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
        model(torch.randn(4, 32)).sum().backward()
    fresh = fp8train.Linear(32, 32)
    fresh.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="trained with current scaling .* now trained with delayed"):
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling()):
            fresh(torch.randn(4, 32))
    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):  # its own recipe: fine
        fresh(torch.randn(4, 32)).sum().backward()


def _grads(recipe, recompute) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8train.LayerNormMLP(64, 160), fp8train.Linear(64, 48))
    x = _with_outliers(24, 64).div(100).requires_grad_()
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = recompute(model, x) if recompute else model(x)
    y.square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", [fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()])
@pytest.mark.parametrize("how", ["fp8train.checkpoint", "torch.utils.checkpoint"])
def test_recomputation_gives_the_same_gradients(recipe, how) -> None:
    """The recomputed forward casts the same tensors, so it takes the same scales: bitwise."""
    if how == "fp8train.checkpoint":
        recompute = fp8train.checkpoint
    else:
        recompute = lambda fn, x: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)  # noqa: E731
    for plain, recomputed in zip(_grads(recipe, None), _grads(recipe, recompute)):
        assert torch.equal(plain, recomputed)


@pytest.mark.parametrize("recipe", [fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()])
def test_fp8_meta_holds_delayed_state_that_other_recipes_leave_alone(recipe) -> None:
    """fp8_meta is delayed scaling's state (histories, scales); current and block scaling keep no
    state, so training with them leaves it at its initial values and launches no amax reduction."""
    layer = fp8train.Linear(32, 32)
    for _ in range(3):
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(8, 32)).sum().backward()
    for key, roles in (("scaling_fwd", 3), ("scaling_bwd", 2)):
        meta = layer.fp8_meta[key]
        assert torch.equal(meta.scale, torch.ones(roles)) and torch.equal(meta.scale_inv, torch.ones(roles))
        assert not bool(meta.amax_history.any())
    assert fp8train.reduction_stats()["launched"] == 0


def test_bad_recipe_arguments_raise() -> None:
    with pytest.raises(ValueError, match="E4M3 or Format.HYBRID"):
        fp8train.Float8CurrentScaling(fp8_format=fp8train.Format.E5M2)
    with pytest.raises(ValueError, match="E4M3 everywhere"):
        fp8train.Float8BlockScaling(fp8_format=fp8train.Format.HYBRID)
    with pytest.raises(ValueError, match="fp8_recipe must be"):
        with fp8train.fp8_autocast(fp8_recipe="block"):
            pass


def _train_gpt(recipe, steps: int = 120) -> list[float]:
    from fp8train.tools.data import MarkovTask
    from fp8train.tools.models import GPT, MODEL_SIZES, next_token_loss

    cfg = MODEL_SIZES["tiny"]
    data = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=0).sample(steps * 8, seed=1)
    data = data.view(steps, 8, cfg.seq_len + 1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for tokens in data:
        with fp8train.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            logits = model(tokens[:, :-1])
        loss = next_token_loss(logits, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # six trainings of 120 steps
def test_each_recipe_trains_a_small_gpt_within_its_gap_of_fp32() -> None:
    """Final loss (mean of the last 10 of 120 steps) within 2% of fp32 for the FP8 recipes and 5% for
    NVFP4 (4-bit values). Measured (this machine, torch 2.13.0+cpu, seed 0): delayed -0.35%, current
    +0.42%, block +0.15%, MXFP8 +0.23%, NVFP4 +0.80% (+0.94% without the Hadamard transform).
    The gaps are those the issues set (13: 2%; 22: NVFP4 larger than FP8, stated here)."""
    fp32 = _train_gpt(None)
    final = sum(fp32[-10:]) / 10
    assert final < 0.5 * fp32[0]  # it learns the language
    for recipe, gap in (
        (fp8train.DelayedScaling(amax_history_len=16), 0.02),
        (fp8train.Float8CurrentScaling(), 0.02),
        (fp8train.Float8BlockScaling(), 0.02),
        (fp8train.MXFP8BlockScaling(), 0.02),
        (fp8train.NVFP4BlockScaling(), 0.05),
    ):
        losses = _train_gpt(recipe)
        assert abs(sum(losses[-10:]) / 10 - final) <= gap * final, (recipe, losses[-10:], fp32[-10:])


@pytest.mark.parametrize("recipe", [fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()])
def test_compiled_fullgraph_equals_eager(recipe) -> None:
    """torch.compile(fullgraph=True) traces current and block scaling (no graph break): the same
    outputs and gradients as eager (aot_eager runs the traced ops as they are)."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(fp8train.LayerNormMLP(64, 160), fp8train.Linear(64, 48))
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        x = _with_outliers(24, 64).div(100).requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = run(x)
        y.square().mean().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in model.parameters()])
        # the recipe kind is recorded (and saved) however the model ran
        assert {m.recipe_kind for m in model} == {recipe_kind(recipe)}
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    with pytest.raises(RuntimeError, match="now trained with delayed scaling"):
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling()):
            model(x)


def test_block_scaling_keeps_one_byte_operands_for_backward_and_caches_the_weight(monkeypatch) -> None:
    """Backward keeps the weight's blocks and the input (quantized along the tokens) as 1-byte FP8
    values, not high-precision copies (the weight parameter itself is saved by reference, for a
    double backward, as torch.nn.Linear saves it); with is_first_microbatch the weight is quantized
    once."""
    from fp8train.quantization.block_scaling import BlockQuantization

    layer = fp8train.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        if t.data_ptr() != layer.weight.data_ptr():
            saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8BlockScaling()):
            layer(x)
    big = [dtype for dtype, n in saved if n >= 128 * 64]  # operands, not per-tile scales
    assert big == [torch.float8_e4m3fn, torch.float8_e4m3fn], saved

    calls = []
    real = BlockQuantization.quantize_weight
    # a spy on the recipe's interface (counts, passes on): the number of weight quantizations
    monkeypatch.setattr(BlockQuantization, "quantize_weight", lambda *a: calls.append(1) or real(*a))
    outputs = []
    for first in (True, False, False):
        with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8BlockScaling()):
            outputs.append(layer(x, is_first_microbatch=first))
    assert len(calls) == 1 and all(torch.equal(outputs[0], y) for y in outputs)


def _ddp_job(rank: int, world: int, recipe, path: str, rank_local: bool) -> dict:
    """DDP training with `recipe`; with `rank_local`, rank 0 also evaluates inside an FP8 region (an
    extra batch: uneven validation), saves a checkpoint alone and waits at a barrier; then a fresh
    model is loaded on rank 0 only and DDP broadcasts it."""
    import torch.distributed as dist

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(fp8train.LayerNormMLP(64, 128), fp8train.Linear(64, 32))

    def train(ddp, steps, start):
        losses = []
        for step in range(start, start + steps):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                loss = ddp(x).square().mean()
            loss.backward()
            with torch.no_grad():
                for p in ddp.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.item())
        return losses

    ddp = torch.nn.parallel.DistributedDataParallel(build())
    losses = train(ddp, 3, 0)
    if rank_local and rank == 0:
        with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=recipe):
            for _ in range(2):
                ddp.module(torch.randn(8, 64))
        fp8train.save_checkpoint(ddp.module.state_dict(), path)
    dist.barrier()
    losses += train(ddp, 2, 3)
    fresh = build()
    if rank == 0:
        fresh.load_state_dict(fp8train.load_checkpoint(path) if rank_local else ddp.module.state_dict())
    resumed = torch.nn.parallel.DistributedDataParallel(fresh)  # broadcasts rank 0's parameters
    losses += train(resumed, 2, 5)
    return {"losses": losses, "params": [p.detach().clone() for p in resumed.parameters()]}


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", [fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()])
def test_ddp_with_rank_local_evaluation_saving_and_a_rank0_load(recipe, tmp_path) -> None:
    """Current and block scaling issue no amax collective: rank-0-only evaluation and saving change
    nothing, and a checkpoint loaded on rank 0 only trains on every rank after DDP's broadcast."""
    from multirank import run_ranks

    path = str(tmp_path / "ckpt.pt")
    lockstep = run_ranks(_ddp_job, 2, recipe, str(tmp_path / "unused.pt"), False)
    patterns = run_ranks(_ddp_job, 2, recipe, path, True)
    for a, b in zip(lockstep, patterns):
        assert a["losses"][:5] == b["losses"][:5]  # evaluation and saving changed nothing
    for run in (lockstep, patterns):  # after the rank-0 load and DDP's broadcast, ranks agree
        assert all(torch.equal(p, q) for p, q in zip(run[0]["params"], run[1]["params"]))
    # the resumed run started from the checkpoint of step 3, not from the weights of step 5
    assert patterns[0]["losses"][5:] != lockstep[0]["losses"][5:]
