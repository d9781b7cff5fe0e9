"""The report's figures (values, not pixels): what the amax reduction costs and what it overlapped, the
clipped share of delayed scaling's casts, loss curves that coincide, bf16 on a CPU without bf16
instructions, label room, and report.md's sections, from a run directory written here."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")

from fp8train.tools import report  # noqa: E402

STEPS = 20


def _step(run: str, step: int, loss: float, utils: dict, hidden_s: float, exposed_s: float) -> dict:
    roles = {
        name: {"amax": 1.0, "scale": 1.0, "util": util, "overflow": bool(util > 1)}
        for name, util in utils.items()
    }
    return {
        "kind": "step", "run": run, "step": step, "loss": loss, "roles": roles,
        "events": {"overflow": sum(v["overflow"] for v in roles.values()), "nonfinite": 0},
        "step_s": 0.1,
        "reduction": {"exposed_wait_s": exposed_s, "hidden_s": hidden_s, "launched": 2 * (step + 1)},
        "coverage": {"fp8_flop_share": 1.0, "gathered_bytes": {"fp8": 0, "high_precision": 0},
                     "high_precision_layers": []},
    }  # fmt: skip


def _write_run(path, summary: dict | None = None) -> str:
    """Three runs as the demo writes them: fp8-async and fp8-blocking (the same losses and FP8 state)
    and the fp32 reference; async's reductions spend 60 ms in flight each and 0.1 ms waited on, per step;
    blocking's 0 in flight and 10 ms waited on; each step is 100 ms (step_s)."""
    records = []
    for run, fp8, hidden, exposed in (("fp8-async", True, 0.06, 0.0001), ("fp8-blocking", True, 0.0, 0.01),
                                      ("reference", False, 0.0, 0.0)):  # fmt: skip
        records.append({"kind": "meta", "run": run, "fp8": fp8, "recipe_kind": "delayed" if fp8 else None,
                        "params": 1000, "recipe": "DelayedScaling()"})  # fmt: skip
        for step in range(STEPS):
            loss = 3.0 - 0.05 * step + (0.01 if not fp8 else 0.0)
            # weight roles clip at 1.05 (4.8% of the largest value) every other step; inputs at 0.5
            utils = {"blocks.0.attn.qkv/input": 0.5, "blocks.0.attn.qkv/weight": 1.05 if step % 2 else 0.9}
            if not fp8:
                utils = {}
            n = 2 * STEPS if fp8 else 0  # per rank, cumulative at the end
            records.append(_step(run, step, loss, utils, hidden * n * (step + 1) / STEPS,
                                 exposed * STEPS * (step + 1) / STEPS))  # fmt: skip
        n = 2 * STEPS if fp8 else 0
        per_rank = [{"exposed_wait_s": exposed * STEPS, "hidden_s": hidden * n, "launched": n}] * 2
        records.append({"kind": "phase_end", "run": run, "steps": STEPS, "final_loss": 2.05,
                        "median_step_s": 0.1, "reduction_per_rank": per_rank,
                        "loss_digest": "L", "fp8_state_digest": "S"})  # fmt: skip
    records.append({"kind": "coverage", "run": "fp8-async", "recipe": "delayed", "fp8_share": 1.0,
                    "layers": [{"name": "blocks.0.attn.qkv", "fp8": True, "reason": ""}]})  # fmt: skip
    records.append({**records[-1], "run": "fp8-blocking"})
    path.mkdir(exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if summary is not None:
        with open(path / "summary.json", "w") as f:
            json.dump(summary, f)
    return str(path)


@pytest.fixture
def runs(tmp_path):
    return report.load_run(_write_run(tmp_path / "run"))


def test_the_reduction_is_shown_as_what_the_step_pays_and_a_share_it_overlapped(runs) -> None:
    async_, blocking = (
        report.reduction_figures(runs["fp8-async"]),
        report.reduction_figures(runs["fp8-blocking"]),
    )
    assert async_["exposed_ms"] == pytest.approx(0.1) and blocking["exposed_ms"] == pytest.approx(10.0)
    assert async_["exposed_share"] == pytest.approx(0.001) and blocking["exposed_share"] == pytest.approx(0.1)
    # hidden_s sums 2 windows of 60 ms per 100 ms step: 120% of the training time, yet no cost; the
    # report shows each window as a share of the step instead
    assert async_["window_ms"] == pytest.approx(60.0) and async_["window_share"] == pytest.approx(0.6)
    assert blocking["window_ms"] == 0 and "nothing overlapped" in report._window_text(blocking)
    assert "60% of a step" in report._window_text(async_) and "not a cost" in report._window_text(async_)


def test_clipping_is_measured_as_the_share_of_the_largest_value_lost(runs) -> None:
    assert report.clipped_share(1.05) == pytest.approx(1 - 1 / 1.05)
    assert report.clipped_share(1.0) == report.clipped_share(0.3) == report.clipped_share(math.inf) == 0
    clip = runs["fp8-async"].clipping()
    assert clip == {"role_steps": 2 * STEPS, "clipped": STEPS // 2, "max_share": pytest.approx(1 - 1 / 1.05),
                    "median_share": pytest.approx(1 - 1 / 1.05)}  # fmt: skip
    text = report.clipping_text(clip)
    assert "10 of 40 role-steps" in text and "at most 4.8%" in text and "margin=1" in text
    small = report.clipping_text({**clip, "max_share": 0.004, "median_share": 0.002})
    assert "margin" not in small and "harmless" in small
    assert "no cast clipped" in report.clipping_text({**clip, "clipped": 0})
    assert report._saturation_text(runs["fp8-async"]) == "10 clipped\n<= 4.8% each"


def test_coinciding_loss_curves_come_apart_as_differences_to_the_reference(runs) -> None:
    diffs = report.loss_differences(runs, window=3)
    assert set(diffs) == {"fp8-async", "fp8-blocking"}
    xs, ys = diffs["fp8-async"]
    assert xs == list(range(STEPS)) and ys == pytest.approx([-0.01] * STEPS)
    assert report.loss_differences({"fp8-async": runs["fp8-async"]}) == {}


def test_bf16_autocast_is_explained_where_the_cpu_has_no_bf16_instructions() -> None:
    why = "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or bf16 flag)"
    note = report.bf16_note({"cpu_bf16_instructions": {"native": False, "why": why}})
    assert why in note and "fp32 GEMM" in note
    assert report.bf16_note({"cpu_bf16_instructions": {"native": True, "why": "avx512_bf16"}}) is None
    assert report.bf16_note({}) is None


def test_bar_labels_have_room_below_the_title() -> None:
    lo, hi = report._label_room([0.0, 0.0, 0.0])
    assert lo < 0 < hi and hi >= 0.3 * 0.05
    lo, hi = report._label_room([-2.0, 1.0])
    assert lo < -2.0 and hi > 1.0 + 0.3 * 3.0 - 1e-9


def test_report_md_says_what_the_user_pays_and_prints_each_coverage_once(tmp_path) -> None:
    timing = {"median_ms": {"fp8-async": 100.0, "reference": 80.0, "bf16-autocast": 600.0},
              "recipe_kind": {"fp8-async": "delayed", "reference": "fp32", "bf16-autocast": "bf16"},
              "rounds": 2, "block": 5}  # fmt: skip
    facts = {"native": False, "why": "this CPU has no bf16 instructions"}
    run_dir = _write_run(tmp_path / "run", {"step_timing": timing, "cpu_bf16_instructions": facts})
    out = report.render(run_dir)
    md = open(out["markdown"], encoding="utf-8").read()
    assert "hidden ms/step" not in md and "exposed ms/step (% of step)" in md
    assert "| 0.1000 (0.10%) | 60.00 ms (60.00%) |" in md  # async: exposed, then in flight per reduction
    assert "| 10.0000 (10.00%) | 0.00 ms (0.00%) |" in md  # blocking
    assert md.count("### fp8-async, fp8-blocking") == 1 and md.count("Linear GEMMs in FP8") == 1
    assert "bf16 autocast is slow here: this CPU has no bf16 instructions" in md
    assert "margin=1" in md and "4.8%" in md
