"""`fp8train demo --model moe`: the tiny GPT with mixture-of-experts MLPs (4 experts, top-2, GroupedLinear)
trains on 2 real gloo ranks in FP8 delayed scaling, async and blocking bit for bit, one amax collective
per direction and step, each expert's roles in the telemetry."""

from __future__ import annotations

import io
import math
import os
from contextlib import redirect_stdout

import pytest

from fp8train.tools import cli
from fp8train.tools.report import load_run

STEPS = 4


@pytest.mark.multirank
def test_moe_demo_trains_each_expert_in_fp8_async_equal_to_blocking(tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    argv = ["demo", "--model", "moe", "--world-size", "2", "--steps", str(STEPS), "--model-size", "tiny",
            "--batch-size", "2", "--run-dir", run_dir, "--timeout", "300", "--timing-rounds", "0",
            "--quant-error-every", "0"]  # fmt: skip
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(argv)
    printed = out.getvalue()
    assert rc == 0, printed
    assert "tiny MoE GPT" in printed
    runs = load_run(run_dir)
    fp8, blocking, reference = runs["fp8-async"], runs["fp8-blocking"], runs["reference"]
    assert fp8.meta["model"]["experts"] == 4
    assert (
        fp8.losses() == blocking.losses() and fp8.end["fp8_state_digest"] == blocking.end["fp8_state_digest"]
    )
    assert [s["launched"] for s in fp8.end["reduction_per_rank"]] == [2 * STEPS] * 2  # however many experts
    roles = fp8.steps[-1]["roles"]
    # per block: qkv and proj (3 roles each), 4 experts x (up, down) x 3 roles
    assert len(roles) == 2 * (2 * 3 + 4 * 2 * 3)
    assert {f"blocks.1.mlp.up/{e}/input" for e in range(4)} <= set(roles)
    assert all(math.isfinite(v["scale"]) and v["scale"] > 0 for v in roles.values())
    assert abs(fp8.final_loss() / reference.final_loss() - 1) < 0.02
    counts = fp8.steps[-1]["tokens_per_expert"]  # rank 0's routing: top-2 of 2 x 32 tokens per block
    assert set(counts) == {"blocks.0.mlp", "blocks.1.mlp"} and all(
        sum(c) == 2 * 32 * 2 for c in counts.values()
    )
    with open(os.path.join(run_dir, "report.md")) as f:
        md = f.read()
    assert "| block | expert | tokens | input amax | input scale |" in md
    assert md.count("| blocks.1.mlp | ") == 4
