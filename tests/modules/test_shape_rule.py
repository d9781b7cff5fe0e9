"""One rule for a weight off 16, on every device; coverage says what runs; fallbacks that speak.

- An FP8 module whose weight is off the multiple of 16 (`fp8train.Linear(60, 50)`) computes FP8
  through the exact emulation inside `fp8_autocast` on every device: the CPU's default path and the
  CUDA path (`FP8TRAIN_GEMM=scaled_mm` with torch._scaled_mm replaced by the CUDA contract checker,
  tests/cuda_contract.py) give the same bits, equal to an independent E4M3 reference, and never reach
  torch._scaled_mm; `fp8train.coverage` reports it in FP8 on the emulated path and the step counters
  count it in FP8. A module of a shape that fits reaches the kernel on the CUDA path.
- Where the emulation is a fallback (the CUDA path) the module warns once, naming it and why; not on
  the CPU's default path, where every shape is emulated.
- `convert_to_fp8` / `prepare` leave such `torch.nn.Linear` layers in high precision and warn once
  about those no module_filter_fn asked for, not about those it kept; `prepare` prints its one-line
  summary on rank 0 (stderr), not with `verbose=False` nor on another rank.
- Names: `module_filter_fn` everywhere but TransformerEngine's functions; `filter_fn` still works,
  with a DeprecationWarning; both at once is a TypeError.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp8train
from cuda_contract import cuda_contract
from fp8train import torch_internals
from fp8train.layer_coverage import StepCoverage

PATHS = ["auto", "fp32", "scaled_mm"]


@contextlib.contextmanager
def _gemm_path(monkeypatch, path: str):
    """FP8TRAIN_GEMM=path; for scaled_mm, torch._scaled_mm is the CUDA contract checker (yields it)."""
    monkeypatch.setenv("FP8TRAIN_GEMM", path)
    if path != "scaled_mm":
        yield None
        return
    # a cold cache of torch_internals' own (no setting fills it): probed again, through the checker
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})
    with cuda_contract() as checker:
        yield checker


def _gemm_calls(checker) -> list[str]:
    """torch._scaled_mm calls other than the kernel probes (16 x 16)."""
    return [c["summary"] for c in checker.calls if "(16, 16)" not in c["summary"]]


def _step(layer: torch.nn.Module, x: torch.Tensor):
    """Output and gradients (input, weight, bias) of one training call under fp8_autocast."""
    x = x.detach().requires_grad_()
    layer.zero_grad()
    with fp8train.fp8_autocast():
        y = layer(x)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def _e4m3_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fresh module's first FP8 forward under delayed scaling, written out: unit scales (no history
    yet; docs/design.md, section 1), values rounded to E4M3, an exact product accumulated in float64,
    rounded once to bf16 (the emulation's bf16 path), the bias added in fp32."""
    xq = x.to(torch.float8_e4m3fn).double()
    wq = layer.weight.detach().to(torch.float8_e4m3fn).double()
    return (xq @ wq.t()).to(torch.bfloat16).float() + layer.bias.detach()


@pytest.mark.parametrize("path", ["auto", "scaled_mm"])
def test_a_weight_off_16_computes_the_same_fp8_on_every_device(monkeypatch, path: str) -> None:
    torch.manual_seed(0)
    off, fits = fp8train.Linear(60, 50), fp8train.Linear(64, 48)
    x_off, x_fits = torch.randn(32, 60), torch.randn(32, 64)
    reference = _e4m3_forward(off, x_off)
    with _gemm_path(monkeypatch, path) as checker, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counter = StepCoverage(torch.nn.ModuleList([off, fits]))
        got = [_step(off, x_off) for _ in range(2)]
        ran_off = counter.take()
        if checker is not None:
            assert _gemm_calls(checker) == [] and not checker.violations
        _step(fits, x_fits)
        if checker is not None:  # the CUDA path: a shape that fits reaches the kernel, within its rules
            assert len(_gemm_calls(checker)) == 3 and not checker.violations, checker.violations
        report = {x.in_features: x for x in fp8train.coverage(torch.nn.ModuleList([off, fits])).layers}
    # within one bf16 rounding of the product (fp32 accumulation order may differ from float64's)
    assert torch.allclose(got[0][0], reference, rtol=2**-8, atol=1e-6), (got[0][0] - reference).abs().max()
    assert not torch.allclose(got[0][0], F.linear(x_off, off.weight, off.bias), rtol=0, atol=1e-5)
    assert ran_off["flops"]["high_precision"] == 0 and ran_off["gemms"] == {"bf16": 6}
    assert (report[60].fp8, report[60].reason, report[60].path) == (True, "fp8", "bf16")
    assert (report[64].fp8, report[64].path) == (True, "scaled_mm" if path == "scaled_mm" else "bf16")
    shape_warnings = [str(w.message) for w in caught if "exact emulation" in str(w.message)]
    if path == "scaled_mm":  # a fallback from the kernel: said once, naming the layer and why
        assert len(shape_warnings) == 1, shape_warnings
        assert shape_warnings[0].startswith(
            "fp8train: Linear(50x60,50) computes FP8 through the exact emulation"
        )
        assert (
            "its weight is 50x60 (out x in)" in shape_warnings[0] and "(padded: 64x64)" in shape_warnings[0]
        )
        assert caught[0].filename == __file__  # attributed to the caller's line
    else:  # the CPU's default: every shape is emulated, nothing falls back
        assert shape_warnings == []
    GOT[path] = got


GOT: dict = {}


def test_the_cpu_and_the_cuda_path_give_the_same_bits() -> None:
    """The rule is the same on every device: both paths computed the same outputs and gradients."""
    if set(GOT) != {"auto", "scaled_mm"}:
        pytest.skip("runs after both paths of the test above")
    for a, b in zip(GOT["auto"], GOT["scaled_mm"]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 20), torch.nn.Linear(20, 32))


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_convert_warns_once_naming_unasked_high_precision_layers() -> None:
    got = _warnings_of(lambda: fp8train.convert_to_fp8(_model()))
    assert len(got) == 1, got
    assert got[0].startswith(
        "UserWarning: fp8train: linear layers in high precision that no module_filter_fn"
    )
    assert "1 (its weight is 20x64 (out x in)" in got[0] and "2 (its weight is 32x20 (out x in)" in got[0]
    # asked for: the filter keeps them (it is consulted for every linear layer, whatever its shape)
    asked = _warnings_of(
        lambda: fp8train.convert_to_fp8(_model(), module_filter_fn=lambda m, fqn: fqn == "0")
    )
    assert asked == []
    assert _warnings_of(lambda: fp8train.convert_to_fp8(_model(), log=False)) == []  # asked for quiet

    # a subclass of torch.nn.Linear is not converted: said too
    class MyLinear(torch.nn.Linear):
        pass

    mine = torch.nn.Sequential(torch.nn.Linear(32, 32), MyLinear(32, 32))
    got = _warnings_of(lambda: fp8train.convert_to_fp8(mine))
    assert len(got) == 1 and "1 (a MyLinear, which convert_to_fp8 does not convert" in got[0], got


def test_prepare_prints_its_summary_on_rank_0_only(capsys, monkeypatch) -> None:
    fp8train.prepare(_model(), module_filter_fn=lambda m, fqn: fqn == "0")
    err = capsys.readouterr().err.strip().splitlines()
    path = fp8train.numerics.gemm.choose_path(torch.device("cpu"), 16, 32, 64)
    assert err == [
        "fp8train: 1/3 linear GEMMs in FP8 (51.6% of linear FLOPs; recipe delayed); high precision: 2 shape; "
        f"paths: 1 {path}"
    ], err
    fp8train.prepare(_model(), module_filter_fn=lambda m, fqn: fqn == "0", verbose=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")  # torchrun's rank, before init_process_group
    fp8train.prepare(_model(), module_filter_fn=lambda m, fqn: fqn == "0")
    assert capsys.readouterr().err == ""


def test_filter_fn_is_the_deprecated_name_of_module_filter_fn() -> None:
    def keep_first(module, fqn: str) -> bool:
        return fqn == "0"

    new = _warnings_of(lambda: fp8train.prepare(_model(), module_filter_fn=keep_first, verbose=False))
    assert new == []  # the new name: silent (the filter asked for the others)
    old_model = []
    old = _warnings_of(
        lambda: old_model.append(fp8train.prepare(_model(), filter_fn=keep_first, verbose=False))
    )
    assert old == [
        "DeprecationWarning: prepare: filter_fn= is deprecated, pass module_filter_fn= (the same argument; "
        "one name across fp8train)"
    ]
    assert [type(m).__name__ for m in old_model[0]] == ["Linear", "Linear", "Linear"]
    assert isinstance(old_model[0][0], fp8train.Linear) and type(old_model[0][1]) is torch.nn.Linear
    with pytest.raises(TypeError, match="got both module_filter_fn= and filter_fn="):
        fp8train.prepare(_model(), module_filter_fn=keep_first, filter_fn=keep_first)


def test_integrations_take_module_filter_fn_and_warn_for_filter_fn(tmp_path) -> None:
    hf = pytest.importorskip(
        "fp8train.integrations.hf", reason='needs transformers: pip install "fp8train[hf]"'
    )

    class Stub:
        @staticmethod
        def from_pretrained(directory, **kwargs):
            return _model()

    keep = lambda m, fqn: fqn == "0"  # noqa: E731
    with pytest.raises(TypeError, match="got both module_filter_fn= and filter_fn="):
        hf.from_pretrained(Stub, str(tmp_path), module_filter_fn=keep, filter_fn=keep)
    # the old name reaches prepare (its warning), then the empty directory is refused
    with pytest.warns(DeprecationWarning, match="filter_fn= is deprecated"), pytest.raises(FileNotFoundError):
        hf.from_pretrained(Stub, str(tmp_path), filter_fn=keep)
    lightning = pytest.importorskip(
        "fp8train.integrations.lightning", reason='needs lightning: pip install "fp8train[lightning]"'
    )
    with pytest.warns(DeprecationWarning, match="FP8Precision: filter_fn= is deprecated"):
        assert lightning.FP8Precision(filter_fn=keep).module_filter_fn is keep
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert lightning.FP8Precision(module_filter_fn=keep).module_filter_fn is keep
    with pytest.raises(TypeError, match="FP8Precision got both"):
        lightning.FP8Precision(module_filter_fn=keep, filter_fn=keep)
