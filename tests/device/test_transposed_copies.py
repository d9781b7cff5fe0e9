"""torch._scaled_mm's operands straight from the fused casts: no FP8 copy in a training step.

torch._scaled_mm takes its first operand row-major and its second column-major, so the backward
GEMMs of y = x @ w.T need tensors in the other layout: w column-major in dgrad (dx = g @ w), g.t()
row-major and x column-major in wgrad (dw = g.t() @ x). On the fused kernels' path the casts of a
training call write those transposed FP8 copies in the same pass (quantization/per_tensor.py,
`cast_operands`; docs/design.md, section 6, "Fused quantization kernels"), where the torch path casts
rows and gemm.py copies each into the other layout.

Checked on the CPU: torch._scaled_mm is the CUDA contract checker (tests/cuda_contract.py: layouts,
strides, alignment; its product the reference one) with FP8TRAIN_GEMM=scaled_mm, and the kernels run in
Triton's interpreter (FP8TRAIN_FUSED_KERNELS=interpret) against the torch path (off): outputs,
gradients, amax histories and scales bit for bit; a dispatch-mode counter sees no aten copy
(clone, copy_, _to_copy) of an FP8 tensor in the fused step, where the torch path's step makes one per
operand in the other layout (so the counter can fail; a column-major input's values keep its layout,
and the forward copies them on either path); the kernels are asked for transposed copies
only where a later GEMM takes them (not in inference, not for the gradient of a layer without a
weight gradient); backward saves as many bytes (each saved operand is the layout backward takes).
The interpreter is chosen when the kernels are first imported, so the steps run in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: the fused kernels cannot be dispatched to")
pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")

_STEPS = r"""
import json, os, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import fp8train
from fp8train.numerics.kernels import triton_cast
from fp8train.tools.bench.memory import saved_bytes
from cuda_contract import cuda_contract

torch.set_num_threads(1)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
aten = torch.ops.aten
COPIES = (aten.clone.default, aten.copy_.default, aten._to_copy.default)


class FP8Copies(TorchDispatchMode):
    # every aten copy that reads or writes an FP8 tensor, and the torch._scaled_mm calls
    def __init__(self):
        super().__init__()
        self.copies, self.gemms = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._scaled_mm.default:
            self.gemms += 1
        if func in COPIES:
            tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
            if any(t.dtype in FP8 for t in tensors):
                self.copies.append(f"{func}: " + ", ".join(f"{t.dtype} {tuple(t.stride())}" for t in tensors))
        return out


asked = []  # the kernels' `transposed` argument, call by call


def spy(name):
    function = getattr(triton_cast, name)

    def spied(*args, **kwargs):
        asked.append(bool(kwargs["transposed"]))
        return function(*args, **kwargs)

    setattr(triton_cast, name, spied)


spy("cast_with_amax")
spy("amax_then_cast")
RECIPES = {
    "delayed": lambda: fp8train.DelayedScaling(amax_history_len=4),
    "current": fp8train.Float8CurrentScaling,
}


def scenario(name):
    # (recipe, module, x, steps): each step a list of (is_first_microbatch, training)
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    x[1] *= 2.0**10  # an outlier token
    if name == "mlp":
        return "delayed", fp8train.LayerNormMLP(128, 256), x, [[(None, True)], [(None, True)]]
    if name == "microbatches":
        return "delayed", fp8train.Linear(128, 256), x, [[(True, True), (False, True)]]
    if name == "inference":
        return "delayed", fp8train.Linear(128, 256), x, [[(None, False)]]
    if name == "recompute":  # fp8train.checkpoint: the forward replayed in backward
        return "delayed", fp8train.Linear(128, 256), x, [[(None, True)]]
    if name == "column-major-input":  # its values keep x's layout (the torch path's): the forward copies
        return "delayed", fp8train.Linear(128, 256), x.t().contiguous().t(), [[(None, True)]]
    if name == "first-layer":  # no input gradient: the gradient's rows are needed by no GEMM
        return "current", fp8train.Linear(128, 256), x, [[(None, True)]]
    return name, fp8train.Linear(128, 256), x, [[(None, True)], [(None, True)]]


def run(name):
    recipe_name, module, x, steps = scenario(name)
    recipe = RECIPES[recipe_name]()
    x = x.requires_grad_(name != "first-layer")
    asked.clear()
    out, saved, counter = {}, [], FP8Copies()
    for s, microbatches in enumerate(steps):
        x.grad = None
        for p in module.parameters():
            p.grad = None
        for first, training in microbatches:
            kw = {} if first is None else {"is_first_microbatch": first}
            with torch.set_grad_enabled(training), counter, fp8train.fp8_autocast(fp8_recipe=recipe):
                forward = lambda: module(x, **kw)  # noqa: E731
                if name == "recompute":
                    forward = lambda: fp8train.checkpoint(module, x)  # noqa: E731
                y, nbytes, tensors = saved_bytes(forward, module.parameters())
                saved.append([nbytes, [[str(t.dtype), list(t.shape), t.is_contiguous()] for t in tensors
                                       if t.dtype in FP8]])
                if training:
                    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        out[f"y{s}"] = y.detach()
    out.update({"dx": x.grad, **{f"grad {n}": p.grad for n, p in module.named_parameters()}})
    if recipe_name == "delayed":
        fp8train.synchronize()
        for d in ("scaling_fwd", "scaling_bwd"):
            meta = module.fp8_meta[d]
            out.update({f"amax_history {d}": meta.amax_history.clone(), f"scale {d}": meta.scale.clone()})
    return {k: v for k, v in out.items() if v is not None}, counter, saved, list(asked)


with cuda_contract():  # torch._scaled_mm's probe (once per process), through the checker, before counting
    assert fp8train.numerics.gemm.kernel_runs("tensorwise", torch.device("cpu"))[0]
report = {}
for name in sys.argv[1:]:
    runs = {}
    with cuda_contract() as checker:
        for mode in ("off", "interpret"):
            os.environ["FP8TRAIN_FUSED_KERNELS"] = mode
            fp8train.inspection.reset()
            runs[mode] = run(name)
    (ref, ref_counter, ref_saved, _), (got, counter, saved, transposed) = runs["off"], runs["interpret"]
    report[name] = {
        "unequal": sorted(k for k in ref if k not in got or not torch.equal(ref[k], got[k])),
        "violations": checker.violations[:5],
        "gemms": [ref_counter.gemms, counter.gemms],
        "torch_path_copies": ref_counter.copies,
        "fused_copies": counter.copies,
        "transposed_asked": transposed,
        "saved": [ref_saved, saved],
    }
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    tests = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "FP8TRAIN_GEMM": "scaled_mm",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", _STEPS, *SCENARIOS], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


SCENARIOS = ("delayed", "current", "mlp", "microbatches", "inference", "recompute", "column-major-input",
             "first-layer")  # fmt: skip
# torch._scaled_mm calls of each scenario (the same on both paths): 3 per Linear step with backward
GEMMS = {"delayed": 6, "current": 6, "mlp": 12, "microbatches": 6, "inference": 1, "recompute": 4,
         "column-major-input": 3, "first-layer": 2}  # fmt: skip
# the torch path's copies into torch._scaled_mm's layout: w, g.t() and x per backward (no w without dgrad)
# (a column-major input: x for the forward, w, g.t(); x is already as wgrad takes it)
LAYOUT_COPIES = {"delayed": 6, "current": 6, "mlp": 12, "microbatches": 6, "inference": 0, "recompute": 3,
                 "column-major-input": 3, "first-layer": 2}  # fmt: skip
# the kernels' calls, in order, and whether each wrote the transposed copy (x, w, then g per GEMM)
ASKED = {
    "delayed": [True] * 6,
    "current": [True] * 6,
    "mlp": [True] * 12,  # fc1's x, w; fc2's x, w; fc2's g, fc1's g; twice
    "microbatches": [True, True, True, True, True],  # the second microbatch reuses the cached weight
    "inference": [False, False],
    "recompute": [True] * 5,  # the forward's x, w; the replay's x, w (its plan names the region); g
    "column-major-input": [True] * 3,
    "first-layer": [True, True, True],  # the gradient's copy for wgrad (its rows are written too)
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_fused_step_equals_the_torch_path_bit_for_bit_in_the_contract(report: dict, name: str) -> None:
    r = report[name]
    assert r["unequal"] == [], f"{name}: the fused step differs from the torch path in {r['unequal']}"
    assert r["violations"] == []
    assert r["gemms"] == [GEMMS[name]] * 2


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_fp8_operand_is_copied_before_the_gemm(report: dict, name: str) -> None:
    """The fused step makes no copy of an FP8 tensor; the torch path's makes one per operand that a
    backward GEMM takes in the other layout (w, g.t(), x: clones into torch._scaled_mm's layout)."""
    r = report[name]
    # a column-major input's values (its layout, as the torch path's) are copied for the forward GEMM
    assert len(r["fused_copies"]) == (1 if name == "column-major-input" else 0), r["fused_copies"]
    layout_copies = [c for c in r["torch_path_copies"] if c.startswith("aten.clone")]
    assert len(layout_copies) == LAYOUT_COPIES[name], r["torch_path_copies"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_transposed_copies_are_asked_where_a_later_gemm_takes_them(report: dict, name: str) -> None:
    assert report[name]["transposed_asked"] == ASKED[name]


@pytest.mark.parametrize("name", ["delayed", "current", "mlp", "microbatches", "column-major-input"])
def test_backward_saves_the_transposed_copies_in_as_many_bytes(report: dict, name: str) -> None:
    """The saved FP8 operands (x for wgrad, w for dgrad, per GEMM) are the transposed copies, contiguous
    [in, tokens] and [in, out], and take as many bytes as the torch path's rows: 1 byte per element."""
    torch_path, fused = report[name]["saved"]
    for (ref_bytes, ref_fp8), (nbytes, fp8) in zip(torch_path, fused):
        assert nbytes == ref_bytes
        assert [shape for _, shape, _ in fp8] == [shape[::-1] for _, shape, _ in ref_fp8]
        assert all(contiguous for _, _, contiguous in fp8)
