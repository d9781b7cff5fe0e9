"""The recipes' dispatch to the fused Triton kernels (kernels.use_fused_kernels; docs/design.md, section
6, "Fused quantization kernels"): with the kernels forced (FP8TRAIN_FUSED_KERNELS=interpret, Triton's
interpreter on CPU tensors) an fp8train.Linear's forward and backward under each recipe (delayed
scaling: two steps, with its amax histories and scales) equal the torch path's
(FP8TRAIN_FUSED_KERNELS=off) bit for bit, outputs and gradients, and the kernels
were called, each the number of times the recipe needs (counted by wrapping the kernel modules' public
functions): a dispatch that silently fell back to the torch path fails.

The interpreter is chosen when the kernels are first imported (TRITON_INTERPRET=1), so the layers run in
a fresh Python process with that environment, whatever this process imported. Skipped only where triton
cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot be dispatched to")
pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")

_RUN_RECIPES = r"""
import json, os, sys
import torch
import fp8train
from fp8train.numerics import kernels
from fp8train.numerics.kernels import triton_cast

torch.set_num_threads(1)
calls = {}


def count_calls(module, names):  # spies in a child process: count the kernels' calls, pass on
    for name in names:
        function = getattr(module, name)

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _function(*args, **kwargs)

        setattr(module, name, counted)


count_calls(triton_cast, ["cast_tiles", "cast_with_amax", "amax_then_cast"])
count_calls(kernels.microscaling(), kernels.microscaling().__all__)

F = fp8train.Format
RECIPES = {
    "delayed": fp8train.DelayedScaling(amax_history_len=4),
    "current": fp8train.Float8CurrentScaling(),
    "block": fp8train.Float8BlockScaling(),
    "block-no-power-2": fp8train.Float8BlockScaling(power_2_scale=False),
    "mxfp8": fp8train.MXFP8BlockScaling(),
    "mxfp8-hybrid-2d": fp8train.MXFP8BlockScaling(fp8_format=F.HYBRID, enable_2d_quantization=True),
    "nvfp4": fp8train.NVFP4BlockScaling(),
    "nvfp4-plain": fp8train.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    ),
}


def run(recipe):
    torch.manual_seed(0)
    layer = fp8train.Linear(128, 256)
    x = torch.randn(64, 128)
    x[1] *= 2.0**10  # an outlier token
    x[:, 3] *= 2.0**-18  # a column far below the rest
    x[2, :64] = 0.0
    x.requires_grad_(True)
    grad_out = torch.randn(64, 256)
    torch.manual_seed(1)  # stochastic rounding draws from here, in the same order on both paths
    # delayed scaling: a second step casts with the scales of the amaxes the first one's casts took
    for _ in range(2 if isinstance(recipe, fp8train.DelayedScaling) else 1):
        x.grad = layer.weight.grad = layer.bias.grad = None
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(grad_out)
    out = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}
    if isinstance(recipe, fp8train.DelayedScaling):
        fp8train.synchronize()
        for d in ("scaling_fwd", "scaling_bwd"):
            meta = layer.fp8_meta[d]
            out.update({f"amax_history_{d}": meta.amax_history.clone(), f"scale_{d}": meta.scale.clone()})
    return out


report = {}
for name, recipe in RECIPES.items():
    outcome = {}
    for mode in ("off", "interpret"):
        os.environ["FP8TRAIN_FUSED_KERNELS"] = mode
        calls.clear()
        outcome[mode] = (run(recipe), dict(calls))
    (torch_path, torch_calls), (fused, fused_calls) = outcome["off"], outcome["interpret"]
    report[name] = {
        "torch_calls": torch_calls,
        "fused_calls": fused_calls,
        "unequal": [k for k in torch_path if not torch.equal(torch_path[k], fused[k])],
        "finite": all(bool(t.isfinite().all()) for t in fused.values()),
    }
print("REPORT" + json.dumps(report))
"""

# The kernels each recipe's layer calls in one forward and backward (weight, input, output gradient);
# nvfp4_amax: the per-tensor amax read of the 16x16 weight blocks and of each un-rotated pair of copies.
EXPECTED_CALLS = {
    "delayed": {"cast_with_amax": 6},  # weight, input and gradient, in each of the two steps
    "current": {"amax_then_cast": 3},
    "block": {"cast_tiles": 3},
    "block-no-power-2": {"cast_tiles": 3},
    "mxfp8": {"mx_quantize_both": 3},
    "mxfp8-hybrid-2d": {"mx_quantize": 1, "mx_quantize_both": 2},
    "nvfp4": {"nvfp4_quantize": 1, "nvfp4_amax": 1, "nvfp4_quantize_both_rotated": 2},
    "nvfp4-plain": {"nvfp4_quantize_both": 3, "nvfp4_amax": 3},
}


def _run_in_interpreter(code: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", **env_vars}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def recipe_report() -> dict:
    result = _run_in_interpreter(_RUN_RECIPES)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


@pytest.mark.parametrize("recipe", sorted(EXPECTED_CALLS))
def test_forced_kernels_equal_the_torch_path_bit_for_bit_and_are_called(
    recipe_report: dict, recipe: str
) -> None:
    """Output, input, weight and bias gradients bit for bit; the torch path calls no kernel, the forced
    path exactly the kernels the recipe needs (NVFP4: with the Hadamard transform and stochastic
    rounding of gradients, its default)."""
    report = recipe_report[recipe]
    assert report["unequal"] == [], (
        f"{recipe}: the fused path differs from the torch path in {report['unequal']}"
    )
    assert report["finite"]
    assert report["torch_calls"] == {}, "FP8TRAIN_FUSED_KERNELS=off called the kernels"
    assert report["fused_calls"] == EXPECTED_CALLS[recipe]


def test_the_mode_is_checked_and_a_forced_kernel_never_falls_back_silently() -> None:
    """off and auto leave CPU tensors to the torch path; a misspelt mode, or interpret without Triton's
    interpreter on, is an error that names the fix."""
    code = (
        "import os, pytest, torch\n"
        "from fp8train.numerics import kernels\n"
        "x = torch.ones(4, 4)\n"
        "for mode in ('off', 'auto', ''):\n"
        "    os.environ['FP8TRAIN_FUSED_KERNELS'] = mode\n"
        "    assert not kernels.use_fused_kernels(x), mode\n"
        "os.environ['FP8TRAIN_FUSED_KERNELS'] = 'on'\n"
        "with pytest.raises(ValueError, match='auto.*off.*interpret'):\n"
        "    kernels.use_fused_kernels(x)\n"
        "os.environ['FP8TRAIN_FUSED_KERNELS'] = 'interpret'\n"
        "with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):\n"
        "    kernels.use_fused_kernels(x)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FP8TRAIN_FUSED_KERNELS")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_mode_set_after_a_prepared_models_first_step_takes_effect_at_its_next_region(monkeypatch) -> None:
    """A prepared model's regions share one quantization object (prepare.py): whether
    FP8TRAIN_FUSED_KERNELS is set is read once per region (docs/design.md, section 6), not once for the
    object's life; a misspelt mode set between two steps is an error at the next one (cf08600 kept the
    first step's answer for good: the setting ignored)."""
    import torch

    import fp8train

    monkeypatch.delenv("FP8TRAIN_FUSED_KERNELS", raising=False)
    model = fp8train.prepare(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    x = torch.randn(16, 32)
    model(x).sum().backward()
    monkeypatch.setenv("FP8TRAIN_FUSED_KERNELS", "on")
    with pytest.raises(ValueError, match="auto.*off.*interpret"):
        model(x)
