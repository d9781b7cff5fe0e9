"""The GPU check (scripts/gpu_check.sh), dry-run on the CPU: every section runs and writes its result,
and the checks that the CPU can make hold.

The dry run is one run of the script (`--device cpu --quick`, FP8TRAIN_FUSED_CAST=0: the cast path a GPU
runs), read by the tests below. On the CPU the
CUDA-only parts are forced where they can be (the reduction's CUDA timing with stand-in events, the
block recipes' "emulated on CUDA" warning) and the host synchronisations are seen as what causes
them: host reads, tensors made from host data and host-to-device copies made by fp8train's code in
steady steps. So the dry run fails on those defects before a GPU ever runs the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = str(REPO)
SECTIONS = (
    "env",
    "contract",
    "syncs",
    "te_table",
    "compile",
    "recipes",
    "kernels",
    "grouped",
    "emulation",
    "overlap",
    "idle",
    "train",
)  # the script's order


def _run(out_dir, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_") and k != "OUT"}
    # a shared CPU runs the dry run many times slower than a GPU runs the check: limits 10x
    environ.update(
        {"PYTHON": sys.executable, "GPU_RESULTS": str(out_dir), "GPU_CHECK_LIMIT_FACTOR": "10", **env}
    )
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out_dir = tmp_path_factory.mktemp("gpu-results")
    # FP8TRAIN_FUSED_CAST=0: the casts run as on a GPU, where fp8train's compiled CPU cast never applies
    # (CPU tensors only); with it on, each section's process compiled it afresh: 3.5x the time of the
    # recipes section (ABAB on this shared 2-core machine: 26.6 and 23.2 s on, 7.6 and 6.4 s off)
    done = _run(out_dir, "--device", "cpu", "--quick", FP8TRAIN_FUSED_CAST="0")
    path = out_dir / "gpu-check.json"
    sections = json.loads(path.read_text())["sections"] if path.exists() else {}
    return done, sections


def _log(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_every_section_runs_on_the_cpu_and_writes_its_result(dry_run) -> None:
    done, sections = dry_run
    assert set(sections) == set(SECTIONS), _log(done)
    for name, result in sections.items():
        assert result["status"] == "done" and result["section"] == name and result["device"] == "cpu", result
        assert f"{name}: " in done.stdout  # its figure line
        assert "error" not in result, result["error"]
    assert "timed out" not in done.stdout


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_the_whole_dry_run_passes(dry_run) -> None:
    done, sections = dry_run
    failed = {name: r.get("figure") for name, r in sections.items() if not r["ok"]}
    assert done.returncode == 0 and not failed, failed


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_gemm_contract_three_layouts_and_three_calls_per_layer(dry_run) -> None:
    contract = dry_run[1]["contract"]
    assert {r["layout"] for r in contract["rows"]} == {"fprop", "dgrad", "wgrad"}
    assert all(r["ok"] for r in contract["rows"]), contract["rows"]
    calls = contract["scaled_mm_calls_per_layer"]
    assert all(c["calls"] == c["expected"] for c in calls.values()), calls


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_steady_steps_make_no_host_read_host_tensor_or_host_copy(dry_run) -> None:
    """Every recipe, both reduction modes, with and without telemetry: no site at all (a Python number
    written into a device tensor, a tensor built from Python data, a host read) in steady steps."""
    syncs = dry_run[1]["syncs"]
    assert syncs["detector_sees_state_dict_reads"] > 0  # the detector can fail: a host point reads
    sites = syncs["sites"]
    assert len(sites) == 2 * 2 + 4  # delayed: 2 modes x telemetry on and off; the 4 other recipes
    found = {config: sorted(s) for config, s in sites.items() if s}
    assert not found, json.dumps(found, indent=1)


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_reduction_timing_stays_bounded_and_reading_counters_waits_for_nothing(dry_run) -> None:
    """The CUDA branch of the reduction's timing (forced on the CPU, with events that complete a few
    events later): the events held must not grow with steps when no telemetry reads them, and
    `reduction_stats(complete=False)` must not wait on any."""
    timing = dry_run[1]["syncs"]["timing"]
    assert timing["events"] != "real CUDA events" and not timing["events"].startswith("not available")
    assert timing["forcing_took_effect"], timing
    assert timing["growth_per_10_steps"] < 10, timing  # fewer than one event kept per step
    assert timing["waits_in_reduction_stats_complete_false"] == 0, timing


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_blocks_compiled_one_by_one_compile_independently_of_their_number(dry_run) -> None:
    blocks = dry_run[1]["compile"]["blocks"]
    graphs = blocks["graphs_by_blocks"]
    assert graphs["12"] <= graphs["4"], graphs


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_block_recipes_emulation_warning_does_not_break_fullgraph(dry_run) -> None:
    warning = dry_run[1]["compile"]["emulation_warning"]
    assert warning["forced"].startswith("warn_emulated_on_cuda in") or warning["forced"].startswith(
        "not available"
    )
    failed = {name: r for name, r in warning["recipes"].items() if not r["ok"]}
    assert not failed, failed


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_fullgraph_compile_is_one_graph_and_close_to_eager(dry_run) -> None:
    fullgraph = dry_run[1]["compile"]["fullgraph"]
    assert fullgraph["graphs"] == 1 and fullgraph["distance_over_fp8_error"] <= 0.25, fullgraph


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_emulation_compares_gradients_and_agrees(dry_run) -> None:
    """The gradients are compared (not zero after the steps), the first layer
    with identical FP8 operands within 1e-4, the rest against FP8's own error."""
    emulation = dry_run[1]["emulation"]
    assert isinstance(emulation["grad_rel_err"], float) and min(emulation["grad_norms"]) > 0, emulation
    assert emulation["first_layer_scales_equal"] and emulation["first_layer_rel_err"] < 1e-4, emulation
    assert emulation["ok"], emulation


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_every_recipe_runs_one_step(dry_run) -> None:
    rows = dry_run[1]["recipes"]["rows"]
    assert [r["recipe"] for r in rows] == ["delayed", "current", "block", "mxfp8", "nvfp4"]
    assert all(r["ok"] for r in rows), rows


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_te_table_has_te_shapes_and_figures(dry_run) -> None:
    table = dry_run[1]["te_table"]
    assert len(table["rows"]) == 13  # 12 GEMMs and the layer's total
    total = table["rows"][-1]
    assert total["fp8train_delayed_te_h200"] == 1.69 and total["scaled_mm_fast_accum_on_te_h200"] == 1.92
    assert total["bf16_ms"] == pytest.approx(sum(r["bf16_ms"] for r in table["rows"][:-1]))


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_overlap_launches_two_reductions_per_step(dry_run) -> None:
    rows = dry_run[1]["overlap"]["rows"]
    assert {(r["latency_ms"], r["mode"]) for r in rows} == {
        (0.0, "async"),
        (0.0, "blocking"),
        (2.0, "async"),
        (2.0, "blocking"),
    }
    assert all(r["launched_per_step"] == 2 for r in rows), rows


@pytest.mark.slow  # the dry run of every section (the module's fixture)
def test_kernels_section_checks_compiled_transposed_casts_and_says_why_fused_is_skipped(dry_run) -> None:
    """The CPU dry run: compiled casts (values and transposed FP8 copies) equal eager ones, every path
    is timed, and the Triton kernels are skipped with the reason (not interpreted here)."""
    section = dry_run[1]["kernels"]
    rows = {row["cast"]: row for row in section["rows"]}
    assert set(rows) == {"delayed", "current", "tiles_1x128", "blocks_128x128"}
    assert rows["delayed"]["compiled_equals_eager"] and rows["tiles_1x128"]["compiled_equals_eager"], rows
    assert all(row["torch_gb_s"] > 0 for row in rows.values())
    assert str(section["fused"]).startswith("skipped: Triton kernels run on CUDA devices"), section["fused"]


@pytest.mark.slow
def test_kernels_section_runs_the_fused_kernels_interpreted_and_they_equal_the_torch_path(tmp_path) -> None:
    """With TRITON_INTERPRET=1 the section runs the Triton kernels on the CPU: each equals the torch path
    bit for bit (values, transposed copies, scales, amax), as on a GPU."""
    pytest.importorskip("triton", reason="triton is not installed: no fused kernels to run")
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_RESULTS")}
    environ.update(TRITON_INTERPRET="1", PYTHONPATH=os.path.join(ROOT, "src"))
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "kernels",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    section = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]["kernels"]
    assert done.returncode == 0 and section["fused"] is True, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(row["fused_equals_torch"] and "fused_gb_s" in row for row in section["rows"]), section["rows"]


def test_grouped_section_times_every_variant_and_says_why_the_kernel_is_off(dry_run) -> None:
    """On the CPU the grouped kernel is not chosen (torch has no CPU kernel of it) and says why; the
    four variants run (bf16 grouped_mm, FP8 E4M3 and HYBRID, one GEMM per expert) and compare."""
    section = dry_run[1]["grouped"]
    assert section["ok"], section.get("figure")
    assert section["grouped_kernel_chosen"] is False and "emulated" in section["why"]
    for name in ("bf16_grouped_mm", "fp8_e4m3_grouped", "fp8_hybrid", "fp8_e4m3_per_expert"):
        assert section[name]["ms"] > 0 and section[name]["grouped_calls_per_step"] == 0
    assert 0 < section["fp8_e4m3_grouped"]["rel_err_y_vs_bf16"] < 0.15
    assert sum(section["shape"]["splits"]) == section["shape"]["rows"] and 0 in section["shape"]["splits"]


def test_without_cuda_the_check_stops_at_once(tmp_path) -> None:
    done = _run(tmp_path, CUDA_VISIBLE_DEVICES="")  # --device cuda, the default; no GPU visible
    assert done.returncode == 2, _log(done)
    assert "sees no CUDA device" in done.stderr and "--device cpu" in done.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_an_unknown_section_is_refused_with_the_list(tmp_path) -> None:
    done = _run(tmp_path, "--sections", "env,speed")
    assert done.returncode == 2 and "no section speed; the sections: env contract syncs" in done.stderr


def test_a_spent_budget_skips_sections_and_says_so(tmp_path) -> None:
    done = _run(tmp_path, "--device", "cpu", "--quick", GPU_CHECK_BUDGET_S="1", GPU_CHECK_LIMIT_FACTOR="1")
    assert done.returncode == 1, _log(done)
    for name in SECTIONS:
        assert f"section {name} skipped: the budget of 1 s is spent" in done.stdout


def test_a_section_alone_refuses_to_run_without_cuda(tmp_path) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_RESULTS")}
    environ.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.path.join(ROOT, "src"))
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "env", "--out", str(tmp_path)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "no CUDA device" in done.stderr, done.stderr
    assert not (tmp_path / "gpu-check.json").exists()
