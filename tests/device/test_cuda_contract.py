"""Every torch._scaled_mm call fp8train makes keeps torch's CUDA contract.

The CPU kernels of `aten::_scaled_mm` and `aten::_scaled_mm.out` are replaced by the checker of
tests/cuda_contract.py (the rules of the CUDA kernel, which the CPU kernel does not check) while the
FP8 modules run with the _scaled_mm path forced (FP8TRAIN_GEMM=scaled_mm): forward, dgrad and
wgrad, every recipe that calls it (per-tensor and the block-scaled kernels), odd strides and views,
eagerly and under inductor (which calls the out= form). Target: no violation. The override is gone
after each test.
"""

from __future__ import annotations

import pytest
import torch

import fp8train
from cuda_contract import cuda_contract
from fp8train import torch_internals

RECIPES = {
    "delayed": fp8train.DelayedScaling(),
    "delayed_e4m3": fp8train.DelayedScaling(fp8_format=fp8train.Format.E4M3),
    "current": fp8train.Float8CurrentScaling(),
    "block": fp8train.Float8BlockScaling(),
    "mxfp8": fp8train.MXFP8BlockScaling(fp8_format=fp8train.Format.HYBRID),
    "mxfp8_2d": fp8train.MXFP8BlockScaling(enable_2d_quantization=True),
    "nvfp4": fp8train.NVFP4BlockScaling(),
}
# block scaling's kernel takes whole 128-tiles, at least 2 along K, K/128 % 4 == 0 for its weight
WIDTH = {"block": 512}


@pytest.fixture(autouse=True)
def _scaled_mm_forced(monkeypatch):
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    # a cold cache of torch_internals' own (no setting fills it): probed again, through the checker
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})
    fp8train.inspection.reset()


def _scenarios(name: str):
    """(description, module, input, how the output is turned into a loss) for one recipe."""
    w = WIDTH.get(name, 64)
    tokens = 256 if name == "block" else 64
    dtype_pairs = [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]
    for dtype, label in dtype_pairs:
        yield (
            f"Linear+bias {label}",
            fp8train.Linear(w, w).to(dtype),
            torch.randn(tokens, w, dtype=dtype),
            "grad",
        )
    yield "3-D input", fp8train.Linear(w, w), torch.randn(4, tokens // 4, w), "grad"
    yield "non-contiguous grad", fp8train.Linear(w, w), torch.randn(tokens, w), "transposed_grad"
    yield "expanded grad (sum)", fp8train.Linear(w, w), torch.randn(tokens, w), "sum"
    yield "sliced input", fp8train.Linear(w, w), torch.randn(tokens + 16, 2 * w)[16:, :w], "grad"
    yield "column-major input", fp8train.Linear(w, w), torch.randn(w, tokens).t(), "grad"
    yield "LayerNormMLP gelu", fp8train.LayerNormMLP(w, 2 * w), torch.randn(tokens, w), "grad"
    yield (
        "LayerNormMLP swiglu",
        fp8train.LayerNormMLP(w, 2 * w, activation="swiglu"),
        torch.randn(tokens, w),
        "grad",
    )
    yield (
        "LayerNormLinear RMSNorm",
        fp8train.LayerNormLinear(w, w, normalization="RMSNorm"),
        torch.randn(tokens, w),
        "grad",
    )


def _step(module, x, loss_kind: str, recipe, **call) -> None:
    x = x.detach().requires_grad_()
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = module(x, **call)
    if loss_kind == "sum":
        y.sum().backward()
    elif loss_kind == "transposed_grad":
        y.backward(torch.randn(y.shape[::-1], dtype=y.dtype).t())
    else:
        y.backward(torch.randn_like(y))


def _gemm_kinds(checker) -> set:
    return {call["kind"] for call in checker.calls}


@pytest.mark.parametrize("name", list(RECIPES))
def test_eager_calls_keep_the_cuda_contract(name: str) -> None:
    recipe = RECIPES[name]
    with cuda_contract() as checker:
        for description, module, x, loss_kind in _scenarios(name):
            before = len(checker.calls)
            _step(module, x, loss_kind, recipe)
            assert len(checker.calls) > before, f"{description}: no torch._scaled_mm call"
        cached = fp8train.Linear(WIDTH.get(name, 64), 64 if name != "block" else 512)
        for first in (True, False):  # the weight cache across microbatches
            _step(cached, torch.randn(256 if name == "block" else 64, cached.in_features), "grad", recipe,
                  is_first_microbatch=first)  # fmt: skip
    assert not checker.violations, "\n".join(checker.violations[:5])
    expected = {"block": "1x128,128x128", "mxfp8": "mx", "mxfp8_2d": "mx", "nvfp4": "nvfp4"}.get(
        name, "tensorwise"
    )
    assert expected in _gemm_kinds(checker)


def test_shapes_scaled_mm_cannot_take_never_reach_it() -> None:
    """24 tokens: not a multiple of 16, so the per-tensor GEMMs emulate; only the probes call it."""
    with cuda_contract() as checker:
        _step(fp8train.Linear(64, 32), torch.randn(24, 64), "grad", RECIPES["delayed"])
    assert not checker.violations
    assert all("(16, 16)" in call["summary"] for call in checker.calls), [c["summary"] for c in checker.calls]


def test_the_override_is_removed_after_the_test() -> None:
    a = torch.zeros(16, 16, dtype=torch.float8_e5m2)
    one = torch.ones(())
    with cuda_contract() as checker:
        torch._scaled_mm(a, a, scale_a=one, scale_b=one, out_dtype=torch.float32)  # e5m2 x e5m2, row-major b
    rules = " / ".join(checker.violations)
    assert "e5m2 x e5m2" in rules and "mat2 must be column-major" in rules
    if torch_internals.has_scaled_mm("cpu"):  # torch's own CPU kernel again: it accepts this
        torch._scaled_mm(a, a, scale_a=one, scale_b=one, out_dtype=torch.float32)
    assert len(checker.calls) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, backend", [("delayed", "inductor"), ("block", "aot_eager"), ("mxfp8", "aot_eager")]
)
def test_compiled_calls_keep_the_cuda_contract(name: str, backend: str) -> None:
    """Inductor's graphs call the out= form with buffers and layouts of its own choosing. The block
    kernels run traced by aot_eager: inductor's CPU code generator has no float8_e8m0fnu (its CUDA
    one moves and bit-casts E8M0 buffers, all the MX scales need), and it fails on block scaling's
    tile graph with or without the kernel (torch 2.13: an assertion in its loop splitting, or, on the
    emulated path, generated code that reads a buffer it never assigned)."""
    torch._dynamo.reset()
    recipe = RECIPES[name]
    width, tokens = (512, 128) if name == "block" else (64, 32)
    model = torch.nn.Sequential(
        fp8train.LayerNormLinear(width, width), torch.nn.GELU(), fp8train.Linear(width, width)
    ).to(torch.bfloat16)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with cuda_contract() as checker:
        for _ in range(2):
            x = torch.randn(2, tokens, width, dtype=torch.bfloat16, requires_grad=True)
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                y = compiled(x)
            y.float().pow(2).mean().backward()
    assert not checker.violations, "\n".join(checker.violations[:5])
    probes = {"(16, 16)", "(128, 128)", "(256, 256)"}
    gemms = [call for call in checker.calls if not any(p in call["summary"].split(" x ")[0] for p in probes)]
    assert len(gemms) >= 2 * 6, len(gemms)  # 2 steps x 2 layers x (forward, dgrad, wgrad)
    if backend == "inductor":
        assert any(call.get("out") for call in gemms)  # inductor's out= form was checked
