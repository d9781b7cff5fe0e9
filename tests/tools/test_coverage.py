"""Is FP8 on? `fp8train.coverage`, the step counters (layer_coverage.StepCoverage), `info --model`,
and the bisecting switches (debug_switches.py)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn.functional as F

import fp8train
from fp8train.debug_switches import SWITCHES, parse_rules
from fp8train.layer_coverage import StepCoverage
from multirank import run_ranks


def build_model() -> torch.nn.Module:
    """Layers: 0 FP8, 1 and 2 off 16 (shape), 3 kept by the filter, 4 FP8 and frozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),  # 0
        torch.nn.Linear(64, 20),  # 1: 20 is not a multiple of 16
        torch.nn.Linear(20, 32),  # 2: neither is its input
        torch.nn.Linear(32, 48),  # 3: the filter keeps it
        torch.nn.Linear(48, 32),  # 4: frozen
    )
    model[4].weight.requires_grad_(False)
    return model


def _keep_3(module, fqn: str) -> bool:
    return fqn != "3"


def test_coverage_names_each_layer_and_why() -> None:
    model = fp8train.prepare(build_model(), module_filter_fn=_keep_3)
    report = fp8train.coverage(model)
    by_name = {layer.name: layer for layer in report.layers}
    assert {n: (x.fp8, x.reason, x.frozen) for n, x in by_name.items()} == {
        "0": (True, "fp8", False),
        "1": (False, "shape", False),
        "2": (False, "shape", False),
        "3": (False, "filter", False),
        "4": (True, "fp8", True),
    }
    assert report.counts() == {"fp8": 2, "shape": 2, "filter": 1, "frozen": 1}
    flops = {"0": 32 * 64, "1": 64 * 20, "2": 20 * 32, "3": 32 * 48, "4": 48 * 32}
    assert report.fp8_share == (flops["0"] + flops["4"]) / sum(flops.values())
    assert by_name["0"].path == fp8train.numerics.gemm.choose_path(torch.device("cpu"), 16, 32, 64)


def test_block_recipes_mark_padded_and_off_block_layers() -> None:
    """Block scaling pads to its 128 blocks; MXFP8 refuses dimensions that are not whole 32-blocks."""
    model = fp8train.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 48)))
    block = fp8train.coverage(model, fp8train.Float8BlockScaling())
    assert [(x.fp8, x.padded, x.path) for x in block.layers] == [
        (True, True, "block_dequantized"),  # the CPU's emulation: no block kernel here
        (True, True, "block_dequantized"),
    ]
    mx = fp8train.coverage(model, fp8train.MXFP8BlockScaling())
    assert [(x.fp8, x.reason) for x in mx.layers] == [(True, "fp8"), (False, "off block")]


def test_the_path_is_the_kernel_gemm_chooses(monkeypatch) -> None:
    """A device whose MXFP8 kernel runs (gemm.kernel_choice says so) shows it as the path."""
    model = fp8train.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 64)), log=False)
    # a device with an MXFP8 kernel, simulated on the CPU: the device decides it, no setting may
    monkeypatch.setattr(
        fp8train.numerics.gemm, "kernel_choice", lambda kernel, device: (kernel == "mxfp8", "stand-in")
    )
    assert [x.path for x in fp8train.coverage(model, fp8train.MXFP8BlockScaling()).layers] == [
        "scaled_mm:mxfp8"
    ]
    assert [x.path for x in fp8train.coverage(model, fp8train.NVFP4BlockScaling()).layers] == [
        "block_dequantized"
    ]


def test_convert_logs_the_summary_once_and_warns_when_nothing_is_fp8(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="fp8train"):
        fp8train.prepare(build_model(), module_filter_fn=_keep_3)
    lines = [r.getMessage() for r in caplog.records if r.name == "fp8train"]
    assert len(lines) == 1 and lines[0].startswith("fp8train: 2/5 linear GEMMs in FP8"), lines
    with pytest.warns(UserWarning, match="nothing trains in FP8"):
        fp8train.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(20, 30)))


def test_step_counts_flops_gemms_and_the_high_precision_layers() -> None:
    """Exact counts from the shapes: 8 tokens; layer 0's input needs no gradient (no dgrad GEMM),
    layer 4 is frozen (no wgrad GEMM)."""
    model = fp8train.prepare(build_model(), module_filter_fn=_keep_3)
    counter = StepCoverage(model)
    model(torch.randn(8, 32)).sum().backward()
    step = counter.take()
    hp = [(64, 20, 3), (20, 32, 3), (32, 48, 3)]  # (in, out, GEMMs): forward, dgrad, wgrad
    fp8 = [(32, 64, 2), (48, 32, 2)]
    assert step["flops"] == {
        "fp8": sum(2 * 8 * k * n * g for k, n, g in fp8),
        "high_precision": sum(2 * 8 * k * n * g for k, n, g in hp),
    }
    path = fp8train.numerics.gemm.choose_path(torch.device("cpu"), 8, 32, 64)
    assert step["gemms"] == {path: 4, "high_precision": 9}
    assert step["high_precision_layers"] == [] and step["gathered_bytes"] == {"fp8": 0, "high_precision": 0}
    with torch.no_grad():  # an FP8 module called outside its region runs in high precision
        model.forward.__wrapped__(torch.randn(8, 32))
    step = counter.take()
    assert step["fp8_flop_share"] == 0 and step["high_precision_layers"] == ["0", "4"]
    assert step["gemms"] == {"high_precision": 5}


def test_info_prints_the_coverage_of_a_named_model(capsys) -> None:
    from fp8train.tools.cli import main

    assert main(["info", "--model", "test_coverage:build_model"]) == 0
    out = capsys.readouterr().out
    assert "2 shape" in out and "3/5 linear GEMMs in FP8" in out  # as convert_to_fp8 converts it
    with pytest.raises(SystemExit):
        main(["info", "--model", "test_coverage:no_such_builder"])
    assert "has no attribute 'no_such_builder'" in capsys.readouterr().err


# ---- the switches ---------------------------------------------------------------------------------------
def test_rules_parse_and_bad_rules_say_what_to_write() -> None:
    assert [(r.pattern, r.start, r.stop) for r in parse_rules("blocks.3.*:100-200, head, a:5-")] == [
        ("blocks.3.*", 100, 200), ("head", 0, None), ("a", 5, None),
    ]  # fmt: skip
    for bad in ("x:200-100", "x:a-b", "x:7", ":1-2"):
        with pytest.raises(ValueError, match="PATTERN"):
            parse_rules(bad)


def _switch_step() -> int:
    """The step as the switches count it: the most any live optimizer has taken (0 once the earlier
    tests' optimizers are collected)."""
    gc.collect()
    return SWITCHES.step


def _switch_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))


def test_switch_runs_exactly_the_named_layers_in_high_precision_for_the_step_range(
    monkeypatch, tmp_path
) -> None:
    """Layer "1" in high precision at steps 1 and 2 (exactly F.linear of its input), FP8 at 0 and 3;
    layers "0" and "2" in FP8 throughout; telemetry records the switched layer per step."""
    start = _switch_step()
    monkeypatch.setenv("FP8TRAIN_HIGH_PRECISION", f"1:{start + 1}-{start + 3}")
    model = fp8train.prepare(_switch_model(), fp8train.Float8CurrentScaling())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls = []
    for layer in model:
        layer.register_forward_hook(lambda m, args, y: calls.append((m, args[0].detach(), y.detach())))
    with fp8train.telemetry.Telemetry(model, run_dir=str(tmp_path)) as tel:
        for step in range(4):
            calls.clear()
            assert SWITCHES.step == start + step
            model(torch.randn(16, 32)).sum().backward()
            exact = [torch.equal(y, F.linear(x, m.weight, m.bias)) for m, x, y in calls]
            assert exact == [False, step in (1, 2), False], (step, exact)
            opt.step()
            opt.zero_grad()
            tel.log_step(step)
    records = fp8train.telemetry.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["coverage"]["high_precision_layers"] for r in records] == [[], ["1"], ["1"], []]
    assert [r["coverage"]["amax_collectives"] for r in records] == [0] * 4  # current scaling: none
    hp_flops = 3 * 2 * 16 * 32 * 32  # layer 1's forward, dgrad and wgrad
    assert [r["coverage"]["flops"]["high_precision"] for r in records] == [0, hp_flops, hp_flops, 0]


def test_high_precision_rules_from_a_config_must_match_a_layer() -> None:
    model = fp8train.prepare(_switch_model())
    assert fp8train.debug_switches.high_precision(model, "[02]") == ["0", "2"]
    assert [x.reason for x in fp8train.coverage(model).layers] == ["switched", "fp8", "switched"]
    with pytest.raises(ValueError, match="match no FP8 layer"):
        fp8train.debug_switches.high_precision(model, "blocks.*")


@pytest.mark.parametrize("how", ["prepare", "convert_to_fp8", "apply_environment"])
def test_high_precision_rules_from_the_environment_must_match_a_layer(monkeypatch, how) -> None:
    """The same rule as from a config: a pattern of FP8TRAIN_HIGH_PRECISION that matches no FP8 layer
    (a typo in a bisection) raises, naming the pattern and the variable; the rules that match are
    applied as before."""
    monkeypatch.setenv("FP8TRAIN_HIGH_PRECISION", "1,blokcs.3.*:10-20")
    with pytest.raises(ValueError, match=r"FP8TRAIN_HIGH_PRECISION.*\['blokcs.3.\*'\] match no FP8 layer"):
        if how == "prepare":
            fp8train.prepare(_switch_model())
        elif how == "convert_to_fp8":
            fp8train.convert_to_fp8(_switch_model(), log=False)
        else:
            model = torch.nn.Sequential(*(fp8train.Linear(32, 32) for _ in range(3)))
            fp8train.debug_switches.apply_environment(model)
    monkeypatch.setenv("FP8TRAIN_HIGH_PRECISION", "1")
    model = fp8train.convert_to_fp8(_switch_model(), log=False)
    assert [x.reason for x in fp8train.coverage(model).layers] == ["fp8", "switched", "fp8"]


def test_a_pipeline_stage_warns_for_an_environment_rule_its_layers_do_not_match(monkeypatch) -> None:
    """A pipeline stage converts only its own layers (prepare_stage), so an environment pattern may
    name layers of another stage: there it is a warning naming the pattern, not an error."""
    from types import SimpleNamespace

    import fp8train.pipeline

    monkeypatch.setenv("FP8TRAIN_HIGH_PRECISION", "1,blocks.7.*")
    # the stage's group check needs a pipeline's ranks (tests/parallel/test_pipeline.py); here the warning
    monkeypatch.setattr(fp8train.pipeline, "check_stage", lambda stage, group=None: None)
    stage = SimpleNamespace(submod=_switch_model(), stage_index=0)
    with pytest.warns(UserWarning, match=r"FP8TRAIN_HIGH_PRECISION.*\['blocks.7.\*'\].*pipeline stage"):
        fp8train.pipeline.prepare_stage(stage)
    assert [x.reason for x in fp8train.coverage(stage.submod).layers] == ["fp8", "switched", "fp8"]


def test_a_rule_names_the_fp8_layer_not_a_wrapper_that_forwards_its_attributes() -> None:
    """checkpoint_wrapper forwards unknown attributes to the layer it wraps: the rule must name the
    inner FP8 layer (which the switch then really holds), never match the wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = fp8train.prepare(_switch_model())
    model[0] = checkpoint_wrapper(model[0])
    assert model[0].fp8_handle is model[0]._checkpoint_wrapped_module.fp8_handle  # forwarded
    with pytest.raises(ValueError, match="match no FP8 layer"):
        fp8train.debug_switches.high_precision(model, "0")
    assert fp8train.debug_switches.high_precision(model, "0*") == ["0._checkpoint_wrapped_module"]


def test_a_switched_layer_is_recomputed_in_high_precision_too() -> None:
    """Under activation recomputation (fp8train.checkpoint and torch's non-reentrant checkpoint) the
    switched layer runs in high precision in the forward and in its recomputation, the others in FP8:
    bitwise the gradients of the model whose layer 1 was never converted."""
    grads = {}
    for how in ("filtered", "plain", "fp8train", "torch"):
        if how == "filtered":  # the reference: layer 1 never converted
            model = fp8train.convert_to_fp8(_switch_model(), lambda m, fqn: fqn != "1", log=False)
        else:
            model = fp8train.convert_to_fp8(_switch_model(), log=False)
            fp8train.debug_switches.high_precision(model, "1")
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling()):
            if how in ("filtered", "plain"):
                y = model(x)
            elif how == "fp8train":
                y = fp8train.checkpoint(model, x)
            else:
                y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        y.square().mean().backward()
        grads[how] = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    for how in ("plain", "fp8train", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(grads["filtered"], grads[how])), how


# ---- FSDP2 -----------------------------------------------------------------------------------------------
def _fsdp_rank(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for option in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 20))
        model = fp8train.convert_to_fp8(model, fsdp_fp8_all_gather=option, log=False)
        fp8train.reset_reduction_stats()  # before the telemetry takes its baseline
        tel = fp8train.telemetry.Telemetry(model)  # its StepCoverage hooks: before fully_shard's
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling()):
            y = model(torch.randn(8, 32))
        y.float().pow(2).mean().backward()
        tel.log_step(0)
        out[option] = tel.flush()["coverage"]
    return out


@pytest.mark.multirank
def test_fsdp2_gathered_bytes_in_fp8_and_in_high_precision() -> None:
    """Layer 0 (32 -> 48) converts, layer 2 (48 -> 20) is off 16. Forward gathers: with the option,
    layer 0's weight in FP8 (1 byte a value); without it, in fp32; layer 2 in fp32 either way. The
    telemetry record counts the step's amax all-reduces."""
    for rank_result in run_ranks(_fsdp_rank, 2, timeout_s=240):
        off, on = rank_result[False], rank_result[True]
        assert off["gathered_bytes"] == {"fp8": 0, "high_precision": (48 * 32 + 20 * 48) * 4}
        assert on["gathered_bytes"] == {"fp8": 48 * 32, "high_precision": 20 * 48 * 4}
        assert on["flops"] == off["flops"] and on["flops"]["fp8"] == 2 * 8 * 32 * 48 * 2
        assert on["amax_collectives"] == off["amax_collectives"] == 2  # forward and backward reductions


# ---- tensor statistics -----------------------------------------------------------------------------------
def test_statistics_match_naive_references_on_crafted_tensors() -> None:
    """Kurtosis: +-1 values give exactly 1, a two-point 0/1 mix with p = 1/4 gives
    (1 - 3p(1-p)) / (p(1-p)) = 7/3. Underflow: per-tensor current scaling scales amax 448 to 448 (scale
    1): 2^-12 quantizes to 0 (below half of E4M3's smallest subnormal 2^-9), 2^-8 to a subnormal."""
    from fp8train.runtime import Call
    from fp8train.tensor_stats import GemmStatistics, kurtosis, underflow_shares

    assert kurtosis(torch.tensor([1.0, -1.0] * 8)).item() == 1.0
    two_point = torch.tensor([1.0] + [0.0] * 3)
    assert abs(kurtosis(two_point).item() - 7 / 3) < 1e-6
    x = torch.tensor([[448.0, 2.0**-12, 2.0**-12, 2.0**-8, 2.0**-8, 2.0**-8, 1.0, 0.0]] * 2)
    q = fp8train.quantization.quantization_of(fp8train.Float8CurrentScaling())
    operand = q.quantize_input(x, Call.outside_module(q)).forward
    zero, subnormal = underflow_shares(x, operand, 2.0**-6).tolist()
    assert (zero, subnormal) == (2 / 8, 3 / 8)

    model = fp8train.prepare(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp8train.MXFP8BlockScaling())
    stats = GemmStatistics(model, what_if=fp8train.Float8CurrentScaling())
    tel = fp8train.telemetry.Telemetry(model, statistics=stats)
    x = torch.randn(32, 32)  # MXFP8: tokens in whole 32-blocks
    x[:, 0] = 0.0  # one zero column: none of it is an underflow
    x[0, 1] = 1e-30  # flushed to zero by its block's scale
    model(x).sum().backward()
    tel.log_step(0)
    record = tel.flush()["statistics"]["0/input"]
    assert record["zero_share"] == 1 / x.numel()
    assert abs(record["kurtosis"] - kurtosis(x).item()) <= 1e-6 * kurtosis(x).item()
    assert record["what_if_rel_error"] > 0 and record["rel_error"] > 0


def test_report_shows_coverage_the_stretch_a_layer_was_switched_and_the_statistics(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from fp8train.tensor_stats import GemmStatistics
    from fp8train.tools.report import render

    start = _switch_step()
    model = fp8train.prepare(_switch_model(), fp8train.Float8CurrentScaling())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fp8train.debug_switches.high_precision(model, f"1:{start + 2}-{start + 4}")  # as a config does
    tel = fp8train.telemetry.Telemetry(
        model, run_dir=str(tmp_path), statistics=GemmStatistics(model, every=2)
    )
    tel.write_coverage()
    for step in range(6):
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        tel.log_step(step, loss=loss.detach())  # the report plots the loss
    tel.close()
    records = fp8train.telemetry.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records if r.get("statistics")] == [0, 2, 4]  # one step in 2
    text = open(render(str(tmp_path))["markdown"]).read()
    assert "Linear GEMMs in FP8: 3/3 (100.0% of linear FLOPs, recipe current)" in text
    share = 100 * 5 / 8  # GEMMs of 32x32 each: layer 0 runs 2 (its input needs no gradient), 1 and 2 run 3
    assert f"**FP8 share {share:.1f}% at steps 2-3** (FP8 layers in high precision: `1`)" in text
    assert text.count("**FP8 share") == 1  # back to 100% after the range
    assert "| `0/input` |" in text and "kurtosis" in text


def test_statistics_of_a_layernorm_linear_are_of_its_gemm_input_the_norm_output() -> None:
    """The same relative error as tools/quant_error.py (the SNR panel) measures on the same tensors."""
    from fp8train.tensor_stats import GemmStatistics
    from fp8train.tools.quant_error import DelayedScales, TensorTap, quantization_errors

    torch.manual_seed(0)
    model = fp8train.LayerNormLinear(32, 32)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    stats, tap = GemmStatistics(model), TensorTap(model, [""])
    tel = fp8train.telemetry.Telemetry(model, statistics=stats)
    for step in range(3):
        scales = DelayedScales.read(model)
        tap.arm()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = model(5 * torch.randn(16, 32) + 3)  # far from what the norm gives
        y.sum().backward()
        tel.log_step(step)
    reference = quantization_errors(recipe, tap.disarm()[""], scales)
    measured = tel.flush()["statistics"]["model/input"]
    assert abs(measured["rel_error"] - reference["input"]) <= 1e-6 * reference["input"]


def test_a_gemm_input_with_outliers_warns_once() -> None:
    """One feature column in 32 at 100x the scale of the others: kurtosis about 3 x 32 = 96 (Gaussian
    columns: E[x^4] ~ 3 * 100^4 / 32, var ~ 100^2 / 32), above the threshold; warned once."""
    from fp8train.tensor_stats import KURTOSIS_WARNING, GemmStatistics

    model = fp8train.prepare(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp8train.Float8CurrentScaling())
    tel = fp8train.telemetry.Telemetry(model, statistics=GemmStatistics(model))
    x = torch.randn(64, 32)
    x[:, 3] *= 100
    with pytest.warns(UserWarning, match="kurtosis of 0/input") as caught:
        for step in range(3):
            model(x).sum().backward()
            tel.log_step(step)
        record = tel.flush()
    assert record["statistics"]["0/input"]["kurtosis"] > KURTOSIS_WARNING
    assert sum("kurtosis" in str(w.message) for w in caught) == 1


def test_block_scale_spread_and_range_against_a_naive_reference() -> None:
    """Block scaling's 1x128 input tiles: a row of all 1s and a row of all 2^-8 (with one 2^-12):
    scale_inv spread log2(1 / 2^-8) = 8 (power-of-2 scales), widest block 2^-8 / 2^-12: 4."""
    from fp8train.runtime import Call
    from fp8train.tensor_stats import block_scale_stats

    x = torch.ones(2, 128)
    x[1] = 2.0**-8
    x[1, 5] = 2.0**-12
    q = fp8train.quantization.quantization_of(fp8train.Float8BlockScaling())
    operand = q.quantize_input(x, Call.outside_module(q)).forward
    inv = operand.scale_inv.flatten()
    assert torch.log2(inv.max() / inv.min()).item() == 8.0  # the naive reference of the spread
    assert block_scale_stats(x, operand).tolist() == [8.0, 4.0]
