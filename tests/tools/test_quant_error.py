"""The demo's quantization-error measurement (fp8train.tools.quant_error) and its timed pass's
interleaving (fp8train.tools.timing): that the tap keeps exactly the tensors each GEMM quantizes,
that each recipe is measured with its own quantization (format, block size, the scales delayed
scaling used that step), and that measuring changes nothing in training."""

from __future__ import annotations

import math

import pytest
import torch

import fp8train
from fp8train.telemetry import Telemetry
from fp8train.tools import demo
from fp8train.tools.demo_worker import DEMO_RECIPES
from fp8train.tools.models import GPT, MODEL_SIZES, next_token_loss
from fp8train.tools.quant_error import (
    ROLES,
    Captured,
    DelayedScales,
    TensorTap,
    mean_errors,
    quantization_errors,
    sample_gemms,
)
from fp8train.tools.timing import interleaved_times, quartiles, slowest_rank

CFG = MODEL_SIZES["tiny"]


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )


def _step(model, tokens, recipe=None) -> torch.Tensor:
    with fp8train.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        logits = model(tokens[:, :-1])
    loss = next_token_loss(logits, tokens)
    loss.backward()
    return loss


def _captured_gpt() -> dict[str, Captured]:
    torch.manual_seed(0)
    model = GPT(CFG)
    tap = TensorTap(model, sample_gemms(model))
    tap.arm()
    _step(model, _tokens(1))
    return tap.disarm()


def test_the_tap_keeps_what_each_gemm_quantizes() -> None:
    """A Linear's input, a LayerNormLinear's normalised input, the weight (a copy the optimizer does
    not change) and the gradient of the output; nothing is kept while disarmed."""
    torch.manual_seed(0)
    model = GPT(CFG)
    names = sample_gemms(model)
    assert names == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.attn.qkv", "blocks.1.attn.proj"]
    qkv, proj = model.get_submodule(names[0]), model.get_submodule(names[1])
    seen = {}
    qkv.register_forward_pre_hook(lambda m, a: seen.__setitem__("qkv_in", a[0].detach()))
    proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("proj_in", a[0].detach()))

    def keep_out(m, a, out):
        out.register_hook(lambda g: seen.__setitem__("proj_grad", g.detach().clone()))

    proj.register_forward_hook(keep_out)
    tap = TensorTap(model, names)
    tap.arm()
    _step(model, _tokens(2))
    captured = tap.disarm()
    assert torch.equal(captured[names[0]].input, qkv.norm(seen["qkv_in"]).detach().reshape(-1, CFG.hidden))
    assert torch.equal(captured[names[1]].input, seen["proj_in"].reshape(-1, CFG.hidden))
    assert torch.equal(captured[names[1]].grad_output, seen["proj_grad"].reshape(-1, CFG.hidden))
    weight = captured[names[1]].weight.clone()
    with torch.no_grad():
        proj.weight.add_(1.0)
    assert torch.equal(captured[names[1]].weight, weight)  # a copy
    kept = {n: (c.input, c.weight, c.grad_output) for n, c in captured.items()}
    _step(model, _tokens(3))  # disarmed: nothing replaced
    assert all(
        all(a is b for a, b in zip(kept[n], (c.input, c.weight, c.grad_output))) for n, c in captured.items()
    )
    assert not torch.equal(seen["proj_in"].reshape(-1, CFG.hidden), captured[names[1]].input)
    tap.remove()


def test_each_recipe_is_measured_with_its_own_format_on_the_same_tensors() -> None:
    """On the same real tensors: NVFP4 (4-bit values) well above MXFP8 (> 2x on every role), and both
    above 0; HYBRID recipes cast gradients to E5M2 (one mantissa bit fewer: about 2x the error of
    their E4M3 input), MXFP8 and block scaling keep E4M3 gradients."""
    captured = _captured_gpt()
    per_recipe = {}
    for kind, recipe in DEMO_RECIPES.items():
        scales = None
        if kind == "delayed":  # an untrained module: scales 1, as delayed scaling's first step uses
            scales = DelayedScales(torch.ones(3), torch.ones(3))
        per_recipe[kind] = mean_errors([{"rel_error": {n: quantization_errors(recipe, c, scales)
                                                       for n, c in captured.items()}}])  # fmt: skip
    for role in ROLES:
        assert all(math.isfinite(per_recipe[k][role]) for k in per_recipe)
        assert per_recipe["nvfp4"][role] > 2 * per_recipe["mxfp8"][role] > 0
    for kind in ("current", "delayed"):
        assert per_recipe[kind]["grad_output"] > 1.5 * per_recipe[kind]["input"]
    for kind in ("mxfp8", "block"):
        assert per_recipe[kind]["grad_output"] < 1.5 * per_recipe[kind]["input"]


def test_block_sizes_show_on_tensors_with_outliers() -> None:
    """One value per row 2**18 above the rest: under power-of-2 block scales the ordinary values of a
    block holding it fall into FP8's subnormals, so the error on them follows the block size: a 1x128
    tile (block scaling) damages 128 values, a 1x32 block (MXFP8) 32 (measured here 0.41 vs 0.20)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    x[::2, 7] = 2.0**18
    x[1::2, 100] = -(2.0**18)
    ordinary = x.abs() < 100
    rel = {}
    for kind in ("block", "mxfp8"):
        q = _dequantized_input(DEMO_RECIPES[kind], x)
        rel[kind] = float((q - x)[ordinary].norm() / x[ordinary].norm())
    assert rel["block"] > 1.5 * rel["mxfp8"] > 0, rel


def _dequantized_input(recipe, x: torch.Tensor) -> torch.Tensor:
    from fp8train.quantization import quantization_of
    from fp8train.runtime import Call

    q = quantization_of(recipe)
    return q.quantize_input(x, Call.outside_module(q)).forward.dequantize()


def test_delayed_scaling_is_measured_with_the_scales_its_step_used(tmp_path) -> None:
    """The scales read before a step are those the telemetry records as used by that step, and the
    error is that of a cast with them."""
    torch.manual_seed(0)
    model = GPT(CFG)
    recipe = DEMO_RECIPES["delayed"]
    tap = TensorTap(model, sample_gemms(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    read, records = [], []
    with Telemetry(model, str(tmp_path)) as tel:
        for step in range(4):
            read.append({n: DelayedScales.read(m) for n, m in tap.modules.items()})
            tap.arm()
            _step(model, _tokens(step), recipe)
            opt.step()
            opt.zero_grad()
            captured = tap.disarm()
            rec = tel.log_step(step)
            records += [rec] if rec else []
        records.append(tel.flush())
    for step in (1, 2, 3):  # step 0 used the initial scales (1)
        for name, scales in read[step].items():
            used = [records[step]["roles"][f"{name}/{role}"]["scale_used"] for role in ROLES]
            assert scales.scale.tolist() == pytest.approx(used, rel=0, abs=0)
            assert not torch.equal(scales.scale, read[0][name].scale)
    name = tap.names[1]
    c, s = captured[name], read[3][name]
    err = quantization_errors(recipe, c, s)
    from fp8train.numerics.cast import cast_operand

    cast = cast_operand(c.input, s.scale[0], "e4m3", torch.float32) * s.scale_inv[0]
    assert err["input"] == pytest.approx(float((cast - c.input).norm() / c.input.norm()), rel=1e-6)
    with pytest.raises(ValueError, match="DelayedScales"):
        quantization_errors(recipe, c)


def test_measuring_does_not_change_training() -> None:
    """NVFP4 rounds gradients stochastically from the global generator: measuring every step draws
    from a forked one, so the losses are bitwise those of an unmeasured run (and the draw would move
    the generator: the control)."""

    def losses(measure: bool) -> list[float]:
        torch.manual_seed(0)
        model = GPT(CFG)
        tap = TensorTap(model, sample_gemms(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(3):
            tap.arm() if measure else None
            out.append(_step(model, _tokens(step), DEMO_RECIPES["nvfp4"]).item())
            opt.step()
            opt.zero_grad()
            if measure:
                for c in tap.disarm().values():
                    quantization_errors(DEMO_RECIPES["nvfp4"], c)
        return out

    assert losses(True) == losses(False)
    captured = next(iter(_captured_gpt().values()))
    from fp8train.quantization import quantization_of
    from fp8train.runtime import Call

    state = torch.get_rng_state()
    q = quantization_of(DEMO_RECIPES["nvfp4"])
    q.quantize_grad(captured.grad_output, Call.outside_module(q), (True, False))
    assert not torch.equal(state, torch.get_rng_state())


def test_interleaved_times_alternate_blocks_and_rotate_the_order() -> None:
    calls: list[str] = []
    ticks = iter(range(1000))
    fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    times = interleaved_times(fns, rounds=3, block=2, warmup_blocks=1, clock=lambda: float(next(ticks)))
    warm = ["a", "a", "b", "b", "c", "c"]
    rounds = ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert calls == warm + rounds
    assert {n: len(v) for n, v in times.items()} == {"a": 6, "b": 6, "c": 6}
    assert all(t == 1.0 for v in times.values() for t in v)  # one tick per timed call: no warm-up


def test_a_steps_time_is_its_slowest_ranks_and_quartiles_bracket_the_median() -> None:
    ranks = [{"a": [1.0, 5.0, 2.0], "b": [3.0]}, {"a": [2.0, 1.0, 2.5], "b": [4.0]}]
    assert slowest_rank(ranks) == {"a": [2.0, 5.0, 2.5], "b": [4.0]}
    assert quartiles([4.0]) == (4.0, 4.0, 4.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def test_the_telemetry_overhead_measurement_runs_its_steps_in_interleaved_blocks() -> None:
    from fp8train.tools.demo_worker import measure_telemetry_overhead

    r = measure_telemetry_overhead("tiny", steps=12, block=2)
    assert r["steps"] == 12  # one warm-up block of each, then 2 rounds of a block of each
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("median_step_ms_off", "median_step_ms_on"))
    assert r["median_log_step_ms"] > 0


def test_the_demo_offers_every_recipe_of_the_worker() -> None:
    assert set(demo.RECIPES) == set(DEMO_RECIPES) == {"delayed", "current", "block", "mxfp8", "nvfp4"}
    assert isinstance(DEMO_RECIPES["mxfp8"], fp8train.MXFP8BlockScaling)
    assert isinstance(DEMO_RECIPES["nvfp4"], fp8train.NVFP4BlockScaling)
