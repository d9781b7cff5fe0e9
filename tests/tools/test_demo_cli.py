"""The demo end to end (2 real gloo ranks via torchrun), `report`, `info`, `bench` and bad CLI input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from fp8train.numerics.gemm import bf16_kernel, choose_path
from fp8train.telemetry import read_metrics
from fp8train.tools import cli
from fp8train.tools.report import load_run
from helpers import REPO

STEPS = 5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("demo") / "run")
    argv = ["demo", "--world-size", "2", "--steps", str(STEPS), "--model-size", "tiny", "--batch-size", "2",
            "--recipe", "all", "--run-dir", run_dir, "--timeout", "300", "--quant-error-every", "2",
            "--timing-rounds", "2", "--timing-block", "1"]  # fmt: skip
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(argv)
    return rc, run_dir, out.getvalue()


@pytest.mark.multirank
def test_demo_end_to_end(demo_run):
    rc, run_dir, printed = demo_run
    assert rc == 0, printed
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    runs = load_run(run_dir)
    assert list(runs) == [
        "fp8-async", "fp8-blocking", "fp8-current", "fp8-block", "fp8-mxfp8", "fp8-nvfp4", "reference"
    ]  # fmt: skip
    for run in runs.values():
        assert run.meta["world_size"] == 2 and run.meta["steps"] == STEPS
        assert [r["step"] for r in run.steps] == list(range(STEPS))
        steps, losses = run.losses()
        assert len(losses) == STEPS and all(math.isfinite(v) and 0 < v < 10 for v in losses)
        for rec in run.steps:
            assert {"loss", "tokens_per_s", "events", "reduction", "reduction_delta", "roles"} <= set(rec)
    fp8 = runs["fp8-async"]
    roles = fp8.steps[-1]["roles"]
    assert len(roles) == 2 * 4 * 3 and "blocks.0.mlp/fc1/input" in roles
    for rec in fp8.steps:
        for values in rec["roles"].values():
            assert all(
                math.isfinite(values[k]) and values[k] > 0 for k in ("amax", "scale", "scale_used", "util")
            )
    for prev, cur in zip(fp8.steps, fp8.steps[1:]):  # the scale a step used is the one the last step produced
        assert {n: v["scale_used"] for n, v in cur["roles"].items()} == {
            n: v["scale"] for n, v in prev["roles"].items()
        }
    stateless = ("fp8-current", "fp8-block", "fp8-mxfp8", "fp8-nvfp4")
    for name in (*stateless, "reference"):  # no delayed state, no amax reduction
        assert runs[name].steps[-1]["roles"] == {}
        assert [s["launched"] for s in runs[name].end["reduction_per_rank"]] == [0, 0]
    for name in stateless:  # a different recipe: different losses, close to fp32
        assert runs[name].meta["recipe_kind"] == name.removeprefix("fp8-")
        assert runs[name].losses() != fp8.losses()
        gap = 0.05 if name == "fp8-nvfp4" else 0.02
        assert abs(runs[name].final_loss() / runs["reference"].final_loss() - 1) < gap
    # async and blocking: the same losses and the same FP8 telemetry, bit for bit
    blocking = runs["fp8-blocking"]
    assert fp8.losses() == blocking.losses()
    assert [r["roles"] for r in fp8.steps] == [r["roles"] for r in blocking.steps]
    assert fp8.end["fp8_state_digest"] == blocking.end["fp8_state_digest"]
    assert fp8.meta["async"] is True and blocking.meta["async"] is False
    # one collective per direction per step (the model's roles fit the collectives' initial size)
    for run in (fp8, blocking):
        assert [s["launched"] for s in run.end["reduction_per_rank"]] == [2 * STEPS] * 2
    assert all(s["hidden_s"] == 0 for s in blocking.end["reduction_per_rank"])
    assert all(s["hidden_s"] > 0 for s in fp8.end["reduction_per_rank"])
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["world_size"] == 2 and summary["loss_floor"] is None  # real text: unknown floor
    assert "standard library" in summary["data"] and fp8.meta["data"] == "text"
    measured = [0, 2, 4]  # every 2 steps and the last
    # meta, steps, end; quant_error and coverage (FP8 runs)
    assert len(records) == 7 * (STEPS + 2) + 6 * (len(measured) + 1)
    coverage = [r for r in records if r.get("kind") == "coverage"]
    assert all(r["counts"] == {"fp8": 8, "not converted": 1, "frozen": 0} for r in coverage)  # the head
    assert [r["recipe"] for r in coverage] == [run.recipe_kind for run in runs.values() if run.fp8]
    assert [r["step"] for r in records if r.get("run") == "fp8-async" and r.get("statistics")] == measured
    width, height = _png_size(os.path.join(run_dir, "report.png"))
    assert width > 800 and height > 1000
    with open(os.path.join(run_dir, "report.md")) as f:
        md = f.read()
    assert "| fp8-async | delayed | 5 |" in md and "| reference | fp32 | 5 |" in md and "bit-identical" in md
    assert "| fp8-block | block | 5 |" in md and "none (own amax)" in md
    assert "| fp8-nvfp4 | nvfp4 | 5 |" in md and "| fp8-mxfp8 | mxfp8 |" in md
    assert "**yes**" in md and "Data: the Python standard library" in md
    assert "async and blocking bit-identical (every loss, scales, amax histories): yes" in printed
    assert os.path.join(run_dir, "report.png") in printed and "final loss" in printed
    assert "fp8-block" in printed and "saturated: none by construction" in printed


@pytest.mark.multirank
def test_demo_measures_each_recipes_quantization_error(demo_run):
    """quant_error records for every FP8 run on the sampled GEMMs, finite and positive; the formats
    show in them (NVFP4 above MXFP8 on every role, E5M2 gradients of the HYBRID recipes), the
    bit-identical async and blocking runs measure the same values, and the report tabulates them."""
    rc, run_dir, printed = demo_run
    assert rc == 0, printed
    runs = load_run(run_dir)
    gemms = {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.attn.qkv", "blocks.1.attn.proj"}
    means = {}
    for run in runs.values():
        if not run.fp8:
            assert run.quant_errors == [] and run.end["quant_error_mean"] is None
            continue
        assert [r["step"] for r in run.quant_errors] == [0, 2, 4]
        for rec in run.quant_errors:
            assert rec["recipe"] == run.recipe_kind and set(rec["rel_error"]) == gemms
            for per_role in rec["rel_error"].values():
                assert set(per_role) == {"input", "weight", "grad_output"}
                assert all(math.isfinite(v) and 0 < v < 1 for v in per_role.values())
        means[run.name] = run.end["quant_error_mean"]
        for role, mean in means[run.name].items():  # the end record's means are the records' means
            xs, ys = run.quant_error_series(role)
            assert mean == pytest.approx(sum(ys) / len(ys), rel=1e-12)
    assert runs["fp8-async"].quant_errors == [
        dict(r, run="fp8-async") for r in runs["fp8-blocking"].quant_errors
    ]
    for role in ("input", "weight", "grad_output"):
        assert means["fp8-nvfp4"][role] > 2 * means["fp8-mxfp8"][role] > 0
    for name in ("fp8-async", "fp8-current"):  # HYBRID: E5M2 gradients
        assert means[name]["grad_output"] > 1.5 * means[name]["input"]
    assert means["fp8-mxfp8"]["grad_output"] < 1.5 * means["fp8-mxfp8"]["input"]
    with open(os.path.join(run_dir, "report.md")) as f:
        md = f.read()
    assert "Quantization error on the model's tensors" in md
    for name, mean in means.items():
        if name != "fp8-blocking":
            row = f"| {name} | {runs[name].recipe_kind} | {mean['input']:.4f} ("
            assert row in md


@pytest.mark.multirank
def test_demo_times_every_configuration_in_an_interleaved_pass(demo_run):
    """summary.json holds the timed pass (every recipe once, the fp32 reference and bf16 autocast,
    from the slowest rank), the report's table shows its medians and ratios and says how they were
    measured, and the printed summary uses them."""
    rc, run_dir, printed = demo_run
    assert rc == 0, printed
    with open(os.path.join(run_dir, "summary.json")) as f:
        timing = json.load(f)["step_timing"]
    names = ["fp8-async", "fp8-current", "fp8-block", "fp8-mxfp8", "fp8-nvfp4", "reference", "bf16-autocast"]
    assert list(timing["median_ms"]) == names and (timing["rounds"], timing["block"]) == (2, 1)
    assert timing["recipe_kind"]["bf16-autocast"] == "bf16" and timing["recipe_kind"]["fp8-nvfp4"] == "nvfp4"
    assert len(timing["median_ms_per_rank"]) == 2
    for name, ms in timing["median_ms"].items():  # of each step's slowest rank: at least each rank's
        q1, q3 = timing["quartiles_ms"][name]
        assert math.isfinite(ms) and 0 < q1 <= ms <= q3
        assert ms >= max(r[name] for r in timing["median_ms_per_rank"])
    with open(os.path.join(run_dir, "report.md")) as f:
        md = f.read()
    ref = timing["median_ms"]["reference"]
    nv = timing["median_ms"]["fp8-nvfp4"]
    q1, q3 = timing["quartiles_ms"]["fp8-nvfp4"]
    assert (
        "| fp8-nvfp4 | nvfp4 | 5 | " in md and f"| {nv:.1f} | {nv / ref:.2f}x | {q1:.1f} - {q3:.1f} |" in md
    )
    assert f"| bf16-autocast | bf16 | | | | {timing['median_ms']['bf16-autocast']:.1f} |" in md
    assert "step ms (interleaved)" in md and "alternates every configuration" in md
    assert "blocks of 1 steps" in md and "then 2 rounds" in md
    assert "alternates the configurations in blocks of 1 steps" in printed
    assert f"step {timing['median_ms']['fp8-mxfp8']:7.1f} ms" in printed


@pytest.mark.multirank
def test_without_a_timed_pass_the_report_says_its_times_are_sequential(demo_run, tmp_path):
    """--timing-rounds 0 (summary.json's step_timing null): the sequential medians, labelled as such."""
    import shutil

    from fp8train.tools.demo import format_summary
    from fp8train.tools.report import render

    rc, run_dir, _ = demo_run
    assert rc == 0
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    with open(os.path.join(copy, "summary.json")) as f:
        summary = json.load(f)
    summary["step_timing"] = None
    with open(os.path.join(copy, "summary.json"), "w") as f:
        json.dump(summary, f)
    outputs = render(copy)
    with open(outputs["markdown"]) as f:
        md = f.read()
    assert "No interleaved pass was run (--timing-rounds 0)" in md and "bf16-autocast" not in md
    seq = summary["phases"]["fp8-mxfp8"]["median_step_s"] * 1e3
    assert "| fp8-mxfp8 | mxfp8 | 5 | " in md and f"|  |  |  | {seq:.1f} |" in md
    printed = format_summary(summary, outputs)
    assert "medians of the training runs, which ran one after another (sequential)" in printed
    assert f"step {seq:7.1f} ms" in printed


@pytest.mark.multirank
def test_report_regenerates_the_png(demo_run, capsys):
    rc, run_dir, _ = demo_run
    assert rc == 0
    png = os.path.join(run_dir, "report.png")
    with open(png, "rb") as f:
        first = f.read()
    os.remove(png)
    os.remove(os.path.join(run_dir, "report.md"))
    assert cli.main(["report", run_dir]) == 0
    assert png in capsys.readouterr().out
    with open(png, "rb") as f:
        assert f.read() == first  # rendering is deterministic
    assert os.path.isfile(os.path.join(run_dir, "report.md"))


def test_info_prints_the_gemm_path(monkeypatch, capsys):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    monkeypatch.delenv("NVTE_ASYNC_AMAX_REDUCTION", raising=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    expected = choose_path(device, 1024, 1024, 1024)
    assert f"FP8 GEMM path for a 1024x1024x1024 GEMM on {device.type}: {expected}\n" in out
    if expected == "bf16":  # and which kernel computes it, and why
        kernel, why = bf16_kernel(device)
        assert f"  computed by the {kernel} GEMM kernel: {why}\n" in out
    assert "NVTE_ASYNC_AMAX_REDUCTION=(unset): asynchronous" in out
    assert f"torch {torch.__version__}" in out
    if device.type == "cpu":  # the grouped GEMMs' choice, and why
        assert (
            "grouped GEMMs (mixture of experts; delayed and current scaling, bf16): one GEMM per expert: "
            in out
        )
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")
    monkeypatch.setenv("NVTE_ASYNC_AMAX_REDUCTION", "0")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"on {device.type}: fp32\n" in out and "FP8TRAIN_GEMM='fp32'" in out
    assert "NVTE_ASYNC_AMAX_REDUCTION='0': blocking" in out
    monkeypatch.setenv("NVTE_ASYNC_AMAX_REDUCTION", "yes")
    assert cli.main(["info"]) == 2
    assert "invalid" in capsys.readouterr().out
    monkeypatch.setenv("NVTE_ASYNC_AMAX_REDUCTION", "0")
    monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "always")
    assert cli.main(["info"]) == 2
    assert "FP8TRAIN_GROUPED_GEMM='always' is not valid: use auto or off" in capsys.readouterr().out


def test_python_dash_m_runs_the_cli():
    env = dict(os.environ, FP8TRAIN_GEMM="bf16")
    proc = subprocess.run([sys.executable, "-m", "fp8train", "info"], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "GEMM on" in proc.stdout and ": bf16" in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--world-size", "0"], "--world-size: must be >= 1, got 0"),
        (["demo", "--world-size", "two"], "--world-size: expected an integer >= 1"),
        (["demo", "--steps", "-3"], "--steps: must be >= 1"),
        (["demo", "--quant-error-every", "-1"], "--quant-error-every: must be >= 0, got -1"),
        (["demo", "--timing-rounds", "x"], "--timing-rounds: expected an integer >= 0"),
        (["demo", "--recipe", "fp4"], "argument --recipe: invalid choice: 'fp4'"),
        (["report", "/nonexistent/fp8train-run"], "run directory '/nonexistent/fp8train-run' does not exist"),
        (["report"], "the following arguments are required: RUN_DIR"),
        (["launch"], "invalid choice: 'launch'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: fp8train" in err


STEP_RECORD = {  # the fields of fp8train.telemetry's step record that the report reads
    "kind": "step", "run": "fp8-async", "step": 0, "loss": None, "roles": {},
    "events": {"overflow": 0, "nonfinite": 0},
    "reduction": {"exposed_wait_s": 0.0, "hidden_s": 0.0, "launched": 0},
}  # fmt: skip


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"kind": "step", "run": "fp8-async", "step": 7}'],
         "line 1: a \"step\" record has a \"roles\" field, this one has only ['kind', 'run', 'step']"),
        ([json.dumps(STEP_RECORD), "", "[1, 2, 3]"],
         "line 3: a record is a JSON object, this line holds an array"),
        ([json.dumps(STEP_RECORD), '{"kind": "step", "step": 1,'], "line 2: not JSON"),
        ([json.dumps({**STEP_RECORD, "events": {"overflow": 0}})],
         'line 1: "events" has a "nonfinite" field, this one has only [\'overflow\']'),
        ([json.dumps({**STEP_RECORD, "step": "7"})],
         'line 1: "step" of a "step" record is int, this one is \'7\''),
        ([json.dumps({**STEP_RECORD, "roles": {"fc1/input": {"amax": 1.0}}})],
         'line 1: role "fc1/input" has a "scale" field'),
        ([json.dumps(STEP_RECORD), json.dumps({"kind": "phase_end", "steps": 0, "final_loss": 1.0})],
         'line 2: "steps" of a "phase_end" record is >= 1, this one is 0'),
        ([json.dumps({"kind": "meta", "run": "fp8-async", "params": "many"}), json.dumps(STEP_RECORD)],
         'line 1: "params" of a "meta" record is int'),
        ([json.dumps({"kind": "quant_error", "run": "fp8-async", "step": 0, "rel_error": {"fc1": 0.1}})],
         'line 1: "rel_error" of GEMM "fc1" is an object, this one is a number'),
    ],
)  # fmt: skip
def test_report_names_the_file_and_line_of_a_record_it_cannot_read(tmp_path, capsys, lines, message):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}, {message}" in err, err
    assert "fp8train.telemetry" in err or "not JSON" in err


def test_report_renders_a_telemetry_file_without_losses(tmp_path, capsys):
    """The smallest file the checks accept renders: step records as telemetry writes them with
    log_step(step) and no loss (the report then has no loss to show)."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps({**STEP_RECORD, "step": i}) + "\n" for i in range(3)))
    assert cli.main(["report", str(tmp_path)]) == 0
    with open(tmp_path / "report.md") as f:
        assert "| fp8-async | fp32 | 3 |  |" in f.read()


def test_report_refuses_a_summary_it_cannot_read(tmp_path, capsys):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(STEP_RECORD) + "\n")
    with open(tmp_path / "summary.json", "w") as f:
        json.dump({"step_timing": {"median_ms": {"fp8-async": 1.0}}}, f)
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(tmp_path)])
    assert exc.value.code == 2
    assert f"{tmp_path / 'summary.json'}: not the summary the demo writes" in capsys.readouterr().err


def _scale_json(tmp_path, **changes) -> str:
    """benchmarks/results/scale.json (a saved `bench scale` run) with `changes`, as a new file."""
    with open(REPO / "benchmarks" / "results" / "scale.json") as f:
        saved = json.load(f)
    path = str(tmp_path / "saved.json")
    with open(path, "w") as f:
        json.dump({**saved, **changes}, f)
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "-1"], "argument --steps: must be >= 1, got -1"),
        (["reduction", "--steps", "two"], "argument --steps: expected an integer >= 1, got 'two'"),
        (["reduction", "--latencies-ms", "abc"],
         "argument --latencies-ms: expected comma-separated milliseconds, got 'abc'"),
        (["reduction", "--latencies-ms", "0,nan"],
         "argument --latencies-ms: a latency is a finite number of milliseconds >= 0, got 'nan'"),
        (["reduction", "--latencies-ms", "5,-1"], "finite number of milliseconds >= 0, got '-1'"),
        (["scale", "--ranks", "0"], "argument --ranks: must be >= 2, got 0"),
        (["scale", "--ranks", "2,x"], "argument --ranks: expected an integer >= 2, got 'x'"),
        (["scale", "--ranks", "4,4"], "on two rank counts: give two different ones or more, got '4,4'"),
        (["scale", "--from", "missing.json"],
         "argument --from: cannot read 'missing.json': No such file or directory"),
        (["scale", "--from", "README.md"], "argument --from: 'README.md' is not JSON"),
        (["scale", "--from", "{fused}"], '"config" is not an object of'),
        (["scale", "--from", "{no_rows}"], '"measured" is not a list of measurements'),
        (["scale", "--from", "{no_fit_rows}"],
         "cannot analyse its measurements: calibration needs blocking points at two rank counts"),
        (["fused", "--out", "README.md"], "--out 'README.md': cannot be a folder for the figures"),
        (["everything"], "argument suites: invalid choice: 'everything'"),
    ],
)  # fmt: skip
def test_bench_refuses_bad_arguments_with_a_message(tmp_path, capsys, monkeypatch, argv, message):
    from fp8train.tools import bench

    monkeypatch.chdir(REPO)
    saved_runs = {  # a --from file: not a scale run, one without measurements, one without calibration points
        "{fused}": lambda: os.path.join("benchmarks", "results", "fused.json"),
        "{no_rows}": lambda: _scale_json(tmp_path, measured=[]),
        "{no_fit_rows}": lambda: _scale_json(
            tmp_path, fit_points={"ranks": [3, 5], "micro": 4, "latency_ms": 3.0}
        ),
    }
    argv = [saved_runs[a]() if a in saved_runs else a for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: fp8train bench" in err, err


def test_bad_input_ends_in_a_message_and_no_traceback(tmp_path):
    """Through the installed command (`python -m fp8train`): the issue's inputs."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"kind": "step", "run": "fp8-async", "step": 7}\n')
    for argv, message in (
        (["report", str(tmp_path)], 'metrics.jsonl, line 1: a "step" record has a "roles" field'),
        (
            ["bench", "scale", "--ranks", "0", "--from", "missing.json"],
            "argument --ranks: must be >= 2, got 0",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "fp8train", *argv], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_demo_progress_is_whole_lines_where_stderr_is_not_a_terminal(monkeypatch, capsys):
    """A log gets a line every tenth of the steps (and the last), no carriage-return redraws; a
    terminal gets tqdm's bar."""
    from fp8train.tools import demo_worker

    bar = demo_worker._progress("fp8-async", 150, rank=0)
    for step in range(150):
        bar.set_postfix_str(f"loss {step}")
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 10 and lines[-1] == "   fp8-async: step 150/150  loss 149", lines
    assert demo_worker._progress("fp8-async", 150, rank=1) is None
    if importlib.util.find_spec("tqdm") is not None:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        import tqdm

        bar = demo_worker._progress("fp8-async", 150, rank=0)
        assert isinstance(bar, tqdm.tqdm)
        bar.close()


def test_report_on_a_directory_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(tmp_path)])
    assert exc.value.code == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_cuda_device_without_cuda_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bench_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("fp8train.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fp8train.tools.bench", fake)
    assert cli.main(["bench", "--quick", "--only", "fused", "--help"]) == 7
    assert seen == [["--quick", "--only", "fused", "--help"]]


@pytest.mark.parametrize("command", ["demo", "report"])
def test_a_missing_extra_is_named(monkeypatch, capsys, tmp_path, command):
    real = importlib.util.find_spec
    hidden = {"matplotlib"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in hidden else real(name))
    assert cli.main([command] + ([str(tmp_path)] if command == "report" else [])) == 1
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "fp8train[demo]"' in err


def test_the_example_report_stays_small():
    """docs/report-example.png is shown in the README: a palette PNG under 500 KB."""
    path = REPO / "docs" / "report-example.png"
    assert os.path.getsize(path) < 500_000
    width, height = _png_size(path)
    assert width > 1000 and height > 2000
