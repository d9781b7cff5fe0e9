"""The benchmarks behind `fp8train bench` run in tiny configurations and report sane figures."""

from __future__ import annotations

import json

import pytest

from fp8train.tools.bench import main


def _rows(tmp_path, suite: str) -> list[dict]:
    assert main([suite, "--quick", "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / f"{suite}.json").read_text())["rows"]


def test_fused_update_op_count_is_flat_while_per_module_grows(tmp_path) -> None:
    rows = _rows(tmp_path, "fused")
    assert [r["modules"] for r in rows] == [4, 16]
    assert [r["roles"] for r in rows] == [12, 48]  # each run has its own group of exactly n modules
    assert rows[0]["fused_ops"] == rows[1]["fused_ops"]
    assert rows[1]["per_module_ops"] == 4 * rows[0]["per_module_ops"]


def test_step_time_runs_each_configuration_in_its_own_precision(tmp_path) -> None:
    """The output errors against float64 show which precision each timed configuration ran in:
    an FP8 row that silently ran in bf16 (or a bf16 row in fp32) fails here."""
    rows = {r["config"]: r for r in _rows(tmp_path, "step")}
    recipes = ["fp8 fp8train", "fp8 fp8train, current scaling", "fp8 fp8train, block scaling"]
    assert {"fp32 torch.nn", "bf16 torch.nn", *recipes} <= set(rows)
    error = {name: r["output_rel_error"] for name, r in rows.items()}
    assert error["fp32 torch.nn"] < 1e-5 < error["bf16 torch.nn"] < 1e-2
    for name in recipes:  # FP8 operands (3 mantissa bits): a few percent, well above bf16
        assert 2 * error["bf16 torch.nn"] < error[name] < 0.1, (name, error)
    # the timed steps repeat one input and do not update weights, so delayed scaling's scales (from
    # earlier steps' amaxes) equal current scaling's (from this step's): the same output; tiles differ
    assert (
        error["fp8 fp8train"]
        == error["fp8 fp8train, current scaling"]
        != error["fp8 fp8train, block scaling"]
    )
    for r in rows.values():  # ratios side by side, against the same bf16 and FP8 eager medians
        assert r["vs_bf16"] == pytest.approx(r["ms"] / rows["bf16 torch.nn"]["ms"])
        assert r["vs_fp32"] == pytest.approx(r["ms"] / rows["fp32 torch.nn"]["ms"])
        assert r["vs_fp8_eager"] == pytest.approx(r["ms"] / rows["fp8 fp8train"]["ms"])


def test_gpu_mode_runs_on_cpu_in_a_tiny_configuration(tmp_path) -> None:
    (row,) = _rows(tmp_path, "gpu")
    assert row["n"] == 32 and row["path"] == "bf16"
    assert 1e-3 < row["fp8_rel_error"] < 0.1  # FP8 operands, not bf16 or fp32 ones
    assert row["speedup"] == pytest.approx(row["bf16_ms"] / row["fp8_ms"])


@pytest.mark.multirank
def test_reduction_benchmark_counts_collectives_and_exposes_blocking_latency(tmp_path) -> None:
    rows = _rows(tmp_path, "reduction")
    by = {(r["latency_ms"], r["mode"]): r for r in rows}
    assert by[(0.0, "none")]["collectives_per_step"] == 0
    assert by[(5.0, "async")]["collectives_per_step"] == 2
    assert by[(5.0, "blocking")]["collectives_per_step"] == 2
    # blocking waits out the whole injected latency of both collectives, every step
    assert by[(5.0, "blocking")]["exposed_ms_per_step"] >= 2 * 5.0 * 0.99


@pytest.mark.multirank
def test_fsdp_benchmark_counts_fp8_gather_bytes_and_amax_collectives(tmp_path) -> None:
    by = {(r["params"], r["fp8_all_gather"]): r for r in _rows(tmp_path, "fsdp")}
    for params, ceiling in (("fp32", 0.30), ("bf16", 0.55)):
        off, on = by[(params, False)], by[(params, True)]
        assert on["gathers_per_step"] == off["gathers_per_step"] == 4  # forward and backward, 2 units
        # the tiny units are half norm and bias parameters, which travel in the parameter dtype
        assert on["max_gather_ratio"] <= ceiling + 0.02 and on["vs_option_off"] < 1
        assert on["amax_collectives_per_step"] == off["amax_collectives_per_step"] == 2
