"""One rule for a weight off 16, on every device; coverage says what runs; fallbacks that speak.

- An FP8 module whose weight is off the multiple of 16 (`fp8train.Linear(60, 50)`) computes in high
  precision inside `fp8_autocast` on every GEMM path: the CPU's default (bf16 emulation), fp32, and
  the CUDA path (`FP8TRAIN_GEMM=scaled_mm` with torch._scaled_mm replaced by the CUDA contract checker,
  tests/cuda_contract.py): its output and gradients equal torch's high-precision ones bit for bit, it
  reaches no torch._scaled_mm, `fp8train.coverage` reports it "shape" and the step counters count it
  in high precision. A module of a shape that fits runs in FP8 on the same paths (the check can fail).
- It warns once, naming it and why, at its first call inside a region (not outside one).
- `convert_to_fp8` / `prepare` warn once about layers left in high precision that no
  module_filter_fn asked for, and not about those it kept; `prepare` prints its one-line summary on
  rank 0 (stderr), not with `verbose=False` nor on another rank.
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
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})  # probed again, through the checker
    with cuda_contract() as checker:
        yield checker


def _gemm_calls(checker) -> list[str]:
    """torch._scaled_mm calls other than the kernel probes (16 x 16)."""
    return [c["summary"] for c in checker.calls if "(16, 16)" not in c["summary"]]


def _step(layer: torch.nn.Module, x: torch.Tensor):
    """Output and gradients (input, weight, bias) of one training call under fp8_autocast."""
    x = x.detach().requires_grad_()
    with fp8train.fp8_autocast():
        y = layer(x)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _reference(layer: torch.nn.Module, x: torch.Tensor):
    x = x.detach().requires_grad_()
    w, b = (p.detach().requires_grad_() for p in (layer.weight, layer.bias))
    y = F.linear(x, w, b)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("path", PATHS)
def test_a_weight_off_16_runs_in_high_precision_on_every_path(monkeypatch, path: str) -> None:
    torch.manual_seed(0)
    off, fits = fp8train.Linear(60, 50), fp8train.Linear(64, 48)
    x_off, x_fits = torch.randn(32, 60), torch.randn(32, 64)
    with _gemm_path(monkeypatch, path) as checker:
        counter = StepCoverage(torch.nn.ModuleList([off, fits]))
        with pytest.warns(UserWarning, match=r"Linear\(50x60,50\) runs in high precision"):
            got = _step(off, x_off)
        if checker is not None:
            assert _gemm_calls(checker) == [] and not checker.violations
        ran_off = counter.take()
        fp8 = _step(fits, x_fits)
        if checker is not None:  # the CUDA path: a shape that fits reaches the kernel, within its rules
            assert len(_gemm_calls(checker)) == 3 and not checker.violations, checker.violations
        ran_fits = counter.take()
    for a, b in zip(got, _reference(off, x_off)):
        assert torch.equal(a, b)  # the high-precision GEMMs, bit for bit
    assert not torch.equal(fp8[0], _reference(fits, x_fits)[0])  # FP8 did run for the shape that fits
    assert ran_off["flops"]["fp8"] == 0 and ran_off["high_precision_layers"] == ["0"]
    assert ran_fits["flops"]["high_precision"] == 0 and ran_fits["gemms"]
    report = {
        layer.in_features: layer for layer in fp8train.coverage(torch.nn.ModuleList([off, fits])).layers
    }
    assert (report[60].fp8, report[60].reason) == (False, "shape")
    assert (report[64].fp8, report[64].reason) == (True, "fp8")


def test_the_module_warns_once_and_only_inside_a_region() -> None:
    layer = fp8train.LayerNormMLP(40, 64)  # both GEMMs off 16 (40 features)
    x = torch.randn(16, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x)  # outside a region: high precision as every FP8 module, nothing to say
        assert caught == []
        for _ in range(3):
            with fp8train.fp8_autocast():
                layer(x).sum().backward()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert (
        "LayerNormMLP" in messages[0]
        and "64x40 (out x in)" in messages[0]
        and "(padded: 64x48)" in messages[0]
    )
    assert caught[0].filename == __file__  # attributed to the caller's line


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

    # a subclass of torch.nn.Linear is not converted: said too
    class MyLinear(torch.nn.Linear):
        pass

    mine = torch.nn.Sequential(torch.nn.Linear(32, 32), MyLinear(32, 32))
    got = _warnings_of(lambda: fp8train.convert_to_fp8(mine))
    assert len(got) == 1 and "1 (a MyLinear, which convert_to_fp8 does not convert" in got[0], got


def test_prepare_prints_its_summary_on_rank_0_only(capsys, monkeypatch) -> None:
    fp8train.prepare(_model(), module_filter_fn=lambda m, fqn: fqn == "0")
    err = capsys.readouterr().err.strip().splitlines()
    path = fp8train.gemm.choose_path(torch.device("cpu"), 16, 32, 64)
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
